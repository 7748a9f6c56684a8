"""Quality gates on the embedded trained model (src/ds4x/assets/tiny_v4): CPU, float32.

The fast tests use short slices (seconds); the `slow` ones reproduce the figures of docs/TRAINING.md
(about 2 minutes). Gates the shipped model misses are strict xfails: a better model must remove them.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from ds4x.assets import default_model_path
from ds4x.config import CSA, HCA, SLIDING
from ds4x.runtime import quality as Q
from ds4x.runtime.engine import Engine
from ds4x.weights.checkpoint import load_checkpoint

MODEL = default_model_path()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(str(MODEL), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def heldout() -> str:
    return Q.heldout_text()


# ---- the artifact -------------------------------------------------------------------------------

def test_default_model_has_every_feature_and_fits_the_native_cache():
    cfg, weights = load_checkpoint(MODEL)
    assert set(cfg.attn_kinds) == {SLIDING, CSA, HCA}
    assert {r for k, r in zip(cfg.attn_kinds, cfg.compress_ratios, strict=True) if k == CSA} == {4}
    assert min(r for k, r in zip(cfg.attn_kinds, cfg.compress_ratios, strict=True) if k == HCA) >= 16
    assert cfg.mlp_hash[0] and not all(cfg.mlp_hash) and cfg.n_shared_experts == 1
    assert cfg.hc_mult == 4 and cfg.compress_rope_scaling is not None
    assert cfg.native_cache_error() is None
    log = json.loads((MODEL / "train_log.json").read_text())
    trained_ctx = max(phase[1] for phase in log["phases"])  # (end fraction, length, batch, retrieval share)
    assert cfg.index_topk < trained_ctx // 4  # the indexer really selects at training length
    assert 4_000_000 < sum(t.numel() for t in weights.values()) < 17_000_000  # CPU CI runs it: at most ~2x 8.2M


def test_artifact_files_are_small():
    files = [f for f in MODEL.iterdir() if f.is_file()]
    assert all(f.stat().st_size <= 16 * 2**20 for f in files)
    assert sum(f.stat().st_size for f in files if "safetensors" in f.name) < 40_000_000


def test_train_log_records_command_time_curve_and_split():
    log = json.loads((MODEL / "train_log.json").read_text())
    assert log["command"].startswith("PYTHONPATH=src python scripts/train_tiny.py")
    assert log["train_seconds"] > 0 and log["steps"] > 0
    curve = log["loss_curve"]
    assert len(curve) >= 10 and curve[-1]["text_loss"] < curve[0]["text_loss"]
    assert "sha1" in log["heldout_rule"]


def test_tokenizer_specials_match_the_config(engine):
    tok = engine.tokenizer
    assert tok is not None
    assert tok._tok.token_to_id("<bos>") == engine.cfg.bos_token_id == 0
    assert tok._tok.token_to_id("<eos>") == engine.cfg.eos_token_ids[0] == 1
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok.encode(text)) == text


# ---- helpers ------------------------------------------------------------------------------------

def test_unigram_perplexity_of_uniform_tokens_is_the_alphabet_size():
    ids = list(range(8)) * 1000
    assert Q.unigram_perplexity(ids, vocab_size=8) == pytest.approx(8.0, rel=1e-3)


def test_cut_function_stops_at_the_functions_own_level():
    src, done = Q.cut_function("def f(x):\n    return (x +\n)\n\ny = 1\n")
    assert done and src == "def f(x):\n    return (x +\n)\n\n"
    src, done = Q.cut_function("def f(self):\n        a = 1\n        return a\n\n    def g(self):\n")
    assert done and src == "def f(self):\n    a = 1\n    return a\n\n"  # a method, dedented
    src, done = Q.cut_function("def f(x):\n    a = 1\n    b = (")
    assert not done and src == "def f(x):\n    a = 1\n"


def test_healed_prompt_moves_the_trailing_space_into_the_first_token(engine):
    ids, mask = Q.healed_prompt(engine.tokenizer, engine.cfg.vocab_size, "def ")
    assert ids == engine.tokenizer.encode("def") and mask is not None
    allowed = [engine.tokenizer.decode([i]) for i in range(engine.cfg.vocab_size) if mask[i]]
    assert " main" in allowed or " get" in allowed
    assert all(a.startswith(" ") and not a[1].isspace() for a in allowed)


def test_question_repeats_the_fact_lines_tokens(engine):
    # the gate encodes the question apart from the prompt; training builds it as the fact line's prefix
    tok = engine.tokenizer
    for key, value in Q.distinct_facts(random.Random(0), 20):
        question, answer = tok.encode(Q.fact_question(key)), tok.encode(Q.fact_answer(value) + "\n")
        assert tok.encode(Q.fact_line(key, value)) == question + answer
        assert tok.encode("x = 1\n" + Q.fact_line(key, value)) == tok.encode("x = 1\n") + question + answer


def test_training_answers_copy_the_planted_fact(engine, heldout):
    # scripts/train_tiny.py's retrieval rows: every answer target is the token its fact distance back, and
    # only answers carry the answer weight (a shifted label or weight would train on the wrong token)
    import importlib.util
    from pathlib import Path

    import numpy as np

    path = Path(__file__).resolve().parents[1] / "scripts" / "train_tiny.py"
    spec = importlib.util.spec_from_file_location("train_tiny", path)
    tt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tt)
    tok = engine.tokenizer._tok
    batcher = tt.Batcher(tt.encode_docs(tok, [heldout[:60_000]]), tok, seed=0, answer_weight=4.0, max_facts=16)
    x, w, dist = (t.numpy() for t in batcher.batch(4, 512, 1.0))
    rows, targets = np.nonzero(dist >= 0)
    assert len(targets) > 4 * 2 * 3  # at least 2 facts of 3+ answer tokens per row
    assert (x[rows, targets + 1] == x[rows, targets + 1 - dist[rows, targets]]).all()
    assert (w[dist >= 0] == 4.0).all() and (w[dist < 0] == 1.0).all()
    ok, far = tt.answers(torch.ones(x[:, 1:].shape, dtype=torch.bool), torch.from_numpy(dist))
    assert ok.all() and len(ok) == len(np.split(targets, np.nonzero(np.diff(targets) != 1)[0] + 1))


def test_recall_prompt_plants_every_fact_once(engine, heldout):
    rng = random.Random(3)
    facts = Q.distinct_facts(rng, 5)
    text = Q.recall_prompt(engine.tokenizer, heldout, 600, facts, rng)
    for k, v in facts:
        assert text.count(Q.fact_line(k, v)) == 1
    assert text.endswith("\n") and 500 < len(engine.tokenizer.encode(text)) <= 600


# ---- quality (fast slices) -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def short_ppl(engine, heldout) -> dict[str, float]:
    d = Q.perplexity_delta(engine, heldout, window=384, max_tokens=384)
    d["unigram"] = Q.unigram_perplexity(engine.tokenizer.encode(heldout)[:384], engine.cfg.vocab_size)
    return d


def test_heldout_perplexity_is_far_below_unigram(short_ppl):
    assert short_ppl["ppl_float"] < 0.1 * short_ppl["unigram"], short_ppl


def test_native_cache_changes_perplexity_by_under_one_percent(short_ppl):
    assert abs(short_ppl["rel_delta"]) < 0.01, short_ppl


def test_float_and_native_greedy_agree(engine):
    prompt = [engine.cfg.bos_token_id, *engine.tokenizer.encode("import os\n\n\ndef main(argv):\n")]
    r = Q.greedy_agreement(Q.RunConfig(engine, "float"), Q.RunConfig(engine, "native"), prompt, n_tokens=12)
    assert r["teacher_forced"] >= 0.9, r


def test_def_prompt_continues_as_python(engine):
    session = engine.new_session(ctx=128, cache="float")
    # (no trailing newline or space: byte-level BPE glues them to the next line's indentation / word)
    prompt = [engine.cfg.bos_token_id, *engine.tokenizer.encode("def fibonacci(n):")]
    text = engine.tokenizer.decode([t for t, _ in session.generate(prompt, 24)])
    assert text.startswith("\n    ")  # an indented body
    assert any(word in text for word in ("return", "if", "for", "\"\"\"", "=", "("))


def test_weight_type_table_reports_each_type_and_q8_0_keeps_perplexity():
    table = Q.weight_type_table("default", ("Q8_0", "IQ2_XXS"), max_tokens=512, n_greedy=16)
    ref, q8, iq2 = table.rows
    assert ref.greedy is None and [q8.label, iq2.label] == ["Q8_0", "IQ2_XXS"]
    assert q8.types["experts"] == q8.types["experts_down"] == q8.types["attn"] == q8.types["shared"] == "Q8_0"
    # IQ2_XXS blocks hold 256 values; the routed down projection's rows (moe_intermediate_size 128) are not
    # whole blocks, so the writer would refuse it and it keeps the mix's Q8_0
    assert iq2.types["experts"] == "IQ2_XXS" and iq2.types["experts_down"] == iq2.types["attn"] == "Q8_0"
    assert iq2.convert_args == ["--mix", "q8", "--type-experts", "IQ2_XXS"]
    assert ref.ppl.tokens == q8.ppl.tokens == iq2.ppl.tokens == 512
    # measured on these 512 tokens: Q8_0 +0.030% (-0.03% over 2048, docs/QUALITY.md), IQ2_XXS +7.8%: the
    # bounds leave >10x margin on Q8_0 and still tell a file whose quantized experts were not used
    assert abs(q8.rel_delta) < 0.005, q8
    assert iq2.rel_delta > 0.01, iq2
    assert q8.greedy is not None and q8.greedy["teacher_forced"] == 1.0, q8.greedy


# ---- the figures of docs/TRAINING.md (slow: about 2 minutes on 2 cores) ------------------------------------

@pytest.mark.slow
def test_heldout_perplexity_and_native_delta_over_8k_tokens(engine, heldout):
    d = Q.perplexity_delta(engine, heldout, window=2048, max_tokens=8192)
    ids = engine.tokenizer.encode(heldout)[:8192]
    assert d["ppl_float"] < 0.1 * Q.unigram_perplexity(ids, engine.cfg.vocab_size), d
    assert abs(d["rel_delta"]) < 0.01, d


@pytest.mark.slow
def test_greedy_agreement_over_256_tokens(engine):
    prompt = [engine.cfg.bos_token_id, *engine.tokenizer.encode("class Config:\n")]
    r = Q.greedy_agreement(Q.RunConfig(engine, "float"), Q.RunConfig(engine, "native"), prompt, n_tokens=256)
    assert r["teacher_forced"] >= 0.9, r


@pytest.mark.slow
def test_sampled_function_bodies_parse(engine):
    res = Q.parse_rate(engine, n=20, seed=0)
    assert all(s.startswith("def") for s in res.samples)
    assert res.parsed >= 10, res.samples


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["float", "native", "packed"])
def test_recall_at_2k(engine, heldout, cache):
    r = Q.recall(engine, heldout, 2048, n_prompts=2, n_facts=10, cache=cache, seed=1)
    assert r.rate >= 0.9, (r.correct, r.asked, r.misses)


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["float", "native", "packed"])
def test_recall_at_8k(engine, heldout, cache):
    r = Q.recall(engine, heldout, 8192, n_prompts=2, n_facts=10, cache=cache, seed=1)
    assert r.rate >= 0.9, (r.correct, r.asked, r.misses)
