"""``ds4x bench prefill``: the DESIGN §7 prefill fixture at several contexts, then greedy decode."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("prefill", help="prefill the DESIGN §7 fixture at each context, then greedy decode "
                                         "(full-size: -m flash:q2 on a GPU)")
    p.add_argument("-m", "--model", default="flash:q2",
                   help="model: PRESET:POLICY synthesizes one on the device (flash:q2 = the ds4 q2 mix), or a "
                        "path / preset as for generate")
    p.add_argument("--contexts", default="4096,16384", help="comma-separated prompt lengths in tokens")
    p.add_argument("--decode", type=int, default=32, help="greedy tokens generated after each prefill")
    p.add_argument("--chunk", type=int, default=None,
                   help="prefill chunk (tokens per forward; default 4096, measured fastest on the H200)")
    p.add_argument("--prefill-mode", default="default", choices=["default", "exact", "reference"])
    p.add_argument("--cache", default="packed", choices=["float", "native", "packed"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="working dtype (default auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0, help="synthetic weights seed")
    p.add_argument("--profile", action="store_true",
                   help="also break one decode step and one prefill chunk (after the context) down by kernel group")
    p.add_argument("--ledger", default="benchmarks/ledger.jsonl", help="JSONL ledger to append to")


def run(args: argparse.Namespace) -> int:
    import torch

    from ds4x.bench import ledger
    from ds4x.bench.prefill import PrefillBenchConfig, fixture_ids, run_prefill_bench
    from ds4x.runtime.engine import Engine, resolve_device

    try:  # int()'s own message ("invalid literal for int() with base 10") names no option
        contexts = tuple(int(c) for c in args.contexts.split(",") if c.strip())
    except ValueError:
        raise ValueError(f"--contexts must be comma-separated positive integers, got {args.contexts!r}") from None
    if not contexts or any(c <= 0 for c in contexts):
        raise ValueError(f"--contexts must be comma-separated positive integers, got {args.contexts!r}")
    dev = resolve_device(args.device)
    engine = Engine.load(args.model, device=str(dev), dtype=args.dtype, seed=args.seed)
    synthetic = ":" in args.model
    label = f"synthetic {args.model}, seed {args.seed}" if synthetic else args.model
    bc = PrefillBenchConfig(contexts=contexts, decode=args.decode, chunk=args.chunk or PrefillBenchConfig.chunk,
                            mode=args.prefill_mode, cache=args.cache)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rows = run_prefill_bench(engine, bc, label, log=say)
    env = ledger.environment()
    ledger.append([{**env, **row} for row in rows], Path(args.ledger))
    print(f"{'context':>8} {'prefill tok/s':>14} {'decode ms':>10} {'decode tok/s':>13} {'floor %':>8}")
    for r in rows:
        print(f"{r['context']:>8} {r['prefill_tok_s']:>14.0f} {r['decode_ms']:>10.2f} {r['decode_tok_s']:>13.1f} "
              f"{100 * r['floor_fraction']:>8.1f}")
    if args.profile:
        if dev.type != "cuda":
            raise ValueError("--profile needs a CUDA device")
        from ds4x.bench.profile import format_profile, profile_step
        from ds4x.weights.synthetic_gguf import active_weight_bytes

        for n in contexts:
            session = engine.new_session(n + 16 + 3 * bc.chunk, bc.cache, bc.chunk, bc.mode, announce=False)
            ids = fixture_ids(engine, n + bc.chunk)
            token = int(session.prefill(ids[:n]).argmax())

            groups, wall_us = profile_step(lambda s=session, t=token: s.step(t))  # consecutive steps from position n
            for g in groups:
                if g["group"].startswith("quantized matmul"):
                    g["bytes"] = active_weight_bytes(engine.cfg, engine.model.w, quantized_only=True)
            print(f"\none decode step at context {n}, by kernel group:")
            print(format_profile(groups, wall_us))
            groups, wall_us = profile_step(lambda s=session, c=ids[n:]: s.prefill(c), reps=1)
            print(f"\none prefill chunk of {bc.chunk} tokens after context {n}, by kernel group:")
            print(format_profile(groups, wall_us))
            del session
            torch.cuda.empty_cache()
    return 0
