"""``ds4x chat``: a conversation with a model in the terminal (or over a pipe), one session for all its turns.

Turns are rendered with the DeepSeek-V4 chat encoding when the model's tokenizer has its chat tokens (GGUF files,
the official tokenizer.json), else as the contents joined by newlines; each turn evaluates only what the session
does not already hold (:class:`ds4x.runtime.conversation.Conversation`). ``-p`` asks one question and exits;
otherwise each line read is a user message, with ``/reset``, ``/exit`` and ``/help``. Ctrl-C stops a reply (kept
as far as it got) and, at the prompt, ends the chat.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TextIO

from ds4x.cli.cpu_threads import add_threads_argument, apply_cpu_threads
from ds4x.cli.sampling_options import add_sampling_arguments, sampling_params
from ds4x.runtime.tokenizer import checked_text

if TYPE_CHECKING:  # the command line starts without importing torch
    from ds4x.runtime.conversation import Conversation
    from ds4x.runtime.sampling import SamplingParams

HELP = "/reset: start a new conversation; /exit (or Ctrl-D): quit; /help: this text"
_DIM, _PLAIN = "\033[2m", "\033[0m"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model (multi-turn, one session)")
    p.add_argument("-m", "--model", default="default",
                   help="checkpoint directory, .gguf file, 'default' (the embedded trained model) or a synthetic "
                        "preset (tiny)")
    p.add_argument("-p", "--prompt", default=None, help="one user message: print the reply and exit")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--think", action="store_true", help="thinking mode (the reply starts with its reasoning)")
    p.add_argument("-n", "--max-tokens", type=int, default=512, help="most tokens of a reply (default 512)")
    add_sampling_arguments(p)
    p.add_argument("--ctx", type=int, default=None,
                   help="context size of the conversation (default: 4096, or the model's maximum if smaller)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation dtype (default auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--cache", default="packed", choices=["packed", "native", "float"],
                   help="attention history (default packed; see ds4x generate --help)")
    p.add_argument("-q", "--quiet", action="store_true", help="no statistics on stderr")
    add_threads_argument(p)


def run(args: argparse.Namespace, stdin: TextIO | None = None, out: TextIO | None = None) -> int:
    from ds4x.runtime.conversation import Conversation
    from ds4x.runtime.engine import Engine

    stdin = stdin if stdin is not None else sys.stdin
    out = out if out is not None else sys.stdout
    if args.max_tokens < 1:
        raise ValueError(f"-n/--max-tokens must be >= 1, got {args.max_tokens}")
    if args.ctx is not None and args.ctx <= 0:
        raise ValueError(f"--ctx must be positive, got {args.ctx}")
    params = sampling_params(args)
    engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
    apply_cpu_threads(engine, args.threads)
    if engine.tokenizer is None:
        raise ValueError(f"model {args.model} has no tokenizer; chat needs text (ds4x generate takes token ids)")
    system = checked_text(args.system, "--system") if args.system is not None else None
    chat = Conversation(engine.new_session(ctx=args.ctx, cache=args.cache), system=system,
                        thinking=args.think)
    if not args.quiet and not chat.templated:
        print("[ds4x] this model's tokenizer has no chat tokens: each turn is its message text on a new line",
              file=sys.stderr)
    if args.prompt is not None:
        _answer(chat, args.prompt, args, params, out)
        return 0
    interactive = stdin.isatty()
    if interactive and not args.quiet:
        print(f"[ds4x] chatting with {args.model}; {HELP}", file=sys.stderr)
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            out.write("\n")
            return 0
        if not line:
            return 0
        text = line.rstrip("\n")
        command = text.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            chat.reset()
            continue
        if command == "/help":
            print(HELP, file=sys.stderr)
            continue
        if not command:
            continue
        try:
            _answer(chat, text, args, params, out)
        except ValueError as exc:  # the conversation outgrew the context or the line is not text: say so, go on
            print(f"[ds4x] {exc}", file=sys.stderr)


def _answer(chat: Conversation, text: str, args: argparse.Namespace, params: SamplingParams, out: TextIO) -> None:
    """Stream one reply to ``out``; statistics to stderr."""
    from ds4x.runtime.chat import ReplyParts
    from ds4x.runtime.engine import GenerationStats
    from ds4x.runtime.tokenizer import TextStream

    engine = chat.session.engine
    assert engine.tokenizer is not None
    stream = TextStream(engine.tokenizer)
    stats = GenerationStats()
    eos = set(engine.cfg.eos_token_ids)
    # thinking mode on a terminal: the reasoning dimmed, the answer after it on its own line (elsewhere the text as
    # generated, </think> included)
    parts = ReplyParts(thinking=True, tools=False) if chat.templated and chat.thinking and out.isatty() else None
    answering = False

    def show(piece: str, last: bool = False) -> None:
        nonlocal answering
        if parts is None:
            out.write(piece)
        else:
            thought, answer, _ = parts.feed(piece, last)
            out.write(f"{_DIM}{thought}{_PLAIN}" if thought else "")
            if answer and not answering:
                answering = True
                out.write("\n")
            out.write(answer)
        out.flush()

    reply = chat.reply(checked_text(text, "the message"), args.max_tokens, params, stats=stats)
    try:
        for token in reply:
            if token not in eos:
                show(stream.push(token))
    except KeyboardInterrupt:
        stats.stop_reason = "interrupted"
    finally:
        reply.close()  # the reply joins the conversation now, before the next turn
    show(stream.flush(), last=True)
    out.write("\n")
    out.flush()
    if not args.quiet:
        dec = (stats.generated - 1) / stats.decode_s if stats.decode_s and stats.generated > 1 else 0.0
        print(f"[ds4x] prompt {stats.prompt_tokens} new tok ({chat.reused} held) in {stats.prefill_s:.2f}s; "
              f"generated {stats.generated} tok ({dec:.1f} tok/s); stop: {stats.stop_reason}; "
              f"context {len(chat.session.tokens)}/{chat.session.ctx}", file=sys.stderr)
