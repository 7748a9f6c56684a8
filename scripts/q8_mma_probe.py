"""Time ds4x.kernels.q8_mma against today's batched Q8_0 paths on an H200 (needs an sm_90 GPU).

For each Flash Q8_0 shape and T in --tokens: ``q8_mma_linear`` (x quantized per 32 values + the int8 MMA kernel;
default configuration, then the --sweep variants), the dp4a token tile of ``ds4x.kernels.quant_matmul``
(``_token_tile`` with the token count ``quant_linear`` picks at 2-8 rows with mirrors on, called directly so that 16
and 32 rows run it too) and the bf16 mirror (``F.linear`` / ``einsum`` on ``dequantize_gpu(w, bf16)``, what the
batched step runs today). Each call runs on ``copies`` distinct weight copies (>= 256 MB in all, so the 60 MB L2
holds none) captured in one CUDA graph; a time is the median replay over --rep-ms milliseconds divided by the
copies, after a warm-up (`ds4x.bench.timing.graph_replay_us`). GB/s = the bytes that kernel's weight holds (Q8_0
split rows: 34 per 32 weights; mirror: 2 per weight) / time; "of copy" against 4,260 GB/s. The q8_mma rows also say
whether the result has the reference's bits.

    PYTHONPATH=src python scripts/q8_mma_probe.py [--tokens 2,4,8,16,32] [--shapes wq_a,...] [--sweep] [--ledger PATH]

``--ledger`` appends a ``quant_matmul`` row per timing (the q8_mma rows marked ``status: variant``: the kernel is
off by default, ``quant_matmul.Q8_MMA``).
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial
from pathlib import Path

import torch

from ds4x.formats.ggml import GGMLQuantizationType as T
from ds4x.formats.ggml import random_blocks
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.kernels import q8_mma as qm
from ds4x.kernels import quant_matmul as qmm

COPY_GBS = 4260.0
# name: (N per group, K, groups); the token tile's time at 8 rows to beat (us, 82211fa)
SHAPES = {"wq_a": (1024, 4096, 1), "wq_b": (32768, 1024, 1), "wo_a": (1024, 4096, 8), "wo_b": (4096, 8192, 1),
          "shared_gate_up": (4096, 4096, 1), "shared_down": (4096, 2048, 1)}
TO_BEAT_8 = {"wq_a": 4.8, "wq_b": 16.5, "wo_a": 15.9, "wo_b": 17.4, "shared_gate_up": 10.0, "shared_down": 6.1}
SWEEP = [dict(split=s, num_warps=w, stages=st) for s in (1, 2, 4, 8, 16) for w in (2, 4, 8) for st in (3, 4)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2,4,8,16,32")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time every valid (split, num_warps, stages)")
    ap.add_argument("--rep-ms", type=int, default=50, help="milliseconds of replays per timing")
    ap.add_argument("--min-bytes", type=int, default=256 << 20, help="weight bytes over all copies")
    ap.add_argument("--ledger", type=Path, default=None, help="benchmark ledger to append rows to")
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and qm.HAVE_GLUON):
        print("needs an sm_90 GPU and Triton's Gluon")
        return 2
    from ds4x.bench.ledger import append, environment
    from ds4x.bench.timing import graph_replay_us

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        n, k, groups = SHAPES[name]
        one = GGMLTensor(random_blocks(T.Q8_0, (groups * n, k), g, device=dev), T.Q8_0, (groups * n, k)).split()
        copies = max(2, min(64, math.ceil(args.min_bytes / one.nbytes)))
        ws = [one] + [GGMLTensor(one.raw.clone(), T.Q8_0, (groups * n, k), "split") for _ in range(copies - 1)]
        mirrors = [qmm.dequantize_gpu(w, torch.bfloat16) for w in ws]
        for tokens in map(int, args.tokens.split(",")):
            shape = (tokens, k) if groups == 1 else (tokens, groups, k)
            x = (torch.randn(shape, device=dev, generator=g) + 0.1).to(torch.bfloat16)  # random, non-zero
            x2 = x.reshape(tokens * groups, k)
            exact = torch.equal(qm.q8_mma_linear(x, ws[0], groups), qm.q8_mma_reference(x, ws[0], groups))
            configs = [dict()] + ([c for c in SWEEP if (k // (qm.BLOCK * qm.KB)) % c["split"] == 0]
                                  if args.sweep else [])
            for cfg in configs:
                us = graph_replay_us([partial(qm.q8_mma_linear, x, w, groups, **cfg) for w in ws],
                                     rep_ms=args.rep_ms)
                label = ",".join(f"{a}={b}" for a, b in cfg.items()) or f"split={qm.q8_mma_config(n, k, groups)}"
                rows.append((name, tokens, "q8_mma", label, us, one.nbytes, "yes" if exact else "NO"))
            tok = min(qmm.TILE_TOKENS["q8_0"], 1 << (tokens - 1).bit_length())
            us = graph_replay_us([partial(qmm._token_tile, x2, w, groups, tok) for w in ws], rep_ms=args.rep_ms)
            rows.append((name, tokens, "dp4a token tile", f"tok={tok}", us, one.nbytes, ""))
            if groups == 1:
                fns = [partial(torch.nn.functional.linear, x, m) for m in mirrors]
            else:
                fns = [partial(torch.einsum, "tgi,goi->tgo", x, m.view(groups, n, k)) for m in mirrors]
            us = graph_replay_us(fns, rep_ms=args.rep_ms)
            rows.append((name, tokens, "bf16 mirror", "", us, mirrors[0].numel() * 2, ""))
        del ws, mirrors
        torch.cuda.empty_cache()
    print("\n| shape | T | kernel | config | us | GB/s | of copy | reference bits | to beat at 8 (us) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, tokens, kernel, cfg, us, nbytes, exact in rows:
        gbs = nbytes / us / 1e3
        beat = TO_BEAT_8[name] if tokens == 8 else ""
        print(f"| {name} | {tokens} | {kernel} | {cfg} | {us:.2f} | {gbs:.0f} | {gbs / COPY_GBS:.1%} | {exact} | "
              f"{beat} |")
    if args.ledger:
        env = environment()
        entries = []
        for name, tokens, kernel, cfg, us, nbytes, exact in rows:
            n, k, groups = SHAPES[name]
            gbs = nbytes / us / 1e3
            entry = {"bench": "quant_matmul", **env, "qtype": "Q8_0", "shape": f"{name} {groups * n}x{k}",
                     "flags": {"config": cfg, "kernel": kernel, "rows": tokens, "command": "scripts/q8_mma_probe.py"},
                     "us": round(us, 2), "gb_s": round(gbs), "floor_fraction": round(gbs / COPY_GBS, 3),
                     "copy_bandwidth_gb_s": COPY_GBS, "model": "random GGML blocks, seed 0"}
            if kernel == "q8_mma":
                entry.update(status="variant",
                             note=f"int8 mma.sync kernel (quant_matmul.Q8_MMA, off); reference bits: {exact}")
            entries.append(entry)
        append(entries, args.ledger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
