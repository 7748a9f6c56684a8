"""Checkpoint loading in both namings, sharding, FP8/FP4 dequantisation, validation errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds4x.config import tiny_config
from ds4x.weights.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ds4x.weights.synthetic import synthetic_weights


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config(vocab_size=259)
    return cfg, synthetic_weights(cfg, seed=5)


def test_synthetic_is_deterministic(tiny):
    cfg, w = tiny
    w2 = synthetic_weights(cfg, seed=5)
    assert all(torch.equal(w[k], w2[k]) for k in w)
    w3 = synthetic_weights(cfg, seed=6)
    assert not torch.equal(w["embed.weight"], w3["embed.weight"])


@pytest.mark.parametrize("naming, shard", [("official", 0), ("hf", 0), ("official", 200_000), ("hf", 150_000)])
def test_namings_and_shards_load_to_identical_tensors(tiny, tmp_path, naming, shard):
    cfg, w = tiny
    save_checkpoint(cfg, w, tmp_path, naming=naming, shard_bytes=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    cfg2, w2 = load_checkpoint(tmp_path)
    assert cfg2 == cfg
    assert set(w2) == set(w)
    for k in w:
        assert torch.equal(w2[k].to(w[k].dtype), w[k]), k


def test_hf_names_are_transformers_names(tiny, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg, w = tiny
    save_checkpoint(cfg, w, tmp_path, naming="hf")
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config.from_pretrained(tmp_path))
    expected = set(model.state_dict())
    saved = set(load_file(tmp_path / "model.safetensors"))
    assert saved == expected - {k for k in expected if "rotary" in k}


def test_missing_and_misshapen_tensors_are_named(tiny, tmp_path):
    cfg, w = tiny
    save_checkpoint(cfg, w, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["layers.1.attn.wkv.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wkv\.weight"):
        load_checkpoint(tmp_path)
    tensors["layers.1.attn.wkv.weight"] = torch.zeros(3, 3)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wkv\.weight.*shape"):
        load_checkpoint(tmp_path)


def test_corrupt_and_absent_files(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "absent")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(tmp_path)
