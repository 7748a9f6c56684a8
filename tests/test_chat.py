"""DeepSeek-V4 chat rendering, compared with antirez/ds4's server renderer.

The expected strings were produced by ds4's ``render_chat_prompt_text`` (ds4_server.c, compiled
into a small harness) for the same messages.
"""

from __future__ import annotations

import pytest

from ds4x.runtime.chat import BOS, REASONING_EFFORT_MAX_PREFIX, render_chat, tool_schemas

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]

TOOL_PROMPT = (
    "## Tools\n\nYou have access to a set of tools to help answer the user question. You can invoke tools by "
    "writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">"
    "$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n"
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nString parameters should be specified as raw text and set "
    "`string=\"true\"`. Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string "
    "characters with XML or HTML entity escapes. Only if a string value itself contains the exact closing "
    "parameter tag `</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. For all "
    "other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`."
    "\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly after </think> "
    "with tool calls or final response.\n\n### Available Tool Schemas\n\n"
    "{\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": "
    "{\"type\": \"string\"}}}}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to "
    "invoke tool calls. Use the exact parameter names from the schemas."
)


def test_single_turn_thinking_on_and_off():
    msgs = [{"role": "user", "content": "Hi"}]
    assert render_chat(msgs, thinking=True) == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>"
    assert render_chat(msgs, thinking=False) == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    assert render_chat(msgs, thinking=True, add_generation_prompt=False) == "<｜begin▁of▁sentence｜><｜User｜>Hi"


def test_systems_joined_and_past_reasoning_dropped():
    msgs = [
        {"role": "system", "content": "S1"}, {"role": "developer", "content": "S2"},
        {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
    ]
    assert render_chat(msgs, thinking=True) == (
        "<｜begin▁of▁sentence｜>S1\n\nS2<｜User｜>Q1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"
        "<｜User｜>Q2<｜Assistant｜><think>")


def test_last_assistant_keeps_reasoning_with_thinking():
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    assert render_chat(msgs, thinking=True) == (
        "<｜begin▁of▁sentence｜><｜User｜>Q<｜Assistant｜><think>R</think>A<｜end▁of▁sentence｜>")
    assert render_chat(msgs, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>Q<｜Assistant｜></think>A<｜end▁of▁sentence｜>")


def test_tool_call_and_results():
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "need tool", "tool_calls": [
            {"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Rome </｜DSML｜parameter>\", \"days\": [1, 2]}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny </tool_result> <b>"},
        {"role": "tool", "tool_call_id": "c2", "content": "second"},
    ]
    want = (
        "<｜begin▁of▁sentence｜>" + TOOL_PROMPT + "<｜User｜>weather?<｜Assistant｜><think>need tool</think>\n\n"
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
        "<｜DSML｜parameter name=\"city\" string=\"true\">Rome &lt;/｜DSML｜parameter></｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"days\" string=\"false\">[1,2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>sunny &lt;/tool_result> <b></tool_result>"
        "<tool_result>second</tool_result><｜Assistant｜><think>"
    )
    assert render_chat(msgs, thinking=True, tools=TOOLS) == want


def test_tool_call_arguments_not_json_and_dict():
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "y", "tool_calls": [{"name": "f", "arguments": "not json"}]},
            {"role": "tool", "content": "r"}]
    out = render_chat(msgs, thinking=False)
    assert "<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"arguments\" string=\"true\">not json" in out
    assert out.endswith("<｜User｜><tool_result>r</tool_result><｜Assistant｜></think>")
    msgs[1]["tool_calls"] = [{"name": "f", "arguments": {"a": 1, "b": "s"}}]
    out = render_chat(msgs, thinking=False)
    assert '<｜DSML｜parameter name="a" string="false">1</｜DSML｜parameter>\n' in out
    assert '<｜DSML｜parameter name="b" string="true">s</｜DSML｜parameter>\n' in out


def test_think_max_prefix_and_content_parts():
    out = render_chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                      thinking=True, think_max=True)
    assert out == BOS + REASONING_EFFORT_MAX_PREFIX + "<｜User｜>ab<｜Assistant｜><think>"


def test_tool_schemas_and_errors():
    assert tool_schemas(TOOLS) == '{"name": "get_weather", "parameters": {"type": "object", "properties": ' \
                                  '{"city": {"type": "string"}}}}'
    assert tool_schemas(['{"raw": true}']) == '{"raw": true}'
    with pytest.raises(ValueError, match="role 'robot'"):
        render_chat([{"role": "robot", "content": "x"}], thinking=False)
    with pytest.raises(TypeError, match="content"):
        render_chat([{"role": "user", "content": 5}], thinking=False)


def test_rendered_prompt_tokenizes_specials():
    pytest.importorskip("gguf")
    from ds4x.runtime.gguf_tokenizer import GGUFTokenizer
    from ds4x.weights.gguf_writer import synthetic_vocab

    v = synthetic_vocab(600)
    tok = GGUFTokenizer(v.tokens, v.merges)
    ids = tok.encode(render_chat([{"role": "user", "content": "Hi"}], thinking=True))
    assert ids[0] == 0 and ids[1] == 2 and ids[-2:] == [3, 4]  # BOS, User ... Assistant, <think>
    assert tok.decode(ids) == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>"


def test_chat_encoding_applies_where_the_tokenizer_has_the_chat_tokens(tmp_path):
    """An official-style tokenizer.json (the chat tokens as added tokens) gets the chat encoding; the embedded
    default model's and the byte tokenizer do not."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ds4x.runtime.chat import ASSISTANT, USER, uses_chat_encoding
    from ds4x.runtime.engine import Engine
    from ds4x.runtime.tokenizer import ByteTokenizer, HFTokenizer

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert not uses_chat_encoding(HFTokenizer(path, None, ()))
    tok.add_special_tokens([BOS, USER, ASSISTANT])
    tok.save(str(path))
    assert uses_chat_encoding(HFTokenizer(path, None, ()))
    assert not uses_chat_encoding(ByteTokenizer())
    assert not uses_chat_encoding(Engine.load("default", device="cpu").tokenizer)


def test_reasoning_split_whole_and_streamed():
    from ds4x.runtime.chat import ReasoningStream, split_reasoning

    assert split_reasoning("think</think>answer</think>x") == ("think", "answer</think>x")
    assert split_reasoning("still thinking") == ("still thinking", "")
    for pieces in (["ab</th", "ink>cd"], ["ab<", "/", "think>", "c", "d"], ["ab</think>cd"], ["a", "b</think>", "cd"]):
        s = ReasoningStream()
        parts = [s.feed(p) for p in pieces] + [s.flush()]
        assert ("".join(r for r, _ in parts), "".join(a for _, a in parts)) == ("ab", "cd"), pieces
    s = ReasoningStream()
    assert s.feed("x</thi") == ("x", "") and s.feed("nk") == ("", "")  # still the start of the tag
    assert s.feed("!<") == ("</think!", "")  # not the tag after all
    assert s.flush() == ("<", "")


def test_tool_calls_parse_back_what_the_encoding_writes():
    """An assistant turn's tool calls as render_chat writes them (the format its tools prompt asks the model for)
    parse back to the same calls: names, and arguments as JSON objects (strings with the closing tag escaped,
    nested JSON, numbers, an attribute-escaped name)."""
    import json

    from ds4x.runtime.chat import parse_tool_calls

    calls = [{"function": {"name": 'get "weather" & <more>', "arguments": json.dumps(
                 {"city": "Paris </｜DSML｜parameter> & co", "days": 3, "opts": {"a": [1, 2.5], "s": "x"}, "n": None},
                 ensure_ascii=False)}},
             {"type": "function", "function": {"name": "noop", "arguments": "{}"}}]
    text = render_chat([{"role": "user", "content": "u"}, {"role": "assistant", "content": "Checking.",
                                                           "tool_calls": calls}], thinking=False)
    reply = text[text.rindex("</think>") + len("</think>"):].removesuffix("<｜end▁of▁sentence｜>")
    content, parsed = parse_tool_calls(reply)
    assert content == "Checking."
    assert [(c["name"], json.loads(c["arguments"])) for c in parsed] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_tool_call_stream_equals_the_whole_parse_at_every_split():
    from ds4x.runtime.chat import ReplyParts, ToolCallStream, parse_tool_calls

    block = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="false">[1]'
             '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    cases = ["Sure.  \n\n" + block, block, "no calls here <｜DSML｜tool", "Broken " + block.replace("invoke>", "inv>"),
             "a\n\n", "a <｜DSML｜tool_calls> never closed"]
    for text in cases:
        whole = parse_tool_calls(text)
        assert (whole[1] is not None) == (text.startswith(("Sure", "<"))), text
        for cut in range(len(text) + 1):
            s = ToolCallStream()
            shown = s.feed(text[:cut]) + s.feed(text[cut:])
            tail, calls = s.finish()
            assert (shown + tail, calls) == whole, (text, cut)
    parts = ReplyParts(thinking=True, tools=True)
    pieces = ["why</th", "ink>Sure.", "\n\n" + block[:20], block[20:]]
    got = [parts.feed(p, last=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert "".join(g[0] for g in got) == "why" and "".join(g[1] for g in got) == "Sure."
    assert got[-1][2] == [{"name": "f", "arguments": '{"x": [1]}'}]
