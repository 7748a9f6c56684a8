"""``ds4x`` command line: generate, chat, inspect, bench, quality (convert and serve in their own modules)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from ds4x import __version__
from ds4x.bench import plot as bench_plot
from ds4x.bench import serve_load as bench_serve
from ds4x.cli import bench_prefill
from ds4x.cli import chat as chat_cmd
from ds4x.cli import convert as convert_cmd
from ds4x.cli import serve as serve_cmd
from ds4x.cli.cpu_threads import add_threads_argument, apply_cpu_threads
from ds4x.cli.sampling_options import add_sampling_arguments, sampling_params
from ds4x.config import ConfigError
from ds4x.files import replaceable_target
from ds4x.runtime.tokenizer import checked_text


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text (or token ids) from a prompt")
    p.add_argument("-m", "--model", default="default",
                   help="checkpoint directory, .gguf file, 'default' (the embedded trained model) or a synthetic "
                        "preset (tiny; flash can only be inspected)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None, help="prompt text")
    src.add_argument("--prompt-ids", default=None, help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    add_sampling_arguments(p)
    p.add_argument("--ctx", type=int, default=None,
                   help="context size of the session (default: 4096, or the model's maximum if smaller)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per forward pass (default 512; with --load-session, the file's)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation dtype (default auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--cache", default=None, choices=["packed", "native", "float"],
                   help="attention history: packed (official FP8/MXFP4 semantics stored in the DS4X rows, "
                        "default), native (same values unpacked, float32) or float (matches transformers); "
                        "with --load-session, the file's")
    # default None: a loaded session keeps the mode it was saved with (its continuation must match the
    # uninterrupted session's), like --cache and --prefill-chunk
    p.add_argument("--prefill-mode", default=None, choices=["default", "exact", "reference"],
                   help="default: chunks, Triton attention and indexer on a packed CUDA cache; exact: bit-identical "
                        "to token-by-token decode; reference: chunks on the torch attention path (quantized products "
                        "keep their kernels unless DS4X_QUANT_KERNEL=torch); default default, with --load-session "
                        "the file's")
    p.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token to a text prompt")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--dump-logits", metavar="FILE.json", default=None,
                   help="write prompt ids, generated ids and the full logits of every generated token")
    p.add_argument("--save-session", metavar="FILE", default=None,
                   help="after generating, save the session (prompt and every generated token) to FILE")
    p.add_argument("--load-session", metavar="FILE", default=None,
                   help="continue the session saved in FILE: the prompt (may be empty) is appended to it")
    p.add_argument("-q", "--quiet", action="store_true", help="no statistics on stderr")
    add_threads_argument(p)


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="print a model's config, parameter counts and weight bytes")
    p.add_argument("model", help="checkpoint directory, .gguf file, 'default' or preset (tiny, flash)")
    p.add_argument("--ctx", type=int, default=None, help="also print the packed cache plan for this context")
    p.add_argument("--prefill-chunk", type=int, default=32, help="prefill chunk of that plan (default 32)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (results appended to the ledger)")
    kinds = p.add_subparsers(dest="bench", required=True)
    f = kinds.add_parser("frontier", help="decode at the frontier of a seeded packed cache (needs a GPU)")
    f.add_argument("--contexts", default="131072,262144,524288,1048576", help="comma-separated context sizes")
    f.add_argument("--steps", type=int, default=50, help="timed decode steps per context (median reported)")
    f.add_argument("--seed", type=int, default=0, help="synthetic weights and cache seed")
    f.add_argument("--experts", type=int, default=None,
                   help="routed experts (Flash: 256); default 8 for bf16, all for q2 (128 fits an 80 GB GPU)")
    f.add_argument("--weights", default="bf16", choices=["bf16", "q2"],
                   help="bf16: attention shapes with the MoE shrunk to --experts; q2: the model in the ds4 q2 mix "
                        "(about 81 GiB with all experts)")
    f.add_argument("--profile", action="store_true", help="also break one decode step down by kernel group (CUDA)")
    f.add_argument("--topk", default="radix", choices=["radix", "blocked", "keys", "threshold"],
                   help="top-k variant")
    f.add_argument("--ab", default="", help="comma-separated top-k variants to alternate with (radix, blocked, "
                                              "keys, threshold)")
    f.add_argument("--variant", action="append", default=[],
                   help="'NAME: pkg.module.attr=EXPR; ...' (repeatable): each context measured also with these "
                        "module attributes set, alternating with the defaults in two rounds; its ledger rows say "
                        "\"status\": \"variant\" and the setting")
    f.add_argument("--ledger", default="benchmarks/ledger.jsonl", help="JSONL ledger to append to")
    c = kinds.add_parser("caches", help="float vs native vs packed cache: logit differences, greedy agreement, "
                                        "top-k overlap")
    c.add_argument("-m", "--model", default="default")
    c.add_argument("--prompt-len", type=int, default=512, help="random prompt tokens (seeded)")
    c.add_argument("--gen", type=int, default=256, help="greedy tokens generated by each cache")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--device", default="auto")
    add_threads_argument(c)
    bench_prefill.add_parser(kinds)
    bench_serve.add_parser(kinds)
    bench_plot.add_parser(kinds)
    r = kinds.add_parser("report", help="render docs/BENCHMARKS.md from the ledger")
    r.add_argument("--ledger", default="benchmarks/ledger.jsonl")
    r.add_argument("--serve-ledger", default="benchmarks/serve_ledger.jsonl",
                   help="`ds4x bench serve` rows to add (if the file exists)")
    r.add_argument("--out", default="docs/BENCHMARKS.md")


def cmd_bench(args: argparse.Namespace) -> int:
    from ds4x.bench import ledger
    from ds4x.bench.frontier import FrontierConfig, format_table, run_frontier

    if args.bench == "caches":
        import torch

        from ds4x.bench.cache_quality import compare_caches
        from ds4x.runtime.engine import Engine

        if args.prompt_len < 1 or args.gen < 1:  # an empty prompt or reply has nothing to compare
            raise ValueError(f"--prompt-len and --gen must be >= 1, got {args.prompt_len} and {args.gen}")
        engine = Engine.load(args.model, device=args.device)
        apply_cpu_threads(engine, args.threads)
        g = torch.Generator().manual_seed(args.seed)
        prompt = torch.randint(0, engine.cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
        report = compare_caches(engine, prompt, gen=args.gen)
        # an overlap with no full top-k to compare is NaN, which json.dumps writes as the invalid token NaN
        report = {pair: {k: None if v != v else v for k, v in row.items()} for pair, row in report.items()}
        print(json.dumps(report, indent=2, allow_nan=False))
        return 0
    if args.bench == "prefill":
        return bench_prefill.run(args)
    if args.bench == "serve":
        return bench_serve.run(args)
    if args.bench == "plot":
        return bench_plot.run(args)
    if args.bench == "report":
        from ds4x.bench.report import write_report

        write_report(Path(args.ledger), Path(args.out), Path(args.serve_ledger))
        print(f"wrote {args.out}")
        return 0

    contexts = tuple(_parse_ids(args.contexts, "--contexts"))
    if any(c <= 0 for c in contexts) or args.steps <= 0:
        raise ValueError("--contexts and --steps must be positive")
    rows = run_frontier(FrontierConfig(contexts=contexts, steps=args.steps, seed=args.seed, experts=args.experts,
                                       weights=args.weights, profile=args.profile, topk=args.topk,
                                       ab=tuple(v for v in args.ab.split(",") if v), variants=tuple(args.variant)),
                        log=lambda m: print(m, file=sys.stderr, flush=True))
    env = ledger.environment()
    ledger.append([{**env, **row} for row in rows], Path(args.ledger))
    print(format_table(rows))
    return 0


def _add_quality(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quality", help="quality report of a trained model: held-out perplexity (float / native / "
                                       "packed cache), unigram baseline, code parse rate, long-context recall")
    p.add_argument("-m", "--model", default="default")
    p.add_argument("--tokens", type=int, default=4096, help="held-out tokens scored (default 4096)")
    p.add_argument("--samples", type=int, default=20, help="sampled function bodies to parse (default 20)")
    p.add_argument("--recall", default="2048,8192", help="contexts of the recall test (empty: skip)")
    p.add_argument("--weights", default=None, metavar="TYPES",
                   help="instead of the cache report: convert the checkpoint to GGUF with each of these routed-expert "
                        "types (comma-separated, from Q8_0,Q4_K,Q2_K,IQ2_XXS; 'all' for the four) and print "
                        "perplexity over --tokens held-out tokens (2048: about 90 s for the four on 2 CPU cores) and "
                        "256-token greedy agreement against the checkpoint")
    p.add_argument("--device", default="auto")
    add_threads_argument(p)


def _weight_table(args: argparse.Namespace) -> int:
    """``ds4x quality --weights``: the GGUF weight-type table as Markdown."""
    import time

    from ds4x.runtime import quality

    types = quality.WEIGHT_TYPES if args.weights == "all" else tuple(t for t in args.weights.split(",") if t)
    unknown = [t for t in types if t not in quality.WEIGHT_TYPES]
    if unknown or not types:
        raise ValueError(f"--weights takes types from {','.join(quality.WEIGHT_TYPES)} (or 'all'), got "
                         f"{args.weights!r}")
    t0 = time.perf_counter()
    table = quality.weight_type_table(args.model, types, max_tokens=args.tokens, device=args.device,
                                      log=lambda m: print(f"[ds4x] {m}", file=sys.stderr, flush=True))
    ref = table.rows[0]
    print(f"{table.source.name}: {ref.ppl.tokens} held-out tokens (windows of {table.window}), {table.cache} cache; "
          f"greedy: {table.greedy_tokens} tokens from {table.greedy_prompt!r}; "
          f"{time.perf_counter() - t0:.0f} s")
    print("| routed experts | tensor classes in that type | other matrices | file MB | ppl | Δppl | "
          "greedy teacher-forced | greedy identical prefix |")
    print("|---|---|---|---|---|---|---|---|")
    for row in table.rows:
        got = sorted(c for c, t in row.types.items() if t == row.label)
        other = ", ".join(f"{c} {t}" for c, t in row.types.items() if t != row.label and c not in ("plain", "int"))
        # the reference row (no greedy comparison) is what the others are measured against
        versus = (f"{100 * row.rel_delta:+.2f}% | {row.greedy['teacher_forced']:.1%} | "
                  f"{int(row.greedy['common_prefix'])}/{int(row.greedy['tokens'])}" if row.greedy else "— | — | —")
        print(f"| {row.label} | {', '.join(got) or '—'} | {other or '—'} | {row.size_bytes / 1e6:.2f} | "
              f"{row.ppl.ppl:.3f} | {versus} |")
    for row in table.rows[1:]:
        print(f"{row.label}: ds4x convert {table.source} OUT.gguf {' '.join(row.convert_args)}")
    return 0


def cmd_quality(args: argparse.Namespace) -> int:
    from ds4x.runtime import quality
    from ds4x.runtime.engine import Engine

    # checked before the model loads: --tokens 0 printed nan perplexities with exit 0, a negative --tokens sliced
    # from the end (scoring nearly the whole text), a negative --samples was ignored, a --recall <= 0 crashed
    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    if args.samples < 0:
        raise ValueError(f"--samples must be >= 0, got {args.samples}")
    recall = _parse_ids(args.recall, "--recall") if args.recall else []
    if any(ctx < 1 for ctx in recall):
        raise ValueError(f"--recall contexts must be positive, got {args.recall!r}")
    if args.weights is not None:
        return _weight_table(args)
    engine = Engine.load(args.model, device=args.device)
    apply_cpu_threads(engine, args.threads)
    if engine.tokenizer is None:
        raise ValueError(f"model {args.model} has no tokenizer; the quality report needs text")
    # checked before the perplexity runs: a too long --recall failed only after it, naming the recall's session size
    limit = engine.cfg.max_position_embeddings
    if any(ctx > limit for ctx in recall):
        raise ValueError(f"--recall contexts must be at most the model's context of {limit} tokens, "
                         f"got {args.recall!r}")
    text = quality.heldout_text()
    rows = []
    ppl = {}
    for cache in ("float", "native", "packed"):
        ppl[cache] = quality.perplexity(engine, text, cache=cache, max_tokens=args.tokens)
        rows.append((f"held-out perplexity ({cache} cache, {ppl[cache].tokens} tokens)", f"{ppl[cache].ppl:.3f}"))
    ids = engine.tokenizer.encode(text)[: args.tokens + 1]
    rows.append(("unigram perplexity (fitted on the same tokens)",
                 f"{quality.unigram_perplexity(ids, engine.cfg.vocab_size):.1f}"))
    rows.append(("native vs float perplexity change", f"{100 * (ppl['native'].ppl / ppl['float'].ppl - 1):+.3f}%"))
    if args.samples:
        parsed = quality.parse_rate(engine, n=args.samples)
        rows.append(("sampled function bodies accepted by ast.parse", f"{parsed.parsed}/{parsed.total}"))
    for ctx in recall:
        for cache in ("float", "packed"):
            r = quality.recall(engine, text, ctx, cache=cache)
            rows.append((f"recall at {ctx} tokens ({cache} cache)", f"{r.correct}/{r.asked}"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4x", description="DeepSeek-V4 inference runtime")
    parser.add_argument("--version", action="version", version=f"ds4x {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details even with -q")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    chat_cmd.add_parser(sub)
    _add_inspect(sub)
    _add_bench(sub)
    _add_quality(sub)
    convert_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    return parser


def _parse_ids(text: str, option: str = "--prompt-ids") -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError(f"{option} is empty")
    return ids


def _check_output_path(option: str, path: str | None) -> None:
    """Refuse an output file that cannot be written before any work: an empty path was skipped silently (exit 0,
    nothing written) and a directory or a missing folder failed only after the whole generation."""
    if path is None:
        return
    if not path:
        raise ValueError(f"{option} needs a file name, got an empty string")
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path} is a directory, not a file")
    if not target.parent.is_dir():
        raise ValueError(f"{option} {path}: folder {target.parent} does not exist")
    try:
        replaceable_target(target)
    except ValueError as exc:
        raise ValueError(f"{option} {exc}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from ds4x.runtime.engine import Engine, GenerationStats
    from ds4x.runtime.tokenizer import TextStream

    if args.max_tokens < 0:
        raise ValueError(f"-n/--max-tokens must be >= 0, got {args.max_tokens}")
    if args.ctx is not None and args.ctx <= 0:
        raise ValueError(f"--ctx must be positive, got {args.ctx}")
    params = sampling_params(args)
    for option, path in (("--save-session", args.save_session), ("--dump-logits", args.dump_logits)):
        _check_output_path(option, path)
    dtype = args.dtype
    if args.load_session is not None and dtype == "auto":
        from ds4x.runtime.session_file import saved_dtype

        # a session continues only in the dtype it was computed in: auto follows the file (saved on the CPU in
        # float32, it continues on a GPU in float32)
        dtype = saved_dtype(args.load_session) or dtype
    engine = Engine.load(args.model, device=args.device, dtype=dtype)
    apply_cpu_threads(engine, args.threads)
    tok = engine.tokenizer
    if args.prompt_ids is not None:
        prompt = _parse_ids(args.prompt_ids)
    else:
        if tok is None:
            raise ValueError(f"model {args.model} has no tokenizer (no tokenizer.json); use --prompt-ids")
        prompt = tok.encode(checked_text(args.prompt, "the prompt") if args.prompt is not None else "")
        # a loaded session already began with BOS; its prompt is a continuation and may be empty
        if tok.bos_id is not None and not args.no_bos and args.load_session is None:
            prompt = [tok.bos_id, *prompt]
        if not prompt and args.load_session is None:
            raise ValueError("the prompt is empty; give -p TEXT or --prompt-ids")
    if args.load_session is not None:
        from ds4x.runtime.session_file import load_session

        session = load_session(engine, args.load_session, ctx=args.ctx, cache=args.cache,
                               prefill_chunk=args.prefill_chunk, prefill_mode=args.prefill_mode)
    else:
        session = engine.new_session(ctx=args.ctx, cache=args.cache or "packed",
                                     prefill_chunk=512 if args.prefill_chunk is None else args.prefill_chunk,
                                     prefill_mode=args.prefill_mode or "default")
    stats = GenerationStats()
    stream = TextStream(tok) if tok is not None and args.prompt_ids is None else None
    generated: list[int] = []
    logits_rows: list[list[float]] = []
    stop = () if args.ignore_eos else None
    out = sys.stdout
    for token, logits in session.generate(prompt, args.max_tokens, params, stop_ids=stop, stats=stats):
        generated.append(token)
        if args.dump_logits:
            logits_rows.append(logits.float().cpu().tolist())
        if stream is not None:
            out.write(stream.push(token))
        else:
            out.write(f"{token} ")
        out.flush()
    if stream is not None:
        out.write(stream.flush())
    out.write("\n")
    out.flush()
    if args.dump_logits:
        Path(args.dump_logits).write_text(json.dumps(
            {"prompt_ids": prompt, "generated_ids": generated, "logits": logits_rows}))
    if args.save_session:
        from ds4x.runtime.session_file import save_session

        # the last sampled token has not been evaluated yet; the file holds everything printed
        full = bool(generated) and len(session.tokens) >= session.ctx
        if generated and not full:
            session.step(generated[-1])
        size = save_session(session, args.save_session)
        if not args.quiet:
            print(f"[ds4x] saved the session ({len(session.tokens)} tokens, {size / 2**20:.2f} MiB) to "
                  f"{args.save_session}" + ("; the last generated token did not fit its context" if full else ""),
                  file=sys.stderr)
    if not args.quiet:
        pf = stats.prompt_tokens / stats.prefill_s if stats.prefill_s else 0.0
        dec = (stats.generated - 1) / stats.decode_s if stats.decode_s and stats.generated > 1 else 0.0
        print(f"[ds4x] prompt {stats.prompt_tokens} tok in {stats.prefill_s:.2f}s ({pf:.1f} tok/s); "
              f"generated {stats.generated} tok ({dec:.1f} tok/s decode); stop: {stats.stop_reason}; "
              f"cache {session.cache.mode}, device {engine.model.device}, "
              f"dtype {str(engine.model.dtype).removeprefix('torch.')}", file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from ds4x.runtime.inspect import describe_model

    report = describe_model(args.model, ctx=args.ctx, chunk=args.prefill_chunk)
    # a plan for a context no session of this model can have (generate and serve refuse it) is no plan
    limit = report["config"]["max_position_embeddings"]
    if args.ctx is not None and args.ctx > limit:
        raise ValueError(f"context {args.ctx} exceeds the model's max_position_embeddings {limit}")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    cfg = report["config"]
    print(f"model: {args.model}")
    print(f"layers: {cfg['num_layers']} ({report['schedule']}), hidden {cfg['hidden_size']}, "
          f"heads {cfg['num_heads']} x {cfg['head_dim']}, vocab {cfg['vocab_size']}")
    print(f"experts: {cfg['n_routed_experts']} routed (top-{cfg['n_experts_per_tok']}) + "
          f"{cfg['n_shared_experts']} shared, intermediate {cfg['moe_intermediate_size']}, "
          f"hash layers {sum(cfg['mlp_hash'])}")
    print(f"parameters: {report['params_total']:,} total, {report['params_active']:,} active per token")
    print("weights by tensor type:")
    for dtype, row in report["bytes_by_dtype"].items():
        counts = f"{row['tensors']:6d} tensors, {row['params']:>16,} params, " if row["tensors"] else ""
        print(f"  {dtype:>14}: {counts}{row['bytes'] / 2**30:10.3f} GiB")
    print(f"  {'total':>14}: {report['bytes_total'] / 2**30:.3f} GiB")
    if "cache_plan" in report:
        plan = report["cache_plan"]
        print(f"packed cache for ctx {args.ctx:,}, prefill chunk {args.prefill_chunk}:")
        for key, value in plan.items():
            print(f"  {key:>20}: {value:>16,} bytes ({value / 2**30:.3f} GiB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if sys.stdout is None:  # started with stdout closed (`>&-`): every write was an AttributeError traceback
        print(f"ds4x {args.command}: error: standard output is closed", file=sys.stderr)
        return 2
    # the startup lines (model, cache plan, which kernel runs each hot op) go to stderr unless -q
    quiet = getattr(args, "quiet", False) and not args.verbose
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="[ds4x] %(message)s",
                        stream=sys.stderr)
    try:
        commands = {"generate": cmd_generate, "inspect": cmd_inspect, "bench": cmd_bench, "quality": cmd_quality,
                    "convert": convert_cmd.run, "serve": serve_cmd.run, "chat": chat_cmd.run}
        return commands[args.command](args)
    except BrokenPipeError:
        # the reader went away (`| head -c 10`): stop quietly, as a command killed by SIGPIPE would (exit 141),
        # not with an error line; stdout goes to /dev/null so the interpreter's last flush cannot complain
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except (ValueError, FileNotFoundError, ConfigError, OSError, MemoryError, RuntimeError) as exc:
        print(f"ds4x {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
