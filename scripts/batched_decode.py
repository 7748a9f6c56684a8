#!/usr/bin/env python3
"""Batched decode through the server's pool of cache slots (``ds4x.runtime.batch.DecodeSlots``): ms per step and
aggregate tok/s for B sessions decoding together, each seeded at a frontier of ``--context`` tokens (no prefill),
the step replayed from its CUDA graph, then a host read of each session's greedy token (the server samples each
request alone); "replay ms" times the captured step alone (CUDA events, no host reads).
``--profile`` breaks the largest batch's replayed step down by kernel group.

    PYTHONPATH=src python scripts/batched_decode.py                       # flash:q2, B = 1, 8, 32 at 4K (H200)
    PYTHONPATH=src python scripts/batched_decode.py -m tiny --device cpu --batches 1,4 --context 256   # dry run

``--ledger PATH`` appends one row per batch size (``bench: batched_decode``) to a benchmark ledger.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from ds4x.bench.frontier import seed_frontier
from ds4x.bench.ledger import append, environment
from ds4x.runtime.batch import DecodeSlots
from ds4x.runtime.engine import Engine, Session


def run(engine: Engine, batch: int, context: int, chunk: int, steps: int, profile: bool) -> dict[str, float]:
    pool = DecodeSlots(engine, context + steps + 16, "packed", chunk, batch)
    sessions = []
    for i in range(batch):
        s = Session(engine, pool.acquire(), chunk)
        seed_frontier(s.cache, context, seed=i)
        s.tokens = [1] * context
        sessions.append(s)
    tokens = [5] * batch
    t0 = time.perf_counter()
    pool.decode(list(zip(sessions, tokens, strict=True)))  # eager, then the capture
    first = time.perf_counter() - t0
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        tokens = [int(x.argmax()) % 256 for x in pool.decode(list(zip(sessions, tokens, strict=True)))]
        if i >= 3:
            times.append(time.perf_counter() - t0)
    ms = 1000 * statistics.median(times)
    replay_ms = None
    graph = pool.steps[batch].graph
    if graph is not None:  # the captured step alone (CUDA events), without the host's token reads and copies
        import torch

        reps = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            reps.append(start.elapsed_time(end))
        replay_ms = statistics.median(reps)
    if profile and pool.steps[batch].graph is not None:
        from ds4x.bench.profile import format_profile, profile_step

        print(format_profile(*profile_step(pool.steps[batch].graph.replay)))
    return {"batch": batch, "step_ms": ms, "tok_s": 1000 * batch / ms, "first_s": first, "replay_ms": replay_ms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="flash:q2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ledger", type=Path, default=None, help="JSONL benchmark ledger to append to")
    args = ap.parse_args()
    engine = Engine.load(args.model, device=args.device, dtype="auto")
    batches = [int(b) for b in args.batches.split(",")]
    rows = [run(engine, b, args.context, args.chunk, args.steps, args.profile and b == max(batches))
            for b in batches]
    print(f"{'batch':>5} {'step ms':>9} {'tok/s':>8} {'replay ms':>10}  (context {args.context}, {args.model})")
    for r in rows:
        replay = "-" if r["replay_ms"] is None else f"{r['replay_ms']:.2f}"
        print(f"{r['batch']:5d} {r['step_ms']:9.2f} {r['tok_s']:8.1f} {replay:>10}")
    if args.ledger is not None:
        env = environment()
        flags = {"steps": args.steps, "chunk": args.chunk, "cache": "packed", "cuda_graph": True,
                 "quant_act": os.environ.get("DS4X_QUANT_ACT", "default")}
        append([{"bench": "batched_decode", **env, "model": f"synthetic {args.model}, seed 0", "flags": flags,
                 "context": args.context, "batch": r["batch"], "step_ms": r["step_ms"], "tok_s": r["tok_s"],
                 "replay_ms": r["replay_ms"]}
                for r in rows], args.ledger)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
