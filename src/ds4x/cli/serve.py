"""``ds4x serve``: an OpenAI-compatible HTTP server (see :mod:`ds4x.serve.app`).

    ds4x serve [-m default] [--host 127.0.0.1] [--port 8000] [--ctx 4096] [--cache packed] [--device auto]
               [--max-batch 32] [--max-queue 128] [--kv-budget 8GiB] [--prefill-chunk 256]
               [--prefix-cache-bytes 64MiB] [--prefix-cache-dir DIR] [--prefix-cache-disk-bytes 8GiB]
               [--no-warmup]

Registered by ``ds4x.cli.main`` through :func:`add_parser` / :func:`run`. Needs the ``serve`` extra
(fastapi, uvicorn).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time

from ds4x.cli.cpu_threads import add_threads_argument, apply_cpu_threads

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``123``, ``512MiB``, ``1.5GB``, ``8 GiB`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 123, 512MiB or 8GiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("-m", "--model", default="default",
                   help="checkpoint directory, .gguf file, 'default' (the embedded trained model) or a synthetic "
                        "preset (tiny)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--ctx", type=int, default=None,
                   help="context size of each request's session (default: 4096, or the model's maximum if "
                        "smaller)")
    p.add_argument("--cache", default="packed", choices=["packed", "native", "float"],
                   help="attention history of the sessions (default packed)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    add_threads_argument(p)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation dtype (default auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models lists (default: the -m argument)")
    p.add_argument("--max-batch", type=_positive, default=32, help="most requests decoding together (default 32)")
    p.add_argument("--max-queue", type=_non_negative, default=128,
                   help="most requests waiting for admission; more get 429 (default 128)")
    p.add_argument("--kv-budget", type=parse_bytes, default=None,
                   help="cache bytes the admitted sessions may plan, e.g. 8GiB (default: 80%% of free GPU memory; "
                        "on the CPU a quarter of the available memory, at most 8 GiB)")
    p.add_argument("--prefill-chunk", type=_positive, default=256,
                   help="prompt tokens evaluated per scheduler step, between decode steps (default 256)")
    p.add_argument("--prefill-budget", type=_positive, default=None,
                   help="prompt tokens of several requests evaluated in one model call, a chunk each (default 4 "
                        "chunks; with batch invariance one request per call)")
    p.add_argument("--batch-invariant", choices=["auto", "on", "off"], default="auto",
                   help="row-by-row products in batched decode, so a request's output does not depend on the rest "
                        "of the batch (auto: on for the CPU, off for CUDA, where it would give up the batching)")
    p.add_argument("--prefix-cache-bytes", type=parse_bytes, default=64 * 2**20,
                   help="memory for stored sessions whose prefixes later requests reuse (default 64MiB; 0 and no "
                        "--prefix-cache-dir: off)")
    p.add_argument("--prefix-cache-dir", default=None,
                   help="directory that keeps stored sessions evicted from memory (and across restarts)")
    p.add_argument("--prefix-cache-disk-bytes", type=parse_bytes, default=8 * 2**30,
                   help="size cap of --prefix-cache-dir (default 8GiB)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="listen at once: with CUDA graphs the first requests then wait while kernels compile and "
                        "each decode batch size's graph is captured (default: before listening)")
    p.add_argument("--shutdown-timeout", type=_non_negative, default=30,
                   help="seconds the running requests may take to finish after SIGINT / SIGTERM; then their "
                        "connections are closed and the process exits (default 30)")
    p.add_argument("-q", "--quiet", action="store_true", help="no startup or access log")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ds4x.serve.app import create_app
    except ImportError as exc:
        raise RuntimeError(f"ds4x serve needs the serve extra (pip install 'ds4x[serve]'): {exc}") from None
    from ds4x.runtime.engine import Engine

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
    apply_cpu_threads(engine, args.threads)
    max_ctx = engine.cfg.max_position_embeddings
    ctx = args.ctx if args.ctx is not None else min(4096, max_ctx)
    if not 0 < ctx <= max_ctx:
        raise ValueError(f"--ctx must be in [1, {max_ctx}], got {ctx}")
    # refuse a context the device cannot hold before listening
    engine.new_session(ctx=ctx, cache=args.cache, prefill_chunk=args.prefill_chunk)
    prefix_cache = None
    if args.prefix_cache_bytes > 0 or args.prefix_cache_dir is not None:
        from ds4x.runtime.prefix_cache import PrefixCache

        prefix_cache = PrefixCache(engine, args.prefix_cache_bytes, args.prefix_cache_dir,
                                   max_disk_bytes=args.prefix_cache_disk_bytes)
    name = args.served_model_name or args.model
    invariant = {"auto": None, "on": True, "off": False}[args.batch_invariant]
    app = create_app(engine, name, ctx, args.cache, prefill_chunk=args.prefill_chunk, max_batch=args.max_batch,
                     max_queue=args.max_queue, kv_budget=args.kv_budget, batch_invariant=invariant,
                     prefix_cache=prefix_cache, prefill_budget=args.prefill_budget)
    sched = app.state.server.scheduler
    log = logging.getLogger(__name__)
    log.info(
        "serving %s as %r on http://%s:%d (ctx %d, %s cache; batches of up to %d, KV budget %.2f GiB = %d sessions "
        "of %.1f MiB, queue %d, prefill chunk %d (up to %d tokens a call), batch-invariant decode %s, decode %s, "
        "prefix cache %s)", args.model, name,
        args.host, args.port, ctx, args.cache, sched.max_batch, sched.kv_budget / 2**30,
        sched.kv_budget // sched.session_bytes, sched.session_bytes / 2**20, sched.max_queue, sched.chunk,
        sched.chunk if sched.rowwise else sched.prefill_budget, "on" if sched.rowwise else "off",
        f"CUDA graphs over a pool of {sched.slots.capacity} cache slots (allocated now)" if sched.slots is not None
        else "eager",
        "off" if prefix_cache is None else f"{args.prefix_cache_bytes / 2**30:.2f} GiB in memory"
        + (f", {args.prefix_cache_dir} (cap {args.prefix_cache_disk_bytes / 2**30:.2f} GiB)"
           if args.prefix_cache_dir else ""))
    if args.warmup and sched.slots is not None:
        t0 = time.perf_counter()
        log.info("warming up before listening (--no-warmup: on the first requests instead): kernels compile and a "
                 "CUDA graph is captured per decode batch size (%s) and position span (%s)",
                 ", ".join(map(str, sched.slots.sizes)),
                 ", ".join("the context" if s is None else f"below {s}" for s in sched.slots.spans))
        sched.warm_up(lambda what: log.info("warm: %s (%.1f s)", what, time.perf_counter() - t0))
    sys.stderr.flush()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning" if args.quiet else "info",
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m ds4x.cli.serve ...``: the serve subcommand on its own."""
    parser = argparse.ArgumentParser(prog="ds4x")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="[ds4x] %(message)s",
                        stream=sys.stderr)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, OSError, MemoryError, RuntimeError) as exc:
        print(f"ds4x serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
