"""OpenAI-compatible HTTP API over one :class:`~ds4x.runtime.engine.Engine`.

Endpoints: ``GET /health``, ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``, ``POST
/v1/chat/completions`` (streaming as server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``, or
one JSON body; either carries a ``system_fingerprint`` of the build, machine and model), ``GET /metrics``
(Prometheus text), and vLLM's tokenizer endpoints ``POST /tokenize`` (``prompt``, BOS first unless
``add_special_tokens`` is false, or chat ``messages`` rendered as the chat endpoint renders them: ``tokens``,
``count``, ``max_model_len``), ``POST /detokenize`` (``tokens`` -> ``prompt``) and ``GET /tokenizer_info`` (the BOS
and EOS tokens' text, the context), which lm-eval-harness's ``local-completions`` finds and tokenizes with. Each
``/v1/models`` entry carries, besides OpenAI's fields, ``max_model_len`` and a ``ds4x`` object describing the build,
machine and model (:func:`ds4x.serve.info.server_info`).

Requests are served with continuous batching by one engine worker thread (:mod:`ds4x.serve.scheduler`): each
request gets its own session, decode steps are batched over all generating requests, prompts are evaluated in
chunks between them, and admission is bounded by a KV-memory budget and a wait queue (past it: 429; while
shutting down: 503; ``ds4x serve`` on SIGTERM lets running requests finish for ``--shutdown-timeout`` seconds).
A client that disconnects frees its session before the next step. Prefix reuse across
requests through an optional :class:`~ds4x.runtime.prefix_cache.PrefixCache`.

Request fields: ``model`` (must be the served name), ``prompt`` (completions: text, token ids, or a list of one of
those) or ``messages`` (chat), ``max_tokens`` (``max_completion_tokens`` for chat), ``stop`` (string or list),
``temperature``, ``top_p``, ``min_p``, ``top_k``, ``seed``, ``presence_penalty`` and ``frequency_penalty`` ([-2, 2],
over the tokens generated so far), ``logit_bias`` (an object of at most 300 token ids, as strings, to a bias in
[-100, 100] added to their logits), ``n`` (choices per prompt, at most 128 a request), ``echo`` (completions),
``stream``, ``stream_options.include_usage``, ``logprobs`` and (chat) ``top_logprobs`` (below). Extensions:
``repetition_penalty`` ((0, 10], default 1 = off; vLLM's: over the prompt and generated tokens, a positive logit
divided by it, a negative one multiplied), ``ignore_eos`` (keep generating past EOS) and ``return_token_ids``
(``prompt_token_ids`` and per-choice ``token_ids`` in the response; ``token_ids`` in every streamed chunk: the ids
generated since the previous chunk), and for chat ``thinking`` (or vLLM's ``chat_template_kwargs`` ``{"thinking":
true}``): DeepSeek-V4's thinking mode where the chat encoding applies (a tokenizer with its chat tokens), the
reply's text before ``</think>`` given apart as the message's (or delta's) ``reasoning_content``, as DeepSeek's API
does; an assistant message's ``reasoning_content`` is rendered back. A null field counts as absent (OpenAI's
optional fields are nullable). Chat ``tools`` (OpenAI function tools; where the chat encoding applies, else a 400)
are offered in the encoding's tools prompt, and a DSML tool-call block closing the reply comes back as the message's
``tool_calls`` (streamed as one delta at the end; finish reason ``tool_calls``;
:class:`ds4x.runtime.chat.ReplyParts`); ``tool_choice`` "none" offers none. The legacy ``functions`` /
``function_call``, a forced ``tool_choice``, a ``response_format`` other than text, and ``audio`` are refused (400
naming the field). Other unknown fields are ignored. ``top_p`` 0 decodes greedily. The bias and penalties apply
before temperature and the top-k / top-p / min-p filters, and to greedy decoding (:mod:`ds4x.runtime.sampling`).

Logprobs: ``logprobs`` (chat: true, with ``top_logprobs`` 0..20 alternatives, which needs it; completions:
0..5 alternatives) gives each generated token's logprob and those of the k most likely tokens: the log_softmax
of the model's raw logits, before the logit bias, the penalties, temperature and the top-k / top-p / min-p
filters (as vLLM reports them by default; -inf floored at -9999 as there). Each choice, and each streamed
chunk's, carries the entries of the tokens it carries (chat: ``content`` of ``token``, ``logprob``, ``bytes``,
``top_logprobs``; completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` dicts holding the chosen token
too, ``text_offset``: the characters of the choice's text completed before the token, counted on across
chunks, so that is where its text starts unless the token before left a character unfinished); ``null`` when
not asked. A token's string is its own text, with U+FFFD where it holds part of a character (chat's ``bytes``
are then its raw bytes); "" for a model without a tokenizer. Tokens cut off by a stop string keep their
entries, at the text's end (streamed with ``return_token_ids``, the entry of a token held back as a possible
start of a stop string comes with the chunk that settles its offset, after its id). A completion's ``echo``
puts the prompt before the completion's text (the text sent; token ids: their decoded text; streamed: in the
first chunk); with ``logprobs`` the prompt's tokens' entries come first (the first
token's logprob and alternatives null, a BOS the server added at offset 0) and the completion's offsets count
the prompt's text, and ``max_tokens`` 0 scores the prompt alone (lm-eval-harness's loglikelihood requests). Such
a prompt is evaluated whole, alone in its prefill calls, with no stored prefix reused.

Chat prompts use the DeepSeek-V4 chat encoding (:func:`ds4x.runtime.chat.render_chat`) when the model has
a GGUF tokenizer (the only one that knows its special tokens); otherwise BOS followed by the message
contents joined with newlines (the embedded default model and the synthetic presets were not trained on
a chat format).

Errors are OpenAI-style bodies ``{"error": {"message", "type", "param", "code"}}``; a request body over
``MAX_REQUEST_BYTES`` (64 MiB) is refused with 413 before it is read whole, and a web page's body of a type it
may send anywhere unasked (text/plain, a form; with an Origin header) with 415 unread.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Annotated, Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ds4x.kernels.jit_watch import watch
from ds4x.runtime.chat import ReplyParts, chat_text, uses_chat_encoding
from ds4x.runtime.engine import Engine
from ds4x.runtime.sampling import SamplingParams
from ds4x.runtime.tokenizer import TextStream, checked_text
from ds4x.serve.info import server_info
from ds4x.serve.scheduler import (
    Generation,
    Job,
    Piece,
    Rejected,
    Scheduler,
    Scores,
    TokenLogprob,
    default_kv_budget,
    queue_delivery,
)

if TYPE_CHECKING:
    from ds4x.runtime.prefix_cache import PrefixCache

_MAX_INT = 2**31 - 1
MAX_REQUEST_BYTES = 64 << 20  # a longer request body is refused (413) before it is read whole
MAX_CHOICES = 128  # choices of one request (prompts x n): each is its own job in the scheduler


class APIError(Exception):
    """An error answered as an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": _printable(self.message), "type": self.type, "param": _printable(self.param),
                          "code": self.code}}


def _printable(text: str | None) -> str | None:
    """``text`` with lone surrogates escaped (\\ud800): a message may quote the request (a model name, a
    logit_bias key), where JSON can escape one, and the response's UTF-8 could not hold it (a 500, or a stream
    cut off, instead of the error)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if text is not None else None


# ---- request models -----------------------------------------------------------------------------

class _Base(BaseModel):
    # NaN / Infinity (JSON extensions Python's parser takes) refused as such, not as out of a range
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # OpenAI's optional fields are nullable and clients send null for "not given" (e.g. "n": null)
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Base):
    include_usage: bool = False


class _SamplingRequest(_Base):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0, le=_MAX_INT)] | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None  # 0 (OpenAI allows it): the most likely token
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=_MAX_INT)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    # token ids are object keys in JSON, hence strings; 300 entries is OpenAI's limit
    # (at most 20 digits: Python refuses to convert an integer of over 4,300, after the check)
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,20}$")],
                               Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=300)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    def sampling(self) -> SamplingParams:
        greedy = self.top_p == 0  # a nucleus of the most likely token alone
        return SamplingParams(temperature=0.0 if greedy else 1.0 if self.temperature is None else self.temperature,
                              top_k=max(self.top_k or 0, 0), top_p=1.0 if self.top_p is None or greedy else self.top_p,
                              min_p=self.min_p or 0.0, seed=self.seed, presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                              logit_bias=tuple({int(t): b for t, b in (self.logit_bias or {}).items()}.items()))

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop] if self.stop else []
        return list(self.stop)


_TokenIds = list[Annotated[int, Field(ge=0, le=_MAX_INT)]]


class CompletionRequest(_SamplingRequest):
    prompt: str | Annotated[_TokenIds, Field(min_length=1)] | Annotated[list[str], Field(min_length=1)] \
        | Annotated[list[_TokenIds], Field(min_length=1)]
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # alternatives per token (OpenAI's limit)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any] | str] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_hold_text(cls, content: str | list[dict[str, Any] | str] | None) -> Any:
        # a text part without a string text (missing, a number) was dropped: an answer to another question
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type", "text") == "text" and not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")
        return content


class TokenizeRequest(_Base):
    """vLLM's ``/tokenize``: a text (BOS first with ``add_special_tokens``, as a completion's text prompt gets it) or
    chat messages (rendered as the chat endpoint renders them)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    thinking: bool = False


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=_MAX_INT)]]


class ChatRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=0, le=_MAX_INT)] | None = None
    thinking: bool = False  # extension: DeepSeek-V4 thinking mode (where the chat encoding applies)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's spelling: {"thinking": true} (or "enable_thinking")
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Any] | None = None  # OpenAI function tools (where the chat encoding applies)
    tool_choice: str | dict[str, Any] | None = None
    # taken only where they ask for nothing this server lacks (forced tool calls, the legacy functions, structured
    # or audio output): one that does gets a 400 naming it, not an answer that silently ignores it
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None

    def check_supported(self, templated: bool) -> None:
        """Refuse (APIError 400) what asks for forced tool calls, structured output or audio, and tools where the
        model has no chat encoding to offer them in."""
        if self.functions:
            raise APIError(400, "functions: the legacy function calling is not supported; use tools", param="functions")
        if self.function_call not in (None, "none", "auto"):
            raise APIError(400, "function_call: the legacy function calling is not supported; use tools",
                           param="function_call")
        if self.tools:
            if not templated:
                raise APIError(400, "tools: this model has no DeepSeek-V4 chat encoding (a tokenizer with its chat "
                                    "tokens) to offer tools in", param="tools")
            for tool in self.tools:
                fn = tool.get("function") if isinstance(tool, dict) else None
                if not isinstance(fn, dict) or tool.get("type", "function") != "function" \
                        or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise APIError(400, "tools: each tool must be {'type': 'function', 'function': {'name': ...}}",
                                   param="tools")
        if self.tool_choice not in (None, "none", "auto"):  # the model decides; a call cannot be forced here
            raise APIError(400, "tool_choice: 'none' or 'auto' only (a tool call cannot be forced)",
                           param="tool_choice")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError(400, "response_format: only {'type': 'text'} is supported (no JSON mode or schemas)",
                           param="response_format")
        if self.audio is not None:
            raise APIError(400, "audio: this server generates text only", param="audio")
        for key in ("thinking", "enable_thinking"):  # a string "false" would read as true
            value = (self.chat_template_kwargs or {}).get(key)
            if value is not None and not isinstance(value, bool):
                raise APIError(400, f"chat_template_kwargs.{key} must be a boolean, got {value!r}",
                               param="chat_template_kwargs")

    def offered_tools(self) -> list[Any]:
        """The tools the prompt offers (none with tool_choice 'none')."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    def thinking_mode(self) -> bool:
        kwargs = self.chat_template_kwargs or {}
        return bool(self.thinking or kwargs.get("thinking") or kwargs.get("enable_thinking"))

    def alternatives(self) -> int | None:
        """Alternatives to report per token (None: no logprobs); ``top_logprobs`` needs ``logprobs``."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


# ---- metrics ------------------------------------------------------------------------------------

def _resident_bytes() -> int | None:
    """This process's resident set size from /proc (Linux); None where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Echo:
    """A completion's prompt as ``echo`` shows it: the text, and where each prompt token's text starts in it."""

    text: str
    offsets: list[int]


@dataclass
class Metrics:
    """Counters of the HTTP side (the event loop); the engine's own come from the scheduler."""

    requests: Counter[tuple[str, int]] = field(default_factory=Counter)

    def render(self, scheduler: Scheduler | None) -> str:
        lines = ["# HELP ds4x_requests_total HTTP requests answered, by endpoint and status.",
                 "# TYPE ds4x_requests_total counter"]
        for (endpoint, status), count in sorted(self.requests.items()):
            lines.append(f'ds4x_requests_total{{endpoint="{endpoint}",status="{status}"}} {count}')
        rss = _resident_bytes()
        if rss is not None:
            lines += ["# HELP process_resident_memory_bytes Resident memory size in bytes.",
                      "# TYPE process_resident_memory_bytes gauge", f"process_resident_memory_bytes {rss}"]
        if scheduler is None:
            return "\n".join(lines) + "\n"
        st, g = scheduler.stats, scheduler.gauges()
        values = [
            ("ds4x_prompt_tokens_total", "counter", "Prompt tokens evaluated (reused prefix tokens excluded).",
             st.prompt_tokens),
            ("ds4x_generation_tokens_total", "counter", "Tokens generated.", st.generation_tokens),
            ("ds4x_requests_cancelled_total", "counter", "Requests dropped because the client went away.",
             st.cancelled),
            ("ds4x_requests_failed_total", "counter", "Requests ended by an engine error.", st.failed),
            ("ds4x_decode_steps_total", "counter", "Batched decode steps.", st.steps),
            ("ds4x_prefill_steps_total", "counter", "Model calls evaluating prompt chunks.", st.prefill_steps),
            ("ds4x_requests_running", "gauge", "Requests holding a session (admitted).", g["running"]),
            ("ds4x_requests_waiting", "gauge", "Requests queued for admission.", g["waiting"]),
            ("ds4x_kv_bytes_in_use", "gauge", "Planned cache bytes of the admitted sessions.", g["kv_bytes_in_use"]),
            ("ds4x_kv_budget_bytes", "gauge", "Cache bytes the scheduler may admit.", g["kv_budget_bytes"]),
            ("ds4x_max_batch", "gauge", "Most requests decoded together.", scheduler.max_batch),
            ("ds4x_max_queue", "gauge", "Most requests waiting before 429.", scheduler.max_queue),
        ]
        device = scheduler.engine.model.device
        if device.type == "cuda":
            values.append(("ds4x_cuda_memory_allocated_bytes", "gauge",
                           "GPU memory held by tensors (weights, caches, activations) on the serving device.",
                           torch.cuda.memory_allocated(device)))
        pc = scheduler.prefix_cache
        if pc is not None:
            values += [
                ("ds4x_prefix_cache_hits_total", "counter", "Requests that started from a stored prefix.",
                 st.prefix_hits),
                ("ds4x_prefix_cache_misses_total", "counter", "Requests that found no usable stored prefix.",
                 st.prefix_misses),
                ("ds4x_prefix_reused_tokens_total", "counter",
                 "Prompt tokens taken from stored sessions instead of evaluated.", st.reused_tokens),
                ("ds4x_prefix_cache_resident_bytes", "gauge", "Bytes of stored sessions in memory.",
                 pc.resident_bytes),
            ]
        for name, kind, help_, value in values:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        compiles = watch().totals()
        if compiles:  # a series per kernel compiled since the server started (none: no series, as Prometheus does)
            lines += ["# HELP ds4x_kernel_compiles_total Kernel specializations compiled (or read from Triton's disk "
                      "cache) after the warm-up: requests waited for each.",
                      "# TYPE ds4x_kernel_compiles_total counter"]
            lines += [f'ds4x_kernel_compiles_total{{kernel="{k}"}} {n}' for k, n, _ in compiles]
            lines += ["# HELP ds4x_kernel_compile_seconds_total Time those compiles took.",
                      "# TYPE ds4x_kernel_compile_seconds_total counter"]
            lines += [f'ds4x_kernel_compile_seconds_total{{kernel="{k}"}} {s:.3f}' for k, _, s in compiles]
        lines += st.batch_size.render("ds4x_batch_size", "Requests per batched decode step.")
        lines += st.ttft.render("ds4x_time_to_first_token_seconds", "From arrival to the first token.")
        lines += st.itl.render("ds4x_inter_token_latency_seconds", "Between consecutive tokens of a request.")
        lines += st.step_model.render("ds4x_decode_step_model_seconds",
                                      "A batched decode step's model call: its device time on CUDA, else from launch "
                                      "to logits ready.")
        lines += st.step_sample.render("ds4x_decode_step_sample_seconds",
                                       "The host's own time for a batched decode step's tokens: drawing, reading "
                                       "and delivering them (waits for the device not counted; with decode slots "
                                       "it overlaps the next step).")
        return "\n".join(lines) + "\n"


# ---- the app ------------------------------------------------------------------------------------

class Server:
    """The state behind the app: the engine, its scheduler, the metrics; request -> prompt ids -> job."""

    def __init__(self, engine: Engine, model_name: str, ctx: int, cache: str, scheduler: Scheduler | None = None):
        self.engine, self.model_name, self.ctx, self.cache = engine, model_name, ctx, cache
        self.scheduler = scheduler
        self.metrics = Metrics()
        self.created = int(time.time())
        # the DeepSeek-V4 chat encoding where the tokenizer has its tokens, else the contents joined by newlines
        self.templated = engine.tokenizer is not None and uses_chat_encoding(engine.tokenizer)

    # request -> prompt ids
    def _check_model(self, req: _SamplingRequest | TokenizeRequest | DetokenizeRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    @functools.cached_property
    def _token_bytes(self) -> int:
        """The most bytes of text one token of the vocabulary stands for."""
        tok = self.engine.tokenizer
        assert tok is not None
        return max(1, *(len(tok.token_bytes(t)) for t in range(self.engine.cfg.vocab_size)))

    def _encode(self, text: str, bos: bool = True, param: str = "prompt") -> list[int]:
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        try:  # JSON may escape a lone surrogate (\udc80), which no tokenizer takes
            checked_text(text, "the text")
        except ValueError as exc:
            raise APIError(400, f"the text is not valid Unicode: {exc}", param=param) from None
        # refused before tokenizing where it cannot fit: the tokenizer's per-token records take ~170 bytes of memory a
        # byte of text (a 60 MB prompt held 11 GB and a worker thread for 80 s before it was refused). A token stands
        # for at most _token_bytes bytes; the factor 4 leaves room for a normalizer that shortens the text
        if len(text) > self.ctx and (size := len(text.encode("utf-8"))) > (limit := 4 * self.ctx * self._token_bytes):
            raise APIError(400, f"This model's maximum context length is {self.ctx} tokens; the text has {size} "
                                f"bytes, more than {limit} could fit", param=param, code="context_length_exceeded")
        ids = tok.encode(text)
        return [tok.bos_id, *ids] if bos and tok.bos_id is not None else ids

    def completion_prompts(self, req: CompletionRequest) -> list[str | list[int]]:
        """The prompts of a completion request: one (a text or token ids), or a list of them (a batch, answered as
        one choice each, ``index`` in request order)."""
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) * req.n > MAX_CHOICES:
                raise APIError(400, f"at most {MAX_CHOICES} choices per request (prompts x n), got {len(prompt)} "
                                    f"prompts x {req.n}", param="prompt")
            return list(prompt)
        return [prompt]

    def completion_ids(self, prompt: str | list[int]) -> tuple[list[int], bool]:
        """A completion prompt's token ids (a text gets BOS first), and whether the job detokenizes."""
        if isinstance(prompt, str):
            return self._encode(prompt), self.engine.tokenizer is not None
        return list(prompt), self.engine.tokenizer is not None

    def tokenize(self, req: TokenizeRequest) -> list[int]:
        """``/tokenize``: the ids of a text or of chat messages (exactly one of them)."""
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt (a text) or messages", param="prompt")
        if req.messages is not None:
            return self.chat_prompt(ChatRequest(messages=req.messages, thinking=req.thinking))
        assert req.prompt is not None
        return self._encode(req.prompt, bos=req.add_special_tokens)

    def detokenize(self, req: DetokenizeRequest) -> str:
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        vocab = self.engine.cfg.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return tok.decode(req.tokens)

    def tokenizer_info(self) -> dict[str, Any]:
        """``/tokenizer_info`` (vLLM's): what a client needs to tokenize for this server (lm-eval-harness's remote
        tokenizer reads it): the BOS and EOS tokens' text (null where a special token has none), the context, and
        whether a completion's text prompt gets BOS first."""
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer")

        def text_of(token: int | None) -> str | None:
            return (tok.decode([token]) or None) if token is not None else None

        return {"tokenizer_class": type(tok).__name__, "bos_token": text_of(tok.bos_id),
                "eos_token": text_of(tok.eos_ids[0] if tok.eos_ids else None), "pad_token": None,
                "add_bos_token": tok.bos_id is not None, "model_max_length": self.ctx,
                "vocab_size": self.engine.cfg.vocab_size, "chat_template": None}

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        messages = [m.model_dump(exclude_none=False) for m in req.messages]
        try:
            text = chat_text(messages, req.thinking_mode(), self.templated, tools=req.offered_tools())
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="messages") from None
        return self._encode(text, bos=not self.templated, param="messages")  # the rendering starts with BOS

    def make_job(self, req: _SamplingRequest, prompt: list[int], text: bool, max_tokens: int | None,
                 logprobs: int | None, copy: int = 0) -> Job:
        """The job of one choice: ``copy`` counts the choices of the same prompt (``n``); with a ``seed`` the k-th
        draws from seed + k, so the n choices differ and each is reproducible."""
        if getattr(req, "best_of", None) not in (None, req.n):
            raise APIError(400, "best_of (choosing the best of more samples than n) is not supported",
                           param="best_of")
        echo = getattr(req, "echo", False)
        if getattr(req, "suffix", None):
            raise APIError(400, "suffix (text after the completion) is not supported", param="suffix")
        vocab = self.engine.cfg.vocab_size
        bad = [t for t in prompt if t >= vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        room = self.ctx - len(prompt)
        if room < 0 or (room == 0 and max_tokens is None):
            raise APIError(400, f"This model's maximum context length is {self.ctx} tokens; the prompt has "
                                f"{len(prompt)} tokens", param="messages" if isinstance(req, ChatRequest) else "prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.ctx} tokens; the prompt has "
                                f"{len(prompt)} tokens and max_tokens is {max_tokens}", param="max_tokens",
                           code="context_length_exceeded")
        try:
            params = req.sampling()
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        if copy and params.seed is not None:
            params = replace(params, seed=(params.seed + copy) % 2**63)
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise APIError(400, f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})",
                           param="logit_bias")
        # streamed token ids arrive with their token, not when held-back text completes (clients time them)
        return Job(prompt, max_tokens, params, req.stops(), req.ignore_eos, text,
                   ids_every_token=bool(req.stream and req.return_token_ids), logprobs=logprobs,
                   prompt_logprobs=logprobs if echo else None)

    def submit(self, job: Job) -> tuple[Generation | None, asyncio.Queue]:
        """Hand ``job`` to the scheduler (or raise the APIError of a refusal); its pieces arrive on the queue."""
        assert self.scheduler is not None
        queue, put = queue_delivery(asyncio.get_running_loop())
        if job.max_tokens == 0 and job.prompt_logprobs is None:  # nothing to evaluate: no session needed
            put(Piece("", [], "length"))
            return None, queue
        try:
            return self.scheduler.submit(job, put), queue
        except Rejected as exc:
            type_ = "rate_limit_error" if exc.status == 429 else "server_error"
            raise APIError(exc.status, exc.message, type_, code=exc.code) from None

    def cancel(self, handle: Generation | None) -> None:
        if handle is not None and self.scheduler is not None:
            self.scheduler.cancel(handle)

    async def pieces(self, request: Request, handle: Generation | None,
                     queue: asyncio.Queue) -> AsyncIterator[Piece]:
        """The pieces of a submitted job until its last one; a client that goes away cancels it."""
        done, checked = False, time.monotonic()
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    item = None
                if time.monotonic() - checked >= 0.5:  # also while pieces keep coming (a non-streamed body)
                    if await request.is_disconnected():
                        return
                    checked = time.monotonic()
                if item is None:
                    continue
                if isinstance(item, Rejected):
                    raise APIError(item.status, item.message, "server_error", code=item.code)
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish is not None:
                    done = True
                    return
        finally:
            if not done:
                self.cancel(handle)

    def _token(self, job: Job, token: int) -> tuple[str, bytes]:
        """A token's string and bytes for logprobs."""
        tok = self.engine.tokenizer
        if not job.text or tok is None:
            return "", b""
        data = tok.token_bytes(token)
        return data.decode("utf-8", errors="replace"), data

    def chat_logprobs(self, job: Job, entries: list[TokenLogprob]) -> dict[str, Any]:
        """A chat choice's ``logprobs``: OpenAI's ``content`` list."""
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text, data = self._token(job, token)
            return {"token": text, "logprob": logprob, "bytes": list(data)}

        return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def completion_logprobs(self, job: Job, entries: list[TokenLogprob], echo: Echo | None = None,
                            with_prompt: bool = False) -> dict[str, Any]:
        """A completion choice's ``logprobs``: OpenAI's legacy parallel lists. With ``echo`` the offsets count the
        prompt's text first, and ``with_prompt`` (the choice's first chunk) puts the prompt's tokens first (the
        first one's logprob and alternatives null)."""
        tokens: list[str] = []
        logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []

        def add(token: int, scores: Scores | None, offset: int) -> None:
            tokens.append(self._token(job, token)[0])
            offsets.append(offset)
            if scores is None:
                logprobs.append(None)
                tops.append(None)
                return
            top: dict[str, float] = {}
            for t, lp in [*scores[1], (token, scores[0])]:  # the chosen token too, as OpenAI's
                top.setdefault(self._token(job, t)[0], lp)  # tokens of the same string: the most likely one
            logprobs.append(scores[0])
            tops.append(top)

        shift = 0
        if echo is not None:
            shift = len(echo.text)
            if with_prompt:
                for token, scores, offset in zip(job.prompt, job.prompt_scores, echo.offsets, strict=True):
                    add(token, scores, offset)
        for e in entries:
            add(e.token, (e.logprob, e.top), e.offset + shift)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def echo(self, prompt: str | list[int], job: Job) -> Echo:
        """The prompt as a completion echoes it: the text sent (token ids: their decoded text), and where each
        prompt token's text starts in it (a BOS this server put first: at 0)."""
        tok = self.engine.tokenizer
        ids = job.prompt
        if not job.text or tok is None:
            return Echo("", [0] * len(ids))
        added_bos = isinstance(prompt, str) and tok.bos_id is not None and ids[:1] == [tok.bos_id]
        stream, offsets, at = TextStream(tok), [], 0
        for i, token in enumerate(ids):
            offsets.append(at)
            if not (added_bos and i == 0):
                at += len(stream.push(token))
        return Echo(prompt if isinstance(prompt, str) else tok.decode(ids), offsets)

    def usage(self, jobs: list[Job], n: int = 1) -> dict[str, int]:
        """A response's usage: each prompt's tokens once, however many (``n``) choices it has (OpenAI's and vLLM's
        count: the n choices of job i * n + k share prompt i), and every choice's generated tokens."""
        p, g = sum(len(job.prompt) for job in jobs[::n]), sum(job.generated for job in jobs)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}


async def _merged(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """The pieces of several jobs as they come, each with its job's index; the first error raises (and the other
    streams end, cancelling their jobs)."""
    if len(streams) == 1:
        async for piece in streams[0]:
            yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                await queue.put((i, piece))
        except Exception as exc:
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # their streams' cleanup cancels unfinished jobs


_ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
              "/detokenize", "/tokenizer_info")


def _endpoint(request: Request) -> str:
    """The metrics label of a request's path (unknown paths share one label)."""
    return request.url.path if request.url.path in _ENDPOINTS else "other"


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _param_of(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    # a union reports an error per branch: of the first field's, the deepest names the value at fault (the token id
    # of a list, not "should be a string"), and among equally deep ones a branch whose type the value has (a list
    # too long, not "should be a string")
    field_of = [[x for x in err.get("loc", ()) if x != "body"][:1] for err in errors]
    e = max((err for err, f in zip(errors, field_of, strict=True) if f == field_of[0]),
            key=lambda err: (len(err.get("loc", ())), not str(err.get("type", "")).endswith("_type")))
    loc = [str(x) for x in e.get("loc", ()) if x not in ("body",)]
    # a union reports each branch (e.g. prompt.str); name the request field
    param = loc[0] if loc else None
    where = ".".join(loc)
    return (f"{where}: {e.get('msg', 'invalid value')}" if where else str(e.get("msg", "invalid request"))), param


def create_app(engine: Engine, model_name: str, ctx: int, cache: str, *, prefill_chunk: int = 256,
               max_batch: int = 32, max_queue: int = 128, kv_budget: int | None = None,
               batch_invariant: bool | None = None, prefix_cache: PrefixCache | None = None,
               decode_slots: bool | None = None, prefill_budget: int | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name``; sessions of ``ctx`` tokens with ``cache``.

    Scheduling (:class:`~ds4x.serve.scheduler.Scheduler`): prompts in chunks of ``prefill_chunk``, at most
    ``max_batch`` sessions decoding together within ``kv_budget`` bytes of planned cache (default
    :func:`~ds4x.serve.scheduler.default_kv_budget`), at most ``max_queue`` waiting. ``batch_invariant``:
    row-by-row products in the decode step (default: on the CPU). ``decode_slots``: sessions in a fixed pool of
    caches whose decode steps replay CUDA graphs (default: where graphs are on). The worker thread runs while
    the app does (its lifespan). ``prefill_budget``: prompt tokens evaluated together (default 4 chunks; without
    batch invariance).
    """
    if ctx <= 0 or ctx > engine.cfg.max_position_embeddings:
        raise ValueError(f"ctx must be in [1, {engine.cfg.max_position_embeddings}], got {ctx}")
    budget = default_kv_budget(engine.model.device) if kv_budget is None else kv_budget
    scheduler = Scheduler(engine, ctx, cache, prefill_chunk=prefill_chunk, max_batch=max_batch, max_queue=max_queue,
                          kv_budget=budget, rowwise=batch_invariant, prefix_cache=prefix_cache,
                          slots=decode_slots, prefill_budget=prefill_budget)
    server = Server(engine, model_name, ctx, cache, scheduler)
    info = {**server_info(engine, cache), "scheduling": scheduler.settings()}  # once: it runs git and nvidia-smi
    card = {"id": model_name, "object": "model", "created": server.created, "owned_by": "ds4x", "max_model_len": ctx,
            "ds4x": info}
    # OpenAI's system_fingerprint names the backend configuration: here the build, machine, model and scheduling
    fingerprint = "fp_" + hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:12]

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="ds4x", description="OpenAI-compatible DeepSeek-V4 server", lifespan=lifespan)
    app.state.server = server

    def count(endpoint: str, status: int) -> None:
        server.metrics.requests[(endpoint, status)] += 1

    def error(exc: APIError, endpoint: str, headers: dict[str, str] | None = None) -> JSONResponse:
        count(endpoint, exc.status)
        if exc.status in (429, 503):
            headers = {**(headers or {}), "Retry-After": "1"}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # the exception's headers too: a 405 names the methods the route takes (Allow), as HTTP requires
        return error(APIError(exc.status_code, str(exc.detail), type_), _endpoint(request), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _param_of(exc)
        return error(APIError(400, msg, param=param), _endpoint(request))

    async def read_body(request: Request) -> bytes:
        too_long = f"the request body is longer than the {MAX_REQUEST_BYTES:,} bytes this server accepts"
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
            raise APIError(413, too_long)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_REQUEST_BYTES:
                    raise APIError(413, too_long)
                chunks.append(chunk)
        except ClientDisconnect:  # gone before the whole body came: a bad request, not an application error
            raise APIError(400, "the client disconnected before sending the whole request body") from None
        return b"".join(chunks)

    async def parse(request: Request, model: type[_Base]) -> Any:
        # a web page may POST text/plain, form or multipart bodies to any origin without asking first (no CORS
        # preflight), so a page the user visits could make this server generate: such a body from a page (browsers
        # send Origin) is refused unread. Without Origin any type is read as JSON (curl -d sends a form type)
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if "origin" in request.headers and kind in ("", "text/plain", "application/x-www-form-urlencoded",
                                                    "multipart/form-data"):
            raise APIError(415, "a request from a web page (with an Origin header) must send its JSON body as "
                                "Content-Type: application/json")
        raw = await read_body(request)
        try:
            data = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
            raise APIError(400, f"We could not parse the JSON body of your request: {exc}") from None
        except RecursionError:
            raise APIError(400, "We could not parse the JSON body of your request: it is nested too deeply") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            msg, param = _param_of(exc)
            raise APIError(400, msg, param=param) from None

    async def tokenizer_call(request: Request, endpoint: str, model: type[TokenizeRequest | DetokenizeRequest],
                             answer: Callable[[Any], dict[str, Any]]) -> Response:
        try:
            req = await parse(request, model)
            server._check_model(req)
            body = await asyncio.to_thread(answer, req)  # off the event loop, as a completion's prompt
        except APIError as exc:
            return error(exc, endpoint)
        count(endpoint, 200)
        return JSONResponse(body)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        def answer(req: TokenizeRequest) -> dict[str, Any]:
            ids = server.tokenize(req)
            return {"count": len(ids), "max_model_len": ctx, "tokens": ids, "token_strs": None}

        return await tokenizer_call(request, "/tokenize", TokenizeRequest, answer)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await tokenizer_call(request, "/detokenize", DetokenizeRequest,
                                    lambda req: {"prompt": server.detokenize(req)})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        try:
            info = server.tokenizer_info()
        except APIError as exc:
            return error(exc, "/tokenizer_info")
        count("/tokenizer_info", 200)
        return JSONResponse(info)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and uptime checkers' probe
    async def health() -> dict[str, str]:
        count("/health", 200)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        count("/metrics", 200)
        return PlainTextResponse(server.metrics.render(scheduler), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        count("/v1/models", 200)
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")  # OpenAI's retrieve (client.models.retrieve); ids may hold slashes
    async def model(model_id: str) -> Response:
        if model_id != model_name:
            return error(APIError(404, f"The model '{model_id}' does not exist; this server serves '{model_name}'",
                                  param="model", code="model_not_found"), "/v1/models")
        count("/v1/models", 200)
        return JSONResponse(card)

    async def serve(request: Request, endpoint: str, chat: bool) -> Response:
        submitted: list[tuple[Generation | None, asyncio.Queue]] = []
        try:
            req = await parse(request, ChatRequest if chat else CompletionRequest)
            server._check_model(req)
            if chat:
                req.check_supported(server.templated)
                logprobs = req.alternatives()
                sent: list[str | list[int]] = []
                # tokenized off the event loop: a long prompt (seconds for megabytes of text) would stall every
                # other request's stream meanwhile
                prompts = [(await asyncio.to_thread(server.chat_prompt, req), True)]
                max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            else:
                logprobs = req.logprobs
                sent = server.completion_prompts(req)
                prompts = await asyncio.to_thread(lambda: [server.completion_ids(p) for p in sent])
                max_tokens = 16 if req.max_tokens is None else req.max_tokens
            # choice i * n + k: the k-th of prompt i (OpenAI's order)
            jobs = [server.make_job(req, prompt, text, max_tokens, logprobs, k) for prompt, text in prompts
                    for k in range(req.n)]
            sent = [p for p in sent for _ in range(req.n)]
            for job in jobs:
                submitted.append(server.submit(job))
        except APIError as exc:
            for handle, _ in submitted:  # a batch refused part way: none of it runs
                server.cancel(handle)
            return error(exc, endpoint)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        head = {"id": rid, "object": obj + (".chunk" if chat and req.stream else ""), "created": created,
                "model": model_name, "system_fingerprint": fingerprint}

        # a chat reply's parts: in thinking mode the text before </think> is reasoning_content (DeepSeek's API field),
        # with tools offered a closing DSML tool-call block becomes tool_calls
        replies = [ReplyParts(server.templated and req.thinking_mode(), bool(req.offered_tools())) for _ in jobs] \
            if chat else None

        # a completion's echo: the prompt before the first piece's text (and its tokens' logprobs before the
        # generated ones'); the later pieces' text offsets count it
        echoes = [server.echo(p, job) for p, job in zip(sent, jobs, strict=True)] if not chat and req.echo else None
        batch = len(sent) > req.n  # several prompts: each choice names its prompt's ids (one: the response does)

        def choice(i: int, piece: Piece, first: bool = False) -> dict[str, Any]:
            job, echo = jobs[i], echoes[i] if echoes is not None else None
            logprobs = None
            if job.logprobs is not None:
                if chat:
                    logprobs = server.chat_logprobs(job, piece.logprobs)
                else:
                    logprobs = server.completion_logprobs(job, piece.logprobs, echo, with_prompt=first)
            if replies is not None:
                reply, key = replies[i], "delta" if req.stream else "message"
                thought, answer, calls = reply.feed(piece.text, piece.finish is not None)
                msg: dict[str, Any] = {"content": answer}
                if reply.reasoning is not None:
                    msg["reasoning_content"] = thought
                finish = piece.finish
                if calls:
                    msg["tool_calls"] = [{**({"index": j} if req.stream else {}), "id": "call_" + uuid.uuid4().hex[:24],
                                          "type": "function", "function": call} for j, call in enumerate(calls)]
                    if not req.stream and not answer:
                        msg["content"] = None  # as OpenAI answers a reply that is only tool calls
                    finish = "tool_calls" if finish == "stop" else finish
                if first or not req.stream:
                    msg = {"role": "assistant", **msg}
                c: dict[str, Any] = {"index": i, key: msg, "logprobs": logprobs, "finish_reason": finish}
            else:
                text = echo.text + piece.text if echo is not None and first else piece.text
                c = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": piece.finish}
            if req.return_token_ids:
                c["token_ids"] = piece.ids
                if batch and first:
                    c["prompt_token_ids"] = job.prompt
            return c

        streams = [server.pieces(request, handle, queue) for handle, queue in submitted]

        def cancel_all() -> None:
            for handle, _ in submitted:
                server.cancel(handle)

        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage

            async def events() -> AsyncIterator[str]:
                first = [True] * len(jobs)
                try:
                    async for i, piece in _merged(streams):
                        chunk = {**head, "choices": [choice(i, piece, first[i])]}
                        if all(first) and req.return_token_ids and not batch:  # the stream's first chunk
                            chunk["prompt_token_ids"] = jobs[i].prompt
                        if include_usage:
                            chunk["usage"] = None
                        first[i] = False
                        yield _sse(chunk)
                except Exception as exc:  # the stream has started: report in band
                    err = exc if isinstance(exc, APIError) else APIError(500, str(exc), "server_error")
                    yield _sse(err.body())
                    return
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": server.usage(jobs, req.n)})
                yield "data: [DONE]\n\n"

            count(endpoint, 200)
            # the background task runs however the response ends, even if the stream never started
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(cancel_all))

        parts: list[list[Piece]] = [[] for _ in jobs]
        try:
            async for i, piece in _merged(streams):
                parts[i].append(piece)
        except APIError as exc:
            return error(exc, endpoint)
        except Exception as exc:
            return error(APIError(500, str(exc), "server_error"), endpoint)
        finally:
            cancel_all()  # a no-op for finished jobs
        choices = []
        for i, got in enumerate(parts):
            whole = Piece("".join(p.text for p in got), [t for p in got for t in p.ids],
                          got[-1].finish if got else None, [lp for p in got for lp in p.logprobs])
            choices.append(choice(i, whole, first=True))
        body = {**head, "choices": choices, "usage": server.usage(jobs, req.n)}
        if req.return_token_ids and not batch:
            body["prompt_token_ids"] = jobs[0].prompt
        count(endpoint, 200)
        return JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "/v1/chat/completions", chat=True)

    return app
