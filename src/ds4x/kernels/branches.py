"""Independent pieces of a captured decode step as parallel branches of its CUDA graph.

A decode step is a chain of small kernels, many of which wait for nothing but the block's input: the shared
expert beside the router and the routed experts; the compressor and indexer projections, the query's second
projection and the row writes beside the indexer's selection. While a step is being captured, a `Branch` runs
such a piece on a side stream forked from the capturing one, joined back where its result is needed, so the graph
holds the pieces as parallel branches and the GPU overlaps their launches, ramps and tails. Outside a capture
(eager steps, prefill, the CPU) every piece runs at once, in line: the kernels and their bits are the same either
way, only their overlap differs.

A piece on a side stream must not share scratch memory with work that may run beside it (the compressor emit's
arrival counters are one set per stream; the radix select, whose programs meet at grid barriers, stays on the
capturing stream), and the tensors it reads stay alive until it is joined (its closure is kept).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, Generic, TypeVar

import torch

ENABLED = True  # False: every piece on the capturing stream (an A/B switch for benchmarks)
SIDE_STREAMS = 8  # per device, taken in turn: a branch that finds its stream still busy queues behind that work

T = TypeVar("T")
_turn: dict[torch.device, int] = {}


@cache
def _side_stream(device: torch.device, k: int) -> torch.cuda.Stream:
    """The k-th side stream of ``device`` (created once, reused by every capture)."""
    return torch.cuda.Stream(device)


def _capturing(device: torch.device) -> bool:
    return ENABLED and device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class Branch(Generic[T]):
    """``fn()`` started as a branch: during a CUDA graph capture on its device, on a side stream forked from the
    current one; otherwise at once, in line. `join` returns the result and orders the calling stream after the
    branch. Every branch must be joined by the capturing stream before the capture ends (joins are idempotent),
    and the branch keeps ``fn`` (and so every tensor its closure reads) alive until then."""

    def __init__(self, device: torch.device, fn: Callable[[], T], after: torch.cuda.Event | None = None):
        self._done: torch.cuda.Event | None = None
        self._fn: Callable[[], T] | None = None
        if not _capturing(device):
            self._result = fn()
            return
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        k = _turn.get(device, 0)
        _turn[device] = (k + 1) % SIDE_STREAMS
        side = _side_stream(device, k)
        # fork: the piece sees everything captured before it, or before ``after`` (a `fork_point`)
        if after is not None:
            side.wait_event(after)
        else:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._result = fn()
        self._done = torch.cuda.Event()
        self._done.record(side)
        self._fn = fn

    def join(self) -> T:
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        return self._result


def fork_point(device: torch.device) -> torch.cuda.Event | None:
    """During a capture, an event marking what the current stream has captured so far: a `Branch` created later with
    ``after=`` it depends on that work only, not on what the stream captures in between. The graph launches ready
    pieces in the order they were captured, and a large grid holds the SMs until its last programs are placed, so
    a piece off the step's critical path, forked early but captured after the critical work, no longer delays it."""
    if not _capturing(device):
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def concurrently(device: torch.device, *pieces: Callable[[], Any]) -> list[Any]:
    """The pieces' results, in order: pieces[1:] as branches (`Branch`), pieces[0] on the current stream, all
    joined before this returns."""
    if not _capturing(device):
        return [piece() for piece in pieces]
    started = [Branch(device, piece) for piece in pieces[1:]]
    first = pieces[0]()
    return [first, *(b.join() for b in started)]
