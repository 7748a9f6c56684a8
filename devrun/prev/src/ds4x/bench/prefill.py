"""Prefill + decode benchmark on the DESIGN §7 fixture (``ds4x bench prefill``).

For each context N: a fresh session of N + decode tokens, a real prefill of the fixture's first N tokens
(the fixture is the seed's prefill text, checked by SHA-256), then greedy decode. The decode rate excludes
the first generated token (it comes from the prefill's logits) and averages the steps that follow. Before
any timing, a scratch session prefills and decodes a few tokens so Triton compilation is not measured.

Rows carry the DESIGN §7 floor: ``bytes_per_token`` is the weight bytes one decode token must read
(``active_weight_bytes``: all dense weights, ``n_experts_per_tok`` routed experts per layer, one embedding
row); ``floor_fraction`` is that over the copy bandwidth, divided by the measured step time.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds4x.bench.frontier import COPY_BANDWIDTH
from ds4x.kernels.quant_matmul import int8_activation_types
from ds4x.runtime.engine import Engine
from ds4x.weights.synthetic_gguf import active_weight_bytes, weight_bytes

FIXTURE_LINE = ("DS4X reproducible prefill benchmark. The quick brown fox jumps over the lazy dog. Compressed sparse "
                "attention and mixture of experts are measured on NVIDIA GB10.\n")
FIXTURE_BYTES = 6_000_000
FIXTURE_SHA256 = "ee9ef79daa0f0adbe3972bebe6a404c19a65c829f19e1c34d84fb6f12c4ff645"


def fixture_text() -> str:
    """The prefill fixture: the line repeated and cut at 6,000,000 bytes (checked against its SHA-256)."""
    data = (FIXTURE_LINE * (FIXTURE_BYTES // len(FIXTURE_LINE) + 1)).encode()[:FIXTURE_BYTES]
    digest = hashlib.sha256(data).hexdigest()
    if digest != FIXTURE_SHA256:  # pragma: no cover - guards edits of the constants above
        raise RuntimeError(f"prefill fixture SHA-256 {digest} != {FIXTURE_SHA256}")
    return data.decode()


def fixture_ids(engine: Engine, n: int) -> list[int]:
    """The first ``n`` tokens of the fixture with the model's tokenizer (BOS first when it has one)."""
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("the model has no tokenizer to encode the prefill fixture with")
    text = fixture_text()
    head = [tok.bos_id] if tok.bos_id is not None else []
    # encode a prefix that certainly holds n tokens (every token covers at least one byte)
    ids = head + tok.encode(text[: 8 * n])
    if len(ids) < n:
        ids = head + tok.encode(text)
    if len(ids) < n:
        raise ValueError(f"the fixture gives only {len(ids)} tokens with this tokenizer, {n} asked")
    return ids[:n]


@dataclass
class PrefillBenchConfig:
    contexts: tuple[int, ...] = (4096, 16384)
    decode: int = 32
    # H200, flash:q2, 16K fixture: 2,327 tok/s with 4,096-token chunks against 1,874 with 2,048 (the routed experts'
    # bf16 decode is paid once per chunk); at 4K before the prefill fast paths, 844 (2,048) against 630 (512)
    chunk: int = 4096
    mode: str = "default"
    cache: str = "packed"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_prefill_bench(engine: Engine, bc: PrefillBenchConfig, model_label: str,
                      log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One ledger row per context."""
    if bc.decode < 2:
        raise ValueError("--decode must be at least 2 (the rate excludes the first token)")
    dev = engine.model.device
    w = engine.model.w
    active, resident = active_weight_bytes(engine.cfg, w), weight_bytes(w)
    log(f"weights resident {resident / 2**30:.2f} GiB, {active / 1e9:.2f} GB read per decode token "
        f"(floor {1000 * active / COPY_BANDWIDTH:.2f} ms at {COPY_BANDWIDTH / 1e12:.2f} TB/s)")
    # warm-up: one full chunk and a partial one, so that every kernel variant a timed prefill meets (routed products
    # past the matvec range, each layer kind's attention) is compiled before the clock starts
    warm = bc.chunk + 256
    scratch = engine.new_session(warm + 8, bc.cache, bc.chunk, bc.mode, announce=False)
    logits = scratch.prefill(fixture_ids(engine, warm))
    for _ in range(4):
        logits = scratch.step(int(logits.argmax()))
    del scratch
    rows = []
    for n in bc.contexts:
        ids = fixture_ids(engine, n)
        session = engine.new_session(n + bc.decode, bc.cache, bc.chunk, bc.mode)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        _sync(dev)
        t0 = time.perf_counter()
        logits = session.prefill(ids, progress=lambda done, total: None)
        token = int(logits.argmax())  # syncs
        t_prefill = time.perf_counter() - t0
        stamps = []
        for _ in range(bc.decode - 1):
            token = int(session.step(token).argmax())
            stamps.append(time.perf_counter())
        step_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else stamps[0] - t0 - t_prefill
        row = {
            "bench": "prefill", "context": n, "model": model_label,
            "flags": {"cache": bc.cache, "chunk": bc.chunk, "mode": bc.mode, "decode_tokens": bc.decode,
                      "dtype": str(engine.model.dtype).removeprefix("torch."), "fixture": FIXTURE_SHA256[:16],
                      "int8_activations": int8_activation_types()},
            "prefill_tok_s": n / t_prefill, "prefill_s": t_prefill,
            "decode_ms": 1000 * step_s, "decode_tok_s": 1 / step_s,
            "bytes_per_token": active, "floor_fraction": active / COPY_BANDWIDTH / step_s,
            "resident_weight_bytes": resident, "cache_bytes": session.cache.plan["total"],
        }
        if dev.type == "cuda":
            row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev)
        rows.append(row)
        log(f"ctx {n:>6}: prefill {row['prefill_tok_s']:.0f} tok/s ({t_prefill:.2f} s), decode "
            f"{row['decode_ms']:.2f} ms/token = {row['decode_tok_s']:.1f} tok/s "
            f"({100 * row['floor_fraction']:.1f}% of the bandwidth floor)")
        del session
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows
