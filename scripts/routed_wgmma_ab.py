#!/usr/bin/env python3
"""A/B of the tensor-core routed-expert kernel's variants at Flash shapes (CUDA, sm_90): us per call of the IQ2_XXS
gate (256 experts of 2048 x 4096, split rows) and the Q2_K down (256 experts of 4096 x 2048) for T tokens x 6
experts, per (BT pairs a chunk, BN rows, warps) tile and per variant of `ds4x.kernels.routed_wgmma`:

* ``shared``: the weights decoded into a shared tile, the activations through registers (the default);
* ``x async``: the activations by cp.async into three shared buffers (``ASYNC_ACTIVATIONS``);
* ``regs``: also the weights decoded straight into the wgmma's register operand (``REGISTER_WEIGHTS``).

Every call of a CUDA graph of 4 picks its own random experts; median of the replays. Each variant's output is
compared with the default's at the same token count (``x async`` alone gives the same bits; ``regs`` sums each
128-weight step in another order). These are the prompt calls' and prefill chunks' routed products (2-96 pairs an
expert); docs/PROFILE.md "Routed experts on the tensor cores" has the tiles' history.

    PYTHONPATH=src python scripts/routed_wgmma_ab.py [--tokens 130,1024,4096] [--ledger benchmarks/ledger.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

COPY_GB_S = 4260  # the H200's measured copy bandwidth (read + write), DESIGN §7
# (variant, tile) candidates per type; the default's own tiles come from wgmma_config
CANDIDATES = {
    "IQ2_XXS": [("x async", (16, 128, 4)), ("regs", (16, 64, 4)), ("x async", (128, 64, 4)),
                ("regs", (128, 64, 4)), ("x async", (64, 64, 4)), ("regs", (64, 64, 4)), ("regs", (128, 128, 8))],
    "Q2_K": [("x async", (16, 64, 4)), ("regs", (16, 64, 4)), ("x async", (64, 64, 4)), ("regs", (64, 64, 4)),
             ("regs", (128, 64, 4)), ("x async", (128, 128, 8)), ("regs", (128, 128, 8))],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="130,1024,4096")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ledger", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("routed_wgmma_ab needs a CUDA GPU", file=sys.stderr)
        return 2
    from ds4x.bench.ledger import append, environment
    from ds4x.bench.timing import graph_replay_us
    from ds4x.formats.ggml import GGMLQuantizationType as T
    from ds4x.formats.ggml import random_blocks
    from ds4x.formats.ggml_tensor import GGMLTensor
    from ds4x.kernels import quant_matmul as qm
    from ds4x.kernels import routed_wgmma as rw

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(args.seed)
    n_exp, inter, hidden, k = 256, 2048, 4096, 6
    weights = {
        "IQ2_XXS": qm.kernel_layout(GGMLTensor(random_blocks(T.IQ2_XXS, (n_exp, inter, hidden), g), T.IQ2_XXS,
                                               (n_exp, inter, hidden))),
        "Q2_K": GGMLTensor(random_blocks(T.Q2_K, (n_exp, hidden, inter), g), T.Q2_K, (n_exp, hidden, inter)),
    }
    env = environment()
    rows = []
    saved = rw.REGISTER_WEIGHTS, rw.ASYNC_ACTIVATIONS
    print(f"{'product':>8} {'tokens':>6} {'variant':>8} {'tile':>10} {'us':>9} {'GB/s':>6} {'of copy':>8}  "
          "max rel diff to the default")
    try:
        for t in (int(v) for v in args.tokens.split(",")):
            for name, w in weights.items():
                x = torch.randn(t, w.shape[2], generator=g, device=dev).bfloat16()
                id_sets = [torch.stack([torch.randperm(n_exp, generator=g, device=dev)[:k] for _ in range(t)])
                           .to(torch.int32) for _ in range(4)]
                nbytes = t * k * w.shape[1] * w.row_bytes
                rw.REGISTER_WEIGHTS, rw.ASYNC_ACTIVATIONS = rw.VARIANTS["shared"]
                default_tile = rw.wgmma_config(w.qtype, t * k / n_exp)
                ref = rw.routed_wgmma(x, w, id_sets[0], k).float()
                for variant, tile in [("shared", default_tile)] + CANDIDATES[name]:
                    rw.REGISTER_WEIGHTS, rw.ASYNC_ACTIVATIONS = rw.VARIANTS[variant]
                    out = rw.routed_wgmma(x, w, id_sets[0], k, tile).float()
                    diff = float((out - ref).abs().max() / ref.abs().max())
                    us = graph_replay_us([lambda i=i, c=tile, x=x, w=w: rw.routed_wgmma(x, w, i, k, c)
                                          for i in id_sets], rep_ms=60)
                    gbs = nbytes / (us * 1e-6) / 1e9
                    print(f"{name:>8} {t:6d} {variant:>8} {','.join(map(str, tile)):>10} {us:9.1f} {gbs:6.0f} "
                          f"{gbs / COPY_GB_S:8.1%}  {diff:.1e}")
                    rows.append({"bench": "quant_matmul", **env, "qtype": name,
                                 "shape": f"{name} {w.shape[1]}x{w.shape[2]} x{k} routed, {t} tokens",
                                 "flags": {"config": list(tile), "kernel": f"routed_wgmma, {variant}", "rows": t,
                                           "command": "scripts/routed_wgmma_ab.py"},
                                 "us": round(us, 2), "gb_s": round(gbs), "floor_fraction": round(gbs / COPY_GB_S, 3),
                                 "rel_diff": diff, "copy_bandwidth_gb_s": COPY_GB_S,
                                 "model": f"random GGML blocks, seed {args.seed}",
                                 **({} if variant == "shared" and tile == default_tile else {"status": "variant"})})
    finally:
        rw.REGISTER_WEIGHTS, rw.ASYNC_ACTIVATIONS = saved
    if args.ledger:
        append(rows, args.ledger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
