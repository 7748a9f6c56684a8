"""Benchmark plumbing (on the CPU; on the GPU where there is one): the frontier run end to end at tiny shapes,
ledger rows, report."""

import json

import torch

from ds4x.bench import ledger
from ds4x.bench.frontier import FrontierConfig, run_frontier
from ds4x.bench.report import write_report
from ds4x.kernels.quant_matmul import int8_activation_types


def test_frontier_dry_run_writes_ledger_rows_and_report(tmp_path):
    # on the GPU where there is one: CPU tensors reach the Triton kernels only through the interpreter, which the
    # test session turns on only on a machine without CUDA
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = run_frontier(FrontierConfig(contexts=(300,), steps=1, preset="tiny", device=device, ab=("keys",)),
                        log=lambda m: None)
    assert [r["flags"]["topk"] for r in rows] == ["radix", "keys"]
    assert all(r["flags"]["int8_activations"] == int8_activation_types() for r in rows)
    # (a CUDA graph only on the GPU)
    assert all(r["compressed_eager_ms"] > 0 and (r["compressed_graph_ms"] is None) == (device == "cpu")
               for r in rows)
    assert all(r["decode_ms"] > 0 and r["csa_indexer_us"] > 0 for r in rows)
    path = tmp_path / "ledger.jsonl"
    ledger.append([{**ledger.environment(), **r} for r in rows], path)
    stored = [json.loads(line) for line in path.read_text().splitlines()]
    assert {"commit", "date", "gpu", "torch", "triton", "model", "flags", "context", "decode_ms"} <= set(stored[0])
    write_report(path, tmp_path / "B.md")
    assert "| 300 |" in (tmp_path / "B.md").read_text()


def test_frontier_variants_alternate_with_the_defaults_and_are_marked(monkeypatch):
    # a module switch is set only while its variant is measured (the kernels see it then) and restored after
    import ds4x.bench.frontier as F
    from ds4x.kernels import attention as A

    device = "cuda" if torch.cuda.is_available() else "cpu"
    seen = []

    def attention_seen(*args, **kwargs):
        seen.append(A.BATCH_SPLIT_WAVES)
        return A.attention_decode_triton(*args, **kwargs)

    monkeypatch.setattr(F, "attention_decode_triton", attention_seen)
    spec = "two waves: ds4x.kernels.attention.BATCH_SPLIT_WAVES=2"
    rows = run_frontier(FrontierConfig(contexts=(300,), steps=1, preset="tiny", device=device, variants=(spec,)),
                        log=lambda m: None)
    assert [r.get("status") for r in rows] == [None, "variant", None, "variant"]
    assert [r.get("variant") for r in rows] == [None, spec, None, spec]
    assert set(seen) == {1, 2} and A.BATCH_SPLIT_WAVES == 1


def test_ledger_commit_named_by_the_caller(monkeypatch):
    # an exported tree's git metadata may belong to another checkout: DS4X_COMMIT names what was measured
    monkeypatch.setenv("DS4X_COMMIT", "feedbee")
    assert ledger.environment()["commit"] == "feedbee"
    monkeypatch.delenv("DS4X_COMMIT")
    assert ledger.provenance()["commit"] != "feedbee"


def test_cache_comparison_native_equals_packed():
    from ds4x.bench.cache_quality import compare_caches
    from ds4x.runtime.engine import Engine

    report = compare_caches(Engine.load("tiny", device="cpu"), list(range(3, 200)), gen=16, chunk=32)
    assert report["native_vs_packed"]["max_abs_over_max_logit"] == 0.0
    assert report["native_vs_packed"]["greedy_tokens_equal_fraction"] == 1.0
    assert report["native_vs_packed"]["topk_overlap"] == 1.0
    assert report["float_vs_native"]["max_abs_over_max_logit"] > 0


def _report_of(tmp_path, row: dict) -> str:
    """docs/BENCHMARKS.md as rendered from a ledger holding ``row`` alone."""
    path = tmp_path / "ledger.jsonl"
    path.write_text(json.dumps(row) + "\n")
    write_report(path, tmp_path / "BENCHMARKS.md")
    return (tmp_path / "BENCHMARKS.md").read_text()


def test_report_has_the_prefill_table(tmp_path):
    row = {"bench": "prefill", "date": "2026-12-01T08:32:00", "commit": "abc", "gpu": "NVIDIA H200",
           "model": "synthetic flash:q2, seed 0", "context": 4096, "prefill_tok_s": 98.0, "decode_ms": 37.81,
           "decode_tok_s": 26.4, "floor_fraction": 0.06, "note": "graph"}
    text = _report_of(tmp_path, row)
    assert "## Full model" in text
    assert "| 4,096 | 98 | 37.81 | 26.4 | 6.0% | - | ok | graph |" in text
    assert "Server under load" not in text
    serve = {"bench": "serve", "date": "2026-12-02T18:23:50", "commit": "abc", "model": "flash:q2", "run_id": "r1",
             "mode": "closed", "concurrency": 8, "requests": 24, "errors": {"http_429": 1}, "aggregate_tok_s": 87.61,
             "per_stream_tok_s_median": 11.6, "ttft_p50_s": 0.755, "itl_p99_ms": None,
             "server_meta": {"gpu": "NVIDIA H200"}, "note": "n"}
    (tmp_path / "serve.jsonl").write_text(json.dumps(serve) + "\n")
    write_report(tmp_path / "ledger.jsonl", tmp_path / "BENCHMARKS.md", tmp_path / "serve.jsonl")
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| abc | NVIDIA H200 | flash:q2 | r1 | 8 | 24 | 1 | 87.6 | 11.6 | 0.755 | - | - | ok | n |" in text


def test_report_has_the_long_decode_table(tmp_path):
    row = {"bench": "long_decode", "date": "2026-12-04T06:20:18", "commit": "abc", "gpu": "none", "model": "default",
           "device": "cpu", "flags": {"steps": 10000}, "decode_ms": 25.93,
           "growth_mib": {"rss": 4.48, "cuda_allocated": 0.0, "cuda_reserved": 0.0}, "status": "failed"}
    text = _report_of(tmp_path, row)
    assert "## Long decode runs" in text
    assert "| abc | none | default | cpu | 10,000 | 25.93 | +4.5 / +0.0 / +0.0 | failed |" in text
