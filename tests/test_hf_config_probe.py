"""transformers DeepSeek-V4 configs beyond PARITY_CONFIGS: ones ds4x used to refuse or run wrongly.

Each parity case saves a small random transformers model with save_pretrained and compares float-cache
greedy decoding with transformers' own cached decode; the refusals are configs whose model ds4x does not
build (transformers would run them, ds4x must say so rather than produce other logits).
"""

from __future__ import annotations

import json

import pytest
import torch

from ds4x.config import ConfigError, config_from_dict, load_config
from ds4x.runtime.engine import Engine
from ds4x.runtime.sampling import SamplingParams
from tests.hf_reference import random_hf_model

pytest.importorskip("transformers")

BASE = dict(
    vocab_size=131, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
    head_dim=32, qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, n_routed_experts=4,
    num_experts_per_tok=2, num_hash_layers=1, sliding_window=5, index_n_heads=16, index_head_dim=16, index_topk=2,
    max_position_embeddings=1024,
    layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 6},
)
_NESTED_ROPE = {
    "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    # no attention_factor: transformers' YaRN scales cos/sin by 0.1 * ln(8) + 1
    "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                 "partial_rotary_factor": 0.25},
}
CASES = {
    "tied_embeddings": dict(tie_word_embeddings=True),  # save_pretrained writes no lm_head.weight
    "groups_split_heads": dict(num_attention_heads=2, o_groups=4),  # 2 heads * 32 dims in 4 groups of 16
    "nested_yarn_magnitude": dict(rope_parameters=_NESTED_ROPE),
    # the top-level default factor (64/512) says 4 rope dims; the nested factors (0.25) that transformers
    # builds its rotary from say 8
    "nested_rope_width": dict(qk_rope_head_dim=None, rope_parameters=_NESTED_ROPE),
}
STEPS = 6


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_matches_transformers(name, tmp_path):
    config = {k: v for k, v in {**BASE, **CASES[name]}.items() if v is not None}
    hf = random_hf_model(seed=3, **config)
    hf.save_pretrained(tmp_path)
    engine = Engine.load(str(tmp_path), device="cpu", dtype="float32")
    prompt = torch.randint(0, config["vocab_size"], (26,), generator=torch.Generator().manual_seed(1)).tolist()
    session = engine.new_session(ctx=64, cache="float", prefill_chunk=8)
    ours = list(session.generate(prompt, STEPS, SamplingParams(), stop_ids=()))
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        ref = [out.logits[0, -1]]
        for token, _ in ours[:-1]:
            out = hf(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
            ref.append(out.logits[0, -1])
    assert [t for t, _ in ours] == [int(r.argmax()) for r in ref]
    worst = max(float((l - r).abs().max() / r.abs().max()) for (_, l), r in zip(ours, ref, strict=True))
    assert worst < 1e-4, f"{name}: worst logit difference {worst:.2e} of the largest logit"


def test_nested_yarn_round_trips_its_magnitude(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = {k: v for k, v in {**BASE, **CASES["nested_yarn_magnitude"]}.items() if v is not None}
    transformers.DeepseekV4Config(**config).save_pretrained(tmp_path)
    cfg = load_config(tmp_path)
    assert cfg.compress_rope_scaling is not None
    assert cfg.compress_rope_scaling.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(8.0)).item() + 1)
    # written back as a flat rope_scaling, the factor is kept (transformers pins only an absent one to 1.0)
    assert config_from_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {**_NESTED_ROPE, "main": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                       "original_max_position_embeddings": 64}}},
         "rope_parameters.main"),
    ],
)
def test_configs_ds4x_cannot_run_are_refused(change, field, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    transformers.DeepseekV4Config(**config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=field):
        load_config(tmp_path)


def test_gguf_writer_refuses_what_the_ds4_layout_cannot_hold():
    # the two relaxations above reach configs the ds4 GGUF layout has no key or shape for
    from ds4x.config import YarnScaling, tiny_config
    from ds4x.weights.gguf_writer import GGUFError, _check_representable

    with pytest.raises(GGUFError, match="attention factor"):
        _check_representable(tiny_config().replace(compress_rope_scaling=YarnScaling(8.0, 64, attention_factor=1.2)))
    with pytest.raises(GGUFError, match="o_groups"):
        _check_representable(tiny_config().replace(o_groups=16))  # 8 heads * 128 dims split 16 ways
