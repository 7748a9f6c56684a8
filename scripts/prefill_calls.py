"""Time the server's prompt calls: several sessions' prompts evaluated in one model call (``step_sessions``), as
``ds4x serve``'s scheduler makes them, after the server's warm-up, in the server's dtype.

Under issue 6's harness at 32 streams the streams finish together and their next prompts queue for such calls,
during which no stream decodes (docs/PROFILE.md, 2026-12-05 third). This prints, per number of sessions, the first
call (a compile shows here) and the median of the others, and with ``--profile`` the kernels of the largest call
by device time. ``--variant 'NAME: module.attr=EXPR; ...'`` (repeatable, as in ``scripts/batched_decode.py``) times
each size again with those module attributes set, in the same process.

    PYTHONPATH=src python scripts/prefill_calls.py [-m flash:q2] [--sessions 1,2,4,8] [--prompt-tokens 130]
        [--rounds 3] [--profile] [--variant 'x async: ds4x.kernels.routed_wgmma.ASYNC_ACTIVATIONS=True']
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from server_engine import add_server_arguments, server_scheduler

from ds4x.bench.variants import parse_variant, variant_applied
from ds4x.serve.scheduler import Scheduler


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(sched: Scheduler, lengths: list[int], rng: random.Random) -> float:
    """Seconds of one prompt call of fresh sessions with ``lengths`` random tokens each (slots freed after)."""
    assert sched.slots is not None
    vocab, device = sched.engine.cfg.vocab_size, sched.engine.model.device
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    _sync(device)
    t0 = time.perf_counter()
    sched.slots.evaluate_prompts(prompts)
    _sync(device)
    return time.perf_counter() - t0


def profile_call(sched: Scheduler, lengths: list[int], rng: random.Random, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        wall = timed_call(sched, lengths, rng)
    events = prof.key_averages()
    on_device = sched.engine.model.device.type == "cuda"

    def self_us(e) -> float:  # kernels' time on a GPU, the operators' own CPU time on the CPU
        return e.self_device_time_total if on_device else e.self_cpu_time_total

    print(f"\nprofile of {len(lengths)} sessions x {lengths[0]} tokens: wall {wall * 1e3:.1f} ms, "
          f"{'kernels' if on_device else 'operators'} {sum(map(self_us, events)) / 1e3:.1f} ms")
    for e in sorted(events, key=lambda e: -self_us(e))[:top]:
        print(f"  {self_us(e) / 1e3:9.2f} ms {e.count:6d}x  {e.key[:100]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_arguments(ap)
    ap.add_argument("--sessions", default="1,2,4,8", help="sessions per call (comma-separated)")
    ap.add_argument("--prompt-tokens", type=int, default=130)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="kernels of the call with the most sessions")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--variant", action="append", default=[], help="'NAME: module.attr=EXPR; ...' (A/B, see above)")
    args = ap.parse_args(argv)
    variants = [("default", [])] + [parse_variant(v) for v in args.variant]
    sizes = [int(v) for v in args.sessions.split(",")]
    if args.rounds < 2 or min(sizes) < 1 or not 0 < args.prompt_tokens <= args.prefill_chunk:
        ap.error("--rounds must be >= 2, sessions >= 1, and 0 < --prompt-tokens <= --prefill-chunk")

    sched = server_scheduler(args, max(sizes), prefill_budget=max(sizes) * args.prefill_chunk)
    engine = sched.engine
    t0 = time.perf_counter()
    sched.warm_up()
    print(f"{args.model} ({engine.model.dtype}) on {engine.model.device}; warm-up {time.perf_counter() - t0:.1f} s")
    rng = random.Random(0)
    print("sessions  tokens  first ms  median ms    tok/s  variant")
    for n in sizes:
        lengths = [args.prompt_tokens] * n
        for name, sets in variants:
            with variant_applied(sets):
                times = [timed_call(sched, lengths, rng) for _ in range(args.rounds)]
            med = statistics.median(times[1:])
            print(f"{n:8d} {n * args.prompt_tokens:7d} {times[0] * 1e3:9.1f} {med * 1e3:10.1f} "
                  f"{n * args.prompt_tokens / med:8.0f}  {name}")
    if args.profile:
        profile_call(sched, [args.prompt_tokens] * max(sizes), rng, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
