"""The OpenAI-compatible server: in-process through TestClient on the synthetic ``tiny`` preset, plus one real
``ds4x serve`` subprocess on a loopback port."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

import ds4x  # noqa: E402
from ds4x.bench.serve_load import wait_until_healthy  # noqa: E402
from ds4x.runtime.engine import Engine  # noqa: E402
from ds4x.runtime.session_file import model_fingerprint  # noqa: E402
from ds4x.serve import create_app  # noqa: E402

CTX = 256


def tiny_client() -> Iterator[TestClient]:
    """The server on the tiny preset, in process (also the fixture of tests/test_serve_probe.py)."""
    engine = Engine.load("tiny", device="cpu")
    with TestClient(create_app(engine, "tiny", CTX, "packed")) as c:
        yield c


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    yield from tiny_client()


def _events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


def _chunks(text: str) -> list[dict]:
    events = _events(text)
    assert events[-1] == "[DONE]"
    assert "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def _assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


def test_kernel_compiles_after_the_warm_up_are_in_the_metrics(client: TestClient, monkeypatch) -> None:
    """A kernel compiled while serving (which requests waited for) is a series by kernel name: count and seconds;
    a server that compiled nothing shows no series."""
    from types import SimpleNamespace

    from ds4x.kernels import jit_watch
    from ds4x.serve import app as app_module

    w = jit_watch.CompileWatch()
    monkeypatch.setattr(app_module, "watch", lambda: w)
    assert "ds4x_kernel_compiles_total" not in client.get("/metrics").text
    fn = SimpleNamespace(name="_routed_probe", jit_function=SimpleNamespace(arg_names=[]))
    w.cache_missed(key="k", fn=fn)
    w.compiled(key="k", fn=fn)
    text = client.get("/metrics").text
    assert re.search(r'^ds4x_kernel_compiles_total\{kernel="_routed_probe"\} 1$', text, re.M)
    assert re.search(r'^ds4x_kernel_compile_seconds_total\{kernel="_routed_probe"\} \d+\.\d{3}$', text, re.M)


def test_health_models_metrics(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny"]
    (entry,) = models["data"]
    assert entry["object"] == "model" and entry["owned_by"] == "ds4x" and isinstance(entry["created"], int)
    assert entry["max_model_len"] == CTX
    # the server's description of itself, for the load harness's ledger rows (DESIGN §7)
    info = entry["ds4x"]
    assert {"version", "commit", "device", "gpu", "driver", "torch", "triton", "dtype", "cache", "model",
            "model_fingerprint", "scheduling"} == set(info)
    sched = client.app.state.server.scheduler
    assert info["scheduling"] == {**info["scheduling"], "ctx": CTX, "prefill_chunk": sched.chunk,
                                  "batch_invariant": True, "decode_slots": 0, "cuda_graphs": False,
                                  "overlapped_reads": False}
    engine = client.app.state.server.engine
    assert info["version"] == ds4x.__version__ and info["torch"] == torch.__version__
    assert info["device"] == "cpu" and info["gpu"] == "cpu" and info["dtype"] == "float32"
    assert info["cache"] == "packed" and info["model"].startswith("tiny ")
    assert info["model_fingerprint"] == model_fingerprint(engine)
    assert info["commit"] is None or isinstance(info["commit"], str) and info["commit"]
    client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "temperature": 0})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert re.search(r'^ds4x_requests_total\{endpoint="/v1/completions",status="200"\} [1-9]', text, re.M)
    assert int(re.search(r"^ds4x_generation_tokens_total (\d+)$", text, re.M).group(1)) >= 3
    assert int(re.search(r"^ds4x_prompt_tokens_total (\d+)$", text, re.M).group(1)) >= 3
    assert re.search(r"^ds4x_requests_running 0$", text, re.M)
    assert "# TYPE ds4x_requests_total counter" in text
    assert "# TYPE process_resident_memory_bytes gauge" in text
    rss = int(re.search(r"^process_resident_memory_bytes (\d+)$", text, re.M).group(1))
    assert 10 * 2**20 < rss < 2**40  # this test process, torch loaded: more than 10 MiB
    assert "ds4x_cuda_memory_allocated_bytes" not in text  # a CPU engine


@pytest.mark.gpu
def test_cuda_metadata_and_memory_metric() -> None:
    engine = Engine.load("tiny", device="cuda")
    with TestClient(create_app(engine, "tiny", CTX, "packed")) as c:
        info = c.get("/v1/models").json()["data"][0]["ds4x"]
        assert info["device"].startswith("cuda") and info["gpu"] == torch.cuda.get_device_name(engine.model.device)
        text = c.get("/metrics").text
    assert int(re.search(r"^ds4x_cuda_memory_allocated_bytes (\d+)$", text, re.M).group(1)) > 0


def test_completion_non_streaming(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "def f(x):", "max_tokens": 8,
                                             "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 8
    assert body["prompt_token_ids"][0] == 0  # BOS
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18}
    # token ids as the prompt give the same continuation
    r2 = client.post("/v1/completions", json={"prompt": body["prompt_token_ids"], "max_tokens": 8,
                                              "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r2.json()["choices"][0]["token_ids"] == choice["token_ids"]
    assert r2.json()["choices"][0]["text"] == choice["text"]


def test_a_batch_of_prompts_gets_one_choice_each(client: TestClient) -> None:
    """A completion request with a list of prompts (texts or token ids) answers one choice per prompt, ``index`` in
    request order, each the answer its prompt gets alone; streamed, the chunks interleave by index and agree with
    the whole answer; usage counts them all; with echo each choice starts with its own prompt."""
    texts = ["def f(x):", "hello", "import os\n"]
    req = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    alone = [client.post("/v1/completions", json={**req, "prompt": t}).json() for t in texts]
    whole = client.post("/v1/completions", json={**req, "prompt": texts}).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and "prompt_token_ids" not in whole
    for c, a in zip(whole["choices"], alone, strict=True):
        assert (c["text"], c["token_ids"], c["finish_reason"]) == (a["choices"][0]["text"],
                                                                   a["choices"][0]["token_ids"], "length")
        assert c["prompt_token_ids"] == a["prompt_token_ids"]
    assert whole["usage"] == {k: sum(a["usage"][k] for a in alone) for k in whole["usage"]}
    by_ids = client.post("/v1/completions", json={**req, "prompt": [a["prompt_token_ids"] for a in alone]}).json()
    assert [c["token_ids"] for c in by_ids["choices"]] == [c["token_ids"] for c in whole["choices"]]
    r = client.post("/v1/completions", json={**req, "prompt": texts, "stream": True,
                                             "stream_options": {"include_usage": True}})
    *content, usage = _chunks(r.text)
    assert usage["usage"] == whole["usage"] and all(len(c["choices"]) == 1 for c in content)
    for i, c in enumerate(whole["choices"]):
        mine = [ch["choices"][0] for ch in content if ch["choices"][0]["index"] == i]
        assert "".join(m["text"] for m in mine) == c["text"] and mine[-1]["finish_reason"] == "length"
        assert [t for m in mine for t in m["token_ids"]] == c["token_ids"]
        assert mine[0]["prompt_token_ids"] == c["prompt_token_ids"]
    echoed = client.post("/v1/completions", json={**req, "prompt": texts, "echo": True}).json()
    assert [c["text"] for c in echoed["choices"]] == [t + c["text"] for t, c in zip(texts, whole["choices"],
                                                                                    strict=True)]


def test_n_choices_draw_from_successive_seeds(client: TestClient) -> None:
    """``n`` choices of one prompt: the k-th draws as a lone request with seed + k would (so they differ and each is
    reproducible), streamed as non-streamed; with several prompts choice i * n + k is prompt i's k-th; chat too."""
    req = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True,
           "return_token_ids": True}
    alone = [client.post("/v1/completions", json={**req, "seed": 5 + k}).json()["choices"][0]["token_ids"]
             for k in range(3)]
    assert len({tuple(a) for a in alone}) > 1
    whole = client.post("/v1/completions", json={**req, "n": 3}).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and [c["token_ids"] for c in whole["choices"]] == alone
    assert whole["usage"]["completion_tokens"] == 24 and whole["prompt_token_ids"][0] == 0
    *content, _ = _chunks(client.post("/v1/completions", json={**req, "n": 3, "stream": True,
                                                               "stream_options": {"include_usage": True}}).text)
    assert [[t for ch in content for c in ch["choices"] if c["index"] == k for t in c["token_ids"]]
            for k in range(3)] == alone
    assert [ch.get("prompt_token_ids") for ch in content if "prompt_token_ids" in ch] == [whole["prompt_token_ids"]]
    two = client.post("/v1/completions", json={**req, "prompt": ["def f(x):", "hello"], "n": 2}).json()
    assert [c["token_ids"] for c in two["choices"][:2]] == alone[:2]
    hello = client.post("/v1/completions", json={**req, "prompt": "hello", "seed": 6}).json()
    assert two["choices"][3]["token_ids"] == hello["choices"][0]["token_ids"]
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                     "max_tokens": 4, "temperature": 0}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["choices"][0]["message"] == chat["choices"][1]["message"]  # greedy: the same answer twice


@pytest.mark.parametrize("stream", [False, True])
def test_usage_counts_a_prompt_once_whatever_n(client: TestClient, stream: bool) -> None:
    """``n`` choices share their prompt: prompt_tokens counts it once (OpenAI's and vLLM's usage), not n times;
    completion_tokens counts every choice's tokens; a list of prompts counts each of them."""
    def usage(url: str, **req) -> dict:
        body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": stream, **req}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = client.post(url, json=body)
        assert r.status_code == 200, r.text
        return _chunks(r.text)[-1]["usage"] if stream else r.json()["usage"]

    for url, req in (("/v1/completions", {"prompt": "def f(x):"}), ("/v1/chat/completions", {"messages": CHAT})):
        one = usage(url, **req)
        assert usage(url, **req, n=3) == {"prompt_tokens": one["prompt_tokens"], "completion_tokens": 15,
                                          "total_tokens": one["prompt_tokens"] + 15}
    p = [usage("/v1/completions", prompt=t)["prompt_tokens"] for t in ("ab", "hello")]
    assert usage("/v1/completions", prompt=["ab", "hello"], n=2) == {"prompt_tokens": sum(p), "completion_tokens": 20,
                                                                      "total_tokens": sum(p) + 20}


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_matches_non_streaming(client: TestClient, chat: bool) -> None:
    url = "/v1/chat/completions" if chat else "/v1/completions"
    req: dict = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    req |= {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]} if chat \
        else {"prompt": "hello"}
    whole = client.post(url, json=req).json()
    r = client.post(url, json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = _chunks(r.text)
    *content, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in content)
    if chat:
        assert all(c["object"] == "chat.completion.chunk" for c in content)
        assert content[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
        assert whole["choices"][0]["message"]["role"] == "assistant"
        assert text == whole["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in content)
        assert text == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in content][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    ids = [i for c in content for i in c["choices"][0]["token_ids"]]
    assert ids == whole["choices"][0]["token_ids"]
    assert whole["usage"]["completion_tokens"] == 12
    # streamed ids come with their token, also while its text is held back (an incomplete UTF-8 character)
    assert [len(c["choices"][0]["token_ids"]) for c in content] == [1] * 12 + [0]


def test_stream_without_usage_ends_with_done(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True, "seed": 1})
    chunks = _chunks(r.text)
    assert chunks and all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_seeded_sampling_is_reproducible(client: TestClient) -> None:
    req = {"prompt": "abc", "max_tokens": 10, "temperature": 0.9, "top_p": 0.95, "min_p": 0.01, "seed": 7,
           "ignore_eos": True, "return_token_ids": True}
    a = client.post("/v1/completions", json=req).json()["choices"][0]["token_ids"]
    b = client.post("/v1/completions", json=req).json()["choices"][0]["token_ids"]
    assert a == b and len(a) == 10


@pytest.mark.parametrize("as_list", [False, True])
def test_stop_strings(client: TestClient, as_list: bool) -> None:
    req = {"prompt": "stop here", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    # a two-character ASCII stop string from inside the greedy continuation
    k = next(i for i in range(1, len(full) - 1) if full[i:i + 2].isascii() and full[i:i + 2].isprintable())
    stop = full[k:k + 2]
    expected = full[: full.find(stop)]
    stops = ["\x00never", stop] if as_list else stop
    r = client.post("/v1/completions", json={**req, "stop": stops})
    (choice,) = r.json()["choices"]
    assert choice["text"] == expected and choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] < 40
    streamed = _chunks(client.post("/v1/completions", json={**req, "stop": stops, "stream": True}).text)
    assert "".join(c["choices"][0]["text"] for c in streamed) == expected
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"
    assert stop not in "".join(c["choices"][0]["text"] for c in streamed)


# ---- logprobs ------------------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "tell me"}]


def _chat_logprobs(client: TestClient, **extra) -> tuple[dict, list[dict]]:
    """A chat answer with logprobs and 3 alternatives: (its body, its logprobs entries)."""
    req = {"messages": CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True,
           "top_logprobs": 3, **extra}
    r = client.post("/v1/chat/completions", json=req)
    assert r.status_code == 200, r.text
    body = r.json()
    return body, body["choices"][0]["logprobs"]["content"]


def test_chat_logprobs(client: TestClient) -> None:
    body, entries = _chat_logprobs(client)
    content = body["choices"][0]["message"]["content"]
    assert len(entries) == body["usage"]["completion_tokens"] == 12
    for e in entries:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["logprob"] <= 0
        top = e["top_logprobs"]
        assert len(top) == 3 and all(set(t) == {"token", "logprob", "bytes"} for t in top)
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert e["logprob"] == top[0]["logprob"]  # greedy: the chosen token is the most likely one
        # a token's string is its bytes' text (U+FFFD for part of a character)
        for t in (e, *top):
            assert t["token"] == bytes(t["bytes"]).decode("utf-8", errors="replace")
    # no stop string: the tokens' bytes are the content (its text, where every token is whole characters)
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", errors="replace") == content
    if all("\ufffd" not in e["token"] for e in entries):
        assert "".join(e["token"] for e in entries) == content


def test_logprobs_are_the_raw_logits_log_softmax(client: TestClient) -> None:
    """Sampled with temperature, top-p and min-p: the logprobs are still those of the model's raw logits, as a
    session evaluating the same tokens gives them (the chosen token's and the 3 most likely)."""
    body, entries = _chat_logprobs(client, temperature=1.7, top_p=0.8, min_p=0.05, seed=3, max_tokens=6,
                                   return_token_ids=True)
    engine = client.app.state.server.engine
    tok = engine.tokenizer
    session = engine.new_session(ctx=CTX, cache="packed", prefill_chunk=256, announce=False)
    logits = session.prefill(body["prompt_token_ids"])
    for token, e in zip(body["choices"][0]["token_ids"], entries, strict=True):
        lp = logits.float().log_softmax(-1)
        assert e["logprob"] == pytest.approx(lp[token].item(), abs=1e-4)
        top = lp.topk(3)
        assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [t["bytes"] for t in e["top_logprobs"]] == [list(tok.token_bytes(i)) for i in top.indices.tolist()]
        logits = session.step(token)


def test_chat_logprobs_streamed(client: TestClient) -> None:
    """A stream's chunks carry the entries of their tokens: together the non-streamed answer's; with streamed
    token ids (a chunk per token) each chunk's entries are those of its ids."""
    _, whole = _chat_logprobs(client)
    for ids in (False, True):
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 12, "temperature": 0,
                                                      "ignore_eos": True, "logprobs": True, "top_logprobs": 3,
                                                      "stream": True, "return_token_ids": ids})
        chunks = [c["choices"][0] for c in _chunks(r.text)]
        assert all(c["logprobs"] is not None for c in chunks)
        assert [e for c in chunks for e in c["logprobs"]["content"]] == whole
        if ids:
            assert [len(c["logprobs"]["content"]) for c in chunks] == [len(c["token_ids"]) for c in chunks]


def _check_completion_logprobs(lp: dict, text: str, k: int, n: int) -> None:
    """``n`` tokens' legacy logprobs with ``k`` alternatives, of a greedy completion ``text``."""
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    for tok, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert chosen <= 0 and isinstance(top, dict)
        # the k alternatives and the chosen token (the most likely one under greedy decoding)
        assert 1 <= len(top) <= k + 1 and top[tok] == chosen == max(top.values())
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    # a token after one that left no character unfinished starts at its offset (unless a stop string cut it:
    # then it is at the end)
    for i, tok in enumerate(lp["tokens"]):
        if "\ufffd" not in tok and (i == 0 or "\ufffd" not in lp["tokens"][i - 1]) and offsets[i] < len(text):
            assert text.startswith(tok, offsets[i]), (i, tok, text)


def test_completion_logprobs(client: TestClient) -> None:
    req = {"prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    body = client.post("/v1/completions", json=req).json()
    (choice,) = body["choices"]
    _check_completion_logprobs(choice["logprobs"], choice["text"], 2, body["usage"]["completion_tokens"])
    # streamed: the chunks' lists joined, the offsets counted on across chunks
    chunks = [c["choices"][0] for c in _chunks(client.post("/v1/completions", json={**req, "stream": True}).text)]
    joined = {key: [v for c in chunks for v in c["logprobs"][key]] for key in choice["logprobs"]}
    assert joined == choice["logprobs"]
    # no alternatives: the chosen token's logprob alone
    lp = client.post("/v1/completions", json={**req, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == choice["logprobs"]["token_logprobs"]
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]


def test_completion_echo_with_prompt_logprobs(client: TestClient) -> None:
    """``echo``: the prompt before the completion's text, and with ``logprobs`` its tokens' entries first (the
    first token's null; the others the log_softmax of the logits before them, as lm-eval's loglikelihood reads
    them), the completion's entries after, their offsets counted after the prompt. Streamed: the same, the echo
    in the first chunk. ``max_tokens`` 0 scores the prompt alone."""
    prompt = "def f(x):\n    return x"
    req = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 2,
           "return_token_ids": True}
    plain = client.post("/v1/completions", json=req).json()["choices"][0]
    body = client.post("/v1/completions", json={**req, "echo": True}).json()
    (choice,) = body["choices"]
    ids, n = body["prompt_token_ids"], len(body["prompt_token_ids"])
    assert choice["text"] == prompt + plain["text"] and choice["token_ids"] == plain["token_ids"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n + 5 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # the same to float rounding (the output head multiplied every prompt position, not the last alone)
    assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert [list(t) for t in lp["top_logprobs"][n:]] == [list(t) for t in plain["logprobs"]["top_logprobs"]]
    assert lp["text_offset"][n:] == [o + len(prompt) for o in plain["logprobs"]["text_offset"]]
    offsets = lp["text_offset"][:n]
    assert offsets[:2] == [0, 0] and offsets == sorted(offsets)  # BOS (the server's), then the text from 0
    assert "".join(lp["tokens"][1:n]) == prompt
    for tok, at in zip(lp["tokens"][1:n], offsets[1:], strict=True):
        assert choice["text"].startswith(tok, at)
    engine = client.app.state.server.engine
    session = engine.new_session(ctx=CTX, cache="packed", prefill_chunk=256, announce=False)
    want = engine.model.forward(torch.tensor(ids), session.cache, all_logits=True).log_softmax(-1)
    for i in range(1, n):
        assert lp["token_logprobs"][i] == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-4)
        top = want[i - 1].topk(2)
        expected: dict[str, float] = {}
        for t, v in [*zip(top.indices.tolist(), top.values.tolist(), strict=True), (ids[i], want[i - 1, ids[i]])]:
            expected.setdefault(engine.tokenizer.token_bytes(t).decode("utf-8", errors="replace"), float(v))
        assert lp["top_logprobs"][i] == pytest.approx(expected, abs=1e-4)
    chunks = [c["choices"][0] for c in _chunks(client.post("/v1/completions",
                                                           json={**req, "echo": True, "stream": True}).text)]
    assert chunks[0]["text"].startswith(prompt) and "".join(c["text"] for c in chunks) == choice["text"]
    assert {key: [v for c in chunks for v in c["logprobs"][key]] for key in lp} == lp
    # the prompt scored alone, streamed or not; echo without logprobs; a prompt of token ids echoes their text
    for stream in (False, True):
        r = client.post("/v1/completions", json={**req, "echo": True, "max_tokens": 0, "stream": stream})
        got = _chunks(r.text)[0]["choices"][0] if stream else r.json()["choices"][0]
        assert got["text"] == prompt and got["finish_reason"] == "length"
        assert got["logprobs"] == {key: v[:n] for key, v in lp.items()}
    r = client.post("/v1/completions", json={**req, "echo": True, "logprobs": None}).json()
    assert r["choices"][0]["text"] == choice["text"] and r["choices"][0]["logprobs"] is None
    r = client.post("/v1/completions", json={**req, "prompt": ids[1:], "echo": True, "max_tokens": 0}).json()
    assert r["choices"][0]["text"] == prompt and r["usage"] == {"prompt_tokens": n - 1, "completion_tokens": 0,
                                                                "total_tokens": n - 1}


def test_lm_eval_loglikelihood_request(client: TestClient) -> None:
    """lm-eval-harness's ``local-completions`` loglikelihood request (token ids, one generated token, echo) read as
    it reads it: the continuation's logprobs are ``token_logprobs[ctxlen:-1]``, greedy when each is its top entry's
    maximum. They match the model's own scoring of the continuation."""
    engine = client.app.state.server.engine
    tok = engine.tokenizer
    context, continuation = [tok.bos_id, *tok.encode("def add(a, b):")], tok.encode("\n    return a + b")
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": [context + continuation],
                                                 "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
                                                 "echo": True}).json()
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    got = lp["token_logprobs"][len(context) : -1]
    tops = lp["top_logprobs"][len(context) : -1]
    assert len(got) == len(continuation)
    session = engine.new_session(ctx=CTX, cache="packed", prefill_chunk=256, announce=False)
    rows = engine.model.forward(torch.tensor(context + continuation), session.cache, all_logits=True).log_softmax(-1)
    want = [rows[len(context) + i - 1, t].item() for i, t in enumerate(continuation)]
    assert sum(got) == pytest.approx(sum(want), abs=1e-3)
    greedy = all(v == max(top.values()) for v, top in zip(got, tops, strict=True))
    assert greedy == all(rows[len(context) + i - 1].argmax().item() == t for i, t in enumerate(continuation))


def test_tokenizer_endpoints(client: TestClient) -> None:
    """vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval-harness's remote tokenizer reads them): a text
    with or without the BOS a completion's text prompt gets, chat messages as the chat endpoint renders them, ids
    back to text; bad input is a 400 / 404 naming the field."""
    engine = client.app.state.server.engine
    tok = engine.tokenizer
    info = client.get("/tokenizer_info").json()
    # the byte tokenizer's specials have no text: null, as a client expects of a token it cannot write
    assert info["eos_token"] == (tok.decode([tok.eos_ids[0]]) or None)
    assert info["bos_token"] == (tok.decode([tok.bos_id]) or None)
    assert info["model_max_length"] == CTX and info["add_bos_token"] is (tok.bos_id is not None)
    text = "def f(x):\n    return x"
    r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == CTX
    with_bos = client.post("/tokenize", json={"model": "tiny", "prompt": text}).json()["tokens"]
    body = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "return_token_ids": True}).json()
    assert with_bos == body["prompt_token_ids"] == [tok.bos_id, *r["tokens"]]
    chat = client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    body = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "return_token_ids": True})
    assert chat == body.json()["prompt_token_ids"]
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    _assert_error(client.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    _assert_error(client.post("/detokenize", json={"tokens": [-1]}), 400)
    _assert_error(client.post("/tokenize", json={}), 400, "prompt")
    _assert_error(client.post("/tokenize", json={"prompt": "a", "messages": CHAT}), 400, "prompt")
    _assert_error(client.post("/tokenize", json={"prompt": "a", "model": "other"}), 404, "model")
    _assert_error(client.post("/tokenize", content=b"{"), 400)


def test_completion_logprobs_with_stop_string(client: TestClient) -> None:
    """A stop string cuts the text, not the entries of the tokens generated (streamed or not)."""
    req = {"prompt": "stop here", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    full = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    k = next(i for i in range(1, len(full) - 1) if full[i:i + 2].isascii() and full[i:i + 2].isprintable())
    req["stop"] = full[k:k + 2]
    body = client.post("/v1/completions", json=req).json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop" and choice["text"] == full[: full.find(req["stop"])]
    n = body["usage"]["completion_tokens"]
    _check_completion_logprobs(choice["logprobs"], choice["text"], 1, n)
    assert choice["logprobs"]["text_offset"][-1] == len(choice["text"])  # the stop string's last token
    streamed = _chunks(client.post("/v1/completions", json={**req, "stream": True,
                                                            "stream_options": {"include_usage": True}}).text)
    *content, usage = streamed
    assert usage["usage"]["completion_tokens"] == n
    assert [t for c in content for t in c["choices"][0]["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_no_logprobs_unless_asked(client: TestClient, stream: bool) -> None:
    for url, req in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "ab"}),
                     ("/v1/chat/completions", {"messages": CHAT, "logprobs": False})):
        r = client.post(url, json={**req, "max_tokens": 3, "temperature": 0, "stream": stream})
        choices = [c["choices"][0] for c in _chunks(r.text)] if stream else r.json()["choices"]
        assert choices and all(c["logprobs"] is None for c in choices)


# ---- logit bias and penalties --------------------------------------------------------------------

def _reference(client: TestClient, prompt: list[int], n: int, frequency: float = 0.0, presence: float = 0.0,
               repetition: float = 1.0, bias: dict[int, float] | None = None, temperature: float = 0.0,
               seed: int = 0) -> list[int]:
    """The tokens a session alone gives with the bias and penalties applied by hand to its logits (OpenAI's and
    vLLM's formulas, token by token), then greedy or a seeded draw with no adjustment."""
    from ds4x.runtime.sampling import SamplingParams, sample

    engine = client.app.state.server.engine
    session = engine.new_session(ctx=CTX, cache="packed", prefill_chunk=256, announce=False)
    logits, out = session.prefill(prompt), []
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        row = logits.float().clone()
        for t, b in (bias or {}).items():
            row[t] += b
        for t in {*prompt, *out}:
            row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
        for t in set(out):
            row[t] -= frequency * out.count(t) + presence
        out.append(sample(row, SamplingParams(temperature=temperature), gen))
        logits = session.step(out[-1])
    return out


def _ids(client: TestClient, **req) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of a completion."""
    r = client.post("/v1/completions", json={"ignore_eos": True, "return_token_ids": True, **req})
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"], r.json()["choices"][0]["token_ids"]


def test_logit_bias_steers_greedy_decoding(client: TestClient) -> None:
    req = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
    prompt, plain = _ids(client, **req)
    # the token greedy picks first, biased away: it never comes
    _, banned = _ids(client, **req, logit_bias={str(plain[0]): -100})
    assert plain[0] not in banned and banned == _reference(client, prompt, 8, bias={plain[0]: -100})
    # a token biased up by 100 comes every time
    favourite = next(t for t in range(3, 259) if t not in plain)
    _, forced = _ids(client, **req, logit_bias={str(favourite): 100})
    assert forced == [favourite] * 8


@pytest.mark.parametrize("extra", [
    {"frequency_penalty": 2},
    {"presence_penalty": 1.5, "frequency_penalty": -0.5},
    {"repetition_penalty": 1.5},
    {"repetition_penalty": 0.5, "logit_bias": {"101": 2.5, "32": -4}},
    {"temperature": 0.8, "seed": 11, "presence_penalty": 2, "repetition_penalty": 1.25},
], ids=["frequency", "presence", "repetition", "repetition-below-1-and-bias", "sampled"])
def test_penalties_match_a_reference(client: TestClient, extra: dict) -> None:
    """Each generated token is the one the hand-adjusted logits of a session alone give (greedy, or the same
    seeded draw: the adjustment comes before temperature)."""
    req = {"prompt": "aaaa bbbb aaaa", "max_tokens": 16, "temperature": 0, **extra}
    prompt, ids = _ids(client, **req)
    assert ids == _reference(client, prompt, 16, extra.get("frequency_penalty", 0), extra.get("presence_penalty", 0),
                             extra.get("repetition_penalty", 1),
                             {int(t): b for t, b in extra.get("logit_bias", {}).items()},
                             req["temperature"], extra.get("seed", 0))


def test_frequency_penalty_reduces_repeats(client: TestClient) -> None:
    req = {"prompt": "aaaa bbbb aaaa", "max_tokens": 24, "temperature": 0}
    _, plain = _ids(client, **req)
    _, penalized = _ids(client, **req, frequency_penalty=2)
    # a property of this model and prompt (deterministic): greedy repeats itself, the penalty breaks that up
    assert len(set(penalized)) > len(set(plain))


def test_neutral_penalties_change_nothing(client: TestClient) -> None:
    for req in ({"prompt": "def f(x):", "max_tokens": 8, "temperature": 0},
                {"prompt": "abc", "max_tokens": 8, "temperature": 0.9, "seed": 4}):
        _, plain = _ids(client, **req)
        _, neutral = _ids(client, **req, presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1,
                          logit_bias={})
        assert neutral == plain
        _, nulls = _ids(client, **req, presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
                        logit_bias=None)
        assert nulls == plain


def test_logprobs_ignore_the_bias(client: TestClient) -> None:
    """The logprobs are the raw logits': the token biased away is still reported as the most likely one."""
    _, plain = _chat_logprobs(client, max_tokens=1, return_token_ids=True)
    body, biased = _chat_logprobs(client, max_tokens=1, return_token_ids=True, logit_bias={"0": 0})
    assert biased == plain  # a zero bias: same token, same entries
    first = plain[0]
    banned = body["choices"][0]["token_ids"][0]
    _, entries = _chat_logprobs(client, max_tokens=1, logit_bias={str(banned): -100})
    assert entries[0]["top_logprobs"][0] == first["top_logprobs"][0]  # the banned token, raw logprob
    assert entries[0]["token"] != first["token"] and entries[0]["logprob"] < first["logprob"]


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None, None),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt", None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "4"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": CTX}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x" * (CTX + 1)}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [0] * (CTX + 1)}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [0, 100000]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [0, -3]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ["a"] * 129}, 400, "prompt", None),  # more than MAX_CHOICES
    ("/v1/completions", {"prompt": ["a"] * 65, "n": 2}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ["a", "x" * (CTX + 1)]}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [[5], []]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "temperature": 1e9}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": -0.1}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "min_p": -0.1}, 400, "min_p", None),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed", None),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, 400, "seed", None),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of", None),
    ("/v1/completions", {"prompt": "x", "n": 129}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", None),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty", None),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": "high"}, 400, "frequency_penalty", None),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 11}, 400, "repetition_penalty", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-1": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1.5": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"259": 1}}, 400, "logit_bias", None),  # the vocabulary: 259
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999999999999999": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "1"}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": [1, 2]}, 400, "logit_bias", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 200}, 400, "n", None),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": False, "top_logprobs": 0}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, 400, "logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * CTX}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "x"}, 404, "model", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "what is this?"}]}]}, 400, "messages", None),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", None),
    # no tool calls, structured or audio output: refused by name, not ignored
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools", None),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice", None),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400,
     "tool_choice", None),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions", None),
    ("/v1/chat/completions", {"messages": CHAT, "function_call": {"name": "f"}}, 400, "function_call", None),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}}, 400, "response_format",
     None),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}}}}, 400, "response_format", None),
    ("/v1/chat/completions", {"messages": CHAT, "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio", None),
]


def test_openai_fields_that_ask_for_nothing_missing_are_taken(client: TestClient) -> None:
    """Fields clients send by default: null for "not given", no tools, text output; the answer is the plain one."""
    req = {"messages": CHAT, "max_tokens": 5, "temperature": 0}
    plain = client.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"]
    nulls = dict.fromkeys(("model", "n", "stream", "stream_options", "logprobs", "top_logprobs", "top_p", "seed",
                           "stop", "presence_penalty", "logit_bias", "max_completion_tokens", "tools", "tool_choice",
                           "response_format", "user"))
    for extra in (nulls, {"tools": [], "tool_choice": "none", "parallel_tool_calls": False, "user": "u",
                          "response_format": {"type": "text"}, "function_call": "auto", "n": 1}):
        r = client.post("/v1/chat/completions", json={**req, **extra})
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["message"]["content"] == plain
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "temperature": 0, "n": None,
                                             "echo": None, "suffix": None, "logprobs": None, "stream": None})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


def test_top_p_zero_is_greedy(client: TestClient) -> None:
    """OpenAI takes top_p in [0, 1]; 0 keeps the most likely token alone."""
    req = {"prompt": "def f(x):", "max_tokens": 8}
    _, greedy = _ids(client, **req, temperature=0)
    assert _ids(client, **req, temperature=1.5, top_p=0, seed=1)[1] == greedy


def test_system_fingerprint_and_model_retrieval(client: TestClient) -> None:
    bodies = [client.post(url, json={**req, "max_tokens": 2}).json() for url, req in
              (("/v1/completions", {"prompt": "ab"}), ("/v1/chat/completions", {"messages": CHAT}))]
    stream = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "stream": True,
                                                       "stream_options": {"include_usage": True}})
    fingerprints = {b["system_fingerprint"] for b in [*bodies, *_chunks(stream.text)]}
    assert len(fingerprints) == 1 and re.fullmatch(r"fp_[0-9a-f]{12}", fingerprints.pop())
    r = client.get("/v1/models/tiny")
    assert r.status_code == 200 and r.json() == client.get("/v1/models").json()["data"][0]
    _assert_error(client.get("/v1/models/gpt-4"), 404, "model", "model_not_found")
    _assert_error(client.get("/v1/models/org/gpt-4"), 404, "model", "model_not_found")


def test_a_union_error_names_the_branch_the_value_takes(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "stop": ["a"] * 17})
    _assert_error(r, 400, "stop")
    assert "at most 16 items" in r.json()["error"]["message"]


def test_a_deeply_nested_body_is_a_bad_request(client: TestClient) -> None:
    r = client.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                    headers={"content-type": "application/json"})
    _assert_error(r, 400)
    assert "nested too deeply" in r.json()["error"]["message"]


def test_a_body_over_the_limit_is_refused_unread(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from ds4x.serve import app as app_module

    monkeypatch.setattr(app_module, "MAX_REQUEST_BYTES", 1000)
    r = client.post("/v1/completions", json={"prompt": "x" * 2000})
    _assert_error(r, 413)
    assert "1,000 bytes" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_a_bad_token_id_is_named(client: TestClient) -> None:
    """A union field's error names the value at fault (the list's token id), not the string branch."""
    r = client.post("/v1/completions", json={"prompt": [5, 6, -3]})
    _assert_error(r, 400, "prompt")
    assert ".2:" in r.json()["error"]["message"] and "greater than or equal to 0" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def default_client() -> TestClient:
    """The embedded default model: its tokenizer is a tokenizer.json (the ``tokenizers`` library), not bytes."""
    with TestClient(create_app(Engine.load("default", device="cpu"), "default", CTX, "packed")) as c:
        yield c


_SURROGATE_PROMPTS = [b'{"prompt": "x\\ud800y", "max_tokens": 2}',
                      b'{"prompt": ["ok", "\\udc80"], "max_tokens": 2, "stream": true}']
_SURROGATE_MESSAGES = [b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
                       b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}], '
                       b'"stream": true}']


@pytest.mark.parametrize(("url", "body"), [
    *[("/v1/completions", b) for b in _SURROGATE_PROMPTS], *[("/v1/chat/completions", b) for b in _SURROGATE_MESSAGES],
    ("/tokenize", _SURROGATE_PROMPTS[0]), *[("/tokenize", b) for b in _SURROGATE_MESSAGES]])
def test_a_lone_surrogate_is_a_bad_request_for_a_tokenizer_json(default_client: TestClient, url: str,
                                                                body: bytes) -> None:
    """JSON can escape a lone surrogate, which is no character: the tokenizers library raised a TypeError on it
    (a 500) where the byte tokenizer's UTF-8 encoding raised the UnicodeError the server answers with a 400."""
    r = default_client.post(url, content=body, headers={"content-type": "application/json"})
    _assert_error(r, 400, "messages" if b"messages" in body else "prompt")
    assert "not valid Unicode" in r.json()["error"]["message"]


def test_an_error_quoting_a_lone_surrogate_is_still_sent(client: TestClient) -> None:
    """An error message that quotes the request (the model's name, a logit_bias key) may hold a lone surrogate,
    which UTF-8 cannot hold: the response failed to render (a 500 / a dropped connection) instead of the error."""
    for url in ("/v1/completions", "/tokenize"):
        r = client.post(url, content=b'{"model": "m\\ud800", "prompt": "x", "max_tokens": 1}',
                        headers={"content-type": "application/json"})
        _assert_error(r, 404, "model", "model_not_found")
        assert "m\\ud800" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=b'{"prompt": "x", "logit_bias": {"\\ud800": 1}}',
                    headers={"content-type": "application/json"})
    _assert_error(r, 400, "logit_bias")


def test_a_long_prompt_is_tokenized_off_the_event_loop(default_client: TestClient, monkeypatch) -> None:
    """Tokenizing megabytes of text takes seconds; on the event loop it stalled every other request meanwhile (an
    8 MB prompt stopped the other streams for ~7 s). Requests sent while a prompt is tokenized (here a tokenizer
    made to take 1.5 s) must be answered."""
    import threading

    tok = default_client.app.state.server.engine.tokenizer
    encode = tok.encode
    started = threading.Event()

    def slow_encode(text: str) -> list[int]:
        started.set()
        time.sleep(1.5)
        return encode(text)

    monkeypatch.setattr(tok, "encode", slow_encode)
    done = threading.Event()
    answered_meanwhile = []

    def send() -> None:
        r = default_client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 1})
        done.set()
        assert r.status_code == 200

    sender = threading.Thread(target=send)
    sender.start()
    assert started.wait(30)  # the body is read and tokenizing has begun
    while not done.is_set():
        t0 = time.monotonic()
        r = default_client.get("/health")
        if not done.is_set():
            answered_meanwhile.append((r.status_code, time.monotonic() - t0))
    sender.join()
    assert any(code == 200 and took < 0.5 for code, took in answered_meanwhile), answered_meanwhile


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-9])
def test_a_vanishing_temperature_decodes_greedily(client: TestClient, temperature: float) -> None:
    """A positive temperature that float32 logits cannot be divided by (1e-300 is 0 in float32) gave NaN
    probabilities and a token id past the vocabulary (a 500); below 1e-5 it decodes greedily, as vLLM does."""
    req = {"prompt": "def f(x):", "max_tokens": 8}
    _, greedy = _ids(client, **req, temperature=0)
    assert _ids(client, **req, temperature=temperature, seed=3)[1] == greedy
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "temperature": temperature,
                                                  "stream": True})
    assert r.status_code == 200 and all("error" not in c for c in _chunks(r.text))


@pytest.mark.parametrize(("url", "body", "status", "param", "code"), BAD_REQUESTS)
def test_bad_requests(client: TestClient, url: str, body: object, status: int, param: str | None,
                      code: str | None) -> None:
    if isinstance(body, bytes):
        r = client.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(url, json=body)
    _assert_error(r, status, param, code)


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(client: TestClient, monkeypatch) -> None:
    """A text longer in bytes than the context times the longest token (x 4) is refused without tokenizing it (the
    tokenizer's records of a 60 MB prompt took 11 GB); one just inside that bound is tokenized and refused by its
    token count."""
    server = client.app.state.server
    limit = 4 * CTX * server._token_bytes
    calls: list[int] = []
    encode = server.engine.tokenizer.encode
    monkeypatch.setattr(server.engine.tokenizer, "encode", lambda text: calls.append(len(text)) or encode(text))
    for url, body, param in (("/v1/completions", {"prompt": "x" * (limit + 1)}, "prompt"),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (limit + 1)}]},
                              "messages"),
                             ("/tokenize", {"prompt": "x" * (limit + 1)}, "prompt")):
        r = client.post(url, json=body)
        _assert_error(r, 400, param, "context_length_exceeded")
        assert "bytes" in r.json()["error"]["message"]
    assert calls == []
    r = client.post("/v1/completions", json={"prompt": "x" * limit})
    _assert_error(r, 400, "prompt", "context_length_exceeded")
    assert "tokens" in r.json()["error"]["message"] and calls == [limit]


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused_as_such(client: TestClient, field: str, value: str) -> None:
    """NaN and Infinity (JSON extensions Python's parser takes) are named as not finite, not as out of range."""
    r = client.post("/v1/completions", content=f'{{"prompt": "x", "{field}": {value}}}'.encode(),
                    headers={"content-type": "application/json"})
    _assert_error(r, 400, field)
    assert "finite" in r.json()["error"]["message"]


def test_a_web_pages_simple_post_is_refused(client: TestClient) -> None:
    """A body a page can send to any origin without a CORS preflight (text/plain, a form) is refused when the
    request comes from a page (Origin); without Origin (curl -d) it is read as JSON, and a page's JSON is served."""
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        for url in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            r = client.post(url, content=body, headers={"content-type": kind, "origin": "http://page.example"})
            _assert_error(r, 415)
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json",
                                                                "origin": "http://page.example"})
    assert r.status_code == 200


def test_unknown_route_and_method(client: TestClient) -> None:
    _assert_error(client.get("/v1/nothing"), 404)
    _assert_error(client.get("/v1/completions"), 405)


def test_chat_prompt_encoding(client: TestClient) -> None:
    from types import SimpleNamespace

    from ds4x.runtime.chat import render_chat
    from ds4x.serve.app import ChatRequest, Server

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text",
                                                                                          "text": "hello"}]}]
    req = ChatRequest.model_validate({"messages": messages})
    # byte tokenizer (no chat template): BOS + the contents joined by newlines
    server = client.app.state.server
    assert server.chat_prompt(req) == [0, *server.engine.tokenizer.encode("be brief\nhello")]
    # a GGUF tokenizer gets the DeepSeek-V4 chat encoding, specials included
    pytest.importorskip("gguf")
    from ds4x.runtime.gguf_tokenizer import GGUFTokenizer
    from ds4x.weights.gguf_writer import synthetic_vocab

    v = synthetic_vocab(600)
    tok = GGUFTokenizer(v.tokens, v.merges)
    gguf_server = Server(SimpleNamespace(tokenizer=tok), "m", CTX, "packed")
    ids = gguf_server.chat_prompt(req)
    assert ids == tok.encode(render_chat([{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hello"}], thinking=False))
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


@pytest.fixture(scope="module")
def gguf_client(tmp_path_factory) -> TestClient:
    """A model whose tokenizer has the chat tokens (a tiny GGUF), so the DeepSeek-V4 chat encoding applies."""
    pytest.importorskip("gguf")
    from ds4x.config import tiny_config
    from ds4x.weights.gguf_writer import write_gguf
    from ds4x.weights.synthetic import synthetic_weights

    cfg = tiny_config()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, cfg, synthetic_weights(cfg, seed=0), "f32")
    with TestClient(create_app(Engine.load(str(path), device="cpu"), "g", 2048, "packed")) as c:  # room for tools
        yield c


def _reply(c: TestClient, stream: bool, **extra) -> tuple[dict, str]:
    """(the assistant message, assembled from the deltas when streamed; the finish reason)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "stream": stream,
            **extra}
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        return choice["message"], choice["finish_reason"]
    choices = [ch["choices"][0] for ch in _chunks(r.text)]
    msg: dict = {"role": choices[0]["delta"]["role"], "content": "".join(ch["delta"]["content"] for ch in choices)}
    if "reasoning_content" in choices[0]["delta"]:
        msg["reasoning_content"] = "".join(ch["delta"]["reasoning_content"] for ch in choices)
    calls = [call for ch in choices for call in ch["delta"].get("tool_calls", [])]
    if calls:
        assert [call.pop("index") for call in calls] == list(range(len(calls)))
        msg["tool_calls"] = calls
    return msg, choices[-1]["finish_reason"]


def test_thinking_reply_gives_reasoning_content(gguf_client) -> None:
    """Thinking mode: the reply's text before </think> is reasoning_content, the rest content, streamed and not;
    vLLM's chat_template_kwargs spelling turns it on too."""
    think_end = gguf_client.app.state.server.engine.tokenizer.encode("</think>")
    assert len(think_end) == 1
    plain, _ = _reply(gguf_client, False)
    assert "reasoning_content" not in plain  # thinking off: no reasoning field
    for stream in (False, True):
        # every token forced to </think>: the first ends the (empty) reasoning, the next four are the answer
        forced, _ = _reply(gguf_client, stream, thinking=True, logit_bias={str(think_end[0]): 100})
        assert (forced["reasoning_content"], forced["content"]) == ("", "</think>" * 4)
        assert _reply(gguf_client, stream, chat_template_kwargs={"thinking": True}) == _reply(gguf_client, False,
                                                                                               thinking=True)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def test_tools_are_offered_in_the_chat_encoding(gguf_client) -> None:
    from ds4x.runtime.chat import render_chat
    from ds4x.serve.app import ChatRequest

    server = gguf_client.app.state.server
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tok = server.engine.tokenizer
    with_tools = ChatRequest.model_validate({"messages": messages, "tools": TOOLS})
    assert server.chat_prompt(with_tools) == tok.encode(render_chat(messages, False, tools=TOOLS))
    none = ChatRequest.model_validate({"messages": messages, "tools": TOOLS, "tool_choice": "none"})
    assert server.chat_prompt(none) == tok.encode(render_chat(messages, False))
    msg, finish = _reply(gguf_client, False, tools=TOOLS)  # the random model calls nothing: a plain answer
    assert "tool_calls" not in msg and finish == "length"
    for bad_tools in ([{"type": "function"}], ["get_weather"], [{"type": "web", "function": {"name": "f"}}]):
        bad = gguf_client.post("/v1/chat/completions", json={"messages": messages, "tools": bad_tools})
        _assert_error(bad, 400, "tools")


@pytest.mark.parametrize("thinking", [False, True])
def test_a_tool_call_block_becomes_tool_calls(gguf_client, monkeypatch, thinking) -> None:
    """The reply's DSML tool-call block (scripted here: the tiny model is random) comes back as OpenAI tool_calls,
    streamed (one delta at the end, the block's text never shown as content) and not, finish reason tool_calls."""
    from ds4x.serve.scheduler import Piece

    server = gguf_client.app.state.server
    block = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
             '</｜DSML｜tool_calls>')
    text = ("the user asks</think>" if thinking else "") + "Let me check." + block
    cuts = [0, 5, 17, 30, 44, 60, 95, len(text) - 3, len(text)]

    async def scripted(request, handle, queue):
        for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            yield Piece(text[a:b], [], "stop" if i == len(cuts) - 2 else None)

    monkeypatch.setattr(server, "pieces", scripted)
    want_call = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    for stream in (False, True):
        msg, finish = _reply(gguf_client, stream, tools=TOOLS, thinking=thinking)
        assert finish == "tool_calls"
        assert msg["content"] == "Let me check."
        assert msg.get("reasoning_content") == ("the user asks" if thinking else None)
        [call] = msg["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"] == want_call


# ---- a real server -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_command(port: int, *more: str) -> list[str]:
    from ds4x.cli.main import build_parser

    args = ["-m", "tiny", "--device", "cpu", "--port", str(port), "--ctx", "4096", "-q", *more]
    try:
        build_parser().parse_args(["serve", *args])
    except SystemExit:  # `serve` not registered in ds4x.cli.main: run the subcommand module directly
        return [sys.executable, "-m", "ds4x.cli.serve", *args]
    script = Path(sys.executable).parent / "ds4x"
    return [str(script), "serve", *args] if script.exists() else [sys.executable, "-m", "ds4x.cli.main", "serve",
                                                                    *args]


def _metric(base: str, name: str) -> int:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return int(float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)))


def test_real_server_subprocess() -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS4X_COMMIT": "abc123-test"}
    proc = subprocess.Popen(_serve_command(port, "--shutdown-timeout", "2"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env)
    try:
        wait_until_healthy(base, proc, 60, lambda: proc.stdout.read().decode(errors="replace"))
        # whoever starts the server names its commit (a copy without git metadata has no other way)
        assert httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["ds4x"]["commit"] == "abc123-test"
        try:
            import openai
        except ImportError:
            openai = None
        if openai is not None:
            oc = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
            out = oc.completions.create(model="tiny", prompt="def", max_tokens=5, temperature=0)
            assert out.usage.prompt_tokens == 4 and 1 <= out.usage.completion_tokens <= 5  # BOS + 3 bytes
            assert out.choices[0].finish_reason in ("length", "stop")
            parts = [c.choices[0].delta.content or "" for c in oc.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, stream=True)
                if c.choices]
            assert isinstance("".join(parts), str)
            with pytest.raises(openai.NotFoundError):
                oc.completions.create(model="nope", prompt="def", max_tokens=1)
            assert oc.models.retrieve("tiny").id == "tiny"
            with pytest.raises(openai.BadRequestError, match="tools"):
                oc.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
            # logprobs as the client library reads them
            chat = oc.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0,
                                              logprobs=True, top_logprobs=2)
            entries = chat.choices[0].logprobs.content
            assert len(entries) == chat.usage.completion_tokens
            assert all(len(e.top_logprobs) == 2 and e.logprob == e.top_logprobs[0].logprob for e in entries)
            legacy = oc.completions.create(model="tiny", prompt="def", max_tokens=4, temperature=0, logprobs=1)
            lp = legacy.choices[0].logprobs
            assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == legacy.usage.completion_tokens
            with pytest.raises(openai.BadRequestError, match="top_logprobs"):
                oc.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, top_logprobs=2)
        else:
            r = httpx.post(f"{base}/v1/completions", json={"prompt": "def", "max_tokens": 5}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5

        # a client that goes away mid-stream stops the generation
        generated_before = _metric(base, "ds4x_generation_tokens_total")
        req = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{base}/v1/completions", json=req, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        deadline = time.monotonic() + 20
        while _metric(base, "ds4x_requests_cancelled_total") < 1:
            assert time.monotonic() < deadline, "generation did not stop after the client disconnected"
            time.sleep(0.1)
        assert _metric(base, "ds4x_requests_running") == 0
        assert _metric(base, "ds4x_generation_tokens_total") - generated_before < 4000
        # and the engine is free for the next request
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "y", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200

        # SIGTERM mid-stream: the stream may run for --shutdown-timeout seconds, then the process exits
        chunks = 0
        with httpx.stream("POST", f"{base}/v1/completions", json=req, timeout=30) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            try:
                chunks = sum(line.startswith("data: ") for line in lines)
            except httpx.HTTPError:  # the connection closed mid-chunk
                pass
        # (uvicorn raises the signal again once it has shut down, so the exit status names it)
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM) and time.monotonic() - t0 < 10
        assert chunks < 3999  # cut short, not drained to max_tokens
    finally:
        proc.kill()
        proc.wait(timeout=10)
