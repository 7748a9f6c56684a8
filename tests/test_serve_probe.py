"""Bugs a client driving the server (streamed against non-streamed greedy answers, hostile bodies) found: in-process
through TestClient on the synthetic ``tiny`` preset (a byte tokenizer: one character per token)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from tests import test_serve  # noqa: E402

_chunks = test_serve._chunks


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    yield from test_serve.tiny_client()


def _merged_completion(chunks: list[dict]) -> dict:
    """A streamed completion's one choice as the non-streamed body gives it (text, ids, logprobs lists joined)."""
    out: dict = {"text": "", "token_ids": [], "logprobs": None, "finish_reason": None}
    for chunk in chunks:
        (c,) = chunk["choices"]
        out["text"] += c["text"]
        out["token_ids"] += c.get("token_ids") or []
        out["finish_reason"] = c["finish_reason"] or out["finish_reason"]
        if c["logprobs"] is not None:
            out["logprobs"] = out["logprobs"] or {k: [] for k in c["logprobs"]}
            for k, v in c["logprobs"].items():
                out["logprobs"][k] += v
    return out


@pytest.mark.parametrize("ids", [False, True])
def test_streamed_logprob_offsets_of_tokens_a_stop_string_cuts_match_the_non_streamed(client: TestClient,
                                                                                      ids: bool) -> None:
    """Tokens held back as a possible start of a stop string that then completes have their offsets moved back to
    the end of the text. Streamed with token ids (a chunk per token), their entries went out before that, with
    offsets past the text's end, unlike the non-streamed answer's."""
    req = {"prompt": "stop here", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    # four ASCII tokens after an ASCII one (a whole character: the first starts at k); three are held back before
    # the fourth completes the stop string
    k = next(i for i in range(2, len(full) - 4) if full[i - 1:i + 4].isascii() and full.find(full[i:i + 4]) == i)
    stop = full[k:k + 4]
    req |= {"stop": stop, "logprobs": 1, "return_token_ids": ids}
    whole = client.post("/v1/completions", json=req).json()["choices"][0]
    assert whole["text"] == full[:k] and whole["finish_reason"] == "stop"
    offsets = whole["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[-4:] == [k] * 4  # the stop string's tokens: at the text's end
    streamed = _merged_completion(_chunks(client.post("/v1/completions", json={**req, "stream": True}).text))
    for key in ("text", "finish_reason", "logprobs"):
        assert streamed[key] == whole[key], key
    if ids:
        assert streamed["token_ids"] == whole["token_ids"]


@pytest.mark.parametrize("part", [{"type": "text"}, {"type": "text", "text": 5}, {"text": None}, {"text": ["a"]}])
def test_a_text_part_without_text_is_a_bad_request(client: TestClient, part: dict) -> None:
    """A text content part whose text is missing or not a string was dropped silently (200, an answer to the
    other parts alone); the README promises a 400 naming the field rather than a silently different answer."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi "}, part]}]
    for url in ("/v1/chat/completions", "/tokenize"):
        r = client.post(url, json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and "text" in err["message"]
    ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi "}, "there"]}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_method_not_allowed_names_the_allowed_methods(client: TestClient) -> None:
    """A 405 must carry Allow (RFC 9110); the OpenAI-shaped error handler dropped the exception's headers."""
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers.get("allow") == "POST"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert set(client.post("/health").headers.get("allow", "").split(", ")) == {"GET", "HEAD"}


@pytest.mark.parametrize("url", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_number_of_too_many_digits_is_a_bad_request(client: TestClient, url: str) -> None:
    """Python's JSON parser raises a plain ValueError (not a JSONDecodeError) for an integer of over 4300 digits:
    it escaped the parse error handling, a plain-text 500 and a dropped connection instead of a 400."""
    r = client.post(url, content=b'{"prompt": "x", "messages": [], "max_tokens": ' + b"1" * 5000 + b"}",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "could not parse the JSON body" in r.json()["error"]["message"]


def test_a_client_gone_before_its_whole_body_is_a_bad_request_not_an_application_error(client: TestClient) -> None:
    """A client that disconnects while sending its body raised ClientDisconnect out of the endpoint: uvicorn logged
    "Exception in ASGI application" with a traceback for what the client did."""
    import asyncio

    messages = [{"type": "http.request", "body": b'{"prompt": "x', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    asyncio.run(client.app(scope, receive, send))  # raised before
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400
    assert b"disconnected" in b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("value", ["no", "false", 0, None])
def test_thinking_switches_of_chat_template_kwargs_are_booleans(client: TestClient, value: object) -> None:
    """vLLM's ``chat_template_kwargs`` thinking switches were read for their truthiness, so the string "false"
    turned thinking on; a value that is not a boolean is a 400 naming the field (null: not given)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template_kwargs": {"enable_thinking": value}}
    r = client.post("/v1/chat/completions", json=body)
    if value is None:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chat_template_kwargs"


def test_health_answers_head_and_a_huge_logit_bias_key_names_its_field(client: TestClient) -> None:
    """HEAD /health (load balancers probe with it) was a 405; a logit_bias token id of thousands of digits got a 400
    naming no field (Python's integer-conversion limit), now the field's own check."""
    assert client.head("/health").status_code == 200
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "logit_bias": {"9" * 5000: 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "logit_bias": {"99999999999": 1}})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"], r.text
