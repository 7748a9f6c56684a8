"""Where one decode step's GPU time goes, by kernel group (``ds4x bench prefill --profile``).

The step runs under ``torch.profiler`` (CUDA activity); every kernel's device time is attributed to a
group by its name. Groups that read weights report the bytes they must read and the bandwidth achieved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# (group, substrings of kernel names) in match order; the first match wins
KERNEL_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("quantized matmul (GGML blocks)", ("_qmv_kernel", "_qmm_kernel", "qmv", "qmm")),
    ("indexer scoring", ("indexer", "score_kernel")),
    ("top-k selection", ("topk", "select", "sort", "radix")),
    ("MoE routing / SwiGLU / combine", ("_route_kernel", "_swiglu", "_moe_")),
    ("attention", ("attention", "attn", "combine", "flash", "partial_kernel", "prefill_kernel")),
    ("mHC pre / post", ("_hc_",)),
    ("compressor emit", ("_emit_kernel",)),
    ("bf16 decode of GGML blocks (prefill)", ("_dequant_kernel",)),
    ("row packing / unpacking", ("pack", "rows", "e4m3", "mxfp4", "hadamard")),
    ("dense matmul (torch)", ("gemm", "gemv", "cutlass", "nvjet", "sm90_", "matmul", "dot_kernel")),
    ("reductions", ("reduce", "norm", "softmax", "sum")),
)
OTHER = "elementwise / copies / other"


def kernel_group(name: str) -> str:
    low = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(k in low for k in keys):
            return group
    return OTHER


def profile_step(fn: Callable[[], Any], reps: int = 3) -> tuple[list[dict[str, Any]], float]:
    """Run ``fn`` ``reps`` times under the profiler; per group: device us per call of ``fn``, kernel launches,
    and the group's heaviest kernels (``top``: name, us, launches).

    Returns (rows sorted by time, the wall time of one call in us measured with CUDA events outside the
    profiler)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    wall_us = 1000 * start.elapsed_time(end) / reps
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    groups: dict[str, dict[str, Any]] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.time_range.elapsed_us() / reps
        g = groups.setdefault(kernel_group(ev.name), {"group": kernel_group(ev.name), "us": 0.0, "kernels": 0,
                                                      "by_name": {}})
        g["us"] += us
        g["kernels"] += 1
        k = g["by_name"].setdefault(ev.name[:90], [0.0, 0])
        k[0] += us
        k[1] += 1
    for g in groups.values():
        g["kernels"] //= reps
        heavy = sorted(g.pop("by_name").items(), key=lambda kv: -kv[1][0])[:4]
        g["top"] = [{"name": n, "us": t, "launches": c // reps} for n, (t, c) in heavy]
    return sorted(groups.values(), key=lambda g: -g["us"]), wall_us


def kernel_timeline(fn: Callable[[], Any], reps: int = 3) -> list[dict[str, Any]]:
    """The kernels of the last of ``reps`` calls of ``fn`` under the profiler, in start order: name, start and end
    (us from the call's first kernel) and stream, to see what a step waits on (``overlap_summary``)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    kernels = sorted(((ev.time_range.start, ev.time_range.end, ev.name, getattr(ev, "device_resource_id", 0))
                      for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    last = kernels[len(kernels) - len(kernels) // reps:]  # every call runs the same kernels (a replayed graph)
    t0 = last[0][0]
    return [{"name": n, "start": s - t0, "end": e - t0, "stream": st} for s, e, n, st in last]


def overlap_summary(timeline: list[dict[str, Any]]) -> dict[str, float]:
    """span (first start to last end), busy (the union of kernel intervals: some kernel runs) and idle (span -
    busy: no kernel runs, the step waits on launches) in us, and the kernel time overlapped by other kernels."""
    busy, reach = 0.0, float("-inf")
    for k in sorted(timeline, key=lambda k: k["start"]):
        start = max(k["start"], reach)
        if k["end"] > start:
            busy += k["end"] - start
            reach = k["end"]
    span = max(k["end"] for k in timeline) - min(k["start"] for k in timeline)
    total = sum(k["end"] - k["start"] for k in timeline)
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy, "kernel_us": total, "overlapped_us": total - busy}


def format_profile(rows: list[dict[str, Any]], wall_us: float) -> str:
    busy = sum(r["us"] for r in rows)
    lines = [f"{'group':<34} {'us':>9} {'share':>6} {'kernels':>8} {'GB/s':>7}"]
    for r in rows:
        gbs = f"{r['bytes'] / r['us'] / 1e3:7.0f}" if r.get("bytes") else f"{'':>7}"
        lines.append(f"{r['group']:<34} {r['us']:9.1f} {100 * r['us'] / busy:5.1f}% {r['kernels']:8d} {gbs}")
        for k in r.get("top", []):
            lines.append(f"    {k['name'][:60]:<60} {k['us']:9.1f} us {k['launches']:6d}x")
    lines.append(f"{'kernel time':<34} {busy:9.1f}")
    lines.append(f"{'step wall time (CUDA events)':<34} {wall_us:9.1f}   (gaps = launch / host overhead)")
    return "\n".join(lines)
