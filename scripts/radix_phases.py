#!/usr/bin/env python3
"""Where the multi-program radix top-k's time goes (CUDA): the fused select launched with LAST = -1 (the scores
loaded, nothing else), 0, 1, ... (each launch runs the phases up to LAST), so consecutive figures differ by one
phase: a level's histogram with the grid barrier before it, the count, the listing with its barrier. Each call
follows a zeroing of the workspace (a select cut short leaves it dirty), whose own time is subtracted. Gaussian
scores; ``--ledger PATH`` appends each figure as a ``kernel`` row.

    PYTHONPATH=src python scripts/radix_phases.py [--sizes 4160,32768,262144] [--ledger benchmarks/ledger.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4160,32768,262144", help="comma-separated score counts (one row each)")
    ap.add_argument("--ledger", type=Path, default=None)
    args = ap.parse_args(argv)
    from triton.testing import do_bench_cudagraph

    from ds4x.bench.ledger import append, environment
    from ds4x.formats.pdl import launch_options
    from ds4x.kernels import select as S
    from ds4x.kernels.indexer import num_sms
    from ds4x.kernels.triton_indexer import radix_kernel

    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    env, rows = environment(), []
    phases = ["load only"] + [f"+ level {i}" for i in range(32 // S.RADIX_BITS)] + ["+ count", "+ listing"]
    for n in (int(v) for v in args.sizes.split(",")):
        scores = torch.randn(1, n, generator=g, device="cuda") * 0.3
        tile, n_prog = S.radix_tiling(n, 1, num_sms(dev))  # as the select lays out one row
        index = torch.empty(1, 512, dtype=torch.long, device="cuda")
        valid = torch.empty(1, 512, dtype=torch.int8, device="cuda")
        count = torch.tensor([n], dtype=torch.int32, device="cuda")
        ws = torch.zeros(1, S._WORKSPACE, dtype=torch.int32, device="cuda")
        zero_us = do_bench_cudagraph(ws.zero_) * 1000

        def select(last: int, scores=scores, n=n, tile=tile, n_prog=n_prog, index=index, valid=valid, count=count,
                   ws=ws) -> None:
            ws.zero_()
            radix_kernel[(n_prog, 1)](scores, n, n, count, 512, n_prog, ws, index, valid, 0, TILE=tile, KP=512,
                                      BITS=S.RADIX_BITS, FIRST=0, LAST=last, DEVICE_COUNT=True, WS=S._WORKSPACE,
                                      MAX_PROGRAMS=S._MAX_PROGRAMS, num_warps=S.RADIX_WARPS,
                                      SHARED_BINS=S.SHARED_HISTOGRAM, **launch_options(dev))

        times = []
        for last in range(-1, len(phases) - 1):
            select(last)
            times.append(do_bench_cudagraph(lambda last=last: select(last)) * 1000 - zero_us)
        whole = S.select_topk_radix(scores[0], count, 512)
        exact = set(whole[0][whole[1]].tolist()) == set(S.select_topk_keys(scores[0], n, 512)[0].tolist())
        print(f"{n:>8,} scores ({n_prog} x {tile}), exact {exact}, us up to: "
              + ", ".join(f"{p} {t:.1f}" for p, t in zip(phases, times, strict=True))
              + f" (the zeroing {zero_us:.1f} subtracted)")
        rows += [{**env, "bench": "kernel", "what": "top-512 select, phases up to", "shape": f"{n:,} scores",
                  "variant": p, "ms": t / 1000, "model": "Gaussian scores, seed 0", "exact": exact,
                  "flags": {"command": "scripts/radix_phases.py", "timing": "do_bench_cudagraph",
                            "programs": n_prog, "tile": tile}} for p, t in zip(phases, times, strict=True)]
    if args.ledger is not None:
        append(rows, args.ledger)
        print(f"{len(rows)} rows appended to {args.ledger}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
