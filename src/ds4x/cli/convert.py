"""``ds4x convert``: a checkpoint directory, or a synthetic model, to a ds4-layout GGUF.

    ds4x convert SRC_DIR OUT.gguf [--mix q2|q4|q8|f16|f32] [--type-attn Q8_0 --type-experts IQ2_XXS ...]
    ds4x convert --synthetic flash --out X.gguf [--mix q2] [--seed 0] [--device cuda]

Both stream: one tensor is read (or generated), encoded and written at a time, so memory stays near
the largest tensor (a stacked routed-expert tensor), not the model.

Registered by ``ds4x.cli.main`` through :func:`add_parser` / :func:`run`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ds4x.config import ModelConfig
    from ds4x.weights.gguf_writer import ProgressFn, TypePolicy, WriteProgress

_MIXES = ["q2", "q4", "q8", "f16", "f32"]

_TYPE_FLAGS = {
    "embed": "token embedding", "output": "LM head", "attn": "attention projections (q_a, q_b, kv, o_a, o_b)",
    "shared": "shared expert", "experts": "routed expert gate/up", "experts_down": "routed expert down",
    "small": "mHC, compressor, indexer, router, position biases",
}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("convert", help="write a ds4-layout GGUF from a checkpoint or a synthetic model")
    p.add_argument("src", nargs="?", help="checkpoint directory (config.json + *.safetensors)")
    p.add_argument("out", nargs="?", help="output .gguf path")
    p.add_argument("--out", dest="out_flag", default=None, help="output .gguf path (alternative to OUT)")
    p.add_argument("--synthetic", choices=["flash", "tiny"], default=None,
                   help="write a SYNTHETIC model of this preset instead (random weights, streamed tensor by "
                        "tensor; for benchmarks only)")
    p.add_argument("--mix", default="q2", choices=_MIXES,
                   help="type preset: q2 = ds4's 2-bit file (IQ2_XXS gate/up, Q2_K down, Q8_0 attention/"
                        "shared/output, F16 small tensors); q4 = Q4_K experts; q8; f16; f32 (lossless)")
    for key, what in _TYPE_FLAGS.items():
        p.add_argument(f"--type-{key.replace('_', '-')}", dest=f"type_{key}", default=None, metavar="TYPE",
                       help=f"GGML type for the {what} (F32, F16, BF16, Q8_0, Q4_K, Q2_K, IQ2_XXS)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights (default 0)")
    p.add_argument("--device", default=None,
                   help="--synthetic only: generate the blocks on this device (cpu, cuda; default cpu). "
                        "A seed gives the same file on the same kind of device; CPU and CUDA files differ")
    p.add_argument("--name", default=None, help="general.name of the file")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return p


def run(args: argparse.Namespace) -> int:
    from ds4x.config import PRESETS
    from ds4x.weights.gguf_writer import write_gguf, write_synthetic_gguf

    out = args.out_flag or (args.out if args.synthetic is None else (args.out or args.src))
    policy = _policy(args.mix, args)
    t0 = time.perf_counter()
    progress = None if args.quiet else _progress_printer(t0)

    if args.synthetic is not None:
        if out is None:
            raise ValueError("convert --synthetic needs --out X.gguf")
        if not 0 <= args.seed < 2**64:  # the file records it as a uint64
            raise ValueError(f"--seed must be an integer in [0, 2^64), got {args.seed}")
        from ds4x.runtime.engine import resolve_device

        # resolved here: without CUDA, torch's own error was a paragraph on ATen_cuda (and 'auto' was refused)
        device = resolve_device(args.device or "cpu")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"convert --device takes cpu or cuda, got {args.device!r}")
        cfg = PRESETS[args.synthetic]()
        _check_mix(cfg, args)
        with _sigterm_as_exit():
            write_synthetic_gguf(out, cfg, policy, seed=args.seed, progress=progress, name=args.name,
                                 device=str(device))
    else:
        if args.src is None or out is None:
            raise ValueError("convert needs SRC_DIR and OUT.gguf (or --synthetic PRESET --out X.gguf)")
        if args.device is not None:
            raise ValueError("convert --device applies to --synthetic only (checkpoints are encoded on the CPU)")
        from ds4x.weights.checkpoint import open_checkpoint
        from ds4x.weights.gguf_writer import synthetic_vocab, vocab_from_tokenizer_json

        src = Path(args.src)
        ckpt = open_checkpoint(src)  # headers only: each tensor is read while it is written
        cfg = ckpt.cfg
        _check_mix(cfg, args)
        tok = src / "tokenizer.json"
        eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
        vocab = (vocab_from_tokenizer_json(tok, cfg.vocab_size, cfg.bos_token_id, eos) if tok.is_file()
                 else synthetic_vocab(cfg.vocab_size))
        with _sigterm_as_exit():
            write_gguf(out, cfg, ckpt, policy, vocab=vocab, name=args.name or f"ds4x convert of {src.name}",
                       progress=progress)
    if not args.quiet:
        size, dt = Path(out).stat().st_size, time.perf_counter() - t0
        print(f"wrote {out}: {size:,} bytes ({size / 2**30:.2f} GiB) in {dt:.1f} s "
              f"({size / 2**30 / max(dt, 1e-9):.2f} GiB/s)", file=sys.stderr)
    return 0


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM (`timeout`, `kill`) ends the write as SystemExit(143), so the writer removes its partial file: an
    untrapped SIGTERM ended the process at once and left up to the whole model's bytes (80 GiB for Flash q2) in a
    hidden file beside the target. Ctrl-C already cleaned up (KeyboardInterrupt)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        print("\nterminated; the partial file is removed", file=sys.stderr)
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _policy(mix: str, args: argparse.Namespace) -> TypePolicy:
    """The type preset ``mix`` with the --type-* overrides."""
    from ds4x.weights.gguf_writer import TypePolicy

    return TypePolicy.preset(mix).with_overrides(**{f: getattr(args, f"type_{f}") for f in _TYPE_FLAGS})


def _mix_error(cfg: ModelConfig, mix: str, args: argparse.Namespace) -> str | None:
    """Why ``mix`` (with the --type-* overrides) cannot hold ``cfg``'s tensors, or None when it can."""
    from ds4x.weights.gguf_writer import GGUFError, tensor_type
    from ds4x.weights.names import expected_shapes

    policy = _policy(mix, args)
    try:
        for name, shape in expected_shapes(cfg).items():
            tensor_type(name, shape, policy)
    except GGUFError as exc:
        return str(exc)
    return None


def _check_mix(cfg: ModelConfig, args: argparse.Namespace) -> None:
    """Refuse a type mix whose blocks do not divide the model's rows before anything is written, naming the mixes
    that fit (the default q2 cannot hold the tiny preset: its 128-value expert rows are half an IQ2_XXS block)."""
    from ds4x.weights.gguf import GGUFError

    error = _mix_error(cfg, args.mix, args)
    if error is None:
        return
    fits = [m for m in _MIXES if m != args.mix and _mix_error(cfg, m, args) is None]
    given = [f"--type-{f.replace('_', '-')} {t}" for f in _TYPE_FLAGS if (t := getattr(args, f"type_{f}"))]
    what = " with ".join([f"--mix {args.mix}", *([" ".join(given)] if given else [])])
    hint = (f"use --mix {fits[0]} (fits: {', '.join(fits)})" if fits
            else "choose another type for that tensor's --type-* option")
    raise GGUFError(f"{what} does not fit this model: {error}; {hint}")


def _progress_printer(t0: float) -> ProgressFn:
    """Tensor i/n, GiB written of the total and the rate so far, at most once a second, on stderr."""
    last = [0.0]

    def show(p: WriteProgress) -> None:
        now = time.perf_counter()
        if p.index < p.count and now - last[0] < 1.0:
            return
        last[0] = now
        done = p.bytes_done / 2**30
        print(f"\r[{p.index}/{p.count}] {done:.2f}/{p.bytes_total / 2**30:.2f} GiB, "
              f"{done / max(now - t0, 1e-9):.2f} GiB/s  {p.name:<40}",
              end="" if p.index < p.count else "\n", file=sys.stderr, flush=True)
    return show
