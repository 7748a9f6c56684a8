#!/usr/bin/env python3
"""Where one decode attention call's time goes on Hopper (CUDA, sm_90): the Gluon partial pass's phases and the
merge, at Flash shapes on the model's bf16 query (window 128, CSA window + top-512 at 1M, HCA at 4K and 1M), with
the blocks in the online loop (``TWO_PHASE_BLOCKS = 0``).

A copy of `ds4x.kernels.attention_wgmma` is written to a temporary directory with time stamps added
(``%globaltimer`` in ns, ``%clock64`` in cycles, thread values of each program's first warp) at the kernel's start,
after its PDL wait, once the query is in shared memory, after each of its first 20 row blocks, after the blocks,
after the partial state's stores and after the RoPE columns' atomics; the attention calls then launch that copy.
Printed per case: us per call (graph of 20 calls, the plain kernel and the stamped one), the profiler's
median kernel durations (partial pass, merge) and gaps, the phases' times from the first program's start (median
and latest over programs), cycles per row block, and the prologue's and epilogue's cycles. The stamps cost a few
stores; compare "plain" and "stamped". Needs the kernel's text as the copy expects it (it stops if a marker line
moved).

    PYTHONPATH=src python scripts/attention_phases.py
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPS = 20  # calls per graph
STAMPS = (  # (marker in attention_wgmma.py, what to insert after (+) or before (-) it)
    ("                       store_a, store_b, index_a, index_b, n_split, sinks_ptr, out_ptr,",
     "+stamps_ptr,"),
    ("        wait_upstream(PDL)\n        HP: gl.constexpr = 64",
     "-        srow = gl.program_id(0) + gl.program_id(2) * gl.num_programs(0)\n"
     "        _stamp(stamps_ptr, srow, 0, num_warps)\n"),
    ("        HP: gl.constexpr = 64", "-        _stamp(stamps_ptr, srow, 1, num_warps)\n"),
    ("            q2.slice(HP, HP, dim=0).store((q - q_hi.to(gl.float32)).to(gl.bfloat16))\n",
     "+            _stamp(stamps_ptr, srow, 2, num_warps)\n"),
    ("                m = m_new\n",
     "+                if i < 20:\n                    _stamp(stamps_ptr, srow, 8 + i, num_warps)\n"),
    ("        hs = gl.arange(0, HP, layout=gl.SliceLayout(1, S_L))\n        ho = gl.arange",
     "-        _stamp(stamps_ptr, srow, 3, num_warps)\n"),
    ("        gl.atomic_add(at, o_r, mask=r_ok, sem=\"relaxed\")\n",
     "-        _stamp(stamps_ptr, srow, 4, num_warps)\n"),
    ("        gl.atomic_add(at, o_r, mask=r_ok, sem=\"relaxed\")\n",
     "+        _stamp(stamps_ptr, srow, 5, num_warps)\n"),
    ("    # row and block counts change",
     "-    @gluon.jit\n"
     "    def _stamp(stamps_ptr, row, slot, num_warps: gl.constexpr):\n"
     "        one: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])\n"
     "        z = gl.full([1], 0, gl.int32, layout=one)\n"
     "        t = gl.inline_asm_elementwise(\"mov.u64 $0, %globaltimer;\", \"=l,r\", [z], dtype=gl.int64,\n"
     "                                      is_pure=False, pack=1)\n"
     "        c = gl.inline_asm_elementwise(\"mov.u64 $0, %clock64;\", \"=l,r\", [z], dtype=gl.int64, is_pure=False,\n"
     "                                      pack=1)\n"
     "        o = gl.arange(0, 1, layout=one)\n"
     "        gl.store(stamps_ptr + row * 64 + 2 * slot + o, t)\n"
     "        gl.store(stamps_ptr + row * 64 + 2 * slot + 1 + o, c)\n\n"),
)
PHASES = ((0, "start"), (1, "after the wait"), (2, "query stored"), (3, "blocks done"), (4, "state stored"),
          (5, "atomics issued"))


def stamped_module(directory: Path):
    """The stamped copy of ds4x.kernels.attention_wgmma, imported from ``directory``."""
    from ds4x.kernels import attention_wgmma

    text = Path(attention_wgmma.__file__).read_text()
    for marker, insert in STAMPS:
        if text.count(marker) != 1:
            raise SystemExit(f"attention_phases: marker not found once in attention_wgmma.py: {marker!r}")
        text = text.replace(marker, marker + insert[1:] if insert[0] == "+" else insert[1:] + marker)
    path = directory / "attention_wgmma_stamped.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("attention_wgmma_stamped", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("attention_phases needs an sm_90 GPU", file=sys.stderr)
        return 2
    from compressed_kernels_ab import attention_cases  # this script's folder is on sys.path
    from torch.profiler import ProfilerActivity, profile

    from ds4x.kernels import attention as A
    from ds4x.kernels import attention_wgmma
    from ds4x.kernels.attention import attention_decode_triton

    A.TWO_PHASE_BLOCKS = 0  # the stamps sit in the online loop (the default takes two phases for a bf16 query)
    dev, heads, dim, nope = "cuda", 64, 512, 448
    g = torch.Generator(device=dev).manual_seed(0)
    stamps = torch.zeros(4096, 64, dtype=torch.int64, device=dev)
    plain = attention_wgmma.partial_kernel
    stamped = stamped_module(Path(tempfile.mkdtemp())).partial_kernel

    class Stamped:  # stands in for the kernel: the same launch with the stamps' buffer added
        def __getitem__(self, grid):
            return lambda *args, **kw: stamped[grid](*args, stamps, **kw)

    q = torch.nn.functional.rms_norm(torch.randn(heads, dim, generator=g, device=dev), (dim,)).bfloat16()
    sinks = torch.randn(heads, generator=g, device=dev)
    _, _, cases = attention_cases(g, dev)  # compressed_kernels_ab's cases, the same draws

    def graph_of(call) -> tuple[torch.cuda.CUDAGraph, float]:
        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(REPS):
                call()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000 / REPS)
        return graph, statistics.median(times)

    def kernels(graph: torch.cuda.CUDAGraph) -> str:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        ev = sorted([e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0],
                    key=lambda e: e.time_range.start)
        by: dict[str, list[float]] = {}
        for e in ev:
            by.setdefault(e.name.split("(")[0][:32], []).append(e.device_time)
        gaps = [b.time_range.start - a.time_range.end for a, b in zip(ev, ev[1:], strict=False)]
        return (", ".join(f"{k} {len(v)} x {statistics.median(v):.2f} us" for k, v in by.items())
                + f"; gaps median {statistics.median(gaps) if gaps else 0.0:.2f} us")

    for name, sources in cases.items():
        def call(sources=sources):
            return attention_decode_triton(q, sources, sinks, dim**-0.5, nope, True)
        attention_wgmma.partial_kernel = plain
        g_plain, t_plain = graph_of(call)
        try:
            profiled = kernels(g_plain)
        except Exception as exc:  # the stamps still come
            profiled = f"profiler failed: {exc}"
        attention_wgmma.partial_kernel = Stamped()
        try:
            g_stamped, t_stamped = graph_of(call)
            stamps.zero_()
            g_stamped.replay()
            torch.cuda.synchronize()
        finally:
            attention_wgmma.partial_kernel = plain
        s = stamps.cpu()
        used = [r for r in range(s.shape[0]) if s[r, 0] != 0]
        t0 = min(int(s[r, 0]) for r in used)
        print(f"{name}: {t_plain:.2f} us a call (stamped {t_stamped:.2f}); {profiled}")
        print(f"  {len(used)} programs; ns from the first program's start, median / latest:")
        for k, label in PHASES:
            v = [int(s[r, 2 * k]) - t0 for r in used]
            print(f"    {label:<15} {statistics.median(v):8.0f} {max(v):8.0f}")
        blocks = []
        for r in used:
            prev = int(s[r, 2 * 2 + 1])  # the query stored (cycles)
            for i in range(20):
                c = int(s[r, 2 * (8 + i) + 1])
                if c == 0:
                    break
                blocks.append(c - prev)
                prev = c
        query = [int(s[r, 2 * 2 + 1]) - int(s[r, 2 * 1 + 1]) for r in used]
        tail = [int(s[r, 2 * 5 + 1]) - int(s[r, 2 * 3 + 1]) for r in used]
        print(f"    cycles: a row block {statistics.median(blocks):.0f} (median of {len(blocks)}); the query "
              f"{statistics.median(query):.0f}; state + atomics {statistics.median(tail):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
