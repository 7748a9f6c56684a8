#!/usr/bin/env python3
"""Where one decode attention call's time goes on Hopper (CUDA, sm_90): the Gluon partial pass's phases and the
merge, at Flash shapes on the model's bf16 query (window 128, CSA window + top-512 at 1M, HCA at 4K and 1M), with
the blocks in the online loop (``TWO_PHASE_BLOCKS = 0``), or with ``--two-phase`` in the two phases a bf16 query's
short programs take (in phase 1 the next block's decode beside each score product, the barrier after it and the
score's wait; in phase 2 each block's output products; stamped).

A copy of `ds4x.kernels.attention_wgmma` is written to a temporary directory with time stamps added
(``%globaltimer`` in ns, ``%clock64`` in cycles, thread values of each program's first warp) at the kernel's start,
after its PDL wait, once the query is in shared memory, after each of its first 20 row blocks, after the blocks,
after the partial state's stores and after the RoPE columns' atomics; the attention calls then launch that copy.
Printed per case: us per call (graph of 20 calls, the plain kernel and the stamped one), the profiler's
median kernel durations (partial pass, merge) and gaps, the phases' times from the first program's start (median
and latest over programs), cycles per row block, and the prologue's and epilogue's cycles. The stamps cost a few
stores; compare "plain" and "stamped". Needs the kernel's text as the copy expects it (it stops if a marker line
moved).

    PYTHONPATH=src python scripts/attention_phases.py [--two-phase [--no-score-products] [--parts N]]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPS = 20  # calls per graph
STAMPS = (  # (marker in attention_wgmma.py, what to insert after (+) or before (-) it)
    ("                       store_a, store_b, index_a, index_b, n_split, sinks_ptr, out_ptr, acc_desc,",
     "+ stamps_ptr,"),
    ("        HP: gl.constexpr = 64\n",
     "-        srow = gl.program_id(0) + (gl.program_id(2) * gl.num_programs(1) + gl.program_id(1)) * "
     "gl.num_programs(0)\n"
     "        _stamp(stamps_ptr, srow, 0, num_warps)\n"),
    ("        wait_upstream(PDL)\n", "+        _stamp(stamps_ptr, srow, 1, num_warps)\n"),
    ("            q2.slice(HP, HP, dim=0).store((q - q_hi.to(gl.float32)).to(gl.bfloat16))\n",
     "+            _stamp(stamps_ptr, srow, 2, num_warps)\n"),
    ("                m = m_new\n",
     "+                if i < 20:\n                    _stamp(stamps_ptr, srow, 8 + i, num_warps)\n"),
    ("        hs = gl.arange(0, HP, layout=gl.SliceLayout(1, S_L))\n        ho = gl.arange",
     "-        _stamp(stamps_ptr, srow, 3, num_warps)\n"),
    # the whole line (its indentation too): a marker starting inside it had put the stamp's line before the atomics
    # at their own indentation and the atomics after it one level out, so that they ran for every state (an HCA
    # call at 1M, bf16 states: stamped 27.3 us against 22.3)
    ("            gl.atomic_add(at, o_r, mask=r_ok, sem=\"relaxed\")\n",
     "-            _stamp(stamps_ptr, srow, 4, num_warps)\n"),
    # a bf16 state (the launches of many splits) has no atomics after it: its stores stamped where they end
    ("                _store_state_bf16(o, o_r, acc_ptr + base * D, NOPE, num_warps)\n",
     "+                _stamp(stamps_ptr, srow, 4, num_warps)\n"),
    ("                _store_state_bf16_tma(o, o_h + o_r, acc_desc, base.to(gl.int32), NOPE)  # noqa: F821 - two "
     "phases\n", "+                _stamp(stamps_ptr, srow, 4, num_warps)\n"),
    ("            gl.atomic_add(at, o_r, mask=r_ok, sem=\"relaxed\")\n",
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
# the two phases' stamps (``--two-phase``; `attention_wgmma._two_phase_blocks`, which gets the stamps' buffer): the
# query stored (slot 2; with QUERY_ASYNC its copy issued, which lands during block 0's decode), the next block
# decoded beside block j's score product (21 + j; for j = 0 block 0's decode too), the fence and barrier after it
# (26 + j), block j's scores waited for and stored (8 + j), every block's scores stored (6), each block's products
# issued (16 + j), the products waited for (7)
TWO_PHASE_STAMPS = (
    ("    def _two_phase_blocks(", "+stamps_ptr, srow, "),
    ("            m, l, o, o_r, o_h = _two_phase_blocks(", "+stamps_ptr, srow, "),
    ("        else:\n            q1 = gl.allocate_shared_memory(gl.bfloat16, [HP, D], SH, q_in.to(gl.bfloat16))\n",
     "+        _stamp(stamps_ptr, srow, 2, num_warps)\n"),
    ("            top = gl.maximum(top, s)\n",
     "+            _stamp(stamps_ptr, srow, 8 + j, num_warps)\n"),
    ("                                                              MODE_B, L3, gl.SliceLayout(0, S1_ACC), False, "
     "PARTS)\n",
     "+                    _stamp(stamps_ptr, srow, 21 + j, num_warps)\n"),
    ("            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))\n",
     "-            _stamp(stamps_ptr, srow, 26 + j, num_warps)\n"),
    ("        gl.thread_barrier()  # every block's scores are stored\n",
     "+        _stamp(stamps_ptr, srow, 6, num_warps)\n"),
    ("            o_r = warpgroup_mma(probs.index(2 * j + 1), keys_lo.index(j), o_r, is_async=True)\n",
     "+            _stamp(stamps_ptr, srow, 16 + j, num_warps)\n"),
    ("        return m, l, o, o_r, o_h\n", "-        _stamp(stamps_ptr, srow, 7, num_warps)\n"),
)
# ``--no-score-products`` (with --two-phase, TWO_PHASE_OVERLAP on): phase 1's score products and their wait left out
# of the overlapped loop, so that its stamps time the decode alone (timing only: the outputs are wrong)
NO_SCORE_PRODUCTS = (
    ("                ok_j = ok\n"
     "                s = _score_products(q1, keys, j * PARTS, keys_lo.index(j), s, NOPE, PARTS)\n",
     "                ok_j = ok\n"),
    ("            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))\n", ""),
)
# a program's stamps in the order they are taken: (slot, label of the time since the stamp before it)
TIMELINE = {False: [(1, "PDL wait"), (2, "query"), *[(8 + i, "a row block") for i in range(20)],
                    (3, "after the blocks"), (4, "state stores"), (5, "RoPE atomics")],
            True: [(1, "PDL wait"), (2, "query"),
                   *[(slot, label) for j in range(5)
                     for slot, label in ((21 + j, "phase 1: the next block decoded"),
                                         (26 + j, "phase 1: its fence and barrier"),
                                         (8 + j, "phase 1: the scores' wait and store"))],
                   (6, "phase 1: last barrier"), *[(16 + j, "phase 2: a block's products issued") for j in range(5)],
                   (7, "phase 2: products waited for"), (3, "after the blocks"), (4, "state stores"),
                   (5, "RoPE atomics")]}
PHASES = ((0, "start"), (1, "after the wait"), (2, "query stored"), (3, "blocks done"), (4, "state stored"),
          (5, "atomics issued"))


def stamped_module(directory: Path, two_phase: bool = False, no_score_products: bool = False):
    """The stamped copy of ds4x.kernels.attention_wgmma, imported from ``directory`` (``two_phase``: with the two
    phases' stamps too; ``no_score_products``: phase 1 without its score products, for timing only)."""
    from ds4x.kernels import attention_wgmma

    text = Path(attention_wgmma.__file__).read_text()
    for marker, insert in STAMPS + (TWO_PHASE_STAMPS if two_phase else ()):
        if text.count(marker) != 1:
            raise SystemExit(f"attention_phases: marker not found once in attention_wgmma.py: {marker!r}")
        text = text.replace(marker, marker + insert[1:] if insert[0] == "+" else insert[1:] + marker)
    for marker, replacement in NO_SCORE_PRODUCTS if no_score_products else ():  # the stamps around them stay
        if text.count(marker) != 1:
            raise SystemExit(f"attention_phases: marker not found once in attention_wgmma.py: {marker!r}")
        text = text.replace(marker, replacement)
    path = directory / "attention_wgmma_stamped.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("attention_wgmma_stamped", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--two-phase", action="store_true",
                    help="the blocks in two phases as a bf16 query runs them (TWO_PHASE_BLOCKS as set), stamped")
    ap.add_argument("--no-score-products", action="store_true",
                    help="with --two-phase: phase 1 without its score products (the decode alone; timing only, the "
                         "outputs are wrong)")
    ap.add_argument("--parts", type=int, default=1,
                    help="with --two-phase: attention.COLUMN_PARTS (a split's output columns over up to that many "
                         "programs, each stamped)")
    args = ap.parse_args(argv)
    two_phase = args.two_phase
    if args.no_score_products and not two_phase:
        ap.error("--no-score-products goes with --two-phase")
    if args.parts != 1 and not two_phase:
        ap.error("--parts goes with --two-phase")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("attention_phases needs an sm_90 GPU", file=sys.stderr)
        return 2
    from compressed_kernels_ab import attention_cases  # this script's folder is on sys.path
    from torch.profiler import ProfilerActivity, profile

    from ds4x.kernels import attention as A
    from ds4x.kernels import attention_wgmma
    from ds4x.kernels.attention import attention_decode_triton

    A.TMA_STATE = False  # the stamps around the state's stores and atomics mark the global-store path
    A.COLUMN_PARTS = args.parts
    if not two_phase:
        A.TWO_PHASE_BLOCKS = 0  # the online loop's stamps (the default takes two phases for a bf16 query)
    dev, heads, dim, nope = "cuda", 64, 512, 448
    g = torch.Generator(device=dev).manual_seed(0)
    stamps = torch.zeros(4096, 64, dtype=torch.int64, device=dev)
    plain = attention_wgmma.partial_kernel
    stamped = stamped_module(Path(tempfile.mkdtemp()), two_phase, args.no_score_products).partial_kernel

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
        for k, label in PHASES:  # a slot no program stamped (the RoPE atomics of a bf16 state): not shown
            v = [int(s[r, 2 * k]) - t0 for r in used if s[r, 2 * k] != 0]
            if v:
                print(f"    {label:<15} {statistics.median(v):8.0f} {max(v):8.0f}")
        # cycles between consecutive stamps of a program, by what they time (medians over programs and blocks)
        spans: dict[str, list[int]] = {}
        for r in used:
            prev = None
            for slot, label in TIMELINE[two_phase]:
                c = int(s[r, 2 * slot + 1])
                if c == 0:
                    continue
                if prev is not None:
                    spans.setdefault(label, []).append(c - prev)
                prev = c
        print("    cycles, median (count): " + "; ".join(f"{label} {statistics.median(v):.0f} ({len(v)})"
                                                      for label, v in spans.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
