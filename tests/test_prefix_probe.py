"""Prefix reuse through the server, probed against a server without it: greedy answers must be the same."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from ds4x.runtime.engine import Engine  # noqa: E402
from ds4x.runtime.prefix_cache import PrefixCache  # noqa: E402
from ds4x.serve import create_app  # noqa: E402

CTX, CHUNK = 256, 8


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load("tiny", device="cpu")


def _client(engine: Engine, prefix_cache: PrefixCache | None) -> TestClient:
    app = create_app(engine, "tiny", CTX, "packed", prefill_chunk=CHUNK, kv_budget=2**30, prefix_cache=prefix_cache)
    return TestClient(app)


def _ids(client: TestClient, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
                                             "ignore_eos": True, "return_token_ids": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def test_a_longer_stored_session_rewound_to_a_chunk_boundary_gives_the_fresh_answer(engine: Engine) -> None:
    # the stored session ran past the prompt; its shared prefix (len(prompt) - 1) is within its packed rings' reach
    # but the chunk boundary below it is not: rewinding there after restoring at the shared prefix read ring rows
    # that later tokens had overwritten
    first = [(7 * i + 3) % 200 + 1 for i in range(20)]
    with _client(engine, None) as ref:
        stored = first + _ids(ref, first, 10)[0]
        for n in (22, 23, 24):  # shared prefixes of 21..23 tokens, cut to the chunk boundary 16
            with _client(engine, PrefixCache(engine, 2**28)) as reuse:
                _ids(reuse, first, 10)  # stored: a session of 29 tokens
                assert _ids(reuse, stored[:n], 4) == _ids(ref, stored[:n], 4), n
