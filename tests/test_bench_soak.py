"""``ds4x bench soak`` on the embedded model (CPU): the row, the samples and the argument checks."""

import pytest

from ds4x.bench.report import render
from ds4x.bench.soak import SoakConfig, host_rss_bytes, run_soak
from ds4x.runtime.engine import Engine


@pytest.fixture(scope="module")
def engine():
    return Engine.load("default", device="cpu")


def test_soak_row(engine):
    logs = []
    row = run_soak(engine, SoakConfig(steps=40, every=10, prompt=8), "default", log=logs.append)
    assert row["bench"] == "soak" and row["context"] == 8 + 40 + 1
    assert [s["step"] for s in row["samples"]] == [10, 20, 30, 40] and len(logs) == 4
    assert row["host_rss_growth_bytes"] == row["samples"][-1]["host_rss_bytes"] - row["samples"][0]["host_rss_bytes"]
    assert row["decode_ms"] > 0 and row["first_interval_decode_ms"] > 0
    assert "device_allocated_growth_bytes" not in row  # CPU: no device memory to report
    assert host_rss_bytes() > 0
    page = render([{**row, "date": "2026-12-02T08:00", "commit": "abc1234", "gpu": "none"}], "ledger.jsonl")
    assert "## Long decode: memory over one session" in page and "| none | default | 40 | 49 |" in page


def test_soak_rejects_bad_arguments(engine):
    with pytest.raises(ValueError, match="at least two sampling intervals"):
        run_soak(engine, SoakConfig(steps=10, every=10), "default")
    too_long = engine.cfg.max_position_embeddings
    with pytest.raises(ValueError, match="over the model's maximum"):
        run_soak(engine, SoakConfig(steps=too_long, every=too_long // 2), "default")
