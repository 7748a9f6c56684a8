import json

import pytest

from ds4x.config import ConfigError, config_from_dict, flash_config, load_config, tiny_config


def test_flash_preset_schedule():
    cfg = flash_config()
    assert cfg.num_layers == 43
    assert cfg.attn_kinds[:2] == ("sliding", "sliding")
    assert sum(k == "csa" for k in cfg.attn_kinds) == 21
    assert sum(k == "hca" for k in cfg.attn_kinds) == 20
    assert all(cfg.compress_ratios[i] == 4 for i in range(2, 43, 2))
    assert all(cfg.compress_ratios[i] == 128 for i in range(3, 42, 2))
    assert cfg.compress_rope_scaling.factor == 16 and cfg.native_cache_error() is None


def test_official_and_transformers_spellings_agree():
    cfg = tiny_config()
    official = cfg.to_hf_dict()
    official.pop("layer_types")
    official.pop("compress_rates")
    official.pop("mlp_layer_types")
    assert config_from_dict(official) == cfg
    hf = dict(official)
    hf.pop("compress_ratios")
    hf.pop("num_hash_layers")
    hf.pop("qk_rope_head_dim")
    rs = hf.pop("rope_scaling")
    hf["layer_types"] = [{"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
                          "hca": "heavily_compressed_attention"}[k] for k in cfg.attn_kinds]
    hf["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
    hf["mlp_layer_types"] = ["hash_moe"] * cfg.num_hash_layers + ["moe"] * (cfg.num_layers - cfg.num_hash_layers)
    hf["partial_rotary_factor"] = cfg.rope_head_dim / cfg.head_dim
    hf["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "compress": {"rope_type": "yarn", "rope_theta": cfg.compress_rope_theta, "factor": rs["factor"],
                     "original_max_position_embeddings": rs["original_max_position_embeddings"],
                     "beta_fast": rs["beta_fast"], "beta_slow": rs["beta_slow"], "attention_factor": 1.0},
    }
    assert config_from_dict(hf) == cfg


def test_transformers_config_json_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config()
    hf_cfg = transformers.DeepseekV4Config(**cfg.to_hf_dict())
    hf_cfg.save_pretrained(tmp_path)
    assert load_config(tmp_path) == cfg


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_size": -4}, "hidden_size"),
        ({"num_hidden_layers": "x"}, "num_hidden_layers"),
        ({"compress_ratios": [0, 4]}, "compress_ratios"),
        ({"o_groups": 3}, "o_groups"),
        ({"num_experts_per_tok": 99}, "num_experts_per_tok"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"model_type": "llama"}, "model_type"),
        ({"num_key_value_heads": 8}, "num_key_value_heads"),
        ({"layer_types": ["full_attention"] * 6}, "layer_types[0]"),
        ({"rope_scaling": {"type": "yarn", "factor": 4}}, "original_max_position_embeddings"),
        ({"eos_token_id": 10**6}, "eos_token_id"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
        ({"mlp_layer_types": ["moe"] * 5}, "mlp_layer_types"),
        ({"mlp_layer_types": ["dense"] * 6}, "mlp_layer_types"),
    ],
)
def test_bad_config_names_the_field(change, field):
    d = tiny_config().to_hf_dict()
    d.pop("layer_types")
    d.update(change)
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        config_from_dict(d)


def test_missing_field_and_bad_json(tmp_path):
    d = tiny_config().to_hf_dict()
    del d["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        config_from_dict(d)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(tmp_path)


def test_hash_layers_anywhere_in_the_schedule():
    d = tiny_config().to_hf_dict()
    d["mlp_layer_types"] = ["moe", "hash_moe", "moe", "hash_moe", "moe", "moe"]
    cfg = config_from_dict(d)
    assert [cfg.is_hash_layer(i) for i in range(6)] == [False, True, False, True, False, False]


def test_native_cache_refused_for_odd_widths():
    cfg = tiny_config().replace(head_dim=96, rope_head_dim=64)
    assert "multiple of 64" in cfg.native_cache_error()
