"""``ds4x bench serve``: load an OpenAI-compatible server and measure it the DESIGN §7 way.

Closed loop (default): at each concurrency level C, C streams each send a streaming ``/v1/completions``
request, and the next one as soon as the previous finishes, for ``--seconds``; requests in flight at the
deadline run to the end (the drain counts in the wall time). Open loop (``--rate``): requests arrive as a
Poisson process at R requests/s for ``--seconds``, whatever the server's state, and goodput counts the
requests that met both the TTFT and the TPOT limits.

Every request has a prompt of its own (a unique tag at its start, so no prefix cache can serve it, unless
``--shared-prefix`` moves the tag to the end) and asks for ``return_token_ids``: output is counted in
returned token ids, not in chunks or characters. Per level:

- aggregate tok/s: output tokens of the successful requests / wall time including the drain;
- per-stream decode tok/s: a request's tokens after its first chunk / time from its first chunk to its last
  (median and 10th percentile over requests);
- TTFT: from sending the request to the first chunk that carries a token (p50, max);
- burst-normalized ITL: a chunk carrying n tokens after a gap g counts g/n for each of its tokens (p99);
- errors by kind (HTTP status, transport failure, an error event in the stream, a missing ``[DONE]``,
  token ids missing or disagreeing with ``usage``, an ``--ignore-eos`` request that did not return exactly
  ``--gen-tokens`` tokens).

One JSON row per level is appended to the ledger, with the client's commit, date and environment, the server's
own description (``server_model``: its ``/v1/models`` entry; ``server_meta``: the ``ds4x`` object a ds4x server
puts in that entry, with its commit, GPU, driver, torch and triton versions, dtype, cache and model fingerprint,
or ``"unavailable"`` when the server reports none or ``/v1/models`` cannot be read), the flags, warm-up, prompt
and output lengths, errors, and for a ds4x server what its ``/metrics`` counters say of the level
(``server_counters``: decode steps and their mean batch, mean device and host time per step, prompt calls, kernels
compiled after the server's warm-up and their seconds; None for another server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_SERVE_LEDGER = Path("benchmarks/serve_ledger.jsonl")
# the DESIGN §7 fixture line: prompts are this text repeated, so every run sends the same kind of tokens
_FILLER = ("DS4X reproducible prefill benchmark. The quick brown fox jumps over the lazy dog. Compressed sparse "
           "attention and mixture of experts are measured on NVIDIA GB10.\n")
# the key of a /v1/models entry under which a ds4x server describes itself (ds4x.serve.info)
_SERVER_META_KEY = "ds4x"


@dataclass
class LoadConfig:
    url: str
    model: str | None = None  # None: the server's first model
    gen_tokens: int = 384
    prompt_tokens: int = 128
    temperature: float = 0.2
    ignore_eos: bool = False
    shared_prefix: bool = False
    seconds: float = 60.0
    warmup: float = 0.0
    timeout: float = 600.0
    ttft_limit: float = 2.0
    tpot_limit: float = 0.2
    seed: int = 0


@dataclass
class Sample:
    """One request as the client saw it (times from ``time.perf_counter``)."""

    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, token ids) of chunks with tokens
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.sent if self.chunks else None

    @property
    def decode_rate(self) -> float | None:
        """Tokens after the first chunk per second after it (None with fewer than two chunks)."""
        if len(self.chunks) < 2:
            return None
        dt = self.chunks[-1][0] - self.chunks[0][0]
        return (self.tokens - self.chunks[0][1]) / dt if dt > 0 else None

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for a single token)."""
        if self.tokens < 2:
            return 0.0
        return (self.chunks[-1][0] - self.chunks[0][0]) / (self.tokens - 1)

    def itl(self) -> list[float]:
        """Burst-normalized inter-token latencies: a chunk of n tokens after a gap g gives n values g/n."""
        out: list[float] = []
        for (t0, _), (t1, n) in zip(self.chunks, self.chunks[1:], strict=False):
            out += [(t1 - t0) / n] * n
        return out


class Prompts:
    """Unique prompts: a tag nobody else sends (this run's id and a counter) plus ``filler_chars`` characters of
    the fixture text."""

    def __init__(self, filler_chars: int, shared_prefix: bool):
        self.run = uuid.uuid4().hex[:8]  # differs between runs too, so an on-disk prefix cache cannot hit
        self.shared_prefix = shared_prefix
        self.count = 0
        self.resize(filler_chars)

    def resize(self, filler_chars: int) -> None:
        filler_chars = max(filler_chars, 0)
        self.filler = (_FILLER * (filler_chars // len(_FILLER) + 1))[:filler_chars]

    def next(self) -> str:
        self.count += 1
        tag = f"[{self.run}-{self.count}]"
        return f"{self.filler}{tag}" if self.shared_prefix else f"{tag} {self.filler}"


def wait_until_healthy(url: str, proc: Any, timeout: float, exited: Any = None) -> None:
    """Poll ``url``/health until it answers 200 (a server process ``proc`` just started). Raises RuntimeError
    if the process exits first (with ``exited()``'s text, e.g. its log) or after ``timeout`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited (code {proc.returncode}) {exited() if exited else ''}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")
        time.sleep(0.2)


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _error_kind(exc: Exception) -> str:
    import httpx

    for cls, kind in ((httpx.TimeoutException, "timeout"), (httpx.ConnectError, "connect"),
                      (httpx.RemoteProtocolError, "disconnect"), (httpx.ReadError, "disconnect"),
                      (json.JSONDecodeError, "bad_json")):
        if isinstance(exc, cls):
            return kind
    return type(exc).__name__


async def one_request(client: Any, cfg: LoadConfig, prompt: str) -> Sample:
    """Send one streaming completion and time every chunk that carries token ids."""
    body = {"model": cfg.model, "prompt": prompt, "max_tokens": cfg.gen_tokens, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
            "ignore_eos": cfg.ignore_eos}
    s = Sample(sent=time.perf_counter())
    usage: dict[str, Any] | None = None
    done = missing_ids = False
    try:
        async with client.stream("POST", f"{cfg.url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                s.error = f"http_{r.status_code}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.perf_counter()
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    s.error = "stream_error"
                    return s
                usage = obj.get("usage") or usage
                for choice in obj.get("choices") or []:
                    ids = choice.get("token_ids")
                    if ids:
                        s.chunks.append((now, len(ids)))
                    elif ids is None and choice.get("text"):
                        missing_ids = True
                if s.prompt_tokens is None and obj.get("prompt_token_ids") is not None:
                    s.prompt_tokens = len(obj["prompt_token_ids"])
    except Exception as exc:  # any failure of one request is a counted error, never the end of the run
        s.error = _error_kind(exc)
        return s
    if usage is not None and s.prompt_tokens is None:
        s.prompt_tokens = usage.get("prompt_tokens")
    if not done:
        s.error = "incomplete"
    elif missing_ids:
        s.error = "no_token_ids"
    elif usage is not None and usage.get("completion_tokens") != s.tokens:
        s.error = "usage_mismatch"
    elif cfg.ignore_eos and s.tokens != cfg.gen_tokens:
        s.error = "wrong_length"
    return s


async def closed_loop(client: Any, cfg: LoadConfig, prompts: Prompts, concurrency: int,
                      seconds: float) -> tuple[list[Sample], float]:
    """``concurrency`` streams, each sending its next request when the previous one ends, until ``seconds``
    have passed; returns the samples and the wall time including the drain."""
    start = time.perf_counter()
    deadline = start + seconds

    async def stream() -> list[Sample]:
        out = []
        while time.perf_counter() < deadline:
            out.append(await one_request(client, cfg, prompts.next()))
        return out

    per_stream = await asyncio.gather(*(stream() for _ in range(concurrency)))
    return [s for ss in per_stream for s in ss], time.perf_counter() - start


async def open_loop(client: Any, cfg: LoadConfig, prompts: Prompts, rate: float, seconds: float,
                    rng: random.Random) -> tuple[list[Sample], float]:
    """Poisson arrivals at ``rate`` requests/s for ``seconds``; returns the samples and the wall time including
    the drain."""
    start = time.perf_counter()
    tasks = []
    t = start
    while True:
        t += rng.expovariate(rate)
        if t >= start + seconds:
            break
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
        tasks.append(asyncio.create_task(one_request(client, cfg, prompts.next())))
    samples = list(await asyncio.gather(*tasks))
    return samples, time.perf_counter() - start


async def _load(client: Any, cfg: LoadConfig, prompts: Prompts, concurrency: int | None, rate: float | None,
                seconds: float, rng: random.Random) -> tuple[list[Sample], float]:
    if rate is not None:
        return await open_loop(client, cfg, prompts, rate, seconds, rng)
    assert concurrency is not None
    return await closed_loop(client, cfg, prompts, concurrency, seconds)


def summarize(samples: list[Sample], wall: float, cfg: LoadConfig, open_loop: bool) -> dict[str, Any]:
    """The DESIGN §7 numbers of one level."""
    ok = [s for s in samples if s.error is None]
    rates = [r for r in (s.decode_rate for s in ok) if r is not None]
    ttfts = [t for t in (s.ttft for s in ok) if t is not None]
    itl = [g for s in ok for g in s.itl()]
    prompt_lens = [s.prompt_tokens for s in ok if s.prompt_tokens is not None]
    tokens = sum(s.tokens for s in ok)
    row: dict[str, Any] = {
        "requests": len(samples),
        "requests_ok": len(ok),
        "errors": dict(Counter(s.error for s in samples if s.error is not None)),
        "output_tokens": tokens,
        "wall_s": wall,
        "aggregate_tok_s": tokens / wall if wall > 0 else 0.0,
        "per_stream_tok_s_median": _percentile(rates, 50),
        "per_stream_tok_s_p10": _percentile(rates, 10),
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_max_s": max(ttfts) if ttfts else None,
        "itl_p99_ms": None if not itl else 1000 * _percentile(itl, 99),
        "prompt_tokens_mean": float(np.mean(prompt_lens)) if prompt_lens else None,
        "output_tokens_mean": tokens / len(ok) if ok else None,
    }
    if open_loop:
        good = [s for s in ok if s.ttft is not None and s.ttft <= cfg.ttft_limit and s.tpot <= cfg.tpot_limit]
        row |= {"goodput_rps": len(good) / wall if wall > 0 else 0.0, "goodput_requests": len(good),
                "ttft_limit_s": cfg.ttft_limit, "tpot_limit_s": cfg.tpot_limit}
    row["status"] = "ok" if not row["errors"] else "errors"
    return row


def server_description(models: dict[str, Any] | None, name: str | None) -> tuple[str, dict[str, Any] | None]:
    """The served model's id and its ``/v1/models`` entry (``name`` picks one; default: the first). ``models``
    is None when the list could not be read: then ``name`` is needed."""
    data = (models or {}).get("data") or []
    entry = next((m for m in data if m.get("id") == name), None) if name else (data[0] if data else None)
    if name is None and entry is None:
        raise RuntimeError("the server lists no model in /v1/models; pass --model")
    return (name or entry["id"]), entry


def server_meta(entry: dict[str, Any] | None) -> dict[str, Any] | str:
    """The server's description of itself (its entry's ``ds4x`` object), or ``"unavailable"``."""
    meta = (entry or {}).get(_SERVER_META_KEY)
    return meta if isinstance(meta, dict) and meta else "unavailable"


async def _prompt_tokens(client: Any, cfg: LoadConfig, text: str) -> int:
    r = await client.post(f"{cfg.url}/v1/completions", json={"model": cfg.model, "prompt": text, "max_tokens": 1,
                                                             "temperature": 0})
    if r.status_code != 200:
        raise RuntimeError(f"calibration request failed: HTTP {r.status_code}: {r.text[:300]}")
    return int(r.json()["usage"]["prompt_tokens"])


async def make_prompts(client: Any, cfg: LoadConfig) -> Prompts:
    """Prompts of about ``cfg.prompt_tokens`` tokens on this server's tokenizer: the fixture's characters per
    token, then one correction for the tag (two non-streamed requests)."""
    text = _FILLER * 2  # short: a server with a small context must accept it
    chars_per_token = len(text) / max(await _prompt_tokens(client, cfg, text), 1)
    chars = int(cfg.prompt_tokens * chars_per_token)
    prompts = Prompts(chars, cfg.shared_prefix)
    short = cfg.prompt_tokens - await _prompt_tokens(client, cfg, prompts.next())
    prompts.resize(chars + int(short * chars_per_token))
    return prompts


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of the level rows."""
    open_ = rows and rows[0]["mode"] == "open"
    head = ["rate/s" if open_ else "conc", "reqs", "errors", "tok/s", "stream med", "stream p10", "TTFT p50",
            "TTFT max", "ITL p99 ms", *(["goodput/s"] if open_ else [])]
    lines = [head]
    for r in rows:
        errs = ",".join(f"{k}:{v}" for k, v in sorted(r["errors"].items())) or "0"
        lines.append([_fmt(r["rate"], "g") if open_ else str(r["concurrency"]), str(r["requests"]), errs,
                      _fmt(r["aggregate_tok_s"], ".1f"), _fmt(r["per_stream_tok_s_median"], ".1f"),
                      _fmt(r["per_stream_tok_s_p10"], ".1f"), _fmt(r["ttft_p50_s"], ".3f"),
                      _fmt(r["ttft_max_s"], ".3f"), _fmt(r["itl_p99_ms"], ".1f"),
                      *([_fmt(r["goodput_rps"], ".2f")] if open_ else [])])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines)


# a ds4x server's /metrics counters whose change over a level a row records (``server_counters``)
_COUNTERS = {"ds4x_decode_steps_total": "decode_steps", "ds4x_batch_size_sum": "decode_rows",
             "ds4x_prefill_steps_total": "prefill_calls", "ds4x_prompt_tokens_total": "prompt_tokens",
             "ds4x_generation_tokens_total": "generation_tokens",
             "ds4x_decode_step_model_seconds_sum": "step_model_s", "ds4x_decode_step_sample_seconds_sum": "step_host_s"}


# labelled per kernel, and absent until a first compile: summed over the kernels, 0 where a ds4x server has none
_COMPILES = {"ds4x_kernel_compiles_total": "kernel_compiles", "ds4x_kernel_compile_seconds_total": "kernel_compile_s"}


def parse_counters(text: str) -> dict[str, float]:
    """The counters of ``_COUNTERS`` in a Prometheus text (those present), and for a ds4x server's text the kernels
    it compiled after its warm-up (``_COMPILES``, summed over its kernels)."""
    out: dict[str, float] = {}
    compiles = dict.fromkeys(_COMPILES.values(), 0.0)
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        series = name.partition("{")[0]
        if name in _COUNTERS:
            out[_COUNTERS[name]] = float(value)
        elif series in _COMPILES:
            compiles[_COMPILES[series]] += float(value)
    return {**out, **compiles} if out else out


def counters_over(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """What a ds4x server's counters say of a level: their change, the mean decode batch, and the mean device and
    host time per decode step (ms). None unless both snapshots hold all of them (another server)."""
    keys = set(_COUNTERS.values()) | set(_COMPILES.values())
    if not before or not after or set(before) != keys or set(after) != keys:
        return None
    d = {k: after[k] - before[k] for k in before}
    steps = d["decode_steps"]
    return {**d, "mean_batch": d["decode_rows"] / steps if steps else None,
            "step_model_ms": 1e3 * d["step_model_s"] / steps if steps else None,
            "step_host_ms": 1e3 * d["step_host_s"] / steps if steps else None}


async def _counters(client: Any, url: str) -> dict[str, float] | None:
    import httpx

    try:
        r = await client.get(f"{url}/metrics")
        return parse_counters(r.text) if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def run_levels(cfg: LoadConfig, concurrency: list[int], rates: list[float],
                     log: Any = print) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Measure every level; returns the level rows and the run's metadata."""
    import httpx

    timeout = httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 30.0))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max([*concurrency, 64]))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        try:
            r = await client.get(f"{cfg.url}/v1/models")
            r.raise_for_status()
            models = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            if not cfg.model:
                raise RuntimeError(f"cannot read {cfg.url}/v1/models (pass --model to measure without it): "
                                   f"{exc}") from None
            # a server without a usable model list can still be measured; its rows say server_meta: unavailable
            log(f"[bench serve] {cfg.url}/v1/models unavailable ({exc}); the server's description is not recorded")
            models = None
        cfg.model, entry = server_description(models, cfg.model or None)
        prompts = await make_prompts(client, cfg)
        rng = random.Random(cfg.seed)
        levels: list[tuple[int | None, float | None]] = [(None, r) for r in rates] if rates else \
            [(c, None) for c in concurrency]
        rows = []
        for conc, rate in levels:
            level = f"rate {rate:g}/s" if rate is not None else f"concurrency {conc}"
            warm: list[Sample] = []
            if cfg.warmup > 0:
                log(f"[bench serve] {level}: warm-up {cfg.warmup:g} s")
                warm, _ = await _load(client, cfg, prompts, conc, rate, cfg.warmup, rng)
            log(f"[bench serve] {level}: {cfg.seconds:g} s")
            before = await _counters(client, cfg.url)
            samples, wall = await _load(client, cfg, prompts, conc, rate, cfg.seconds, rng)
            server = counters_over(before, await _counters(client, cfg.url))
            if server is not None and server["decode_steps"]:
                log(f"[bench serve] {level}: the server's {server['decode_steps']:.0f} decode steps (mean batch "
                    f"{server['mean_batch']:.1f}): {server['step_model_ms']:.2f} ms of device and "
                    f"{server['step_host_ms']:.2f} ms of host time each; {server['prefill_calls']:.0f} prompt calls"
                    + (f"; {server['kernel_compiles']:.0f} kernels compiled after the server's warm-up "
                       f"({server['kernel_compile_s']:.1f} s, requests waiting)" if server["kernel_compiles"] else ""))
            rows.append({"mode": "open" if rate is not None else "closed", "concurrency": conc, "rate": rate,
                         **summarize(samples, wall, cfg, rate is not None),
                         "warmup_requests": len(warm), "warmup_errors": sum(s.error is not None for s in warm),
                         "server_counters": server})
    # the ds4x object goes to server_meta only, not twice into each row
    described = None if entry is None else {k: v for k, v in entry.items() if k != _SERVER_META_KEY}
    meta = {"model": cfg.model, "server_model": described, "server_meta": server_meta(entry), "url": cfg.url}
    return rows, meta


def add_parser(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = kinds.add_parser("serve", help="closed- or open-loop load on an OpenAI-compatible server (DESIGN §7)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default http://127.0.0.1:8000)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated closed-loop stream counts")
    p.add_argument("--rate", default=None,
                   help="open loop instead: comma-separated Poisson arrival rates (requests/s)")
    p.add_argument("--seconds", type=float, default=60.0, help="measured seconds per level (default 60)")
    p.add_argument("--warmup", type=float, default=0.0,
                   help="seconds of the same load before each level, not measured (default 0)")
    p.add_argument("--gen-tokens", type=int, default=384, help="max_tokens of every request (default 384)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="approximate prompt length (default 128)")
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --gen-tokens tokens per request")
    p.add_argument("--shared-prefix", action="store_true",
                   help="prompts share everything but their end (prefix-cache hits allowed)")
    p.add_argument("--model", default=None, help="model id to request (default: the server's first)")
    p.add_argument("--ttft-limit", type=float, default=2.0, help="open-loop goodput TTFT limit, s (default 2)")
    p.add_argument("--tpot-limit", type=float, default=0.2,
                   help="open-loop goodput limit on time per output token after the first, s (default 0.2)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s (default 600)")
    p.add_argument("--seed", type=int, default=0, help="seed of the open-loop arrival times")
    p.add_argument("--ledger", default=str(DEFAULT_SERVE_LEDGER), help="JSONL ledger to append to")
    return p


def _positive_list(text: str, option: str, kind: type) -> list[Any]:
    try:
        values = [kind(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"{option} must be a comma-separated list of numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{option} must list positive numbers, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    """``ds4x bench serve``: measure, print the table, append the rows to the ledger."""
    from ds4x.bench import ledger  # imports torch: only when measuring, not to build the CLI

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request
    rates = _positive_list(args.rate, "--rate", float) if args.rate else []
    concurrency = [] if rates else _positive_list(args.concurrency, "--concurrency", int)
    if args.seconds <= 0 or args.gen_tokens <= 0 or args.prompt_tokens <= 0 or args.warmup < 0:
        raise ValueError("--seconds, --gen-tokens and --prompt-tokens must be positive, --warmup >= 0")
    cfg = LoadConfig(url=args.url.rstrip("/"), model=args.model, gen_tokens=args.gen_tokens,
                     prompt_tokens=args.prompt_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos,
                     shared_prefix=args.shared_prefix, seconds=args.seconds, warmup=args.warmup, timeout=args.timeout,
                     ttft_limit=args.ttft_limit, tpot_limit=args.tpot_limit, seed=args.seed)
    rows, meta = asyncio.run(run_levels(cfg, concurrency, rates, log=lambda m: print(m, flush=True)))
    env = ledger.environment()
    client = {k: v for k, v in env.items() if k not in ("commit", "date")}
    flags = {"endpoint": "/v1/completions", "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos,
             "shared_prefix": cfg.shared_prefix, "seconds": cfg.seconds, "timeout_s": cfg.timeout}
    run_id = uuid.uuid4().hex[:12]
    common = {"bench": "serve", "run_id": run_id, "commit": env["commit"], "date": env["date"], **meta,
              "client": client, "flags": flags, "warmup_s": cfg.warmup, "prompt_tokens_target": cfg.prompt_tokens,
              "gen_tokens": cfg.gen_tokens}
    ledger.append([{**common, **r} for r in rows], Path(args.ledger))
    print(table(rows))
    sm = meta["server_meta"]
    server = sm if isinstance(sm, str) else f"ds4x {sm.get('version')} {sm.get('commit')} on {sm.get('gpu')}"
    print(f"model {meta['model']} at {cfg.url}; server: {server}; appended {len(rows)} rows to {args.ledger} "
          f"(run {run_id})")
    failed = [r for r in rows if r["requests_ok"] == 0]
    for r in failed:  # the rows stay in the ledger (status "errors"); the exit status says they measured nothing
        level = f"rate {r['rate']}/s" if r.get("rate") else f"concurrency {r['concurrency']}"
        print(f"ds4x bench serve: every request at {level} failed: {r['errors']}", file=sys.stderr)
    return 1 if failed else 0
