#!/usr/bin/env python3
"""Decode attention blocking sweep at Flash shapes (CUDA): microseconds per call for each layer type's row sources
(the 128-row window, plus CSA's top-512 or HCA's closed rows) and (rows per block, heads per program, warps, most
splits per source), the partial pass plus the merge replayed from a CUDA graph so that Python launch time is not
measured. The figures behind ``ds4x.kernels.attention.DECODE_CONFIG``.

    PYTHONPATH=src python scripts/attention_sweep.py
    PYTHONPATH=src python scripts/attention_sweep.py --configs 16,16,4,64 16,32,8,32

Heads per program are clamped to ``MAX_HEADS_PER_PROGRAM`` by the wrapper.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=["16,16,4,64", "16,16,8,64", "16,32,8,64", "32,16,8,64",
                                                   "16,16,4,32", "16,16,4,128"],
                   help="rows per block,heads per program,warps,most splits per source")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("attention_sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    from ds4x.bench.timing import graph_replay_us
    from ds4x.formats import rows_triton
    from ds4x.kernels.attention import Slots, attention_decode_triton

    dev, heads, dim, nope = "cuda", 64, 512, 448
    g = torch.Generator(device=dev).manual_seed(args.seed)
    q = torch.nn.functional.rms_norm(torch.randn(heads, dim, generator=g, device=dev), (dim,))
    sinks = torch.randn(heads, generator=g, device=dev)

    def store(n: int) -> torch.Tensor:
        return rows_triton.pack_kv_rows_triton(torch.randn(n, dim, generator=g, device=dev) * 2, validate=False)

    def top512(n: int) -> torch.Tensor:
        return torch.randperm(n, generator=g, device=dev)[:512].sort().values

    ring, rows = store(768), store(262_146)
    at_4k, at_1m = torch.tensor([4095], device=dev), torch.tensor([1_048_575], device=dev)
    window = (ring, Slots(128, position=at_4k, ring=768))
    window_1m = (ring, Slots(128, position=at_1m, ring=768))
    cases = {
        "window 128": [window],
        "CSA top-512 @4K": [window, (rows, top512(1024))],
        "CSA top-512 @1M": [window_1m, (rows, top512(262_144))],
        "HCA 34 rows @4K": [window, (rows, Slots(34, position=at_4k, ratio=128))],
        "HCA 8194 rows @1M": [window_1m, (rows, Slots(8194, position=at_1m, ratio=128))],
    }
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    print(f"{'sources':<18} {'rows,heads,warps,splits':<24} {'us':>8} {'max rel diff':>13}")
    for name, sources in cases.items():
        ref = attention_decode_triton(q, sources, sinks, dim**-0.5, nope, True, configs[0])
        for cfg in configs:
            def call(cfg=cfg, sources=sources):
                return attention_decode_triton(q, sources, sinks, dim**-0.5, nope, True, cfg)
            diff = float((call() - ref).abs().max() / ref.abs().max())
            us = graph_replay_us([call] * 20)
            print(f"{name:<18} {','.join(map(str, cfg)):<24} {us:8.1f} {diff:13.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
