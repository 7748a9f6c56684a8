"""Synthetic quantized models built on the device equal the synthetic GGUF file of the same seed."""

import pytest
import torch

from ds4x.config import tiny_config
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.weights.gguf import load_gguf
from ds4x.weights.gguf_writer import write_synthetic_gguf
from ds4x.weights.synthetic_gguf import (
    active_weight_bytes,
    expected_distinct_experts,
    synthetic_quantized_weights,
    weight_bytes,
)

pytest.importorskip("gguf")


def test_in_memory_equals_the_file(tmp_path):
    cfg = tiny_config().replace(hidden_size=256, moe_intermediate_size=256)
    path = tmp_path / "syn.gguf"
    write_synthetic_gguf(path, cfg, "q2", seed=5)
    _, from_file, _ = load_gguf(path, dtype=torch.bfloat16)
    built = synthetic_quantized_weights(cfg, "q2", seed=5, dtype=torch.bfloat16, device="cpu")
    assert built.keys() == from_file.keys()
    for name, a in built.items():
        b = from_file[name]
        assert type(a) is type(b), name
        if isinstance(a, GGMLTensor):
            assert a.qtype == b.qtype and a.shape == b.shape, name
            assert torch.equal(a.raw, b.raw), name
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert built["layers.2.ffn.experts.w1"].qtype.name == "IQ2_XXS"
    assert built["layers.2.ffn.experts.w2"].qtype.name == "Q2_K"
    assert built["layers.0.attn.wq_a.weight"].qtype.name == "Q8_0"


def test_active_bytes_count_top_k_experts_and_one_embedding_row():
    cfg = tiny_config().replace(hidden_size=256, moe_intermediate_size=256)
    w = synthetic_quantized_weights(cfg, "q8", seed=0, device="cpu")
    experts = sum(t.nbytes for n, t in w.items() if ".ffn.experts." in n)
    embed = w["embed.weight"].numel() * w["embed.weight"].element_size()
    hashes = sum(t.numel() * t.element_size() for n, t in w.items() if n.endswith("tid2eid"))
    rest = weight_bytes(w) - experts - embed - hashes
    want = rest + experts * cfg.n_experts_per_tok // cfg.n_routed_experts + embed // cfg.vocab_size \
        + hashes // cfg.vocab_size
    assert active_weight_bytes(cfg, w) == want
    assert active_weight_bytes(cfg, w) < weight_bytes(w)


def test_a_batched_step_reads_the_expected_distinct_experts_once():
    cfg = tiny_config().replace(hidden_size=256, moe_intermediate_size=256)
    w = synthetic_quantized_weights(cfg, "q8", seed=0, device="cpu")
    n, k = cfg.n_routed_experts, cfg.n_experts_per_tok
    assert expected_distinct_experts(cfg, 1) == pytest.approx(k)
    g = torch.Generator().manual_seed(0)
    for tokens in (2, 8, 32):  # against routes drawn at random: k distinct experts a token
        met = [len({int(e) for _ in range(tokens) for e in torch.randperm(n, generator=g)[:k]}) for _ in range(2000)]
        assert expected_distinct_experts(cfg, tokens) == pytest.approx(sum(met) / len(met), rel=0.02)
    experts = sum(t.nbytes for name, t in w.items() if ".ffn.experts." in name)
    rows = sum(t.numel() * t.element_size() // cfg.vocab_size for name, t in w.items()
               if name == "embed.weight" or name.endswith("tid2eid"))  # one row of each a token
    one, many = active_weight_bytes(cfg, w), active_weight_bytes(cfg, w, tokens=32)
    want = experts * (expected_distinct_experts(cfg, 32) - k) / n + 31 * rows
    assert many - one == pytest.approx(want, abs=cfg.num_layers * 3)  # (rounded once per expert tensor)
    assert expected_distinct_experts(cfg, 10_000) == pytest.approx(n)  # every expert, once
    with pytest.raises(ValueError, match="at least 1"):
        expected_distinct_experts(cfg, 0)


def test_engine_loads_a_synthetic_mix_and_runs():
    from ds4x.runtime.engine import Engine

    with pytest.raises(Exception, match="multiple of the IQ2_XXS block size"):
        Engine.load("tiny:q2", device="cpu")  # tiny's 128-wide rows are not whole K-quant blocks
    e = Engine.load("tiny:q8", device="cpu")
    assert isinstance(e.model.w["layers.0.attn.wq_a.weight"], GGMLTensor)
    s = e.new_session(64, cache="packed")
    logits = s.prefill([1, 2, 3])
    assert logits.shape == (e.cfg.vocab_size,) and torch.isfinite(logits).all()


def test_a_synthetic_mix_may_keep_fewer_routed_experts():
    """``PRESET:POLICY:EXPERTS`` (flash:q2:128 fits an 80 GB GPU): the experts' tensors shrink, top-k routing stays,
    and a count outside [top-k, the preset's] is refused with the range named."""
    from ds4x.runtime.engine import Engine, synthetic_quantized_spec

    full, _ = synthetic_quantized_spec("flash:q2")
    half, policy = synthetic_quantized_spec("flash:q2:128")
    assert (full.n_routed_experts, half.n_routed_experts, policy) == (256, 128, "q2")
    assert half.n_experts_per_tok == full.n_experts_per_tok == 6
    assert synthetic_quantized_spec("tiny") is None and synthetic_quantized_spec("model.gguf") is None
    for bad in ("flash:q2:5", "flash:q2:257", "flash:q2:many"):
        with pytest.raises(ValueError, match="from 6 .* to 256"):
            synthetic_quantized_spec(bad)
    base = Engine.load("tiny:q8", device="cpu")
    k = base.cfg.n_experts_per_tok
    e = Engine.load(f"tiny:q8:{k}", device="cpu")
    assert e.cfg.n_routed_experts == k < base.cfg.n_routed_experts
    assert e.model.w["layers.3.ffn.experts.w1"].shape[0] == k
    logits = e.new_session(64, cache="packed").prefill([1, 2, 3])
    assert torch.isfinite(logits).all()


def test_experts_by_slot_matches_by_expert():
    """The fused routed-experts form (decode on the GPU) against the per-expert reference."""
    from ds4x.model.moe import combine, experts_by_expert, experts_by_slot

    cfg = tiny_config().replace(hidden_size=256, moe_intermediate_size=256)
    w = synthetic_quantized_weights(cfg, "q2", seed=2, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, cfg.hidden_size, generator=g)
    ids = torch.tensor([[0, 5], [5, 7], [2, 0]])
    weights = torch.rand(3, 2, generator=g)
    p = "layers.3.ffn.experts."
    experts = (w[p + "w1"], w[p + "w3"], w[p + "w2"])
    ref = experts_by_expert(x, *experts, ids, weights, cfg.swiglu_limit)
    fast = combine(experts_by_slot(x, *experts, ids, cfg.swiglu_limit), weights, torch.zeros_like(x))
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_a_synthetic_model_that_cannot_fit_is_refused_up_front(monkeypatch):
    """The weights' bytes are compared with the device's free memory before any is made (flash:q2 on a CPU with
    22 GiB free grew past 8 GiB before it was stopped); with room, the weights take about what was planned."""
    import ds4x.weights.synthetic_gguf as S

    cfg = tiny_config(512).replace(hidden_size=256, moe_intermediate_size=256)
    monkeypatch.setattr(S, "free_memory", lambda device: 1 << 20)
    with pytest.raises(MemoryError, match=r"needs \d+\.\d+ GiB on cpu, which has 0\.00 GiB free"):
        synthetic_quantized_weights(cfg, "q2", device="cpu")
    monkeypatch.setattr(S, "free_memory", lambda device: 1 << 40)
    w = synthetic_quantized_weights(cfg, "q2", dtype=torch.float32, device="cpu")
    assert weight_bytes(w) > 1 << 20
