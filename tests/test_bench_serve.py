"""``ds4x bench serve`` and ``ds4x bench plot``: the metric definitions on hand-made timings, then a few
seconds of closed- and open-loop load on a real ``ds4x serve`` subprocess (the embedded default model, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from ds4x.bench.serve_load import (  # noqa: E402
    LoadConfig,
    Sample,
    server_description,
    server_meta,
    summarize,
    wait_until_healthy,
)
from ds4x.cli.main import main  # noqa: E402
from tests.test_serve import _free_port  # noqa: E402


def test_metric_definitions() -> None:
    # sent at 0.5; chunks of 1, 1 and 2 tokens at 1.0, 1.5 and 2.5 s
    s = Sample(sent=0.5, chunks=[(1.0, 1), (1.5, 1), (2.5, 2)], prompt_tokens=10)
    assert s.tokens == 4 and s.ttft == 0.5
    assert s.itl() == [0.5, 0.5, 0.5]  # the 1 s gap before a 2-token chunk counts 0.5 s per token
    assert s.decode_rate == pytest.approx(3 / 1.5)  # tokens after the first chunk / time after it
    assert s.tpot == pytest.approx(1.5 / 3)
    slow = Sample(sent=0.0, chunks=[(5.0, 1), (9.0, 1)])
    failed = Sample(sent=0.0, chunks=[(0.5, 3)], error="http_503")
    cfg = LoadConfig(url="", ttft_limit=1.0, tpot_limit=1.0)
    row = summarize([s, slow, failed], wall=10.0, cfg=cfg, open_loop=True)
    assert row["requests"] == 3 and row["requests_ok"] == 2 and row["errors"] == {"http_503": 1}
    assert row["output_tokens"] == 6 and row["aggregate_tok_s"] == pytest.approx(0.6)  # failed tokens not counted
    assert row["ttft_max_s"] == 5.0 and row["ttft_p50_s"] == pytest.approx(2.75)
    assert row["goodput_requests"] == 1 and row["goodput_rps"] == pytest.approx(0.1)  # `slow` misses both limits
    assert row["status"] == "errors"


def test_server_counters_only_from_a_ds4x_metrics_text() -> None:
    from ds4x.bench.serve_load import counters_over, parse_counters

    text = "\n".join(["# TYPE ds4x_decode_steps_total counter", "ds4x_decode_steps_total 10", "ds4x_batch_size_sum 40",
                      "ds4x_prefill_steps_total 2", "ds4x_prompt_tokens_total 100", "ds4x_generation_tokens_total 40",
                      "ds4x_decode_step_model_seconds_sum 0.5", "ds4x_decode_step_sample_seconds_sum 0.01",
                      'ds4x_batch_size_bucket{le="4"} 10'])
    assert parse_counters(text)["kernel_compiles"] == 0  # no compile yet: no such series
    before = {k: 0.0 for k in parse_counters(text)}
    after = parse_counters(text + '\nds4x_kernel_compiles_total{kernel="a"} 2\nds4x_kernel_compiles_total{kernel="b"} 1'
                           '\nds4x_kernel_compile_seconds_total{kernel="a"} 1.5')
    c = counters_over(before, after)
    assert c is not None and (c["decode_steps"], c["mean_batch"], c["step_model_ms"]) == (10, 4, 50)
    assert c["step_host_ms"] == pytest.approx(1.0)
    assert (c["kernel_compiles"], c["kernel_compile_s"]) == (3, 1.5)
    assert counters_over(before, parse_counters("vllm:num_requests_running 3")) is None  # another server
    assert counters_over(None, after) is None


def test_server_meta_only_from_a_ds4x_entry() -> None:
    entry = {"id": "m", "object": "model", "ds4x": {"gpu": "cpu", "commit": None}}
    assert server_description({"data": [entry]}, None) == ("m", entry)
    assert server_meta(entry) == {"gpu": "cpu", "commit": None}
    assert server_meta({"id": "m", "object": "model"}) == "unavailable"  # another server: no ds4x object
    # /v1/models unreadable: measurable only with a model name, and nothing is known of the server
    assert server_description(None, "m") == ("m", None) and server_meta(None) == "unavailable"
    with pytest.raises(RuntimeError, match="pass --model"):
        server_description(None, None)


@pytest.fixture(scope="module")
def server() -> str:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "ds4x.cli.main", "serve", "--device", "cpu", "--ctx", "512",
                             "--port", str(port), "-q"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_healthy(url, proc, 90)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_closed_loop_ledger_and_plot(server: str, tmp_path, capsys) -> None:
    ledger = tmp_path / "serve.jsonl"
    assert main(["bench", "serve", "--url", server, "--concurrency", "1,2", "--seconds", "2", "--gen-tokens", "6",
                 "--prompt-tokens", "24", "--temperature", "0", "--ignore-eos", "--ledger", str(ledger)]) == 0
    rows = _rows(ledger)
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("closed", 1), ("closed", 2)]
    assert len({r["run_id"] for r in rows}) == 1
    for r in rows:
        assert {"commit", "date", "model", "server_model", "server_meta", "client", "flags", "warmup_s",
                "prompt_tokens_target", "prompt_tokens_mean", "gen_tokens", "errors", "status"} <= set(r)
        assert r["bench"] == "serve" and r["model"] == "default" and r["server_model"]["id"] == "default"
        # the server's own description (its /v1/models "ds4x" object), recorded once, not inside server_model
        sm = r["server_meta"]
        assert sm["gpu"] == "cpu" and sm["device"] == "cpu" and sm["torch"] and sm["cache"] == "packed"
        assert sm["dtype"] == "float32" and len(sm["model_fingerprint"]) == 64 and sm["model"]
        assert {"version", "commit", "driver", "triton"} <= set(sm) and "ds4x" not in r["server_model"]
        assert r["client"]["torch"] and r["flags"]["ignore_eos"] is True and r["flags"]["shared_prefix"] is False
        assert r["errors"] == {} and r["status"] == "ok" and r["requests"] == r["requests_ok"] >= 1
        assert r["output_tokens"] == 6 * r["requests_ok"]  # --ignore-eos: every request returned 6 token ids
        assert 12 <= r["prompt_tokens_mean"] <= 48  # about --prompt-tokens on the server's tokenizer
        assert r["aggregate_tok_s"] > 0 and r["per_stream_tok_s_median"] > 0 and r["per_stream_tok_s_p10"] > 0
        assert 0 < r["ttft_p50_s"] <= r["ttft_max_s"] and r["itl_p99_ms"] > 0
        assert r["wall_s"] >= 2
        c = r["server_counters"]  # the server's own counters over the level
        assert c["generation_tokens"] >= r["output_tokens"] and c["decode_steps"] > 0 and c["prefill_calls"] >= 1
        assert 1 <= c["mean_batch"] <= r["concurrency"] and c["step_model_ms"] > 0 and c["step_host_ms"] >= 0
    out = capsys.readouterr().out
    assert "appended 2 rows" in out and f"server: ds4x {sm['version']}" in out

    assert main(["bench", "plot", str(ledger), "--out", str(tmp_path / "plots" / "serve")]) == 0
    png, svg = tmp_path / "plots" / "serve.png", tmp_path / "plots" / "serve.svg"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in svg.read_text()


def test_a_level_whose_requests_all_fail_exits_non_zero(server: str, tmp_path, capsys) -> None:
    """Requests the server refuses (more tokens than its context): the row is kept with its errors, and the
    exit status says the level measured nothing (it was 0)."""
    ledger = tmp_path / "failed.jsonl"
    assert main(["bench", "serve", "--url", server, "--concurrency", "1", "--seconds", "1", "--gen-tokens",
                 "100000", "--ledger", str(ledger)]) == 1
    (r,) = _rows(ledger)
    assert r["requests_ok"] == 0 and r["status"] == "errors" and r["errors"]
    assert "every request at concurrency 1 failed" in capsys.readouterr().err


def test_open_loop_goodput(server: str, tmp_path) -> None:
    ledger = tmp_path / "open.jsonl"
    assert main(["bench", "serve", "--url", server, "--rate", "2", "--seconds", "2", "--gen-tokens", "3",
                 "--prompt-tokens", "16", "--shared-prefix", "--ttft-limit", "1000", "--tpot-limit", "1000",
                 "--ledger", str(ledger)]) == 0
    (r,) = _rows(ledger)
    assert r["mode"] == "open" and r["rate"] == 2 and r["concurrency"] is None and r["flags"]["shared_prefix"]
    assert r["errors"] == {} and r["requests"] >= 1
    # limits nobody misses: every successful request counts
    assert r["goodput_requests"] == r["requests_ok"] and r["goodput_rps"] == pytest.approx(r["requests"] / r["wall_s"])
    assert main(["bench", "plot", str(ledger)]) == 0
    assert (tmp_path / "open_open.png").exists() and (tmp_path / "open_open.svg").exists()
