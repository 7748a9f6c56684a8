"""``ds4x bench soak``: a long greedy decode that samples memory and step time (see ds4x.bench.soak)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("soak", help="decode many greedy steps in one session and report memory growth "
                                      "(full-size: -m flash:q2 on a GPU)")
    p.add_argument("-m", "--model", default="default",
                   help="model: a path or preset as for generate, or PRESET:POLICY (flash:q2, made on the device)")
    p.add_argument("--steps", type=int, default=10_000, help="decode steps (default 10,000)")
    p.add_argument("--every", type=int, default=500, help="steps between memory samples; the first interval is "
                                                          "warm-up")
    p.add_argument("--cache", default="packed", choices=["float", "native", "packed"])
    p.add_argument("--dtype", default="auto", help="activation dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0, help="synthetic weights seed")
    p.add_argument("--ledger", default="benchmarks/ledger.jsonl", help="JSONL ledger to append to")


def run(args: argparse.Namespace) -> int:
    from ds4x.bench import ledger
    from ds4x.bench.soak import SoakConfig, run_soak
    from ds4x.runtime.engine import Engine

    engine = Engine.load(args.model, device=args.device, dtype=args.dtype, seed=args.seed)
    label = f"synthetic {args.model}, seed {args.seed}" if ":" in args.model else args.model
    row = run_soak(engine, SoakConfig(steps=args.steps, every=args.every, cache=args.cache), label,
                   log=lambda m: print(m, file=sys.stderr, flush=True))
    ledger.append([{**ledger.environment(), **row}], Path(args.ledger))
    growth = [f"host RSS {row['host_rss_growth_bytes'] / 2**20:+.1f} MiB"]
    if "device_allocated_growth_bytes" in row:
        growth = [f"device allocated {row['device_allocated_growth_bytes'] / 2**20:+.1f} MiB",
                  f"reserved {row['device_reserved_growth_bytes'] / 2**20:+.1f} MiB", *growth]
    print(f"{args.steps} steps at context {row['context']}: {row['first_interval_decode_ms']:.2f} ms/step in the "
          f"first interval, {row['decode_ms']:.2f} in the last; growth after the first interval: {', '.join(growth)}")
    return 0
