"""The DeepSeek-V4 chat encoding, rendered as antirez/ds4's server renders it.

``render_chat(messages, thinking)`` returns the prompt text (special tokens spelled out, e.g.
``<｜User｜>``); encode it with a tokenizer that recognises them
(:class:`ds4x.runtime.gguf_tokenizer.GGUFTokenizer`). The layout:

    <｜begin▁of▁sentence｜>[max-effort prefix][tools prompt][system text]
    <｜User｜>user text                      (a run of tool results shares one <｜User｜>:
    <｜User｜><tool_result>...</tool_result>  each result wrapped in <tool_result>)
    <｜Assistant｜></think>reply<｜end▁of▁sentence｜>
    <｜Assistant｜><think>            (generation prompt; </think> with thinking off)

A past assistant turn keeps its reasoning (``<think>reasoning</think>``) only with thinking on and
either tools in play or the turn after the last user message; otherwise it opens with ``</think>``.
Tool calls are written in DSML (``<｜DSML｜tool_calls>``) after the reply text.

Messages are dicts with ``role`` (system / developer / user / assistant / tool / function) and
``content`` (a string, None, or a list of parts whose ``text`` fields are joined); assistants may
carry ``reasoning_content`` and ``tool_calls`` (OpenAI form ``{"function": {"name", "arguments"}}``
or ``{"name", "arguments"}``; arguments a JSON string or an object). ``tools`` are OpenAI tool
definitions (the ``function`` object of each is listed, as JSON, one per line) or raw JSON strings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

REASONING_EFFORT_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

_TOOLS_PROMPT_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user question. "
    f"You can invoke tools by writing a \"<{DSML}tool_calls>\" block like the following:\n\n"
    f"<{DSML}tool_calls>\n"
    f"<{DSML}invoke name=\"$TOOL_NAME\">\n"
    f"<{DSML}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"<{DSML}invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    "String parameters should be specified as raw text and set `string=\"true\"`. "
    "Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML or "
    "HTML entity escapes. "
    f"Only if a string value itself contains the exact closing parameter tag `</{DSML}parameter>`, write that tag "
    f"as `&lt;/{DSML}parameter>` inside the value. "
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    "`string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_PROMPT_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. "
    "Use the exact parameter names from the schemas."
)

_SYSTEM_ROLES = ("system", "developer")
_TOOL_ROLES = ("tool", "function")
_PARAM_END = f"</{DSML}parameter>"
_CALLS_START, _CALLS_END = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
_INVOKE_START = re.compile(rf'\s*<{re.escape(DSML)}invoke name="([^"]*)">')
_INVOKE_END = re.compile(rf"\s*</{re.escape(DSML)}invoke>")
_PARAM = re.compile(rf'\s*<{re.escape(DSML)}parameter name="([^"]*)" string="(true|false)">(.*?)'
                    + re.escape(_PARAM_END), re.S)
_RESULT_END = "</tool_result>"


def message_text(content: Any) -> str:
    """A message content as text: strings as is, None empty, a list of parts joined (strings and
    the ``text`` field of objects, as ds4 reads OpenAI content arrays). A part of another type (an image, audio)
    is refused (ValueError): the model reads text, and dropping it would answer a different question."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") != "text":
                raise ValueError(f"content parts of type {part.get('type')!r} are not supported: this model reads "
                                 "text parts only")
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                out.append(part["text"])
        return "".join(out)
    raise TypeError(f"message content must be a string, a list of parts or None, got {type(content).__name__}")


def _escape_end(text: str, end: str, repl: str) -> str:
    """Protect a wrapper's closing tag inside data: its leading '<' becomes ``repl``."""
    return text.replace(end, repl + end[1:])


def _attr(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _minify(raw: str) -> str:
    """JSON text without whitespace outside strings (ds4 writes non-string arguments this way)."""
    out, in_str, esc = [], False, False
    for ch in raw:
        if in_str:
            out.append(ch)
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
            out.append(ch)
        elif ch not in " \t\n\r":
            out.append(ch)
    return "".join(out)


def _object_items(text: str) -> list[tuple[str, Any, str]] | None:
    """Top-level (key, value, raw value text) of a JSON object in source order, or None."""
    dec = json.JSONDecoder()
    ws = " \t\n\r"
    i, n = 0, len(text)

    def skip(j: int) -> int:
        while j < n and text[j] in ws:
            j += 1
        return j

    i = skip(i)
    if i >= n or text[i] != "{":
        return None
    i = skip(i + 1)
    items: list[tuple[str, Any, str]] = []
    try:
        while i < n and text[i] != "}":
            key, i = dec.raw_decode(text, i)
            if not isinstance(key, str):
                return None
            i = skip(i)
            if i >= n or text[i] != ":":
                return None
            i = skip(i + 1)
            start = i
            value, i = dec.raw_decode(text, i)
            items.append((key, value, text[start:i]))
            i = skip(i)
            if i < n and text[i] == ",":
                i = skip(i + 1)
    except json.JSONDecodeError:
        return None
    return items if i < n and text[i] == "}" else None


def _param(key: str, value: Any, raw: str) -> str:
    if isinstance(value, str):
        body, flag = _escape_end(value, _PARAM_END, "&lt;"), "true"
    else:
        body, flag = _escape_end(_minify(raw), _PARAM_END, "\\u003c"), "false"
    return f'<{DSML}parameter name="{_attr(key)}" string="{flag}">{body}{_PARAM_END}\n'


def _tool_calls(calls: Iterable[Mapping[str, Any]]) -> str:
    calls = list(calls)
    if not calls:
        return ""
    out = [f"\n\n<{DSML}tool_calls>\n"]
    for call in calls:
        fn = call.get("function", call)
        name = str(fn.get("name", ""))
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append(f'<{DSML}invoke name="{_attr(name)}">\n')
        items = _object_items(args)
        if items is None:  # not a JSON object: the whole text as one string parameter
            out.append(f'<{DSML}parameter name="arguments" string="true">'
                       f'{_escape_end(args, _PARAM_END, "&lt;")}{_PARAM_END}\n')
        else:
            out.extend(_param(k, v, raw) for k, v, raw in items)
        out.append(f"</{DSML}invoke>\n")
    out.append(f"</{DSML}tool_calls>")
    return "".join(out)


def tool_schemas(tools: Iterable[Any] | None) -> str:
    """One JSON line per tool: the ``function`` object of an OpenAI tool, a raw JSON string as is."""
    lines = []
    for tool in tools or ():
        if isinstance(tool, str):
            lines.append(tool)
        elif isinstance(tool, Mapping):
            lines.append(json.dumps(tool.get("function", tool), ensure_ascii=False))
        else:
            raise TypeError(f"a tool must be a JSON object or string, got {type(tool).__name__}")
    return "\n".join(line for line in lines if line)


def uses_chat_encoding(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` knows DeepSeek-V4's chat tokens (BOS, User and Assistant each one token): a
    conversation is then rendered by :func:`render_chat`. A model trained without them (the embedded default
    model, the byte tokenizer) reads the contents joined by newlines instead (:func:`chat_text`)."""
    return all(len(tokenizer.encode(t)) == 1 for t in (BOS, USER, ASSISTANT))


def chat_text(messages: Iterable[Mapping[str, Any]], thinking: bool, templated: bool,
              tools: Iterable[Any] | None = None) -> str:
    """The prompt text of a conversation: :func:`render_chat` (which starts with BOS) when ``templated``,
    else the message contents joined by newlines (the caller adds the BOS id; no tools there)."""
    if templated:
        return render_chat(messages, thinking, tools=tools)
    if tools:
        raise ValueError("tools need a model with the DeepSeek-V4 chat encoding (a tokenizer with its chat tokens)")
    return "\n".join(message_text(m.get("content")) for m in messages)


def _tag_start_at_end(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (what a stream must hold back)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def _unattr(text: str) -> str:
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&amp;", "&")


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, str]] | None]:
    """A reply's (content, tool calls): the inverse of how :func:`render_chat` writes an assistant's calls, the
    DSML block its tools prompt asks the model for. Content is the text before the block, trailing whitespace
    dropped; each call is ``{"name", "arguments"}`` with the arguments as a JSON object text (``string="true"``
    parameters as strings, the others as the JSON they hold). Text without a complete, well-formed block is all
    content (None: no calls), as is anything after the block."""
    start = text.find(_CALLS_START)
    end = text.find(_CALLS_END, start)
    if start < 0 or end < 0:
        return text, None
    body, pos, calls = text[start + len(_CALLS_START):end], 0, []
    while (invoke := _INVOKE_START.match(body, pos)) is not None:
        args: dict[str, Any] = {}
        pos = invoke.end()
        while (param := _PARAM.match(body, pos)) is not None:
            name, is_string, value = _unattr(param[1]), param[2] == "true", param[3]
            if is_string:
                args[name] = value.replace("&lt;" + _PARAM_END[1:], _PARAM_END)
            else:
                try:
                    args[name] = json.loads(value)
                except json.JSONDecodeError:  # not JSON after all: keep the text rather than drop the call
                    args[name] = value
            pos = param.end()
        closing = _INVOKE_END.match(body, pos)
        if closing is None:
            return text, None
        calls.append({"name": _unattr(invoke[1]), "arguments": json.dumps(args, ensure_ascii=False)})
        pos = closing.end()
    if not calls or body[pos:].strip():
        return text, None
    return text[:start].rstrip(), calls


class ToolCallStream:
    """:func:`parse_tool_calls` of a reply that arrives in pieces: ``feed`` returns the text that is content for
    certain; from the start of a tool-call block on (with the whitespace and any start of the block's tag before
    it) the text is held, and ``finish`` returns the rest of the content and the calls (None: none)."""

    def __init__(self) -> None:
        self._held, self._in_block = "", False

    def feed(self, text: str) -> str:
        text, self._held = self._held + text, ""
        if self._in_block:
            self._held = text
            return ""
        at = text.find(_CALLS_START)
        if at >= 0:
            self._in_block = True
            cut = len(text[:at].rstrip())
        else:
            cut = len(text[:len(text) - _tag_start_at_end(text, _CALLS_START)].rstrip())
        self._held = text[cut:]
        return text[:cut]

    def finish(self) -> tuple[str, list[dict[str, str]] | None]:
        held, self._held = self._held, ""
        return parse_tool_calls(held) if self._in_block else (held, None)


def split_reasoning(text: str) -> tuple[str, str]:
    """A thinking-mode reply (generated after ``<think>``) as (reasoning, answer): the text before the first
    ``</think>`` and the text after it; all reasoning while the tag has not come."""
    reasoning, tag, answer = text.partition(THINK_END)
    return reasoning, answer if tag else ""


class ReasoningStream:
    """:func:`split_reasoning` of a reply that arrives in pieces: ``feed`` returns each piece's (reasoning, answer)
    parts; a piece that ends in the start of ``</think>`` keeps that start until the next piece says whether the
    tag follows (``flush`` returns it at the end)."""

    def __init__(self) -> None:
        self.answering = False
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        if self.answering:
            return "", text
        text, self._held = self._held + text, ""
        reasoning, answer = split_reasoning(text)
        if THINK_END in text:
            self.answering = True
            return reasoning, answer
        keep = _tag_start_at_end(text, THINK_END)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""  # only ever a start of the tag, before the answer: reasoning
        return held, ""


class ReplyParts:
    """A chat reply, piece by piece, as its parts: with ``thinking`` the reasoning (before ``</think>``), then the
    content, and with ``tools`` the calls of a tool-call block at its end (known once the last piece is in)."""

    def __init__(self, thinking: bool, tools: bool):
        self.reasoning = ReasoningStream() if thinking else None
        self.tools = ToolCallStream() if tools else None

    def feed(self, text: str, last: bool) -> tuple[str, str, list[dict[str, str]] | None]:
        """(reasoning, content, calls) of this piece; ``last``: the reply ends with it."""
        thought, answer = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        if last and self.reasoning is not None:
            thought += self.reasoning.flush()[0]
        calls = None
        if self.tools is not None:
            answer = self.tools.feed(answer)
            if last:
                tail, calls = self.tools.finish()
                answer += tail
        return thought, answer, calls


def render_chat(
    messages: Iterable[Mapping[str, Any]],
    thinking: bool,
    add_generation_prompt: bool = True,
    *,
    tools: Iterable[Any] | None = None,
    think_max: bool = False,
) -> str:
    """The prompt text of a conversation (see the module docstring). ``think_max`` adds ds4's
    maximum-effort prefix after BOS (ds4 does so only with a context of at least 384K tokens)."""
    msgs = list(messages)
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, Mapping) else None
        if role not in (*_SYSTEM_ROLES, "user", "assistant", *_TOOL_ROLES):
            raise ValueError(f"message {i} has role {role!r}; expected system, developer, user, assistant, tool "
                             f"or function")
    schemas = tool_schemas(tools)
    tool_context = bool(schemas) or any(
        (m["role"] == "assistant" and m.get("tool_calls")) or m["role"] in _TOOL_ROLES for m in msgs
    )
    system = []
    if schemas:
        system.append(_TOOLS_PROMPT_HEAD + schemas + _TOOLS_PROMPT_TAIL)
    system += [message_text(m.get("content")) for m in msgs if m["role"] in _SYSTEM_ROLES]
    last_user = max((i for i, m in enumerate(msgs) if m["role"] in ("user", *_TOOL_ROLES)), default=-1)

    out = [BOS]
    if think_max:
        out.append(REASONING_EFFORT_MAX_PREFIX)
    out.append("\n\n".join(system))
    pending_assistant = pending_result = False
    for i, m in enumerate(msgs):
        role = m["role"]
        if role in _SYSTEM_ROLES:
            continue
        if role == "user":
            out += [USER, message_text(m.get("content"))]
            pending_assistant, pending_result = True, False
        elif role in _TOOL_ROLES:
            if not pending_result:
                out.append(USER)
            out += ["<tool_result>", _escape_end(message_text(m.get("content")), _RESULT_END, "&lt;"), _RESULT_END]
            pending_assistant = pending_result = True
        else:  # assistant
            if pending_assistant:
                out.append(ASSISTANT)
                if thinking and (tool_context or i > last_user):
                    reasoning = m.get("reasoning_content", m.get("reasoning"))
                    out += [THINK_START, message_text(reasoning), THINK_END]
                else:
                    out.append(THINK_END)
            out.append(message_text(m.get("content")))
            out.append(_tool_calls(m.get("tool_calls") or ()))
            out.append(EOS)
            pending_assistant = pending_result = False
    if pending_assistant and add_generation_prompt:
        out += [ASSISTANT, THINK_START if thinking else THINK_END]
    return "".join(out)
