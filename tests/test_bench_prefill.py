"""ds4x bench prefill: the fixture, the rows it writes, the kernel grouping of the profile."""

import hashlib
import json

from ds4x.bench.prefill import FIXTURE_SHA256, PrefillBenchConfig, fixture_ids, fixture_text, run_prefill_bench
from ds4x.bench.profile import OTHER, format_profile, kernel_group, overlap_summary
from ds4x.kernels.quant_matmul import int8_activation_types
from ds4x.runtime.engine import Engine


def test_fixture_is_the_seed_text():
    text = fixture_text()
    assert len(text.encode()) == 6_000_000
    assert hashlib.sha256(text.encode()).hexdigest() == FIXTURE_SHA256
    assert text.startswith("DS4X reproducible prefill benchmark. The quick brown fox")


def test_rows_carry_the_floor_and_flags():
    engine = Engine.load("tiny", device="cpu")
    ids = fixture_ids(engine, 40)
    assert len(ids) == 40 and ids[0] == engine.tokenizer.bos_id
    assert engine.tokenizer.decode(ids[1:]).startswith("DS4X reproducible")
    rows = run_prefill_bench(engine, PrefillBenchConfig(contexts=(24, 40), decode=3, chunk=16), "tiny",
                             log=lambda m: None)
    assert [r["context"] for r in rows] == [24, 40]
    for r in rows:
        assert r["prefill_tok_s"] > 0 and r["decode_ms"] > 0
        assert abs(r["decode_tok_s"] * r["decode_ms"] - 1000) < 1e-6
        assert 0 < r["floor_fraction"] < 1 and r["bytes_per_token"] > 0
        assert r["flags"] == {"cache": "packed", "chunk": 16, "mode": "default", "decode_tokens": 3,
                              "dtype": "float32", "fixture": FIXTURE_SHA256[:16],
                              "int8_activations": int8_activation_types()}
        json.dumps(r)


def test_kernel_groups():
    assert kernel_group("_qmv_kernel") == "quantized matmul (GGML blocks)"
    for name in ("partial_kernel", "prefill_kernel", "combine_kernel"):
        assert kernel_group(name) == "attention"
    assert kernel_group("_moe_combine_kernel") == "MoE routing / SwiGLU / combine"
    assert kernel_group("_hc_pre_kernel") == "mHC pre / post" and kernel_group("_emit_kernel") == "compressor emit"
    assert kernel_group("_indexer_scores_kernel") == kernel_group("score_kernel") == "indexer scoring"
    assert kernel_group("void at::native::vectorized_elementwise_kernel<4, ...>") == OTHER
    assert kernel_group("sm90_xmma_gemm_bf16bf16_bf16f32") == "dense matmul (torch)"
    text = format_profile([{"group": "attention", "us": 30.0, "kernels": 2, "bytes": 3e6,
                            "top": [{"name": "_attn", "us": 30.0, "launches": 2}]}], wall_us=50.0)
    assert "attention" in text and "100.0%" in text and "_attn" in text


def test_overlap_summary_splits_the_span_into_busy_idle_and_overlapped_time():
    """Kernels [0, 4) and [2, 6) overlap by 2 us, then none runs until [8, 9): a 9 us span, 7 busy, 2 idle."""
    timeline = [{"name": "a", "start": 0.0, "end": 4.0}, {"name": "b", "start": 2.0, "end": 6.0},
                {"name": "c", "start": 8.0, "end": 9.0}, {"name": "d", "start": 2.5, "end": 3.0}]
    assert overlap_summary(timeline) == {"span_us": 9.0, "busy_us": 7.0, "idle_us": 2.0, "kernel_us": 9.5,
                                         "overlapped_us": 2.5}
