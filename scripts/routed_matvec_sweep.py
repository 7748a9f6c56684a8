#!/usr/bin/env python3
"""Routed-expert matvec tile sweep at Flash shapes (CUDA): us per call of the decode step's two routed products, gate /
up with SwiGLU in one launch (IQ2_XXS, 2 x 256 experts of 2048 x 4096, split rows) and down (Q2_K, 256 experts of
4096 x 2048), for T tokens x 6 experts and each (R rows, U units, warps) tile. Every call of a CUDA graph of 16
picks its own random experts (little L2 reuse between calls); median of the replays. "xq": gate / up reading x
quantized once beforehand (`quantize_activations`, timed alone as "quantize x") instead of in every program; "down":
x quantized in every program (``Q2_K_PREPARED_ACTIVATIONS`` off); "down xq": with it on (x quantized with its
groups' sums in one more launch, timed in, at any number of pairs here; the default from
``Q2_K_PREPARED_MIN_PAIRS``). The figures behind ``ds4x.kernels.quant_matmul.MATVEC_TILES``.

    PYTHONPATH=src python scripts/routed_matvec_sweep.py --tokens 1,8,32 --ledger benchmarks/ledger.jsonl

GB/s counts the bytes of every (token, expert) pair's rows (a pair repeated across tokens counts again).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ds4x.bench.variants import variant_applied

GATE_UP = ["16,64,2", "8,64,2", "32,64,2", "16,32,1", "32,32,1", "16,64,1", "16,128,4", "32,128,4", "16,128,2"]
DOWN = ["8,32,1", "2,32,1", "4,32,1", "16,32,1", "32,32,1"]
PREPARED_DOWN = {"Q2_K_PREPARED_ACTIVATIONS": True, "Q2_K_PREPARED_MIN_PAIRS": 1}
PER_PROGRAM_DOWN = {"Q2_K_PREPARED_ACTIVATIONS": False}  # the default from Q2_K_PREPARED_MIN_PAIRS pairs is "xq"
COPY_GB_S = 4260  # the H200's measured copy bandwidth (read + write), DESIGN §7


def tiles(specs: list[str]) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in s.split(",")) for s in specs]  # type: ignore[misc]


def switched(qm, switches: dict, call, *args, **kwargs):
    """``call(*args, **kwargs)`` with quant_matmul's attributes set as ``switches`` says (A/B switches)."""
    with variant_applied([(qm, name, value) for name, value in switches.items()]):
        return call(*args, **kwargs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,8,32")
    p.add_argument("--gate-up", nargs="*", default=GATE_UP, help="R,U,warps tiles of the gate / up + SwiGLU launch")
    p.add_argument("--down", nargs="*", default=DOWN, help="R,U,warps tiles of the down launch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ledger", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("routed_matvec_sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    from ds4x.bench.ledger import append, environment
    from ds4x.bench.timing import graph_replay_us
    from ds4x.formats.ggml import GGMLQuantizationType as T
    from ds4x.formats.ggml import random_blocks
    from ds4x.formats.ggml_tensor import GGMLTensor
    from ds4x.kernels import quant_matmul as qm

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(args.seed)
    n_exp, inter, hidden, k = 256, 2048, 4096, 6
    w13 = qm.kernel_layout(GGMLTensor(random_blocks(T.IQ2_XXS, (2 * n_exp, inter, hidden), g), T.IQ2_XXS,
                                      (2 * n_exp, inter, hidden)))
    w2 = qm.kernel_layout(GGMLTensor(random_blocks(T.Q2_K, (n_exp, hidden, inter), g), T.Q2_K,
                                     (n_exp, hidden, inter)))
    env = environment()
    rows, best = [], {}
    print(f"{'product':>17} {'tokens':>6} {'tile':>10} {'us':>8} {'GB/s':>7} {'of copy':>8}  max rel diff to default")
    for t in (int(v) for v in args.tokens.split(",")):
        x = (torch.randn(t, hidden, generator=g, device=dev)).bfloat16()
        h = (torch.randn(t * k, inter, generator=g, device=dev) * 0.1).bfloat16()
        xq = qm.quantize_activations(x)
        id_sets = [torch.stack([torch.randperm(n_exp, generator=g, device=dev)[:k] for _ in range(t)])
                   for _ in range(16)]
        cases = [
            ("gate/up+swiglu", tiles(args.gate_up), t * k * 2 * inter * w13.row_bytes,
             lambda cfg, ids, x=x: qm.quant_routed_swiglu(x, w13, ids, 10.0, config=cfg),
             f"IQ2_XXS split 2x(2048x4096) x{k} routed + SwiGLU", "routed swiglu int8"),
            ("gate/up+swiglu xq", tiles(args.gate_up), t * k * 2 * inter * w13.row_bytes,
             lambda cfg, ids, x=x, xq=xq: qm.quant_routed_swiglu(x, w13, ids, 10.0, config=cfg, xq=xq),
             f"IQ2_XXS split 2x(2048x4096) x{k} routed + SwiGLU", "routed swiglu int8, x quantized once"),
            ("down", tiles(args.down), t * k * hidden * w2.row_bytes,
             lambda cfg, ids, h=h, t=t: switched(qm, PER_PROGRAM_DOWN, qm.quant_matmul_routed, h, w2,
                                                 ids.reshape(t * k, 1), config=cfg),
             f"Q2_K 4096x2048 x{k} routed", "matvec int8"),
            ("down xq", tiles(args.down), t * k * hidden * w2.row_bytes,
             lambda cfg, ids, h=h, t=t: switched(qm, PREPARED_DOWN, qm.quant_matmul_routed, h, w2,
                                                 ids.reshape(t * k, 1), config=cfg),
             f"Q2_K 4096x2048 x{k} routed", "matvec int8, x quantized once with sums (launch timed in)"),
        ]
        for what, configs, nbytes, call, shape, kernel in cases:
            ref = call(configs[0], id_sets[0]).float()
            for cfg in configs:
                us = graph_replay_us([lambda c=cfg, i=i, f=call: f(c, i) for i in id_sets], rep_ms=40)
                diff = float((call(cfg, id_sets[0]).float() - ref).abs().max() / ref.abs().max())
                gbs = nbytes / (us * 1e-6) / 1e9
                print(f"{what:>17} {t:6d} {','.join(map(str, cfg)):>10} {us:8.2f} {gbs:7.0f} {gbs / COPY_GB_S:8.1%}"
                      f"  {diff:.1e}")
                rows.append({"bench": "quant_matmul", **env, "qtype": shape.split()[0], "shape": shape,
                             "flags": {"config": list(cfg), "kernel": kernel, "rows": t,
                                       "command": "scripts/routed_matvec_sweep.py"},
                             "us": round(us, 2), "gb_s": round(gbs), "floor_fraction": round(gbs / COPY_GB_S, 3),
                             "copy_bandwidth_gb_s": COPY_GB_S, "model": f"random GGML blocks, seed {args.seed}"})
                if (what, t) not in best or us < best[(what, t)][1]:
                    best[(what, t)] = (cfg, us)
        xq_us = graph_replay_us([lambda x=x: qm.quantize_activations(x)])
        print(f"{'quantize x':>17} {t:6d} {'-':>10} {xq_us:8.2f}")
    print("fastest tile per product and token count:")
    for (what, t), (cfg, us) in best.items():
        print(f"  {what} T={t}: {','.join(map(str, cfg))} {us:.2f} us")
    if args.ledger:
        append(rows, args.ledger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
