"""Independent pieces of a captured decode step as parallel branches of its CUDA graph.

A decode step is a chain of small kernels, many of which wait for nothing but the block's input: the shared
expert beside the router and the routed experts, the compressor and indexer projections beside the query path.
While a step is being captured, `concurrently` runs each such piece on its own stream forked from the capturing
one and joined back, so the graph holds them as parallel branches and the GPU overlaps their launches, ramps and
tails. Outside a capture (eager steps, prefill, the CPU) the pieces run one after another in order: the kernels and
their bits are the same either way, only their overlap differs.

A piece run on a side stream must not share scratch memory with the others (the radix select's workspace and
the compressor emit's arrival counters are one per shape, so the pieces given here stay clear of them), and it
reads only tensors kept alive by its closure until the join.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch

ENABLED = True  # False: every piece on the capturing stream (an A/B switch for benchmarks)

_busy: dict[torch.device, int] = {}  # side streams of a device taken by the `concurrently` calls in progress


@cache
def _side_stream(device: torch.device, k: int) -> torch.cuda.Stream:
    """The k-th side stream of ``device`` (created once, reused by every capture)."""
    return torch.cuda.Stream(device)


def concurrently(device: torch.device, *pieces: Callable[[], Any]) -> list[Any]:
    """The pieces' results, in order. During a CUDA graph capture on ``device``, pieces[0] runs on the capturing
    stream and every other piece on a side stream forked from it and joined back before this returns (nested calls
    take further side streams); otherwise one after another."""
    if not (ENABLED and device.type == "cuda" and len(pieces) > 1 and torch.cuda.is_current_stream_capturing()):
        return [piece() for piece in pieces]
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    main = torch.cuda.current_stream(device)
    first = _busy.get(device, 0)
    sides = [_side_stream(device, first + k) for k in range(len(pieces) - 1)]
    _busy[device] = first + len(sides)
    try:
        results: list[Any] = [None] * len(pieces)
        for k, side in enumerate(sides, start=1):
            side.wait_stream(main)  # fork: the piece sees everything captured before it
            with torch.cuda.stream(side):
                results[k] = pieces[k]()
        results[0] = pieces[0]()
        for side in sides:
            main.wait_stream(side)  # join
        return results
    finally:
        _busy[device] = first
