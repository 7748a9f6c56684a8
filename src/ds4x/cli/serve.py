"""``ds4x serve``: an OpenAI-compatible HTTP server (see :mod:`ds4x.serve.app`).

    ds4x serve [-m default] [--host 127.0.0.1] [--port 8000] [--ctx 4096] [--cache packed] [--device auto]

Registered by ``ds4x.cli.main`` through :func:`add_parser` / :func:`run`. Needs the ``serve`` extra
(fastapi, uvicorn).
"""

from __future__ import annotations

import argparse
import logging
import sys


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
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models lists (default: the -m argument)")
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
    max_ctx = engine.cfg.max_position_embeddings
    ctx = args.ctx if args.ctx is not None else min(4096, max_ctx)
    if not 0 < ctx <= max_ctx:
        raise ValueError(f"--ctx must be in [1, {max_ctx}], got {ctx}")
    engine.new_session(ctx=ctx, cache=args.cache)  # refuse a context the device cannot hold before listening
    name = args.served_model_name or args.model
    app = create_app(engine, name, ctx, args.cache)
    logging.getLogger(__name__).info("serving %s as %r on http://%s:%d (ctx %d, %s cache)", args.model, name,
                                     args.host, args.port, ctx, args.cache)
    sys.stderr.flush()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning" if args.quiet else "info")
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
