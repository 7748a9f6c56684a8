"""Multi-turn chat in one session (runtime.conversation) and ``ds4x chat``."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("gguf")

from ds4x.cli import chat as chat_cmd  # noqa: E402
from ds4x.cli.main import build_parser, main  # noqa: E402
from ds4x.config import tiny_config  # noqa: E402
from ds4x.runtime.chat import render_chat, uses_chat_encoding  # noqa: E402
from ds4x.runtime.conversation import Conversation  # noqa: E402
from ds4x.runtime.engine import Engine, GenerationStats  # noqa: E402
from ds4x.weights.gguf_writer import write_gguf  # noqa: E402
from ds4x.weights.synthetic import synthetic_weights  # noqa: E402


@pytest.fixture(scope="module")
def gguf_engine(tmp_path_factory) -> Engine:
    """A tiny model in a GGUF whose tokenizer has ds4's chat tokens (so the chat encoding applies)."""
    cfg = tiny_config()
    path = tmp_path_factory.mktemp("chat") / "tiny.gguf"
    write_gguf(path, cfg, synthetic_weights(cfg, seed=0), "f32")
    return Engine.load(str(path), device="cpu")


def _greedy(session, ids: list[int], n: int) -> list[int]:
    return [t for t, _ in session.generate(ids, n, stop_ids=())]


def test_turns_reuse_the_session_and_answer_as_a_fresh_one(gguf_engine):
    assert uses_chat_encoding(gguf_engine.tokenizer)
    # exact prefill: every token through the decode step, so reuse and a fresh prompt give the same bits
    chat = Conversation(gguf_engine.new_session(ctx=256, cache="packed", prefill_mode="exact"), system="be brief")
    first = list(chat.reply("hello", 6, stats=GenerationStats()))
    assert chat.reused == 0 and len(first) == 6
    assert chat.messages[-1] == {"role": "assistant", "content": gguf_engine.tokenizer.decode(first)}
    held = list(chat.session.tokens)
    first_prompt = gguf_engine.tokenizer.encode(render_chat(chat.messages[:2], thinking=False))
    second = list(chat.reply("and then?", 6))
    ids = gguf_engine.tokenizer.encode(render_chat(chat.messages[:-1], thinking=False))
    # at least the first turn's prompt is kept (the reply too where its text tokenizes back to the same ids)
    assert len(first_prompt) <= chat.reused < len(ids) and held[:chat.reused] == ids[:chat.reused]
    fresh = gguf_engine.new_session(ctx=256, cache="packed", prefill_mode="exact")
    assert second == _greedy(fresh, ids, 6)
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "be brief"}]
    list(chat.reply("hello", 6))  # the first turn again: its prompt is a prefix of what the session holds
    assert chat.reused == len(gguf_engine.tokenizer.encode(render_chat(chat.messages[:2], thinking=False))) - 1


def test_thinking_reply_splits_reasoning_and_an_interrupted_reply_is_kept(gguf_engine):
    tok = gguf_engine.tokenizer
    chat = Conversation(gguf_engine.new_session(ctx=256), thinking=True)
    think_end = tok.encode("</think>")
    assert len(think_end) == 1
    # what a thinking-mode reply records: the reasoning before </think>, the answer after it, no EOS
    eos = list(gguf_engine.cfg.eos_token_ids)
    message = chat._assistant_message([*tok.encode("ab"), *think_end, *tok.encode("cd"), *eos])
    assert message == {"role": "assistant", "content": "cd", "reasoning_content": "ab"}
    assert chat._assistant_message(tok.encode("ab")) == {"role": "assistant", "content": "", "reasoning_content": "ab"}
    reply = chat.reply("hi", 50)
    got = [next(reply), next(reply)]
    reply.close()  # the reader stops after two tokens: the reply is kept as far as it got
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    assert chat.messages[-1] == chat._assistant_message(got)


def test_a_conversation_over_the_context_is_refused_and_the_chat_goes_on(gguf_engine):
    chat = Conversation(gguf_engine.new_session(ctx=32))
    with pytest.raises(ValueError, match="no longer fits the context of 32"):
        list(chat.reply("x " * 40, 4))
    assert chat.messages == []
    assert len(list(chat.reply("x", 4))) == 4


def test_untemplated_model_turns_are_lines_and_reuse():
    engine = Engine.load("default", device="cpu")
    assert not uses_chat_encoding(engine.tokenizer)
    chat = Conversation(engine.new_session(ctx=512))
    assert chat.prompt_ids() == [engine.tokenizer.bos_id, *engine.tokenizer.encode("\n")]
    list(chat.reply("def add(a, b):", 8))
    assert chat.prompt_ids()[:3] == [engine.tokenizer.bos_id, *engine.tokenizer.encode("def add(a, b):")][:3]
    list(chat.reply("class A:", 8))
    assert chat.reused > 5


def test_chat_command_one_shot_and_piped_turns(gguf_engine, capsys):
    gguf = gguf_engine.name
    assert main(["chat", "-m", gguf, "-p", "hello", "-n", "5", "--seed", "1", "-q"]) == 0
    assert capsys.readouterr().out.endswith("\n")
    args = build_parser().parse_args(["chat", "-m", gguf, "-n", "4"])
    out = io.StringIO()
    assert chat_cmd.run(args, stdin=io.StringIO("hello\n/help\n\nmore\n/reset\nhello\n/exit\nignored\n"), out=out) == 0
    turns = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[ds4x] prompt")]
    assert len(turns) == 3  # hello, more, hello again after /reset; /help, the empty line and after /exit: none
    held = [int(line.split("(")[1].split()[0]) for line in turns]
    assert held[0] == 0 and held[1] > 0 and held[2] > 0  # the second turn and the repeated first reuse the session
    assert main(["chat", "-m", gguf, "-p", "x", "-n", "0"]) == 2
    assert "-n/--max-tokens must be >= 1" in capsys.readouterr().err


def test_chat_command_shows_reasoning_apart_on_a_terminal(gguf_engine):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    think_end = gguf_engine.tokenizer.encode("</think>")[0]
    argv = ["chat", "-m", gguf_engine.name, "-p", "hi", "--think", "-n", "3", "--logit-bias", f"{think_end}=100", "-q"]
    # every token forced to </think>: no reasoning, then an answer of the two later tags
    term, pipe = Terminal(), io.StringIO()
    assert chat_cmd.run(build_parser().parse_args(argv), out=term) == 0
    assert term.getvalue() == "\n" + "</think>" * 2 + "\n"
    assert chat_cmd.run(build_parser().parse_args(argv), out=pipe) == 0
    assert pipe.getvalue() == "</think>" * 3 + "\n"  # not a terminal: the text as generated
    argv[argv.index("--logit-bias") + 1] = f"{think_end}=-100"  # never the tag: three tokens of reasoning, dimmed
    dimmed = Terminal()
    assert chat_cmd.run(build_parser().parse_args(argv), out=dimmed) == 0
    assert dimmed.getvalue().startswith("\033[2m") and "</think>" not in dimmed.getvalue()
