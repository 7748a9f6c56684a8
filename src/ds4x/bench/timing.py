"""Kernel timing for sweeps: calls captured in one CUDA graph and replayed, so Python launch time is not measured."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def graph_replay_us(fns: Sequence[Callable[[], object]], rep_ms: int = 50) -> float:
    """Median microseconds of one call: ``fns`` run once (compiled, warm) on a side stream, then captured in order
    in one CUDA graph, whose replays ``triton.testing.do_bench`` times (median); the time per call is the replay's
    divided by the number of calls."""
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=rep_ms, return_mode="median")
    return 1000 * ms / len(fns)
