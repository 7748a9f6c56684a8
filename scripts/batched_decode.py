#!/usr/bin/env python3
"""Batched decode through the server's pool of cache slots (``ds4x.runtime.batch.DecodeSlots``): ms per step and
aggregate tok/s for B sessions decoding together, each seeded at a frontier of ``--context`` tokens (no prefill) in
a cache of ``--capacity`` tokens (default: just enough), the step replayed from its CUDA graph, then a host read of
each session's greedy token (the server samples each request alone); "replay ms" times the captured step alone (CUDA
events, no host reads).
``--profile`` breaks the largest batch's replayed step down by kernel group; ``--timeline DIR`` writes each replayed
step's kernels (name, start, end, stream) to DIR/timeline_b{B}_{variant}.json and prints how much of the step no
kernel runs (launch waits) and how much kernel time overlaps (graph branches), from one more pass after all the
timings (in a process that has run the profiler, later launches are slower).

    PYTHONPATH=src python scripts/batched_decode.py                       # flash:q2, B = 1, 8, 32 at 4K (H200)
    PYTHONPATH=src python scripts/batched_decode.py -m tiny --device cpu --batches 1,4 --context 256   # dry run

``--ledger PATH`` appends one row per batch size (``bench: batched_decode``) to a benchmark ledger.

``--variant 'NAME: module.attr=EXPR; ...'`` (repeatable) adds an A/B in one process: every round runs the defaults
and then each variant (module attributes set to the Python expressions, restored after), each with a freshly
captured pool, e.g. ``--variant 'multi-program select: ds4x.kernels.select.SMALL_ROWS=0' --rounds 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from ds4x.bench.frontier import COPY_BANDWIDTH, seed_frontier
from ds4x.bench.ledger import append, environment
from ds4x.bench.variants import parse_variant, variant_applied
from ds4x.runtime.batch import DecodeSlots
from ds4x.runtime.engine import Engine, Session
from ds4x.weights.synthetic_gguf import active_weight_bytes


def run(engine: Engine, batch: int, context: int, chunk: int, steps: int, profile: bool,
        timeline: Path | None = None, capacity: int | None = None) -> dict[str, Any]:
    pool = DecodeSlots(engine, capacity or context + steps + 16, "packed", chunk, batch)
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
    overlap = None
    if timeline is not None and pool.steps[batch].graph is not None:
        from ds4x.bench.profile import kernel_timeline, overlap_summary

        kernels = kernel_timeline(pool.steps[batch].graph.replay)
        timeline.parent.mkdir(parents=True, exist_ok=True)
        timeline.write_text(json.dumps(kernels))
        overlap = overlap_summary(kernels)
    return {"batch": batch, "step_ms": ms, "tok_s": 1000 * batch / ms, "first_s": first, "replay_ms": replay_ms,
            "overlap": overlap}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="flash:q2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--capacity", type=int, default=None,
                    help="each session's cache capacity in tokens (default: the context and the steps; a larger one "
                         "times a long-context session at a short position)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--timeline", type=Path, default=None, help="directory for each replayed step's kernel timeline")
    ap.add_argument("--ledger", type=Path, default=None, help="JSONL benchmark ledger to append to")
    ap.add_argument("--variant", action="append", default=[], help="'NAME: module.attr=EXPR; ...' (A/B, see above)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the defaults and the variants, alternating")
    args = ap.parse_args()
    variants = [("default", [])] + [parse_variant(v) for v in args.variant]
    engine = Engine.load(args.model, device=args.device, dtype="auto")
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for _ in range(args.rounds if args.variant else 1):
        for name, sets in variants:
            with variant_applied(sets):
                rows += [{**run(engine, b, args.context, args.chunk, args.steps, args.profile and b == max(batches),
                               capacity=args.capacity), "variant": name} for b in batches]
    if args.timeline is not None:  # after every timing: the profiler slows the launches of the process after it
        for name, sets in variants:
            with variant_applied(sets):
                for b in batches:
                    path = args.timeline / f"timeline_b{b}_{name.replace(' ', '_')}.json"
                    overlap = run(engine, b, args.context, args.chunk, 3, False, path, args.capacity)["overlap"]
                    next(r for r in rows if r["variant"] == name and r["batch"] == b)["overlap"] = overlap
    # the weight bytes floor of each batch (DESIGN §7): the expected distinct routed experts of B randomly routed
    # tokens read once at copy bandwidth, the cache's reads left out
    floor_ms = {b: 1000 * active_weight_bytes(engine.cfg, engine.model.w, tokens=b) / COPY_BANDWIDTH
                for b in batches}
    for r in rows:
        r["weight_floor_ms"] = floor_ms[r["batch"]]
    print(f"{'batch':>5} {'step ms':>9} {'tok/s':>8} {'replay ms':>10} {'floor ms':>9} {'of floor':>8}  variant  "
          f"(context {args.context}, {args.model})")
    for r in rows:
        replay = "-" if r["replay_ms"] is None else f"{r['replay_ms']:.2f}"
        print(f"{r['batch']:5d} {r['step_ms']:9.2f} {r['tok_s']:8.1f} {replay:>10} {r['weight_floor_ms']:9.2f} "
              f"{100 * r['weight_floor_ms'] / (r['replay_ms'] or r['step_ms']):7.1f}%  {r['variant']}")
        if r["overlap"] is not None:
            o = r["overlap"]
            print(f"      kernels {o['kernel_us']:.0f} us in a {o['span_us']:.0f} us span: busy {o['busy_us']:.0f}, "
                  f"idle {o['idle_us']:.0f} (no kernel runs), overlapped {o['overlapped_us']:.0f}")
    one = 1000 * active_weight_bytes(engine.cfg, engine.model.w) / COPY_BANDWIDTH
    print("at the floor, B sessions give at most " + ", ".join(
        f"{b * one / floor_ms[b]:.2f}x (B = {b})" for b in batches if b > 1) + " one session's tok/s")
    if args.ledger is not None:
        env = environment()
        flags = {"steps": args.steps, "chunk": args.chunk, "cache": "packed", "cuda_graph": True,
                 "quant_act": os.environ.get("DS4X_QUANT_ACT", "default"),
                 **({"capacity": args.capacity} if args.capacity else {})}
        spec = dict(zip([n for n, _ in variants], ["", *args.variant], strict=True))
        append([{"bench": "batched_decode", **env, "model": f"synthetic {args.model}, seed 0",
                 "flags": {**flags, **({"variant": spec[r["variant"]]} if r["variant"] != "default" else {})},
                 "context": args.context, "batch": r["batch"], "step_ms": r["step_ms"], "tok_s": r["tok_s"],
                 "replay_ms": r["replay_ms"], "weight_floor_ms": r["weight_floor_ms"],
                 **({"status": "variant"} if r["variant"] != "default" else {})}
                for r in rows], args.ledger)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
