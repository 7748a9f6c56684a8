"""The server's scheduler under concurrency: a real uvicorn server on a loopback port (in this process, so several
configurations start quickly), driven by the ``openai`` client and raw httpx, on the synthetic ``tiny`` model."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from ds4x.runtime.engine import Engine  # noqa: E402
from ds4x.runtime.sampling import SamplingParams  # noqa: E402
from ds4x.serve import create_app  # noqa: E402
from ds4x.serve.scheduler import Job, Rejected, Scheduler  # noqa: E402

CTX, CHUNK = 512, 32
PROMPTS = ["def f(x):", "hello world", "The quick brown fox jumps", "a", "import os\nimport sys\n", "1 2 3 4 5 6",
           "class A:\n    pass\n" * 3, "zzz"]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load("tiny", device="cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live(engine: Engine, **options) -> Iterator[tuple[str, Scheduler]]:
    """A uvicorn server for ``create_app(engine, "tiny", CTX, "packed", **options)`` on a free loopback port:
    (its URL, its scheduler)."""
    app = create_app(engine, "tiny", CTX, "packed", **{"prefill_chunk": CHUNK, **options})
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}", app.state.server.scheduler
    finally:
        server.should_exit = True
        thread.join(30)


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def _wait_for(cond, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _decode_together(engine: Engine, jobs: list[Job], **options) -> dict[int, list]:
    """The pieces of each job, all submitted to one scheduler before it starts (so that steps batch them)."""
    sched = Scheduler(engine, CTX, "packed", prefill_chunk=CHUNK, kv_budget=2**30, **options)
    got: dict[int, list] = {i: [] for i in range(len(jobs))}
    for i, job in enumerate(jobs):
        sched.submit(job, got[i].append)
    sched.start()
    try:
        _wait_for(lambda: all(g and g[-1].finish for g in got.values()), "the requests")
    finally:
        sched.stop()
    assert sched.stats.batch_size.counts[0] < sched.stats.steps  # some steps decoded several requests
    return got


def _expected(engine: Engine, text: str, n: int, cache: str = "packed") -> list[int]:
    """Greedy tokens of one session alone, evaluated in the server's chunks."""
    tok = engine.tokenizer
    s = engine.new_session(ctx=CTX, cache=cache, prefill_chunk=CHUNK, announce=False)
    return [t for t, _ in s.generate([tok.bos_id, *tok.encode(text)], n, SamplingParams(), stop_ids=())]


async def _stream(client: openai.AsyncOpenAI, prompt: str, n: int) -> tuple[str, list[int], str]:
    text, ids, finish = "", [], None
    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in stream:
        (c,) = chunk.choices
        text += c.text
        ids += c.model_extra["token_ids"]
        finish = c.finish_reason or finish
    return text, ids, finish


async def _whole(client: openai.AsyncOpenAI, prompt: str, n: int) -> tuple[str, list[int], str]:
    out = await client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    (c,) = out.choices
    assert out.usage.completion_tokens == n
    return c.text, c.model_extra["token_ids"], c.finish_reason


@pytest.mark.parametrize("slots", [False, True], ids=["sessions", "decode-slots"])
def test_concurrent_streams_are_separate_and_match_their_non_streamed_rerun(engine: Engine, slots: bool) -> None:
    """Also with the sessions in a pool of decode slots (the CUDA path, here stepped eagerly on the CPU)."""
    n = 12
    with live(engine, decode_slots=slots) as (base, scheduler):
        async def main() -> tuple[list, list]:
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
            streamed = await asyncio.gather(*[_stream(client, p, n) for p in PROMPTS])
            # the reruns overlap each other differently, and with fresh streams of other prompts
            whole = await asyncio.gather(*[_whole(client, p, n) for p in PROMPTS],
                                         *[_stream(client, p[::-1] + "!", n) for p in PROMPTS[:4]])
            return streamed, whole[: len(PROMPTS)]

        streamed, whole = asyncio.run(main())
        assert _metric(base, "ds4x_requests_running") == 0 and _metric(base, "ds4x_kv_bytes_in_use") == 0
        assert _metric(base, 'ds4x_batch_size_bucket{le="4"}') < _metric(base, "ds4x_batch_size_count")  # batched
        steps = _metric(base, "ds4x_decode_steps_total")
        assert _metric(base, "ds4x_decode_step_model_seconds_count") == steps > 0
        assert _metric(base, "ds4x_decode_step_sample_seconds_count") == steps
        assert _metric(base, "ds4x_decode_step_model_seconds_sum") > 0
        assert (scheduler.slots is not None) == slots
    for prompt, s, w in zip(PROMPTS, streamed, whole, strict=True):
        assert s == w
        assert s[2] == "length" and len(s[1]) == n
        assert s[1] == _expected(engine, prompt, n)  # the same tokens as the session alone
    assert len({tuple(s[1]) for s in streamed}) > len(PROMPTS) // 2  # separate outputs, not one stream copied


def test_queue_full_gets_429_and_a_disconnect_frees_the_session(engine: Engine) -> None:
    with live(engine, max_batch=1, max_queue=1) as (base, _):
        long = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # held: dropping the iterator would close the connection
            next(line for line in lines if line.startswith("data: "))  # it is generating
            assert _metric(base, "ds4x_requests_running") == 1
            queued: dict = {}
            waiter = threading.Thread(target=lambda: queued.setdefault("r", httpx.post(
                f"{base}/v1/completions", json={"prompt": "y", "max_tokens": 3, "temperature": 0}, timeout=60)))
            waiter.start()
            _wait_for(lambda: _metric(base, "ds4x_requests_waiting") == 1, "the second request to queue")
            full = httpx.post(f"{base}/v1/completions", json={"prompt": "z", "max_tokens": 3}, timeout=30)
            assert full.status_code == 429 and full.headers["retry-after"]
            err = full.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "queue_full"
            oc = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
            with pytest.raises(openai.RateLimitError):
                oc.completions.create(model="tiny", prompt="z", max_tokens=3)
        # the stream's client went away: its session is freed and the queued request runs
        waiter.join(60)
        assert queued["r"].status_code == 200 and queued["r"].json()["usage"]["completion_tokens"] == 3
        _wait_for(lambda: _metric(base, "ds4x_requests_running") == 0, "the sessions to be freed")
        assert _metric(base, "ds4x_kv_bytes_in_use") == 0 and _metric(base, "ds4x_requests_cancelled_total") == 1
        assert _metric(base, "ds4x_generation_tokens_total") < 400 + 3
        assert _metric(base, "ds4x_kv_budget_bytes") > 0


def test_a_batch_refused_part_way_runs_none_of_it(engine: Engine) -> None:
    """A list of prompts whose later prompts find the queue full: 429, and the prompts already taken are cancelled
    (nothing keeps running or waiting); a batch that fits then runs whole."""
    with live(engine, max_batch=1, max_queue=1) as (base, _):
        many = {"prompt": ["a", "b", "c"], "max_tokens": 50, "ignore_eos": True, "temperature": 0}
        r = httpx.post(f"{base}/v1/completions", json=many, timeout=60)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        _wait_for(lambda: _metric(base, "ds4x_requests_running") == _metric(base, "ds4x_requests_waiting") == 0,
                  "the taken prompts to be cancelled")
        assert _metric(base, "ds4x_requests_cancelled_total") == 2
        ok = httpx.post(f"{base}/v1/completions", json={**many, "prompt": ["a", "b"], "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200 and [c["finish_reason"] for c in ok.json()["choices"]] == ["length", "length"]


@pytest.mark.parametrize("prompt", ["x", ["x", "y", "z"]], ids=["one", "batch"])
def test_disconnect_mid_stream_frees_the_session_at_once(engine: Engine, prompt: str | list[str]) -> None:
    """Also every session of a batch of prompts streamed together."""
    with live(engine) as (base, _):
        others = [{"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True} for p in PROMPTS[:3]]
        with httpx.Client(timeout=60) as client:
            req = {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
            with client.stream("POST", f"{base}/v1/completions", json=req) as r:
                next(line for line in r.iter_lines() if line.startswith("data: "))
            n = 1 if isinstance(prompt, str) else len(prompt)
            _wait_for(lambda: _metric(base, "ds4x_requests_cancelled_total") == n, "the cancellation", 10)
            assert _metric(base, "ds4x_requests_running") == 0 and _metric(base, "ds4x_kv_bytes_in_use") == 0
            assert _metric(base, "ds4x_generation_tokens_total") < 400 * n
            for body in others:  # and the server goes on serving
                assert client.post(f"{base}/v1/completions", json=body).json()["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("slots", [False, True], ids=["sessions", "decode-slots"])
def test_prefix_reuse_hit_gives_the_same_tokens(engine: Engine, slots: bool) -> None:
    from ds4x.runtime.prefix_cache import PrefixCache

    prompt = "Once upon a time there was a small model that read the same prompt twice."
    with live(engine, prefix_cache=PrefixCache(engine, 2**28), decode_slots=slots) as (base, _):
        oc = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)

        def ask(text: str) -> list[int]:
            out = oc.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
            return out.choices[0].model_extra["token_ids"]

        first = ask(prompt)
        assert _metric(base, "ds4x_prefix_cache_hits_total") == 0
        evaluated = _metric(base, "ds4x_prompt_tokens_total")
        assert ask(prompt) == first
        assert _metric(base, "ds4x_prefix_cache_hits_total") == 1
        n = len(prompt) + 1  # BOS + one token per byte
        reused = (n - 1) // CHUNK * CHUNK  # the longest stored prefix, cut to a chunk boundary
        assert reused > 0 and _metric(base, "ds4x_prefix_reused_tokens_total") == reused
        assert _metric(base, "ds4x_prompt_tokens_total") - evaluated == n - reused
        longer = prompt + " And then it read more."
        assert ask(longer) == _expected(engine, longer, 8)
        assert _metric(base, "ds4x_prefix_cache_hits_total") == 2
    assert first == _expected(engine, prompt, 8)


BAD = [
    b"{not json",
    b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}',  # not UTF-8
    b'{"prompt": "\\udc80", "max_tokens": 2}',  # a lone surrogate
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "top_p": Infinity}',
    b'{"prompt": "x", "max_tokens": 1e400}',
    b'{"prompt": "x", "max_tokens": 100000}',
    b'{"prompt": [1, "a"]}',
    b'{"prompt": "x", "model": "nope"}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"messages": [{"role": "user"}], "max_tokens": -5}',
    b'{"prompt": "x", "seed": -1}',
    b'{"prompt": "x", "stop": [""]}',
    b"",
]


def test_hostile_requests_under_load_get_4xx_and_streams_stay_correct(engine: Engine) -> None:
    n = 10
    with live(engine) as (base, _):
        async def main() -> tuple[list, list]:
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
            async with httpx.AsyncClient(timeout=60) as raw:
                bad = [raw.post(f"{base}/v1/{'chat/' if b'messages' in body else ''}completions", content=body,
                                headers={"content-type": "application/json"}) for body in BAD]
                results = await asyncio.gather(*[_stream(client, p, n) for p in PROMPTS[:4]], *bad)
            return results[:4], results[4:]

        streams, answers = asyncio.run(main())
        for body, r in zip(BAD, answers, strict=True):
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], body
        assert httpx.get(f"{base}/health", timeout=10).json() == {"status": "ok"}
        assert _metric(base, "ds4x_requests_failed_total") == 0
    for prompt, s in zip(PROMPTS, streams, strict=False):
        assert s[1] == _expected(engine, prompt, n)


def test_shutdown_answers_503(engine: Engine) -> None:
    with live(engine) as (base, scheduler):
        scheduler.stop()
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


def test_a_kernel_compiled_while_serving_is_logged(engine: Engine, caplog) -> None:
    """From `start` (after the warm-up) to `stop` the scheduler hears of every kernel compile (the process's
    CompileWatch, Triton's JIT hooks) and logs it as a warning: requests waited for it."""
    from types import SimpleNamespace

    from ds4x.kernels.jit_watch import watch

    sched = Scheduler(engine, CTX, "packed", prefill_chunk=CHUNK, kv_budget=2**30)
    fn = SimpleNamespace(name="_late_kernel", jit_function=SimpleNamespace(arg_names=["x", "BLOCK"]))
    info = {"constants": {(1,): 64}}
    sched.start()
    try:
        with caplog.at_level("WARNING", logger="ds4x.serve.scheduler"):
            watch().cache_missed(key="late", fn=fn, compile=info)
            watch().compiled(key="late", fn=fn, compile=info)
    finally:
        sched.stop()
    assert any("kernel _late_kernel compiled while serving" in r.message and "BLOCK=64" in r.message
               for r in caplog.records)
    assert sched._kernel_compiled not in watch().listeners


def test_scheduler_admission_by_kv_budget(engine: Engine) -> None:
    from ds4x.model.cache import plan_cache

    per = plan_cache(engine.cfg, CTX, CHUNK, "packed")["total"]
    with pytest.raises(ValueError, match="smaller than one session"):
        Scheduler(engine, CTX, "packed", prefill_chunk=CHUNK, kv_budget=per - 1)
    sched = Scheduler(engine, CTX, "packed", prefill_chunk=CHUNK, max_batch=8, max_queue=2, kv_budget=2 * per + 1)
    job = Job([0, 5, 6], 4, SamplingParams(), [], True, True)
    got: list = []
    running = [sched.submit(job, got.append) for _ in range(2)]  # the budget holds two sessions
    queued = [sched.submit(job, got.append) for _ in range(2)]
    assert sched.gauges() == {"waiting": 2, "running": 2, "kv_bytes_in_use": 2 * per, "kv_budget_bytes": 2 * per + 1}
    with pytest.raises(Rejected) as exc:
        sched.submit(job, got.append)
    assert exc.value.status == 429
    sched.cancel(running[0])
    sched.cancel(queued[1])  # a waiting request leaves the queue at once, before the worker runs
    assert sched.gauges()["waiting"] == 1 and sched.stats.cancelled == 1
    queued[1] = sched.submit(job, got.append)  # its place is free
    sched.cancel(queued[1])
    sched.start()
    deadline = time.monotonic() + 30
    while sum(p.finish is not None for p in got if not isinstance(p, Exception)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sched.stop()
    assert sched.stats.cancelled == 3 and sched.gauges()["kv_bytes_in_use"] == 0
    with pytest.raises(Rejected) as exc:
        sched.submit(job, got.append)
    assert exc.value.status == 503


def test_scheduler_warm_up_then_serves_as_a_cold_one(engine: Engine) -> None:
    """The server's warm-up before listening (decode slots: CUDA graphs, here stepped eagerly): a prompt chunk and
    every batch size's step, reported line by line; requests afterwards get a cold scheduler's tokens. Without
    slots (the eager decode) it does nothing; after `start` it is refused."""
    prompts = [[0, *range(5, 5 + n)] for n in (3, 40, 9)]

    def run(warm: bool) -> list[list[int]]:
        sched = Scheduler(engine, CTX, "packed", prefill_chunk=CHUNK, max_batch=4, kv_budget=2**30, slots=True,
                          rowwise=True)
        lines: list[str] = []
        if warm:
            sched.warm_up(lines.append)
            calls = sched.warm_prompt_calls()
            assert lines[:len(calls)] == [
                f"a prompt call of {sum(c)} token{'s' * (sum(c) > 1)} in {len(c)} session{'s' * (len(c) > 1)}"
                for c in calls]
            assert calls[-2:] == [[CHUNK] * 4, [CHUNK] * 3 + [CHUNK - 1]]
            assert lines[len(calls):] == ["the decode step of 1 session", "the decode step of 2 sessions",
                                          "the decode step of 4 sessions"]
            assert sched.stats.steps == 0 and sched.slots is not None and len(sched.slots.free) == 4
        got: dict[int, list] = {i: [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            sched.submit(Job(p, 6, SamplingParams(), [], True, True, ids_every_token=True), got[i].append)
        sched.start()
        try:
            _wait_for(lambda: all(g and g[-1].finish for g in got.values()), "the requests")
            with pytest.raises(RuntimeError, match="before the scheduler starts"):
                sched.warm_up()
        finally:
            sched.stop()
        return [[t for piece in g for t in piece.ids] for g in got.values()]

    assert run(True) == run(False)
    eager = Scheduler(engine, CTX, "packed", prefill_chunk=CHUNK, kv_budget=2**30, slots=False)
    lines: list[str] = []
    eager.warm_up(lines.append)
    assert lines == []


def test_warm_prompt_calls_climb_to_the_prefill_budget(engine: Engine) -> None:
    """The warm-up's prompt calls: every power of two tokens below the prefill budget, one chunk and the budget
    itself, each also one token short, cut into chunks over as many sessions as it takes (at most the slots); a
    context shorter than the chunk caps the lengths."""
    def calls(**kw) -> list[list[int]]:
        return Scheduler(engine, kw.pop("ctx", CTX), "packed", kv_budget=2**30, slots=True, **kw).warm_prompt_calls()

    small = [[1], [2], [4], [3], [8], [7], [16], [15], [32], [31]]
    assert calls(prefill_chunk=32, max_batch=8) == small + [[32, 32], [32, 31], [32] * 4, [32, 32, 32, 31]]
    assert calls(prefill_chunk=32, max_batch=8, prefill_budget=80) == small + [[32, 32], [32, 31], [32, 32, 16],
                                                                                [32, 32, 15]]
    assert calls(prefill_chunk=32, max_batch=2) == small + [[32, 32], [32, 31]]
    assert calls(prefill_chunk=32, max_batch=1) == small
    assert calls(prefill_chunk=32, max_batch=4, prefill_budget=33) == small + [[32, 1]]
    assert calls(prefill_chunk=24, max_batch=4, prefill_budget=48) == [[1], [2], [4], [3], [8], [7], [16], [15],
                                                                       [24], [23], [24, 8], [24, 7], [24, 24],
                                                                       [24, 23]]
    assert calls(ctx=2, prefill_chunk=32, max_batch=1, prefill_budget=32) == [[1]]


def test_prompt_logprobs_across_prefill_chunks(engine: Engine) -> None:
    """A job asking for its prompt's logprobs (a completion's echo) gets one entry per prompt token across prefill
    chunks (the first None; each the log_softmax of the logits before the token, the chunk's last row scoring the
    next chunk's first token), evaluated alone in its calls beside a job reading its own prompt; max_tokens 0
    generates nothing."""
    prompt = [0, *torch.randint(3, 259, (2 * CHUNK + 7,), generator=torch.Generator().manual_seed(1)).tolist()]
    sched = Scheduler(engine, CTX, "packed", prefill_chunk=CHUNK, kv_budget=2**30, rowwise=False)
    calls: list[tuple[int, bool]] = []
    model_batch = engine.model.forward_batch

    def counting(tokens, caches, **kw):
        calls.append((len(caches), kw.get("all_logits", False)))
        return model_batch(tokens, caches, **kw)

    engine.model.forward_batch = counting
    scored = Job(prompt, 0, SamplingParams(), [], True, True, prompt_logprobs=3)
    other = Job(prompt[:50], 2, SamplingParams(), [], True, True)
    got: dict[str, list] = {"scored": [], "other": []}
    try:
        sched.submit(other, got["other"].append)
        sched.submit(scored, got["scored"].append)
        sched.start()
        _wait_for(lambda: all(g and g[-1].finish for g in got.values()), "the requests")
    finally:
        sched.stop()
        del engine.model.forward_batch
    assert [(p.ids, p.finish) for p in got["scored"]] == [([], "length")] and scored.generated == 0
    assert len(scored.prompt_scores) == len(prompt) and scored.prompt_scores[0] is None
    session = engine.new_session(ctx=CTX, cache="packed", prefill_chunk=CHUNK, announce=False)
    rows = torch.cat([engine.model.forward(torch.tensor(prompt[a : a + CHUNK]), session.cache, all_logits=True)
                      for a in range(0, len(prompt), CHUNK)]).log_softmax(-1)
    for i, (logprob, top) in enumerate(scored.prompt_scores[1:], 1):
        assert logprob == pytest.approx(rows[i - 1, prompt[i]].item(), abs=1e-4)
        want = rows[i - 1].topk(3)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-4)
    # the scored prompt's 3 chunks alone in their calls, each keeping every position's logits
    assert [n for n, every in calls if every] == [1, 1, 1]


def test_a_long_prompt_is_evaluated_between_decode_steps(engine: Engine) -> None:
    """A running stream gets a token after every prefill chunk of a newcomer's long prompt (no stall)."""
    sched = Scheduler(engine, CTX, "packed", prefill_chunk=CHUNK, kv_budget=2**30)
    events: list[tuple[str, object]] = []
    running = sched.submit(Job([0, 5, 6], 300, SamplingParams(), [], True, False), lambda p: events.append(("a", p)))
    sched.start()
    try:
        _wait_for(lambda: len(events) >= 3, "the first stream to generate")
        prompt = [0, *torch.randint(3, 259, (400,), generator=torch.Generator().manual_seed(0)).tolist()]
        mark = len(events)
        sched.submit(Job(prompt, 2, SamplingParams(), [], True, False), lambda p: events.append(("b", p)))
        _wait_for(lambda: any(who == "b" for who, _ in events[mark:]), "the long prompt's first token", 60)
        first = next(i for i, (who, _) in enumerate(events) if i >= mark and who == "b")
        chunks = -(-len(prompt) // CHUNK)
        assert sum(who == "a" for who, _ in events[mark:first]) >= chunks - 1
    finally:
        sched.cancel(running)
        sched.stop()


def test_prompts_of_several_requests_share_a_prefill_call_without_batch_invariance(engine: Engine) -> None:
    """Without row-by-row products the next chunks of several prompts go through one model call (up to the
    prefill budget); with them each prompt is evaluated alone, as Session.prefill would."""
    prompts = [[engine.tokenizer.bos_id, *engine.tokenizer.encode(p)] for p in PROMPTS[:5]]
    assert [len(p) for p in prompts] == [10, 12, 26, 2, 22]  # 50 tokens fit the budget of 64, then 22 more
    for rowwise, calls in ((False, 2), (True, 5)):
        sched = Scheduler(engine, CTX, "float", prefill_chunk=CHUNK, kv_budget=2**30, rowwise=rowwise,
                          prefill_budget=2 * CHUNK)
        got: dict[int, list] = {i: [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):  # all admitted before the worker starts: one prefill pass sees them all
            sched.submit(Job(p, 6, SamplingParams(), [], True, True, ids_every_token=True), got[i].append)
        sched.start()
        try:
            _wait_for(lambda got=got: all(any(getattr(x, "finish", None) for x in g) for g in got.values()),
                      "the requests")
        finally:
            sched.stop()
        assert sched.stats.prefill_steps == calls and sched.stats.prompt_tokens == sum(map(len, prompts))
        for i in range(len(prompts)):
            # float32 on the CPU: the batched call's products differ from the lone session's in the last bits at
            # most, far from flipping a greedy pick of this model
            assert [t for piece in got[i] for t in piece.ids] == _expected(engine, PROMPTS[i], 6, "float")


@pytest.mark.parametrize("slots", [False, True], ids=["sessions", "decode-slots"])
def test_logprobs_of_a_batch(engine: Engine, slots: bool) -> None:
    """Requests decoded together, with and without logprobs and with different numbers of alternatives, each get
    those of their own tokens: the raw logits' log_softmax of a lone session evaluating the same tokens (also when
    the host reads them a step late: decode slots)."""
    tok = engine.tokenizer
    ks = [None, 0, 3, 5, 1]
    params = [SamplingParams(), SamplingParams(temperature=1.2, top_p=0.9, seed=1), SamplingParams(),
              SamplingParams(temperature=0.7, min_p=0.1, seed=2), SamplingParams(top_k=4, temperature=1.0, seed=3)]
    prompts = [[tok.bos_id, *tok.encode(p)] for p in PROMPTS[: len(ks)]]
    got = _decode_together(engine, [Job(p, 6, sp, [], True, True, logprobs=k)
                                    for p, sp, k in zip(prompts, params, ks, strict=True)], slots=slots)
    for i, k in enumerate(ks):
        ids = [t for piece in got[i] for t in piece.ids]
        entries = [e for piece in got[i] for e in piece.logprobs]
        assert len(ids) == 6 and all(len(piece.logprobs) == (0 if k is None else len(piece.ids)) for piece in got[i])
        if k is None:
            continue
        session = engine.new_session(ctx=CTX, cache="packed", prefill_chunk=CHUNK, announce=False)
        logits = session.prefill(prompts[i])
        for token, e in zip(ids, entries, strict=True):
            lp = logits.float().log_softmax(-1)
            assert e.token == token and e.logprob == pytest.approx(lp[token].item(), abs=1e-5)
            top = lp.topk(k)
            assert [t for t, _ in e.top] == top.indices.tolist()
            assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-5)
            logits = session.step(token)


@pytest.mark.parametrize("slots", [False, True], ids=["sessions", "decode-slots"])
def test_penalties_of_a_batch(engine: Engine, slots: bool) -> None:
    """Requests with different logit biases and penalties (and none) decoded together: each gets the tokens of
    its prompt alone through ``Session.generate`` with the same parameters (each keeps its own history)."""
    tok = engine.tokenizer
    params = [SamplingParams(frequency_penalty=2.0), SamplingParams(),
              SamplingParams(presence_penalty=0.5, repetition_penalty=0.5),
              SamplingParams(repetition_penalty=0.6, logit_bias=((120, 4.0), (58, -100.0))),
              SamplingParams(temperature=0.9, seed=5, frequency_penalty=1.0, logit_bias=((32, 2.0),))]
    prompts = [[tok.bos_id, *tok.encode(p)] for p in ["aaaa bbbb aaaa"] * 3 + PROMPTS[:2]]
    n = 12
    got = _decode_together(engine, [Job(p, n, sp, [], True, True) for p, sp in zip(prompts, params, strict=True)],
                           slots=slots)
    outputs = []
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        session = engine.new_session(ctx=CTX, cache="packed", prefill_chunk=CHUNK, announce=False)
        outputs.append([t for piece in got[i] for t in piece.ids])
        assert outputs[-1] == [t for t, _ in session.generate(p, n, sp, stop_ids=())]
    assert len({tuple(o) for o in outputs[:3]}) == 3  # one prompt, three penalties: three outputs


class _StoreSpy:
    """A prefix cache that stores nothing and records what each finished session holds."""

    def __init__(self) -> None:
        self.held: list[tuple[int, int]] = []  # (tokens, cache rows)

    def lookup(self, prompt: list[int], into=None):  # noqa: ANN001, ANN201
        return None, 0

    def store(self, session) -> None:  # noqa: ANN001
        self.held.append((len(session.tokens), session.cache.length))


@pytest.mark.parametrize("slots,overlap", [(False, True), (True, True), (True, False)],
                         ids=["sessions", "decode-slots", "decode-slots-no-overlap"])
def test_requests_ending_early_match_their_session_alone(engine: Engine, slots: bool, overlap: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests ending at an EOS token or a stop string, decoded together with ones that go on. With decode slots
    the host reads a token after queueing the step that takes it (unless DS4X_SERVE_OVERLAP=0), so a request that
    the token ends has had one step too many: its row is given back. Each request gets the tokens of its session
    alone, and what a finished session holds (as the prefix cache stores it) is exactly its kept tokens."""
    from dataclasses import replace

    monkeypatch.setenv("DS4X_SERVE_OVERLAP", "1" if overlap else "0")
    tok = engine.tokenizer
    prompts = [[tok.bos_id, *tok.encode(p)] for p in PROMPTS[:5]]
    n = 10
    alone = [_expected(engine, text, n) for text in PROMPTS[:5]]
    eos = alone[0][3]  # the first prompt's fourth token stands for EOS here
    monkeypatch.setattr(engine, "cfg", replace(engine.cfg, eos_token_ids=(eos,)))
    stop = tok.decode(alone[1][2:4])  # the second prompt's output ends before its third token's text
    assert stop and eos not in alone[1][:4]
    jobs = [Job(prompts[0], n, SamplingParams(), [], False, True),
            Job(prompts[1], n, SamplingParams(), [stop], True, True),
            *[Job(p, n, SamplingParams(), [], True, True) for p in prompts[2:]]]
    spy = _StoreSpy()
    given_back = []
    retire = Scheduler._retire
    monkeypatch.setattr(Scheduler, "_retire", lambda self, req, finished: (given_back.append(req.fed_unread),
                                                                          retire(self, req, finished)))
    got = _decode_together(engine, jobs, slots=slots, prefix_cache=spy)
    ids = [[t for piece in got[i] for t in piece.ids] for i in range(len(jobs))]
    assert ids[0] == alone[0][: alone[0].index(eos) + 1] and got[0][-1].finish == "stop"
    assert ids[1] == alone[1][: len(ids[1])] and got[1][-1].finish == "stop"
    text = "".join(piece.text for piece in got[1])
    assert stop not in text and (text + stop) in tok.decode(alone[1])
    assert ids[2:] == alone[2:]
    assert len(spy.held) == len(jobs) and all(tokens == rows for tokens, rows in spy.held)
    assert any(given_back) == (slots and overlap)  # only then is a token evaluated before it is read


@pytest.mark.gpu
def test_scheduler_on_cuda_times_the_step_by_events() -> None:
    """On CUDA the worker queues the sampling behind the step (no synchronize between them) and times the step by two
    events: three greedy requests finish, every step is counted in both histograms, the model's part is positive."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda_engine = Engine.load("tiny", device="cuda")
    sched = Scheduler(cuda_engine, CTX, "packed", prefill_chunk=CHUNK, kv_budget=2**30)
    got: dict[int, list] = {k: [] for k in range(3)}
    for k in got:
        sched.submit(Job([0, 5 + k, 6], 12, SamplingParams(), [], True, False), got[k].append)
    sched.start()
    try:
        _wait_for(lambda: all(out and (isinstance(out[-1], Exception) or out[-1].finish) for out in got.values()),
                  "the requests to end", seconds=120)
    finally:
        sched.stop()
    assert all(out[-1].finish == "length" and sum(len(p.ids) for p in out) == 12 for out in got.values())
    st = sched.stats
    assert sum(st.step_model.counts) == sum(st.step_sample.counts) == st.steps > 0
    assert st.step_model.total > 0 and st.step_sample.total >= 0


def test_a_failing_request_does_not_stop_the_others(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    import ds4x.serve.scheduler as sched_mod

    # the step's rows are drawn together; when that fails they are drawn one by one, and the row whose draw fails
    # fails only its request
    real_rows, real, batches, rows = sched_mod.draw_rows, sched_mod.draw, [], []

    def flaky_rows(*args, **kwargs):  # noqa: ANN002, ANN003
        batches.append(1)
        if len(batches) == 2:
            raise RuntimeError("batch")
        return real_rows(*args, **kwargs)

    def flaky(logits, params, generator=None, history=None):  # noqa: ANN001
        rows.append(1)
        if len(rows) == 1:
            raise RuntimeError("injected")
        return real(logits, params, generator, history)

    monkeypatch.setattr(sched_mod, "draw_rows", flaky_rows)
    monkeypatch.setattr(sched_mod, "draw", flaky)
    sched = Scheduler(engine, CTX, "packed", prefill_chunk=CHUNK, kv_budget=2**30)
    got: dict[int, list] = {0: [], 1: []}
    for k in got:
        sched.submit(Job([0, 5 + k, 6], 5, SamplingParams(), [], True, False), got[k].append)
    sched.start()
    try:
        _wait_for(lambda: all(out and (isinstance(out[-1], Exception) or out[-1].finish) for out in got.values()),
                  "both requests to end")
    finally:
        sched.stop()
    failed = [k for k, out in got.items() if isinstance(out[-1], Exception)]
    assert len(failed) == 1 and "injected" in str(got[failed[0]][-1])
    ok = got[1 - failed[0]]
    assert ok[-1].finish == "length" and sum(len(p.ids) for p in ok) == 5
    assert sched.stats.failed == 1 and sched.gauges()["kv_bytes_in_use"] == 0


def test_serve_flags(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from ds4x.cli.serve import main, parse_bytes

    assert parse_bytes("123") == 123 and parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1.5 GB") == 1.5e9
    assert parse_bytes("8gib") == 8 * 2**30
    for bad in ("", "-1", "12 parsecs", "GiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)
    # a budget below one session's cache is refused before listening
    assert main(["-m", "tiny", "--device", "cpu", "--ctx", "512", "--kv-budget", "1KiB", "-q"]) == 2
    assert "smaller than one session's cache" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["-m", "tiny", "--max-batch", "0"])


def test_prefill_calls_script_times_the_servers_prompt_calls() -> None:
    """scripts/prefill_calls.py (the device stage `device_ab.sh prefill`) on the tiny model: after the warm-up, a
    row per number of sessions and variant, then the profile of the largest call."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "scripts" / "prefill_calls.py"), "-m", "tiny", "--device", "cpu",
                          "--sessions", "1,3", "--prompt-tokens", "20", "--prefill-chunk", "32", "--ctx", "128",
                          "--rounds", "2", "--profile", "--top", "3",
                          "--variant", "async: ds4x.kernels.routed_wgmma.ASYNC_ACTIVATIONS=True"],
                         env={**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [(r[0], r[1], r[5]) for r in rows] == [("1", "20", "default"), ("1", "20", "async"),
                                                   ("3", "60", "default"), ("3", "60", "async")]
    assert all(float(r[3]) > 0 for r in rows)
    assert "profile of 3 sessions x 20 tokens" in out


def test_scheduler_ab_script_serves_both_orders(tmp_path: Path) -> None:
    """scripts/scheduler_ab.py on the tiny model: each level with the tokens read after and before the next step,
    a table row and a ledger row each (the ledger's report shows them)."""
    import json

    from ds4x.bench.report import render

    root = Path(__file__).resolve().parents[1]
    ledger = tmp_path / "ledger.jsonl"
    out = subprocess.run([sys.executable, str(root / "scripts" / "scheduler_ab.py"), "-m", "tiny", "--device", "cpu",
                          "--concurrency", "1,3", "--prompt-tokens", "20", "--gen-tokens", "5", "--prefill-chunk",
                          "32", "--ctx", "128", "--max-batch", "4", "--rounds", "1", "--ledger", str(ledger)],
                         env={**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300, check=True).stdout
    table = [r for r in map(str.split, out.splitlines()) if len(r) == 9 and r[0].isdigit()]  # not progress lines
    assert [(r[0], r[2]) for r in table] == [("1", "after"), ("1", "before"), ("3", "after"), ("3", "before")]
    rows = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert [(r["concurrency"], r["flags"]["overlapped_reads"]) for r in rows] == [(1, True), (1, False), (3, True),
                                                                                  (3, False)]
    assert all(r["tok_s"] > 0 and r["steps"] >= 4 for r in rows)
    assert "The server's decode loop without HTTP" in render(rows, "ledger.jsonl")
