#!/usr/bin/env python3
"""Soak an OpenAI-compatible ``ds4x serve``: a timed mix of valid and hostile requests, checked.

Workers send, for ``--seconds``:

- valid requests (completions with a text or token-id prompt or a list of prompts, chat; greedy, or sampled with
  a fixed seed; sometimes n choices, a stop string, penalties and logit biases, logprobs): each is sent streamed and
  non-streamed (in random order), and both answers must agree, choice by choice (text, token ids, finish reason,
  usage, logprobs). Half the prompts come from a small pool, so the same request recurs across the run and must
  give the same answer each time; the others are unique. A token of another stream leaking into a response shows
  up as a disagreement.
- invalid requests (malformed JSON, non-objects, wrong types, unknown model, prompts over the context,
  absurd parameters, non-UTF-8 bytes, streamed invalid requests): each must be answered 4xx with an OpenAI
  error body ``{"error": {"message": ..., "type": ...}}``.
- mid-stream disconnects: a long streamed generation dropped after its first chunk.

Checks: no 5xx and no transport failure anywhere, the agreements above, and afterwards the server idle
(``ds4x_requests_running`` and ``ds4x_requests_waiting`` back to 0, no 5xx in ``ds4x_requests_total``,
``/health`` ok) and its resident memory not grown by more than ``--max-rss-growth-mib`` between the second
quarter of the run and the last (RSS from ``process_resident_memory_bytes`` in ``/metrics`` if the server
exports it, else from ``/proc`` or psutil for ``--pid``, or the server ``--spawn`` started). Prints a summary;
exit status 1 on any failure.

    python scripts/soak_serve.py --spawn --seconds 60                          # starts `ds4x serve` itself
    python scripts/soak_serve.py --url http://127.0.0.1:8000 --pid 1234 --seconds 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from ds4x.bench.serve_load import wait_until_healthy


@dataclass
class Soak:
    url: str
    model: str
    ctx: int
    gen_tokens: int
    pid: int | None
    counts: Counter[str] = field(default_factory=Counter)
    failures: list[tuple[str, str]] = field(default_factory=list)
    references: dict[str, tuple[str, list[int], str | None]] = field(default_factory=dict)
    rss: list[tuple[float, int]] = field(default_factory=list)

    def fail(self, case: str, message: str) -> None:
        self.counts[case + ":FAIL"] += 1
        self.failures.append((case, message))


# ---- valid requests -----------------------------------------------------------------------------

_WORDS = ("def", "return", "import", "class", "for", "while", "lambda", "value", "key", "self", "print", "list",
          "dict", "yield", "async", "await", "with", "open", "path", "json")
POOL = [" ".join(random.Random(i).choices(_WORDS, k=3 + i % 7)) for i in range(12)]


def valid_body(rng: random.Random, soak: Soak) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.4
    text = rng.choice(POOL) if rng.random() < 0.5 else f"{rng.choice(_WORDS)} {rng.getrandbits(40):x} " \
        f"{' '.join(rng.choices(_WORDS, k=rng.randint(1, 12)))}"
    body: dict[str, Any] = {"model": soak.model, "max_tokens": rng.randint(1, soak.gen_tokens),
                            "return_token_ids": True, "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body |= {"temperature": 0.8, "top_p": 0.9, "seed": rng.randint(0, 2**31)}
    if rng.random() < 0.2:
        body["stop"] = rng.choice(["\n", ["(", ":"], " "])
    if rng.random() < 0.25:  # penalties over the tokens so far, and biases on ids every vocabulary has
        body |= {"presence_penalty": round(rng.uniform(-1, 2), 2), "frequency_penalty": round(rng.uniform(-1, 2), 2)}
        if rng.random() < 0.5:
            body["repetition_penalty"] = round(rng.uniform(1, 1.5), 2)
        if rng.random() < 0.5:
            body["logit_bias"] = {str(rng.randint(3, 255)): rng.choice([-100, -5, 5, 100]) for _ in range(3)}
    logprobs = rng.random() < 0.3
    if rng.random() < 0.1:  # several choices of the prompt
        body["n"] = rng.randint(2, 3)
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        if logprobs:
            body |= {"logprobs": True, "top_logprobs": rng.randint(0, 5)}
        return "/v1/chat/completions", body
    if logprobs:
        body["logprobs"] = rng.randint(0, 5)
    # token-id prompts: ids below 256 exist in any vocabulary worth serving
    body["prompt"] = [rng.randint(3, 255) for _ in range(rng.randint(1, 24))] if rng.random() < 0.3 else text
    if rng.random() < 0.15:  # a batch: a list of prompts, one choice each
        body["prompt"] = [text, *[f"{rng.choice(_WORDS)} {rng.getrandbits(24):x}" for _ in range(rng.randint(1, 3))]]
    return "/v1/completions", body


def _content(choice: dict[str, Any], chat: bool, key: str) -> str:
    return (choice.get(key) or {}).get("content") or "" if chat else choice.get("text") or ""


def _logprob_entries(choice: dict[str, Any], chat: bool) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """A choice's logprobs as (token, logprob, alternatives) per token, whichever endpoint's format."""
    lp = choice.get("logprobs")
    if lp is None:
        return []
    if chat:
        return [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
                for e in lp["content"]]
    return [(t, v, sorted(top.items())) for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                                              strict=True)]


def _same_logprobs(a: list, b: list) -> bool:
    # floats through JSON both ways: equal up to the last printed digits
    return len(a) == len(b) and all(
        ta == tb and abs(va - vb) <= 1e-5 and len(xa) == len(xb)
        and all(sa == sb and abs(ua - ub) <= 1e-5 for (sa, ua), (sb, ub) in zip(xa, xb, strict=True))
        for (ta, va, xa), (tb, vb, xb) in zip(a, b, strict=True))


def _choice(text: str = "", ids: list[int] | None = None, finish: str | None = None,
            prompt_ids: list[int] | None = None, logprobs: list | None = None) -> dict[str, Any]:
    return {"text": text, "ids": ids, "finish": finish, "prompt_ids": prompt_ids, "logprobs": logprobs or []}


async def streamed(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Send ``body`` streamed; returns the usage and each choice's assembled text, ids, finish reason, prompt ids and
    logprobs (by index), or raises AssertionError with what was wrong with the stream."""
    chat = url.endswith("chat/completions")
    req = {**body, "stream": True, "stream_options": {"include_usage": True}}
    usage, ids_in_prompt, choices = None, None, {}
    async with client.stream("POST", url, json=req) as r:
        if r.status_code != 200:
            await r.aread()
            raise AssertionError(f"HTTP {r.status_code}: {r.text[:200]}")
        events = [line[5:].strip() async for line in r.aiter_lines() if line.startswith("data:")]
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1], f"bad SSE framing: {events[-3:]}"
    rids = set()
    for e in events[:-1]:
        chunk = json.loads(e)
        assert "error" not in chunk, f"in-band error: {chunk}"
        rids.add(chunk["id"])
        if chunk.get("usage"):
            usage = chunk["usage"]
        if chunk.get("prompt_token_ids") is not None:
            ids_in_prompt = chunk["prompt_token_ids"]
        for c in chunk["choices"]:
            mine = choices.setdefault(c["index"], _choice(ids=[], prompt_ids=c.get("prompt_token_ids")))
            assert mine["finish"] is None, f"a chunk of choice {c['index']} after its finish reason"
            mine["text"] += _content(c, chat, "delta")
            mine["ids"] += c.get("token_ids") or []
            mine["logprobs"] += _logprob_entries(c, chat)
            mine["finish"] = c.get("finish_reason")
    assert len(rids) == 1, f"chunks of {len(rids)} different response ids in one stream"
    if ids_in_prompt is not None:  # one prompt: the response names its ids, once
        for c in choices.values():
            c["prompt_ids"] = c["prompt_ids"] or ids_in_prompt
    return {"usage": usage, "choices": [choices[i] for i in sorted(choices)]}


async def whole(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    chat = url.endswith("chat/completions")
    r = await client.post(url, json=body)
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:200]}"
    out = r.json()
    choices = [_choice(_content(c, chat, "message"), c.get("token_ids"), c["finish_reason"],
                       c.get("prompt_token_ids", out.get("prompt_token_ids")), _logprob_entries(c, chat))
               for c in sorted(out["choices"], key=lambda c: c["index"])]
    return {"usage": out["usage"], "choices": choices}


async def valid_case(client: httpx.AsyncClient, soak: Soak, rng: random.Random) -> None:
    url, body = valid_body(rng, soak)
    case = "valid:" + ("chat" if "messages" in body else "completion")
    first_streamed = rng.random() < 0.5
    try:
        a = await (streamed if first_streamed else whole)(client, soak.url + url, body)
        b = await (whole if first_streamed else streamed)(client, soak.url + url, body)
    except (AssertionError, KeyError, ValueError, httpx.HTTPError) as exc:
        soak.fail(case, f"{type(exc).__name__}: {exc} for {json.dumps(body)[:300]}")
        return
    sw, ww = (a, b) if first_streamed else (b, a)
    problems = []
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and isinstance(prompt[0], str | list)
    prompts = [p for p in (prompt if batch else [prompt]) for _ in range(body.get("n", 1))]  # choice i * n + k
    if len(sw["choices"]) != len(prompts) or len(ww["choices"]) != len(prompts):
        problems.append(f"{len(sw['choices'])} streamed / {len(ww['choices'])} non-streamed choices for "
                        f"{len(prompts)} (prompts x n)")
    if sw["usage"] != ww["usage"]:
        problems.append(f"usage {sw['usage']} != {ww['usage']}")
    if ww["usage"]["completion_tokens"] != sum(len(w["ids"] or []) for w in ww["choices"]):
        problems.append(f"usage says {ww['usage']['completion_tokens']} tokens, other than the ids returned")
    asked = body.get("logprobs") is not None and body["logprobs"] is not False  # completions' 0 asks too
    for s, w, sent in zip(sw["choices"], ww["choices"], prompts, strict=False):
        for key in ("text", "ids", "finish"):
            if s[key] != w[key]:
                problems.append(f"streamed {key} {s[key]!r} != non-streamed {w[key]!r}")
        if len(w["ids"] or []) > body["max_tokens"]:
            problems.append(f"{len(w['ids'])} tokens > max_tokens {body['max_tokens']}")
        if not _same_logprobs(s["logprobs"], w["logprobs"]):
            problems.append(f"streamed logprobs {s['logprobs']!r:.200} != non-streamed {w['logprobs']!r:.200}")
        if asked and len(w["logprobs"]) != len(w["ids"] or []):
            problems.append(f"{len(w['logprobs'])} logprob entries for {len(w['ids'] or [])} tokens")
        if not asked and w["logprobs"]:
            problems.append("logprobs not asked for but returned")
        sent_ids = sent if isinstance(sent, list) else None
        if s["prompt_ids"] != w["prompt_ids"] or (sent_ids is not None and w["prompt_ids"] != sent_ids):
            problems.append(f"prompt_token_ids differ: streamed {s['prompt_ids']}, non-streamed {w['prompt_ids']}")
    key = json.dumps(body, sort_keys=True)
    answer = [(w["text"], w["ids"], w["finish"]) for w in ww["choices"]]
    ref = soak.references.setdefault(key, answer)
    if ref != answer:
        problems.append(f"the same request answered differently earlier: {ref!r} now {answer!r}")
    if problems:
        soak.fail(case, "; ".join(problems) + f" for {json.dumps(body)[:300]}")
    else:
        soak.counts[case] += 1


# ---- invalid requests ---------------------------------------------------------------------------

def invalid_cases(soak: Soak, rng: random.Random) -> list[tuple[str, str, Any]]:
    """(name, path, body): a dict is sent as JSON, bytes as they are."""
    m = soak.model
    long_text = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789 ", k=soak.ctx * 8))
    cases: list[tuple[str, str, Any]] = [
        ("malformed_json", "/v1/completions", b'{"prompt": "x", "max_tokens": '),
        ("not_an_object", "/v1/completions", b"[1, 2, 3]"),
        ("empty_body", "/v1/chat/completions", b""),
        ("non_utf8", "/v1/completions", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}'),
        ("non_utf8_chat", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}'),
        ("prompt_wrong_type", "/v1/completions", {"model": m, "prompt": 5}),
        ("prompt_missing", "/v1/completions", {"model": m, "max_tokens": 3}),
        ("max_tokens_string", "/v1/completions", {"model": m, "prompt": "x", "max_tokens": "4"}),
        ("max_tokens_negative", "/v1/completions", {"model": m, "prompt": "x", "max_tokens": -5}),
        ("max_tokens_huge", "/v1/completions", {"model": m, "prompt": "x", "max_tokens": 10**12}),
        ("temperature_huge", "/v1/completions", {"model": m, "prompt": "x", "temperature": 1e9}),
        ("temperature_nan", "/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
        ("top_p_out_of_range", "/v1/completions", {"model": m, "prompt": "x", "top_p": 7}),
        ("n_absurd", "/v1/completions", {"model": m, "prompt": "x", "n": 1000}),
        ("seed_negative", "/v1/completions", {"model": m, "prompt": "x", "seed": -1}),
        ("stop_wrong_type", "/v1/completions", {"model": m, "prompt": "x", "stop": 3}),
        ("token_id_out_of_vocab", "/v1/completions", {"model": m, "prompt": [0, 2**30]}),
        ("token_id_negative", "/v1/completions", {"model": m, "prompt": [0, -7]}),
        ("logprobs_too_many", "/v1/completions", {"model": m, "prompt": "x", "logprobs": 6}),
        ("top_logprobs_too_many", "/v1/chat/completions", {"model": m, "logprobs": True, "top_logprobs": 21,
                                                           "messages": [{"role": "user", "content": "x"}]}),
        ("top_logprobs_without_logprobs", "/v1/chat/completions", {"model": m, "top_logprobs": 2,
                                                                   "messages": [{"role": "user", "content": "x"}]}),
        ("presence_penalty_out_of_range", "/v1/completions", {"model": m, "prompt": "x", "presence_penalty": 2.5}),
        ("repetition_penalty_zero", "/v1/completions", {"model": m, "prompt": "x", "repetition_penalty": 0}),
        ("logit_bias_not_an_id", "/v1/completions", {"model": m, "prompt": "x", "logit_bias": {"abc": 1}}),
        ("logit_bias_out_of_range", "/v1/chat/completions", {"model": m, "logit_bias": {"5": 101},
                                                             "messages": [{"role": "user", "content": "x"}]}),
        ("logit_bias_out_of_vocab", "/v1/completions", {"model": m, "prompt": "x", "logit_bias": {str(2**30): 1}}),
        ("unknown_model", "/v1/completions", {"model": "no-such-model", "prompt": "x"}),
        ("unknown_model_chat", "/v1/chat/completions", {"model": "no-such-model",
                                                        "messages": [{"role": "user", "content": "x"}]}),
        ("over_long_ids", "/v1/completions", {"model": m, "prompt": [3] * (soak.ctx + 1)}),
        ("over_long_text", "/v1/completions", {"model": m, "prompt": long_text}),
        ("over_long_chat", "/v1/chat/completions", {"model": m, "messages": [{"role": "user",
                                                                               "content": long_text}]}),
        ("messages_empty", "/v1/chat/completions", {"model": m, "messages": []}),
        ("role_unknown", "/v1/chat/completions", {"model": m, "messages": [{"role": "wizard", "content": "x"}]}),
        ("content_wrong_type", "/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": 7}]}),
        ("streamed_invalid", "/v1/completions", {"model": m, "prompt": 5, "stream": True}),
        ("streamed_over_long", "/v1/chat/completions", {"model": m, "stream": True, "messages": [
            {"role": "user", "content": long_text}]}),
    ]
    return cases


async def invalid_case(client: httpx.AsyncClient, soak: Soak, rng: random.Random) -> None:
    await send_invalid(client, soak, *rng.choice(invalid_cases(soak, rng)))


async def send_invalid(client: httpx.AsyncClient, soak: Soak, name: str, path: str, body: Any) -> None:
    case = "invalid:" + name
    try:
        if isinstance(body, bytes):
            r = await client.post(soak.url + path, content=body, headers={"content-type": "application/json"})
        else:
            r = await client.post(soak.url + path, json=body)
    except httpx.HTTPError as exc:
        soak.fail(case, f"{type(exc).__name__}: {exc}")
        return
    try:
        err = r.json()["error"]
        body_ok = isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    except (ValueError, KeyError, TypeError):
        body_ok = False
    if not 400 <= r.status_code < 500 or not body_ok:
        soak.fail(case, f"HTTP {r.status_code} {r.text[:200]!r} (wanted a 4xx with an OpenAI error body)")
    else:
        soak.counts[case] += 1


async def disconnect_case(client: httpx.AsyncClient, soak: Soak, rng: random.Random) -> None:
    body = {"model": soak.model, "prompt": f"{rng.getrandbits(32):x} def", "max_tokens": max(soak.ctx - 64, 1),
            "ignore_eos": True, "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", soak.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                soak.fail("disconnect", f"HTTP {r.status_code}: {r.text[:200]}")
                return
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break  # leaving the block closes the connection with the stream unfinished
    except httpx.HTTPError as exc:
        soak.fail("disconnect", f"{type(exc).__name__}: {exc}")
        return
    soak.counts["disconnect"] += 1


# ---- server state -------------------------------------------------------------------------------

def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def process_rss(pid: int) -> int | None:
    """Resident set size in bytes from /proc (Linux), else psutil if installed."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


async def server_rss(client: httpx.AsyncClient, soak: Soak) -> int | None:
    try:
        value = _metric((await client.get(soak.url + "/metrics")).text, "process_resident_memory_bytes")
    except httpx.HTTPError:
        value = None
    if value is not None:
        return int(value)
    return process_rss(soak.pid) if soak.pid is not None else None


async def sample_rss(client: httpx.AsyncClient, soak: Soak, start: float, deadline: float) -> None:
    while time.monotonic() < deadline:
        rss = await server_rss(client, soak)
        if rss is not None:
            soak.rss.append((time.monotonic() - start, rss))
        await asyncio.sleep(1.0)


def rss_growth(soak: Soak, seconds: float) -> int | None:
    """Median RSS of the last quarter minus that of the second quarter (the first is warm-up)."""
    q2 = [r for t, r in soak.rss if seconds / 4 <= t < seconds / 2]
    q4 = [r for t, r in soak.rss if t >= 3 * seconds / 4]
    if not q2 or not q4:
        return None
    return int(statistics.median(q4) - statistics.median(q2))


async def final_checks(client: httpx.AsyncClient, soak: Soak) -> None:
    deadline = time.monotonic() + 60
    while True:
        text = (await client.get(soak.url + "/metrics")).text
        busy = [(n, v) for n in ("ds4x_requests_running", "ds4x_requests_waiting")
                if (v := _metric(text, n)) is not None and v > 0]
        if not busy:
            break
        if time.monotonic() > deadline:
            soak.fail("final", f"server still busy 60 s after the load stopped: {busy}")
            break
        await asyncio.sleep(0.5)
    server_errors = [line for line in text.splitlines()
                     if line.startswith("ds4x_requests_total") and re.search(r'status="5\d\d"', line)]
    if server_errors:
        soak.fail("final", f"the server counted 5xx answers: {server_errors}")
    r = await client.get(soak.url + "/health")
    if r.status_code != 200:
        soak.fail("final", f"/health answered {r.status_code}")


# ---- driver -------------------------------------------------------------------------------------

async def soak_run(url: str, seconds: float, workers: int, gen_tokens: int, pid: int | None, seed: int,
                   timeout: float) -> Soak:
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        entry = (await client.get(url + "/v1/models")).json()["data"][0]
        soak = Soak(url, entry["id"], int(entry.get("max_model_len") or 4096), gen_tokens, pid)
        for name, path, body in invalid_cases(soak, random.Random(seed)):  # every kind at least once
            await send_invalid(client, soak, name, path, body)
        start = time.monotonic()
        deadline = start + seconds

        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                x = rng.random()
                case = valid_case if x < 0.5 else invalid_case if x < 0.92 else disconnect_case
                await case(client, soak, rng)

        await asyncio.gather(sample_rss(client, soak, start, deadline), *(worker(i) for i in range(workers)))
        await final_checks(client, soak)
        return soak


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(serve_args: str, log_path: str) -> tuple[subprocess.Popen, str]:
    """``ds4x serve`` on a free loopback port, its output to ``log_path`` (a pipe nobody reads could fill and
    stall it)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "ds4x.cli.main", "serve", "--port", str(port), "-q", *shlex.split(serve_args)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def log_tail() -> str:
        with open(log_path, errors="replace") as log:
            return log.read()[-2000:]

    try:
        wait_until_healthy(url, proc, 180, log_tail)
    except RuntimeError:
        proc.kill()
        raise
    return proc, url


def report(soak: Soak, seconds: float, limit_mib: float) -> bool:
    ok_total = sum(v for k, v in soak.counts.items() if not k.endswith(":FAIL"))
    fail_total = sum(v for k, v in soak.counts.items() if k.endswith(":FAIL"))
    print(f"soak of {soak.url} ({soak.model}, ctx {soak.ctx}) for {seconds:g} s: {ok_total} checks passed, "
          f"{fail_total} failed, {len(soak.references)} distinct valid requests")
    groups: Counter[str] = Counter()
    for k, v in soak.counts.items():
        groups[k.split(":")[0] + (" FAIL" if k.endswith(":FAIL") else "")] += v
    print("  " + ", ".join(f"{k}: {v}" for k, v in sorted(groups.items())))
    growth = rss_growth(soak, seconds)
    if soak.rss:
        rs = [r for _, r in soak.rss]
        print(f"  server RSS: first {rs[0] / 2**20:.1f} MiB, peak {max(rs) / 2**20:.1f} MiB, last "
              f"{rs[-1] / 2**20:.1f} MiB; growth (last quarter vs second quarter, medians): "
              + ("n/a" if growth is None else f"{growth / 2**20:+.1f} MiB (limit {limit_mib:g})"))
        if growth is not None and growth > limit_mib * 2**20:
            soak.fail("memory", f"RSS grew by {growth / 2**20:.1f} MiB > {limit_mib:g} MiB")
    else:
        print("  server RSS: not measured (no process_resident_memory_bytes in /metrics and no --pid)")
    for case, msg in soak.failures[:30]:
        print(f"  FAIL {case}: {msg}")
    if len(soak.failures) > 30:
        print(f"  ... and {len(soak.failures) - 30} more failures")
    passed = not soak.failures
    print("PASS" if passed else "FAIL")
    return passed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="server base URL (or --spawn)")
    p.add_argument("--spawn", action="store_true", help="start `ds4x serve` on a free loopback port, stop it after")
    p.add_argument("--serve-args", default="--device cpu", help="arguments of the spawned `ds4x serve`")
    p.add_argument("--server-log", default="/tmp/ds4x_soak_server.log", help="output of the spawned server")
    p.add_argument("--pid", type=int, default=None, help="server process id, for its RSS")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--workers", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--gen-tokens", type=int, default=8, help="largest max_tokens of a valid request (default 8)")
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, s")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if (args.url is None) == (not args.spawn):
        p.error("give exactly one of --url and --spawn")
    proc = None
    url, pid = args.url, args.pid
    if args.spawn:
        proc, url = spawn_server(args.serve_args, args.server_log)
        pid = proc.pid
        print(f"spawned `ds4x serve {args.serve_args}` (pid {pid}) at {url}, log {args.server_log}", flush=True)
    try:
        soak = asyncio.run(soak_run(url.rstrip("/"), args.seconds, args.workers, args.gen_tokens, pid, args.seed,
                                    args.timeout))
        if proc is not None and proc.poll() is not None:
            soak.fail("server", f"the server exited with {proc.returncode}")
        return 0 if report(soak, args.seconds, args.max_rss_growth_mib) else 1
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
