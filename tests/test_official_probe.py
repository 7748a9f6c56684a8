"""Official-format edge cases: the shard index decides where a tensor lives, scales are checked from the
headers (shape, dtype) and for NaN, and a failed ``ds4x convert`` leaves no truncated GGUF behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds4x.config import tiny_config
from ds4x.weights.checkpoint import CheckpointError, load_checkpoint, open_checkpoint, save_checkpoint
from ds4x.weights.synthetic import synthetic_weights
from tests.test_official_quantized import quantize_fp8

CFG = tiny_config()
WQ = "layers.1.attn.wq_a.weight"


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return synthetic_weights(CFG, seed=4)


def _sharded(root: Path, w: dict[str, torch.Tensor]) -> tuple[dict[str, str], list[str]]:
    save_checkpoint(CFG, w, root, shard_bytes=300_000)
    wm = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    return wm, sorted(set(wm.values()))


def _fp8(root: Path, w: dict[str, torch.Tensor], scale: torch.Tensor | None = None) -> None:
    """Official single-file checkpoint with ``WQ`` in FP8 (its scale replaced by ``scale`` if given)."""
    save_checkpoint(CFG, w, root)
    t = load_file(root / "model.safetensors")
    t[WQ], s, _ = quantize_fp8(t[WQ])
    t[WQ.replace(".weight", ".scale")] = s if scale is None else scale
    save_file(t, str(root / "model.safetensors"))


def test_stale_copy_in_another_shard_does_not_replace_the_indexed_tensor(tmp_path, weights):
    wm, files = _sharded(tmp_path, weights)
    name = next(k for k in sorted(wm) if wm[k] == files[0] and weights[k].dim() == 2)
    other = files[-1]  # the sorted-last shard used to win
    t = load_file(tmp_path / other)
    t[name] = torch.zeros_like(weights[name])
    save_file(t, str(tmp_path / other))
    _, loaded = load_checkpoint(tmp_path)
    assert torch.equal(loaded[name], weights[name])


def test_index_naming_a_shard_without_the_tensor_is_an_error(tmp_path, weights):
    wm, files = _sharded(tmp_path, weights)
    name = "layers.0.attn.wkv.weight"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = next(f for f in files if f != wm[name])
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wkv\.weight"):
        open_checkpoint(tmp_path)


def test_same_tensor_in_two_unindexed_files_is_an_error(tmp_path, weights):
    save_checkpoint(CFG, weights, tmp_path)
    save_file({"norm.weight": torch.zeros(CFG.hidden_size)}, str(tmp_path / "zz-extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"'norm\.weight'.*more than one file"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("bad, match", [
    (torch.ones(2, 1), r"scale 'layers\.1\.attn\.wq_a\.scale' has shape \[2, 1\], expected \[1, 1\]"),
    (torch.ones(1, 1, dtype=torch.int32), r"scale 'layers\.1\.attn\.wq_a\.scale' has dtype I32"),
])
def test_bad_scale_is_refused_at_open_from_the_headers(tmp_path, weights, bad, match):
    _fp8(tmp_path, weights, bad)
    with pytest.raises(CheckpointError, match=match):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e8m0fnu])
def test_nan_scale_is_refused(tmp_path, weights, dtype):
    nan = torch.full((1, 1), float("nan")) if dtype == torch.float32 else torch.full((1, 1), 255, dtype=torch.uint8)
    _fp8(tmp_path, weights, nan.view(dtype) if dtype != torch.float32 else nan)
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wq_a\.scale.*NaN"):
        load_checkpoint(tmp_path)


def test_failed_convert_leaves_the_previous_output_untouched(tmp_path, weights):
    pytest.importorskip("gguf")
    from ds4x.weights.gguf_writer import write_gguf

    _fp8(tmp_path / "ck", weights, torch.full((1, 1), float("nan")))  # fails while its tensor is written
    out = tmp_path / "out.gguf"
    out.write_bytes(b"previous")
    with pytest.raises(CheckpointError, match="NaN"):
        write_gguf(out, CFG, open_checkpoint(tmp_path / "ck"), "f32")
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out.gguf"]  # no partial file left


def test_non_finite_plain_weight_is_refused(tmp_path, weights):
    """A NaN in a norm weight loaded and made every logit NaN; refused by name, as the GGUF loader does."""
    bad = dict(weights)
    name = next(k for k in sorted(bad) if k.endswith("attn_norm.weight") or k.endswith("attn.q_norm.weight"))
    bad[name] = bad[name].clone()
    bad[name][3] = float("nan")
    save_checkpoint(CFG, bad, tmp_path)
    with pytest.raises(CheckpointError, match=r"holds 1 NaN or infinite values"):
        load_checkpoint(tmp_path)
