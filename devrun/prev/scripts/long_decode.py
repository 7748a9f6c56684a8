#!/usr/bin/env python3
"""A long greedy decode (default 10,000 steps) in one session, watching memory: the process's resident memory
and, on CUDA, the caching allocator's allocated and reserved bytes, sampled at even intervals. The growth is
measured from the sample at a quarter of the run (after warm-up, capture and the first allocations) to the end;
the run fails (exit status 1) if either grows by more than ``--max-growth-mib`` or the cache does not hold every
token. On CUDA the steps replay the captured decode graph, as `ds4x generate` does.

    PYTHONPATH=src python scripts/long_decode.py -m flash:q2 --steps 10000          # H200, synthetic q2 model
    PYTHONPATH=src python scripts/long_decode.py --device cpu --steps 2000          # the embedded model on CPU

``--ledger PATH`` appends one row (``bench: long_decode``) to a benchmark ledger.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from ds4x.bench.ledger import append, environment
from ds4x.runtime.engine import Engine


def rss_bytes() -> int:
    """The process's resident set size now (Linux /proc; else the peak, from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--cache", default="packed", choices=("native", "packed"))
    ap.add_argument("--samples", type=int, default=20, help="memory samples over the run")
    ap.add_argument("--max-growth-mib", type=float, default=16.0)
    ap.add_argument("--ledger", type=Path, default=None, help="JSONL benchmark ledger to append to")
    args = ap.parse_args()
    if args.steps < args.samples or args.samples < 4:
        ap.error("need --samples >= 4 and --steps >= --samples")

    engine = Engine.load(args.model, device=args.device, dtype="auto")
    dev = engine.model.device
    session = engine.new_session(ctx=args.prompt_tokens + args.steps + 1, cache=args.cache)
    prompt = [3 + i % 250 for i in range(args.prompt_tokens)]
    token = int(session.prefill(prompt).argmax())
    cuda = dev.type == "cuda"
    rows: list[tuple[int, float, int, int, int]] = []  # step, ms per step since the last sample, rss, alloc, reserved
    every = args.steps // args.samples
    t0 = time.perf_counter()
    for i in range(1, args.steps + 1):
        token = int(session.step(token).argmax())  # the host reads each token, as a client would
        if i % every == 0 or i == args.steps:
            if cuda:
                torch.cuda.synchronize(dev)
            now = time.perf_counter()
            span = i - (rows[-1][0] if rows else 0)
            alloc, reserved = (torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)) if cuda else (0, 0)
            rows.append((i, 1000 * (now - t0) / span, rss_bytes(), alloc, reserved))
            t0 = now
            print(f"step {i:6d}: {rows[-1][1]:7.2f} ms/step, rss {rows[-1][2] / 2**20:8.1f} MiB"
                  + (f", cuda allocated {rows[-1][3] / 2**20:9.1f} MiB, reserved {rows[-1][4] / 2**20:9.1f} MiB"
                     if cuda else ""), flush=True)
    base = next(r for r in rows if r[0] >= args.steps // 4)
    growth = {name: (rows[-1][k] - base[k]) / 2**20 for k, name in ((2, "rss"), (3, "cuda_allocated"),
                                                                    (4, "cuda_reserved"))}
    held = session.cache.length == args.prompt_tokens + args.steps
    ms = statistics.median(r[1] for r in rows[1:])
    print(f"{args.steps} steps on {dev} ({args.model}, {args.cache} cache): median {ms:.2f} ms/step; growth from "
          f"step {base[0]} to {rows[-1][0]}: rss {growth['rss']:+.1f} MiB"
          + (f", cuda allocated {growth['cuda_allocated']:+.1f} MiB, reserved {growth['cuda_reserved']:+.1f} MiB"
             if cuda else "") + f"; cache holds {session.cache.length} tokens")
    ok = held and all(abs(g) <= args.max_growth_mib for g in growth.values())
    if args.ledger is not None:
        append([{**environment(), "bench": "long_decode", "model": args.model, "device": str(dev),
                 "flags": {"cache": args.cache, "steps": args.steps, "prompt_tokens": args.prompt_tokens,
                           "cuda_graph": getattr(session.decoder, "graph", None) is not None},
                 "decode_ms": ms, "growth_mib": growth, "from_step": base[0],
                 **({} if ok else {"status": "failed"})}], args.ledger)
    print("PASS" if ok else f"FAIL (growth limit {args.max_growth_mib} MiB, cache complete: {held})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
