"""The server's decode loop without HTTP, with a step's tokens read after the next step is queued (the default) and
before it (``DS4X_SERVE_OVERLAP=0``'s order), alternating in one process after one warm-up.

A ``Scheduler`` as ``ds4x serve`` makes it (its dtype, prefill chunk and budget, batch limit, KV budget; sessions in
decode slots) serves N jobs submitted together: unique random prompts of ``--prompt-tokens``, ``--gen-tokens`` each
(EOS ignored), temperature 0.2. Per run: the wall time from submitting them to the last token, aggregate tok/s,
the per-stream decode rate after the first token (median), the largest time to first token, and the scheduler's
own figures over the run (decode steps; mean device time and host time per step). One server start measures what
two `device_ab.sh serve` calls would, without the HTTP side. ``--prefill-budgets`` adds the prompt tokens one prompt
call may take as a second dimension (default: the server's, 4 prefill chunks).

    PYTHONPATH=src python scripts/scheduler_ab.py [-m flash:q2] [--concurrency 1,8,32] [--gen-tokens 256]
        [--prefill-budgets 1024,2048] [--rounds 2] [--ledger benchmarks/ledger.jsonl]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from server_engine import add_server_arguments, server_scheduler

from ds4x.bench.ledger import append, environment
from ds4x.runtime.sampling import SamplingParams
from ds4x.serve.scheduler import Job, Piece, Scheduler


def run(sched: Scheduler, n: int, prompt_tokens: int, gen_tokens: int, rng: random.Random) -> dict[str, Any]:
    """Serve ``n`` jobs submitted at once; their figures and the scheduler's over the run."""
    vocab = sched.engine.cfg.vocab_size
    arrivals: list[list[float]] = [[] for _ in range(n)]  # when each piece carrying tokens came
    counts = [0] * n
    failures: list[Exception] = []
    left = threading.Semaphore(0)

    def deliver(i: int):
        def put(item: Piece | Exception) -> None:
            if isinstance(item, Exception):
                failures.append(item)
                left.release()
                return
            if item.ids:
                arrivals[i].append(time.perf_counter())
                counts[i] += len(item.ids)
            if item.finish is not None:
                left.release()
        return put

    st = sched.stats
    before = (st.steps, st.step_model.total, st.step_sample.total)
    t0 = time.perf_counter()
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        sched.submit(Job(prompt, gen_tokens, SamplingParams(temperature=0.2, seed=i), [], True, False,
                         ids_every_token=True), deliver(i))
    for _ in range(n):
        if not left.acquire(timeout=600):
            raise TimeoutError("the jobs did not finish in 600 s")
    wall = time.perf_counter() - t0
    if failures:
        raise RuntimeError(f"{len(failures)} job(s) failed: {failures[0]}")
    steps = st.steps - before[0]
    rates = [(c - 1) / (a[-1] - a[0]) for c, a in zip(counts, arrivals, strict=True) if c > 1 and a[-1] > a[0]]
    return {"concurrency": n, "wall_s": wall, "tok_s": sum(counts) / wall,
            "per_stream_tok_s": statistics.median(rates) if rates else None,
            "ttft_max_s": max(a[0] for a in arrivals) - t0, "steps": steps,
            "step_model_ms": 1e3 * (st.step_model.total - before[1]) / max(steps, 1),
            "step_host_ms": 1e3 * (st.step_sample.total - before[2]) / max(steps, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_arguments(ap)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=130)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--prefill-budgets", default=None, help="comma-separated prompt tokens a call may take "
                    "(default: the server's)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both orders, alternating")
    ap.add_argument("--ledger", type=Path, default=None, help="JSONL benchmark ledger to append to")
    args = ap.parse_args(argv)
    levels = [int(v) for v in args.concurrency.split(",")]
    if min(levels) < 1 or max(levels) > args.max_batch or args.gen_tokens < 2 or args.rounds < 1:
        ap.error("concurrency levels in [1, --max-batch], --gen-tokens >= 2, --rounds >= 1")

    sched = server_scheduler(args, args.max_batch)
    engine = sched.engine
    default_budget = sched.prefill_budget
    budgets = [int(v) for v in args.prefill_budgets.split(",")] if args.prefill_budgets else [default_budget]
    if min(budgets) < args.prefill_chunk:
        ap.error("a prefill budget holds at least one prefill chunk")
    sched.prefill_budget = max(budgets)  # the warm-up's prompt calls cover the largest
    t0 = time.perf_counter()
    sched.warm_up()
    print(f"{args.model} ({engine.model.dtype}) on {engine.model.device}; {sched.slots.capacity} slots; warm-up "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    sched.start()
    rng = random.Random(0)
    rows = []
    try:
        for r in range(args.rounds):
            for n in levels:
                for budget in budgets:
                    for overlap in ((True, False) if r % 2 == 0 else (False, True)):
                        sched.overlap, sched.prefill_budget = overlap, budget  # between runs: nothing in flight
                        rows.append({**run(sched, n, args.prompt_tokens, args.gen_tokens, rng), "overlapped": overlap,
                                     "prefill_budget": budget})
                        x = rows[-1]
                        print(f"  {n:3d} streams, budget {budget}, reads {'after' if overlap else 'before'} the next "
                              f"step: {x['tok_s']:8.1f} tok/s, {x['steps']} steps", flush=True)
    finally:
        sched.stop()
    print(f"{'streams':>7} {'budget':>6} {'reads':>6} {'tok/s':>8} {'per stream':>10} {'TTFT max s':>10} {'steps':>6} "
          f"{'model ms':>9} {'host ms':>8}  ({args.model}, {args.prompt_tokens}-token prompts, {args.gen_tokens} "
          f"tokens each)")
    for x in sorted(rows, key=lambda x: (x["concurrency"], x["prefill_budget"], not x["overlapped"])):
        per = "-" if x["per_stream_tok_s"] is None else f"{x['per_stream_tok_s']:.1f}"
        print(f"{x['concurrency']:7d} {x['prefill_budget']:6d} {'after' if x['overlapped'] else 'before':>6} "
              f"{x['tok_s']:8.1f} {per:>10} {x['ttft_max_s']:10.3f} {x['steps']:6d} {x['step_model_ms']:9.2f} "
              f"{x['step_host_ms']:8.2f}")
    if args.ledger is not None:
        env = environment()
        flags = {"ctx": args.ctx, "prefill_chunk": args.prefill_chunk, "max_batch": args.max_batch,
                 "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "temperature": 0.2,
                 "dtype": str(engine.model.dtype).removeprefix("torch.")}
        append([{"bench": "scheduler", **env, "model": f"synthetic {args.model}, seed 0",
                 "flags": {**flags, "overlapped_reads": x["overlapped"], "prefill_budget": x["prefill_budget"]},
                 **{k: v for k, v in x.items() if k not in ("overlapped", "prefill_budget")},
                 **({} if x["overlapped"] and x["prefill_budget"] == default_budget else {"status": "variant"})}
                for x in rows], args.ledger)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
