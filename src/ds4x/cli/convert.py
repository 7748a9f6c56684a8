"""``ds4x convert``: a checkpoint directory, or a synthetic model, to a ds4-layout GGUF.

    ds4x convert SRC_DIR OUT.gguf [--mix q2|q4|q8|f16|f32] [--type-attn Q8_0 --type-experts IQ2_XXS ...]
    ds4x convert --synthetic flash --out X.gguf [--mix q2] [--seed 0]

Registered by ``ds4x.cli.main`` through :func:`add_parser` / :func:`run`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

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
    p.add_argument("--mix", default="q2", choices=["q2", "q4", "q8", "f16", "f32"],
                   help="type preset: q2 = ds4's 2-bit file (IQ2_XXS gate/up, Q2_K down, Q8_0 attention/"
                        "shared/output, F16 small tensors); q4 = Q4_K experts; q8; f16; f32 (lossless)")
    for key, what in _TYPE_FLAGS.items():
        p.add_argument(f"--type-{key.replace('_', '-')}", dest=f"type_{key}", default=None, metavar="TYPE",
                       help=f"GGML type for the {what} (F32, F16, BF16, Q8_0, Q4_K, Q2_K, IQ2_XXS)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights (default 0)")
    p.add_argument("--name", default=None, help="general.name of the file")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return p


def run(args: argparse.Namespace) -> int:
    from ds4x.config import PRESETS
    from ds4x.weights.gguf_writer import TypePolicy, write_gguf, write_synthetic_gguf

    out = args.out_flag or (args.out if args.synthetic is None else (args.out or args.src))
    policy = TypePolicy.preset(args.mix).with_overrides(**{f: getattr(args, f"type_{f}") for f in _TYPE_FLAGS})
    t0 = time.perf_counter()

    def progress(name: str, i: int, n: int) -> None:
        if not args.quiet and (i == n or i % 50 == 0):
            print(f"\r[{i}/{n}] {name:<48}", end="" if i < n else "\n", file=sys.stderr, flush=True)

    if args.synthetic is not None:
        if out is None:
            raise ValueError("convert --synthetic needs --out X.gguf")
        cfg = PRESETS[args.synthetic]()
        write_synthetic_gguf(out, cfg, policy, seed=args.seed, progress=progress, name=args.name)
    else:
        if args.src is None or out is None:
            raise ValueError("convert needs SRC_DIR and OUT.gguf (or --synthetic PRESET --out X.gguf)")
        from ds4x.weights.checkpoint import load_checkpoint
        from ds4x.weights.gguf_writer import synthetic_vocab, vocab_from_tokenizer_json

        src = Path(args.src)
        cfg, weights = load_checkpoint(src)  # float32 in RAM: fine for small models, not for Flash
        tok = src / "tokenizer.json"
        eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
        vocab = (vocab_from_tokenizer_json(tok, cfg.vocab_size, cfg.bos_token_id, eos) if tok.is_file()
                 else synthetic_vocab(cfg.vocab_size))
        write_gguf(out, cfg, weights, policy, vocab=vocab, name=args.name or f"ds4x convert of {src.name}")
    if not args.quiet:
        size = Path(out).stat().st_size
        print(f"wrote {out}: {size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
