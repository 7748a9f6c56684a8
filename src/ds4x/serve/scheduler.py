"""Continuous batching: one engine worker thread serving many requests, each in its own session.

Each loop of the worker (between two loops requests join and leave):

1. drop cancelled requests (a client that went away frees its session here, before the next step) and admit
   waiting ones while the batch has room (``max_batch``) and the KV budget covers their planned cache bytes;
2. run the next prefill chunk of the oldest request still reading its prompt (alone under ``rowwise``: the
   chunk's shapes are its own, so the prompt is evaluated exactly as ``Session.prefill`` with the same chunk
   does; otherwise together with the next chunks of the following ones, up to ``prefill_budget`` tokens in one
   model call, since a call's fixed cost dominates short prompts);
3. run one batched decode step for every request that is generating (``ds4x.runtime.batch.step_sessions``;
   on CUDA the sessions hold caches of a ``DecodeSlots`` pool and the step replays a CUDA graph), and read the
   drawn tokens back and deliver them. With decode slots a step takes each request's last drawn token on the
   device and the host reads the tokens only after queueing the step (and the sampling behind it), so the
   host's reading and delivering run while the GPU computes the next step instead of between two steps; a
   request that the token read then ends (EOS, a stop string) gives back the row the step wrote for it.

So a long prompt costs the running streams one chunk per step, never a stall. With ``rowwise`` (the default on
the CPU) the decode step's products are batch-invariant, and a request's tokens are exactly those of
``Session.generate`` with the same prefill chunk, whatever else shares the batch; without it (the GPU default:
row-by-row products would give up the batching) a request's logits may differ in the last bits between
batch compositions.

Admission: every session has the same context, so each admitted request reserves that plan's bytes
(``cache.plan``) against ``kv_budget``. When the batch or the budget is full, requests wait in a FIFO queue of at
most ``max_queue``; past it :class:`Rejected` (429); after ``stop``, 503.

Prefix reuse (optional ``PrefixCache``): a new request starts from the longest stored prefix of its prompt, cut
back to a multiple of the prefill chunk so that the rest is evaluated in the very chunks a fresh session
would use (the reused state is the same too: it was computed in those chunks), hence the same logits; each
finished request's session is stored.

Logit bias and penalties (a job's ``params``, `ds4x.runtime.sampling.adjust`): a request that has any keeps a
``TokenHistory`` of its prompt and generated tokens on the logits' device, updated with each drawn token before
the batch's single read; the others skip the adjustment. A step's rows are drawn together
(`ds4x.runtime.sampling.draw_rows`: on CUDA a fixed number of launches whatever the batch size, each row's draw
the one it would make alone).

Logprobs (a job's ``logprobs``): the log_softmax of the model's raw logits, before the logit bias, the
penalties, temperature and the top-k / top-p / min-p filters (as vLLM reports them by default), for the drawn
token and the most likely alternatives, computed on the device and read back with the tokens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ds4x.kernels.jit_watch import KernelCompile, watch
from ds4x.memory import free_memory
from ds4x.model.cache import ModelCache, plan_cache
from ds4x.runtime.batch import DecodeSlots, step_sessions
from ds4x.runtime.decode_graph import graphs_enabled
from ds4x.runtime.engine import Engine, Session
from ds4x.runtime.sampling import SamplingParams, TokenHistory, draw, draw_rows
from ds4x.runtime.tokenizer import TextStream

if TYPE_CHECKING:
    from ds4x.runtime.prefix_cache import PrefixCache

log = logging.getLogger(__name__)


def default_kv_budget(device: torch.device) -> int:
    """Cache bytes to admit when not told: 80% of the GPU's free memory (after the weights are loaded); on the
    host a quarter of the available memory, at most 8 GiB (the host also holds the weights and everything else)."""
    free = free_memory(device)
    return int(0.8 * free) if device.type == "cuda" else min(free // 4, 8 * 2**30)


class Rejected(Exception):
    """A request the scheduler does not take: ``status`` 429 (queue full) or 503 (shutting down)."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class Job:
    """One request's generation: prompt ids, budget, sampling, stop strings."""

    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    stops: list[str]
    ignore_eos: bool
    text: bool  # detokenize (False: a model without a tokenizer; ids only)
    ids_every_token: bool = False  # a piece per token even while its text is held back (streamed token ids)
    logprobs: int | None = None  # report each token's logprob and this many alternatives (None: no logprobs)
    # the same for the prompt's tokens (None: not asked), into prompt_scores before the first piece is sent: one
    # entry per prompt token, None for the first (nothing predicts it); such a prompt is evaluated whole (no
    # stored prefix), alone in its prefill calls, and with max_tokens 0 nothing is generated
    prompt_logprobs: int | None = None
    prompt_scores: list[Scores | None] = field(default_factory=list)
    prompt_tokens: int = 0  # evaluated so far (reused prefix tokens are not evaluated)
    reused_tokens: int = 0
    generated: int = 0
    stop_reason: str = ""


# a drawn token's logprob and the most likely (id, logprob) pairs, most likely first
Scores = tuple[float, list[tuple[int, float]]]

# the logprob of a token the model rules out (-inf) is floored as vLLM does: JSON has no -inf
_LOGPROB_FLOOR = -9999.0


@dataclass
class TokenLogprob:
    """A generated token's logprob, its most likely alternatives, and where in the output it comes."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (id, logprob), most likely first
    # characters of the output's text completed before this token (its text starts there unless the token
    # before left a character unfinished)
    offset: int


@dataclass
class Piece:
    text: str
    ids: list[int]
    finish: str | None = None  # "stop" or "length" on the last piece
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per id when the job asked for them


def _logprobs(logits: torch.Tensor, token: torch.Tensor, k: int) -> torch.Tensor:
    """The logprob of ``token`` [..., 1] under raw ``logits`` [..., V], then the ``k`` highest logprobs and their
    ids, as float64 [..., 1 + 2k] on the logits' device (not read back; `_scores` reads one row)."""
    lp = logits.float().log_softmax(-1).clamp_min(_LOGPROB_FLOOR)
    top = lp.topk(k, dim=-1)
    return torch.cat([lp.gather(-1, token).double(), top.values.double(), top.indices.double()], dim=-1)


def _scores(row: list[float], k: int) -> Scores:
    """A token's Scores from its row of `_logprobs`, read back."""
    return row[0], [(int(i), lp) for lp, i in zip(row[1 : 1 + k], row[1 + k : 1 + 2 * k], strict=True)]


def _holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _first_stop(text: str, stops: list[str]) -> int:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


class Output:
    """Token ids -> pieces of text: incomplete UTF-8 characters and possible stop-string prefixes are held back
    (with ``ids_every_token`` the token's piece then carries its id and no text); a stop string ends the output
    before it. A piece carries the logprobs of its ids, except entries a stop string may still move: those come
    with a later piece."""

    def __init__(self, engine: Engine, job: Job):
        self.job = job
        self.eos = set(engine.cfg.eos_token_ids)
        tok = engine.tokenizer
        self.stream = TextStream(tok) if job.text and tok is not None else None
        self.pending, self.ids = "", []
        self.logprobs: list[TokenLogprob] = []
        self.sent = 0  # characters sent in earlier pieces

    def push(self, token: int, scores: Scores | None = None) -> Piece | None:
        """The piece to send after ``token`` (None: nothing to show yet); a piece with ``finish`` ends it.
        ``scores``: the token's logprobs, when the job asked for them."""
        job = self.job
        self.ids.append(token)
        if scores is not None:
            self.logprobs.append(TokenLogprob(token, *scores, offset=self.sent + len(self.pending)))
        if self.stream is not None and (job.ignore_eos or token not in self.eos):
            self.pending += self.stream.push(token)
        if job.stops:
            hit = _first_stop(self.pending, job.stops)
            if hit >= 0:
                job.stop_reason = "stop"
                return self._last(hit, "stop")
            cut = len(self.pending) - _holdback(self.pending, job.stops)
        else:
            cut = len(self.pending)
        if not cut and job.text and not job.ids_every_token:
            return None
        # a token whose text starts past the cut may yet be cut off by a stop string, which moves its offset back
        # (`_last`): its entry waits for the piece that settles it, so a streamed offset is the non-streamed one
        # (with ``ids_every_token`` its id goes now, its entry later)
        settled = sum(lp.offset <= self.sent + cut for lp in self.logprobs)  # offsets only grow: a prefix
        piece = Piece(self.pending[:cut], self.ids, logprobs=self.logprobs[:settled])
        self.pending, self.ids, self.logprobs = self.pending[cut:], [], self.logprobs[settled:]
        self.sent += cut
        return piece

    def finish(self) -> Piece:
        """The last piece once generation ended by EOS, budget or context."""
        if self.stream is not None:
            self.pending += self.stream.flush()
        finish = "length" if self.job.stop_reason in ("length", "context") else "stop"
        hit = _first_stop(self.pending, self.job.stops) if self.job.stops else -1
        if hit >= 0:
            return self._last(hit, "stop")
        return self._last(len(self.pending), finish)

    def _last(self, end: int, finish: str) -> Piece:
        """The last piece: the pending text up to ``end``. The tokens after a stop string keep their logprobs
        (OpenAI's too) with their offsets at the end of the text, which they do not reach."""
        for lp in self.logprobs:
            lp.offset = min(lp.offset, self.sent + end)
        return Piece(self.pending[:end], self.ids, finish, self.logprobs)


class Generation:
    """A job inside the scheduler: its session and sampling state; pieces (or an exception) go to ``deliver``."""

    def __init__(self, job: Job, deliver: Callable[[Piece | Exception], None]):
        self.job, self._deliver = job, deliver
        self.cancelled = False  # set by the server when the client went away
        self.done = False  # set by the worker after the last piece
        self.session: Session | None = None
        self.fed = 0  # prompt tokens the session holds
        self.drawn = 0  # tokens drawn so far (on the device; the host may not have read the last ones yet)
        self.next_token: int | None = None  # read on the host, to be evaluated by the next decode step
        # decode slots: the last drawn token, on the device, for the next step to take before the host reads it
        self.feed: torch.Tensor | None = None
        self.fed_unread = False  # a step took the token the host reads next (its row is given back if it ends)
        self.generator: torch.Generator | None = None
        self.history: TokenHistory | None = None  # for a logit bias or penalties
        self.output: Output | None = None
        self.submitted = time.perf_counter()
        self.last_token_at: float | None = None

    def send(self, item: Piece | Exception) -> None:
        self._deliver(item)


def queue_delivery(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Queue, Callable[[Any], None]]:
    """An asyncio queue of ``loop`` and a thread-safe function that puts into it."""
    q: asyncio.Queue = asyncio.Queue()

    def put(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    return q, put


@dataclass
class Histogram:
    """A Prometheus histogram: cumulative buckets with upper bounds ``bounds``, plus sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        i = next((k for k, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, help_: str) -> list[str]:
        lines, acc = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"], 0
        for b, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += c
            le = "+Inf" if b == float("inf") else f"{b:g}"
            lines.append(f'{name}_bucket{{le="{le}"}} {acc}')
        return [*lines, f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]


@dataclass
class EngineStats:
    """What the worker counts (written by the worker thread only)."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefix_hits: int = 0  # requests that started from a stored prefix
    prefix_misses: int = 0
    generation_tokens: int = 0
    cancelled: int = 0
    failed: int = 0
    steps: int = 0
    prefill_steps: int = 0  # model calls evaluating prompt chunks
    batch_size: Histogram = field(default_factory=lambda: Histogram((1, 2, 4, 8, 16, 32, 64, 128, 256)))
    ttft: Histogram = field(default_factory=lambda: Histogram(
        (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)))
    itl: Histogram = field(default_factory=lambda: Histogram(
        (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)))
    # where a decode step's time goes: the model (on CUDA the step's device time, else launch to logits ready), then
    # the rest until the batch's tokens are sampled, read and delivered; with the ITL the rest is the worker loop and
    # the HTTP side
    step_model: Histogram = field(default_factory=lambda: Histogram(
        (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1)))
    step_sample: Histogram = field(default_factory=lambda: Histogram(
        (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)))


def _to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying ``values`` to the host: (the host tensor, an event recorded after the copy). On the CPU the
    values themselves, and no event."""
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(values.device))
    return host, ready


@dataclass
class _StepTimes:
    """A decode step's figures, taken when its tokens are read."""

    events: list[torch.cuda.Event] | None  # around the step on CUDA: its device time
    launch_s: float  # the host's time in the call (on the CPU the step itself)
    host_s: float = 0.0  # the host's own time drawing (then reading and delivering) its tokens


@dataclass
class _Drawn:
    """Tokens drawn on the device, on their way to the host (`Scheduler._read`)."""

    rows: list[tuple[Generation, int | None]]  # each request and its logprobs count (None: no logprobs)
    values: torch.Tensor | None  # the tokens, then each scored row's logprobs; on the host once ``ready``
    ready: torch.cuda.Event | None
    step: _StepTimes | None  # the decode step they come from (None: a prompt call)


class Scheduler:
    def __init__(self, engine: Engine, ctx: int, cache: str, *, prefill_chunk: int = 256, max_batch: int = 32,
                 max_queue: int = 128, kv_budget: int, rowwise: bool | None = None,
                 prefix_cache: PrefixCache | None = None, slots: bool | None = None,
                 prefill_budget: int | None = None):
        if prefill_chunk <= 0 or max_batch <= 0 or max_queue < 0:
            raise ValueError(f"prefill chunk and max batch must be positive and max queue >= 0, got "
                             f"{prefill_chunk}, {max_batch}, {max_queue}")
        self.engine, self.ctx, self.cache, self.chunk = engine, ctx, cache, prefill_chunk
        self.prefill_budget = 4 * prefill_chunk if prefill_budget is None else prefill_budget
        if self.prefill_budget < prefill_chunk:
            raise ValueError(f"the prefill budget ({self.prefill_budget} tokens) must hold a prefill chunk "
                             f"({prefill_chunk})")
        self.max_batch, self.max_queue, self.kv_budget = max_batch, max_queue, kv_budget
        self.rowwise = engine.model.device.type == "cpu" if rowwise is None else rowwise
        self.prefix_cache = prefix_cache
        self.session_bytes = plan_cache(engine.cfg, ctx, prefill_chunk, cache)["total"]
        if kv_budget < self.session_bytes:
            raise ValueError(f"the KV budget ({kv_budget / 2**20:.1f} MiB) is smaller than one session's cache "
                             f"({self.session_bytes / 2**20:.1f} MiB: ctx {ctx}, {cache} cache)")
        # a fixed pool of caches decoded from CUDA graphs (``slots`` None: where graphs are on)
        if slots is None:
            slots = graphs_enabled(engine.model.device, cache)
        self.slots = (DecodeSlots(engine, ctx, cache, prefill_chunk, min(max_batch, kv_budget // self.session_bytes),
                                  self.rowwise) if slots else None)
        # with decode slots a step's tokens are read after the next step is queued (`_decode`);
        # DS4X_SERVE_OVERLAP=0 reads them before it, as the eager step must (for A/B runs)
        self.overlap = self.slots is not None and os.environ.get("DS4X_SERVE_OVERLAP", "1") != "0"
        self.stats = EngineStats()
        self._pending: deque[_Drawn] = deque()  # drawn tokens the host has not read, oldest first
        self._cond = threading.Condition()
        self._waiting: deque[Generation] = deque()
        self._running: list[Generation] = []
        self._kv_in_use = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    def settings(self) -> dict[str, Any]:
        """How this scheduler batches, for the server's description of itself (a load harness's ledger rows)."""
        return {"ctx": self.ctx, "prefill_chunk": self.chunk, "prefill_budget": self.prefill_budget,
                "max_batch": self.max_batch, "max_queue": self.max_queue, "kv_budget_bytes": self.kv_budget,
                "batch_invariant": self.rowwise, "decode_slots": self.slots.capacity if self.slots else 0,
                "cuda_graphs": graphs_enabled(self.engine.model.device, self.cache), "overlapped_reads": self.overlap,
                "prefix_cache": self.prefix_cache is not None}

    # ---- called from the server (any thread) ---------------------------------------------------------------

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """Before `start`, where decode runs from CUDA graphs: evaluate the prompt calls of `warm_prompt_calls` and
        make the decode step of every batch size (`DecodeSlots.warm_up`), so that no request waits while kernels
        compile and graphs are captured. ``progress`` gets a line per piece. A no-op for the eager decode (nothing
        is captured)."""
        if self._thread is not None:
            raise RuntimeError("warm up before the scheduler starts")
        if self.slots is None:
            return
        vocab = self.engine.cfg.vocab_size
        for lengths in self.warm_prompt_calls():
            self.slots.evaluate_prompts([[(7 * i + 1) % vocab for i in range(n)] for n in lengths])
            if progress:
                n = sum(lengths)
                progress(f"a prompt call of {n} token{'s' * (n > 1)} in {len(lengths)} "
                         f"session{'s' * (len(lengths) > 1)}")
        self.slots.warm_up(lambda b: progress and progress(f"the decode step of {b} session{'s' * (b > 1)}"))

    def warm_prompt_calls(self) -> list[list[int]]:
        """The prompt calls the warm-up evaluates, each a list of per-session token counts: a call of every power of
        two tokens up to the ``prefill_budget`` (and the budget and one chunk themselves), each also one token
        short, split into prefill chunks over as many sessions as it takes. The kernels a call runs depend on its
        size (the routed experts' products pick a kernel and its tiles by pairs per expert, and a short context's
        attention and cache writes take other shapes), and Triton compiles a kernel again for an integer argument
        that is not a multiple of 16 or is 1, so a ladder of sizes and their odd neighbours meets what requests of
        any length will."""
        assert self.slots is not None
        n = min(self.chunk, self.ctx - 1)  # leaves a row for the decode steps' token
        top = min(self.prefill_budget, n * self.slots.capacity)
        sizes = sorted({1 << k for k in range(top.bit_length()) if 1 << k < top} | {min(n, top), top})
        calls: list[list[int]] = []
        for size in sizes:
            for total in (size, size - 1):
                lengths = [n] * (total // n) + ([total % n] if total % n else [])
                if lengths and lengths not in calls:
                    calls.append(lengths)
        return calls

    def start(self) -> None:
        """Start the engine thread. From here on (after the warm-up) a kernel compile is one the warm-up did not
        foresee, which requests wait for: logged as a warning, counted in /metrics."""
        watch().listeners.append(self._kernel_compiled)
        self._thread = threading.Thread(target=self._loop, name="ds4x-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, end the queued and running ones with an error, and join the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._kernel_compiled in watch().listeners:
            watch().listeners.remove(self._kernel_compiled)

    def _kernel_compiled(self, event: KernelCompile) -> None:
        log.warning("kernel %s compiled while serving (%.2f s; requests waited): %s", event.kernel, event.seconds,
                    event.constants)

    def submit(self, job: Job, deliver: Callable[[Piece | Exception], None]) -> Generation:
        """Take ``job``, or raise :class:`Rejected`."""
        req = Generation(job, deliver)
        with self._cond:
            if self._stopping:
                raise Rejected(503, "the server is shutting down", "shutting_down")
            if self._waiting or not self._has_room():
                if len(self._waiting) >= self.max_queue:
                    raise Rejected(429, f"the server is busy: {len(self._running)} requests running and "
                                        f"{len(self._waiting)} waiting (the queue holds {self.max_queue}); "
                                        f"retry later", "queue_full")
                self._waiting.append(req)
            else:
                self._admit(req)
            self._cond.notify_all()
        return req

    def cancel(self, req: Generation) -> None:
        """The client went away (or its batch was refused part way): a waiting request leaves the queue at once, so
        it holds no place another request is refused for; a running one's session is freed by the worker before
        its next step."""
        with self._cond:
            if req.done:
                return
            if req in self._waiting:
                self._release(req)
                self.stats.cancelled += 1
            else:
                req.cancelled = True
            self._cond.notify_all()

    def gauges(self) -> dict[str, int]:
        with self._cond:
            return {"waiting": len(self._waiting), "running": len(self._running), "kv_bytes_in_use": self._kv_in_use,
                    "kv_budget_bytes": self.kv_budget}

    # ---- the worker ------------------------------------------------------------------------------------------

    def _has_room(self) -> bool:
        return len(self._running) < self.max_batch and self._kv_in_use + self.session_bytes <= self.kv_budget

    def _admit(self, req: Generation) -> None:
        self._running.append(req)
        self._kv_in_use += self.session_bytes

    def _release(self, req: Generation) -> None:
        """Under the lock: forget a request (its session goes with it) and give back its reservation."""
        if req in self._running:
            self._running.remove(req)
            self._kv_in_use -= self.session_bytes
            if self.slots is not None and req.session is not None:
                self.slots.release(req.session.cache)
        elif req in self._waiting:
            self._waiting.remove(req)
        req.session = None
        req.done = True

    def _loop(self) -> None:
        while True:
            with self._cond:
                for req in [r for r in (*self._running, *self._waiting) if r.cancelled]:
                    self._release(req)
                    self.stats.cancelled += 1
                while self._waiting and self._has_room():
                    self._admit(self._waiting.popleft())
                if self._stopping:
                    for req in [*self._running, *self._waiting]:
                        self._release(req)
                        req.send(Rejected(503, "the server is shutting down", "shutting_down"))
                    return
                if not self._running and not self._pending:  # drawn tokens left: their step's figures
                    self._cond.wait()
                    continue
                running = list(self._running)
            finished: list[Generation] = []
            try:
                self._prefill(running, finished)
                self._decode(running, finished)
            except Exception as exc:  # a bug of ours: fail what was running, keep serving
                self._fail([r for r in running if r not in finished], exc, finished)

    def _fail(self, reqs: list[Generation], exc: Exception, finished: list[Generation]) -> None:
        log.error("generation failed for %d request(s)", len(reqs), exc_info=exc)
        for req in reqs:
            self.stats.failed += 1
            self._retire(req, finished)
            req.send(RuntimeError(f"generation failed: {exc}"))

    def _start(self, req: Generation) -> None:
        """Give an admitted request its session: a stored prefix if one is usable, else a fresh one."""
        job, params = req.job, req.job.params
        slot = self.slots.acquire() if self.slots is not None else None
        session, n = self._reuse(job.prompt, slot) if job.prompt_logprobs is None else (None, 0)
        if session is None and slot is not None:
            slot.reset()  # a lookup may have loaded a prefix it then could not use
            session, n = Session(self.engine, slot, self.chunk), 0
        elif session is None:
            session, n = self.engine.new_session(ctx=self.ctx, cache=self.cache, prefill_chunk=self.chunk,
                                                 announce=False), 0
        req.session, req.fed = session, n
        job.reused_tokens = n
        self.stats.reused_tokens += n
        if self.prefix_cache is not None:
            if n:
                self.stats.prefix_hits += 1
            else:
                self.stats.prefix_misses += 1
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        elif not params.greedy:
            req.generator = torch.Generator().manual_seed(torch.seed())
        if params.adjusts:
            req.history = TokenHistory(params, job.prompt, self.engine.cfg.vocab_size, self.engine.model.device)
        req.output = Output(self.engine, job)

    def _reuse(self, prompt: list[int], into: ModelCache | None) -> tuple[Session | None, int]:
        if self.prefix_cache is None or len(prompt) <= self.chunk:  # a usable prefix is a whole chunk or more
            return None, 0
        try:
            # continue at a chunk boundary: the rest is evaluated as a fresh session would. The lookup picks and
            # rewinds to that boundary itself, checked against the entry's rewind floor (a second rewind here
            # could need ring rows the stored session's later tokens overwrote, and be refused)
            session, n = self.prefix_cache.lookup(prompt, into=into, align=self.chunk,
                                                  layout=(self.ctx, self.cache, self.chunk))
        except Exception:  # a broken store costs the reuse, not the request
            log.exception("prefix cache: lookup failed")
            return None, 0
        if session is None:  # (entries a server with other settings stored in a shared directory are skipped)
            return None, 0
        return session, n

    def _prefill(self, running: list[Generation], finished: list[Generation]) -> None:
        """The next chunk of the requests reading their prompts, oldest first: one request under ``rowwise``,
        else as many as ``prefill_budget`` tokens hold (the first always)."""
        batch: list[tuple[Generation, list[int]]] = []
        total = 0
        for req in running:
            if req.drawn or req.cancelled:  # generating already
                continue
            try:
                if req.session is None:
                    self._start(req)
            except Exception as exc:  # the server survives a failed request
                self._fail([req], exc, finished)
                continue
            part = req.job.prompt[req.fed : req.fed + self.chunk]
            scored = req.job.prompt_logprobs is not None  # alone: its call keeps every position's logits
            if batch and (self.rowwise or scored or total + len(part) > self.prefill_budget):
                break
            batch.append((req, part))
            total += len(part)
            if scored:
                break
        if not batch:
            return
        scored = batch[0][0].job.prompt_logprobs is not None
        try:
            logits = step_sessions([(req.session, part) for req, part in batch], all_logits=scored)
            if scored:
                self._score_prompt(batch[0][0], logits[0])
                logits = [logits[0][-1]]
        except Exception as exc:
            self._fail([req for req, _ in batch], exc, finished)
            return
        self.stats.prefill_steps += 1
        ready = []
        for (req, part), row in zip(batch, logits, strict=True):
            req.fed += len(part)
            req.job.prompt_tokens += len(part)
            self.stats.prompt_tokens += len(part)
            if req.fed < len(req.job.prompt):
                continue
            if req.job.max_tokens == 0:  # the prompt's logprobs only
                req.job.stop_reason = "length"
                self._finish(req, Piece("", [], "length"), finished)
            else:
                ready.append((req, row))
        self._sample(ready, finished)

    def _score_prompt(self, req: Generation, rows: torch.Tensor) -> None:
        """The prompt logprobs (`Job.prompt_logprobs`) of the tokens that ``rows``, the logits after each of this
        chunk's tokens, predict: from the second token of the chunk to the first of the next (one device read)."""
        job, k = req.job, req.job.prompt_logprobs
        assert k is not None
        if req.fed == 0:
            job.prompt_scores.append(None)
        targets = job.prompt[req.fed + 1 : req.fed + rows.shape[0] + 1]
        if not targets:
            return
        tokens = torch.tensor(targets, device=rows.device)[:, None]
        job.prompt_scores += [_scores(row, k) for row in _logprobs(rows[: len(targets)], tokens, k).tolist()]

    def _decode(self, running: list[Generation], finished: list[Generation]) -> None:
        """One batched decode step of the generating requests, then the host reads drawn tokens (`_read`).

        With decode slots each request's step takes its last drawn token on the device (``feed``), and the host
        reads the tokens drawn before this step only after queueing it and the sampling behind it: the host's
        reading and delivering overlap the step instead of leaving the GPU idle between steps. A request whose
        token turns out to end it (EOS, a stop string) has then had one step too many: its row is given back
        (`_retire`). A token that ends it by budget or context is known before it is drawn (`_feedable`) and never
        evaluated. The eager step takes host ids: the host reads the tokens first (so does ``overlap`` off)."""
        if not self.overlap:
            self._read(finished)
        batch = [r for r in running if r not in finished and not r.cancelled and not r.done
                 and (r.next_token is not None or (r.feed is not None and self._feedable(r)))]
        if not batch:
            self._read(finished)
            return
        # on CUDA the host queues the sampling behind the step instead of waiting for the step first; the step's
        # device time comes from two events, read with its tokens
        dev = self.engine.model.device
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if dev.type == "cuda" else None
        t0 = time.perf_counter()
        try:
            if events:  # the model's device's stream (not the thread's current device's: cuda:N)
                events[0].record(torch.cuda.current_stream(dev))
            if self.slots is not None:
                logits = self.slots.decode([(r.session, r.next_token if r.feed is None else r.feed) for r in batch])
            else:
                logits = step_sessions([(r.session, [r.next_token]) for r in batch], rowwise=self.rowwise)
            if events:
                events[1].record(torch.cuda.current_stream(dev))
        except Exception as exc:
            self._fail(batch, exc, finished)
            self._read(finished)
            return
        step = _StepTimes(events, time.perf_counter() - t0)
        for r in batch:
            r.fed_unread = r.feed is not None
            r.feed = r.next_token = None
        self.stats.steps += 1
        self.stats.batch_size.observe(len(batch))
        self._sample(list(zip(batch, logits, strict=True)), finished, step)
        self._read(finished, keep=1 if self.overlap else 0)

    def _feedable(self, req: Generation) -> bool:
        """Whether the request's last drawn token, not read yet, may be evaluated before it is: it is not the last
        of its budget and the context has room for it (else the request ends there whatever the token is)."""
        assert req.session is not None
        return req.drawn < req.job.max_tokens and req.session.cache.length < self.ctx

    def _sample(self, rows: list[tuple[Generation, torch.Tensor]], finished: list[Generation],
                step: _StepTimes | None = None) -> None:
        """Draw each request's next token from its logits, with its logprobs where the job asks (`_logprobs`), on
        the device, and start copying them to the host for `_read` (one copy for all: the tokens and the
        logprobs together in one float64 tensor, exact for token ids). With ``overlap`` each token is also the
        request's ``feed``. ``step``: the decode step the logits come from (its figures are taken at the read)."""
        t0 = time.perf_counter()
        drawn: list[tuple[Generation, torch.Tensor]] = []
        scored: list[torch.Tensor] = []
        for (req, row), token in self._draw(rows, finished):
            try:
                if req.job.logprobs is not None:
                    scored.append(_logprobs(row, token, req.job.logprobs))
                drawn.append((req, token))
            except Exception as exc:
                self._fail([req], exc, finished)
        values = ready = None
        if drawn:
            tokens = torch.cat([t for _, t in drawn])
            values, ready = _to_host(torch.cat([tokens.double(), *scored]) if scored else tokens)
            for i, (req, _) in enumerate(drawn):
                req.drawn += 1
                if self.overlap:
                    req.feed = tokens[i : i + 1]
        if step is not None:
            step.host_s += time.perf_counter() - t0
        if drawn or step is not None:
            self._pending.append(_Drawn([(req, req.job.logprobs) for req, _ in drawn], values, ready, step))

    def _read(self, finished: list[Generation], keep: int = 0) -> None:
        """Read the drawn tokens back, oldest first, all but the last ``keep`` batches, and `_take` each (a request
        that ended meanwhile is skipped). A decode step's figures are taken here: its device time (events) and the
        host's own time drawing, reading and delivering its tokens (not counting waits for the device)."""
        while len(self._pending) > keep:
            drawn = self._pending.popleft()
            t0 = time.perf_counter()
            if drawn.ready is not None:
                drawn.ready.synchronize()
            elif drawn.step is not None and drawn.step.events:  # nothing drawn: the step's end itself
                drawn.step.events[1].synchronize()
            waited = time.perf_counter() - t0
            values = drawn.values.tolist() if drawn.values is not None else []
            at = len(drawn.rows)  # the logprobs follow the tokens, row after row
            for (req, k), token in zip(drawn.rows, values[: len(drawn.rows)], strict=True):
                scores: Scores | None = None
                if k is not None:
                    scores = _scores(values[at : at + 1 + 2 * k], k)
                    at += 1 + 2 * k
                if req.done:
                    continue
                try:
                    self._take(req, int(token), scores, finished)
                except Exception as exc:
                    self._fail([req], exc, finished)
            step = drawn.step
            if step is not None:
                if step.events:
                    model = step.events[0].elapsed_time(step.events[1]) / 1000  # done: the sampling came after
                else:
                    model = step.launch_s  # the eager step computes as it is called
                self.stats.step_model.observe(model)
                self.stats.step_sample.observe(step.host_s + time.perf_counter() - t0 - waited)

    def _draw(self, rows: list[tuple[Generation, torch.Tensor]],
              finished: list[Generation]) -> list[tuple[tuple[Generation, torch.Tensor], torch.Tensor]]:
        """Each row's next token (a tensor [1] on the device), all rows drawn together (`draw_rows`: a fixed number
        of launches for the batch); should that fail, row by row, so that one bad row fails only its request."""
        try:
            tokens = draw_rows([row for _, row in rows], [req.job.params for req, _ in rows],
                               [req.generator for req, _ in rows], [req.history for req, _ in rows])
            return [(item, tokens[i : i + 1]) for i, item in enumerate(rows)]
        except Exception:
            out = []
            for req, row in rows:
                try:
                    out.append(((req, row), draw(row, req.job.params, req.generator, req.history)))
                except Exception as exc:
                    self._fail([req], exc, finished)
            return out

    def _take(self, req: Generation, token: int, scores: Scores | None, finished: list[Generation]) -> None:
        """Send what ``token`` shows and decide whether the request goes on (the same order of checks as
        ``Session.generate``)."""
        job, session, out = req.job, req.session, req.output
        assert session is not None and out is not None
        now = time.perf_counter()
        if req.last_token_at is None:
            self.stats.ttft.observe(now - req.submitted)
        else:
            self.stats.itl.observe(now - req.last_token_at)
        req.last_token_at = now
        job.generated += 1
        self.stats.generation_tokens += 1
        piece = out.push(token, scores)
        if piece is not None and piece.finish is not None:  # a stop string
            self._finish(req, piece, finished)
            return
        if piece is not None:
            req.send(piece)
        stop_ids = () if job.ignore_eos else self.engine.cfg.eos_token_ids
        if token in stop_ids:
            job.stop_reason = "eos"
        elif len(session.tokens) >= self.ctx:
            job.stop_reason = "context"
        elif job.generated >= job.max_tokens:
            job.stop_reason = "length"
        else:
            if req.fed_unread:  # a decode step took it already
                session.tokens.append(token)
                req.fed_unread = False
            else:
                req.next_token, req.feed = token, None
            return
        self._finish(req, out.finish(), finished)

    def _retire(self, req: Generation, finished: list[Generation]) -> None:
        """Free a request's place before its last message goes out, so a client that has its answer sees the
        server's gauges without it. A row a decode step wrote for a token the session does not keep is given back
        (the session ends before that token; a stored prefix must not hold it)."""
        if req.fed_unread and req.session is not None:
            req.session.cache.length -= 1
        req.fed_unread = False
        req.next_token = req.feed = None
        finished.append(req)
        with self._cond:
            self._release(req)

    def _finish(self, req: Generation, last: Piece, finished: list[Generation]) -> None:
        session = req.session
        self._retire(req, finished)
        req.send(last)
        if self.prefix_cache is not None and session is not None:
            try:
                self.prefix_cache.store(session)
            except Exception:  # a full disk or the like must not fail the request that already finished
                log.exception("prefix cache: could not store a finished session")
