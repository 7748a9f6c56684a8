#!/usr/bin/env python3
"""Memory soak of a long decode: does the process (or the GPU) hold more memory the longer a session decodes?

Decodes ``--steps`` tokens the way ``ds4x generate --ignore-eos`` does (``Engine.load``, ``new_session``,
``Session.generate`` with no stop ids, the text streamed through ``TextStream``, the generated ids kept) and
every ``--every`` steps prints the process RSS (``/proc/self/statm``), glibc's heap in use / free (mallinfo2,
where available) and, on CUDA, ``torch.cuda.memory_allocated`` / ``memory_reserved``. The verdict line gives the
growth per 1000 steps after ``--warmup`` steps (least-squares slope over the samples).

``--restart-steps N`` then resets the session to position 0 and decodes N more steps: memory that grows with the
*position* (transient tensors sized by the rows in use, allocator high-water marks, per-shape library buffers)
stays flat in that pass until it passes the first pass's position, while a per-step leak keeps growing. On CPU,
``MKL_DISABLE_FAST_MM=1`` (MKL's per-size GEMM buffers off) and ``MALLOC_ARENA_MAX=2`` / ``--trim``
(``malloc_trim(0)`` at every sample) separate library buffers and allocator fragmentation from ds4x.

    python scripts/memory_soak.py --steps 10000 --ctx 10300 --device cpu
    python scripts/memory_soak.py --steps 10000 --ctx 10300 --device cuda --restart-steps 2000
    python scripts/memory_soak.py -m flash:q2 --steps 10000 --device cuda --every 1000

Exit status 1 when ``--max-growth`` is given and the RSS (or CUDA allocated) slope after warm-up exceeds it.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time

import torch

from ds4x.runtime.engine import Engine, GenerationStats
from ds4x.runtime.sampling import SamplingParams
from ds4x.runtime.tokenizer import TextStream

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None


LIBC = _libc()


def rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB
    except OSError:
        import resource  # no /proc: the peak is the best there is

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def slope_per_1k(points: list[tuple[int, float]]) -> float | None:
    """Least-squares growth per 1000 steps of (step, value) points; None with fewer than two."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / sxx


def sample(device: torch.device, trim: bool) -> dict[str, float]:
    gc.collect()
    out = {"rss": rss_mib()}
    if LIBC is not None:
        m = LIBC.mallinfo2()
        out["heap_inuse"], out["heap_free"] = m.uordblks / MIB, m.fordblks / MIB
        if trim:
            LIBC.malloc_trim(0)
            out["rss_trimmed"] = rss_mib()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out["cuda_alloc"] = torch.cuda.memory_allocated(device) / MIB
        out["cuda_reserved"] = torch.cuda.memory_reserved(device) / MIB
    return out


def fmt(step: int, pos: int, s: dict[str, float], rate: float, label: str) -> str:
    line = f"{label} step {step:7d} pos {pos:7d} rss {s['rss']:9.2f} MiB"
    if "rss_trimmed" in s:
        line += f" (trimmed {s['rss_trimmed']:9.2f})"
    if "heap_inuse" in s:
        line += f"  heap in use {s['heap_inuse']:8.2f} free {s['heap_free']:6.2f}"
    if "cuda_alloc" in s:
        line += f"  cuda allocated {s['cuda_alloc']:10.2f} reserved {s['cuda_reserved']:10.2f}"
    return line + f"  {rate:7.1f} tok/s"


def decode_pass(session, prompt: list[int], steps: int, every: int, device: torch.device, trim: bool, label: str,
                params: SamplingParams) -> list[tuple[int, dict[str, float]]]:
    tok = session.engine.tokenizer
    stream = TextStream(tok) if tok is not None else None
    generated: list[int] = []  # as `ds4x generate` keeps them
    samples = []
    stats = GenerationStats()
    t0, last = time.perf_counter(), 0
    for i, (token, _logits) in enumerate(session.generate(prompt, steps, params, stop_ids=(), stats=stats)):
        generated.append(token)
        if stream is not None:
            stream.push(token)
        n = i + 1
        if n % every == 0 or n == steps:
            now = time.perf_counter()
            s = sample(device, trim)
            samples.append((n, s))
            print(fmt(n, session.cache.length, s, (n - last) / max(now - t0, 1e-9), label), flush=True)
            t0, last = time.perf_counter(), n
    if stats.stop_reason != "length":
        print(f"{label}: stopped early ({stats.stop_reason}) after {stats.generated} tokens", flush=True)
    return samples


def growth(samples: list[tuple[int, dict[str, float]]], key: str, warmup: int) -> float | None:
    return slope_per_1k([(n, s[key]) for n, s in samples if n >= warmup and key in s])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="default", help="as `ds4x generate -m` (default: the embedded model)")
    p.add_argument("--steps", type=int, default=10000, help="tokens decoded (default 10000)")
    p.add_argument("--ctx", type=int, default=None, help="session context (default: prompt + steps + 8)")
    p.add_argument("--cache-mode", default="packed", choices=["packed", "native", "float"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation dtype (default auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--every", type=int, default=500, help="sample every N steps (default 500)")
    p.add_argument("--warmup", type=int, default=1000, help="steps before the growth is measured (default 1000)")
    p.add_argument("--prompt", default="def main():\n", help="prompt text (needs a tokenizer; else BOS/0)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trim", action="store_true", help="also call glibc malloc_trim(0) at every sample")
    p.add_argument("--restart-steps", type=int, default=0,
                   help="then reset the session to position 0 and decode this many steps more (position-bound "
                        "memory stays flat there; a per-step leak keeps growing)")
    p.add_argument("--max-growth", type=float, default=None, metavar="MIB",
                   help="exit 1 if RSS or CUDA allocated grows more than this many MiB per 1000 steps after warm-up")
    args = p.parse_args(argv)
    if args.steps <= 0 or args.every <= 0 or args.warmup < 0 or args.restart_steps < 0:
        p.error("--steps and --every must be positive, --warmup and --restart-steps >= 0")

    engine = Engine.load(args.model, device=args.device, dtype=args.dtype, seed=args.seed)
    device = engine.model.device
    tok = engine.tokenizer
    prompt = [] if tok is None else ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(args.prompt)
    prompt = prompt or [0]
    ctx = args.ctx if args.ctx is not None else len(prompt) + args.steps + 8
    if ctx < len(prompt) + args.steps:
        p.error(f"--ctx {ctx} is smaller than the prompt ({len(prompt)}) plus --steps ({args.steps})")
    session = engine.new_session(ctx=ctx, cache=args.cache_mode)
    params = SamplingParams(temperature=args.temp, seed=args.seed)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("MALLOC_ARENA_MAX", "MKL_DISABLE_FAST_MM", "DS4X_CUDA_GRAPHS")
                   if k in os.environ)
    print(f"model {args.model}, device {device}, {args.cache_mode} cache, ctx {ctx}, prompt {len(prompt)} tokens, "
          f"{args.steps} steps, torch threads {torch.get_num_threads()}" + (f", {env}" if env else ""), flush=True)
    start = sample(device, False)
    print(fmt(0, 0, start, 0.0, "start"), flush=True)

    first = decode_pass(session, prompt, args.steps, args.every, device, args.trim, "decode ", params)
    second: list[tuple[int, dict[str, float]]] = []
    if args.restart_steps:
        session.cache.reset()
        session.tokens, session.logits = [], None
        second = decode_pass(session, prompt, min(args.restart_steps, ctx - len(prompt)), args.every, device,
                             args.trim, "restart", params)

    end = first[-1][1]
    keys = ["rss"] + (["rss_trimmed"] if args.trim else []) + (["heap_inuse"] if LIBC is not None else []) + (
        ["cuda_alloc"] if device.type == "cuda" else [])
    parts, worst = [], 0.0
    for key in keys:
        g = growth(first, key, args.warmup)
        line = f"{key} {start[key] if key in start else first[0][1][key]:.2f} -> {end[key]:.2f} MiB"
        if g is not None:
            line += f", {g:+.3f} MiB/1k steps after step {args.warmup}"
            if key in ("rss", "cuda_alloc"):
                worst = max(worst, g)
        if second:
            g2 = growth(second, key, 0)
            if g2 is not None:
                line += f" (restart pass {g2:+.3f} MiB/1k)"
        parts.append(line)
    if device.type == "cuda":
        parts.append(f"cuda peak allocated {torch.cuda.max_memory_allocated(device) / MIB:.2f} MiB")
    print("verdict: " + "; ".join(parts), flush=True)
    if args.max_growth is not None:
        ok = worst <= args.max_growth
        print(f"verdict: {'PASS' if ok else 'FAIL'}: worst growth {worst:+.3f} MiB/1k steps "
              f"(limit {args.max_growth:.3f})", flush=True)
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
