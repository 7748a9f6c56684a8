"""Official-checkpoint FP8 (128x128 UE8M0 blocks) and FP4 expert (UE8M0 per 32) weights load exactly.

The quantizer and expected values here are written independently of ds4x.formats.
"""

import re

import pytest
import torch
from safetensors.torch import save_file

from ds4x.config import tiny_config
from ds4x.weights.checkpoint import load_checkpoint, save_checkpoint, to_official_names
from ds4x.weights.synthetic import synthetic_weights

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP8_NAMES = re.compile(
    r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|shared_experts\.w[123]\.weight$|indexer\.wq_b\.weight$"
)
FP4_NAMES = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight$")


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x, via frexp (x = m * 2**e with m in [0.5, 1))."""
    m, e = torch.frexp(x)
    return torch.where(m == 0.5, torch.ldexp(torch.ones_like(x), e - 1), torch.ldexp(torch.ones_like(x), e))


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out_dim, in_dim = w.shape
    rb, cb = -(-out_dim // 128), -(-in_dim // 128)
    scale = torch.empty(rb, cb)
    expected = torch.empty_like(w)
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rb):
        for j in range(cb):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = pow2_ceil(blk.abs().max().clamp(min=1e-4) / 448)
            q = (blk / s).to(torch.float8_e4m3fn)
            codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = q
            expected[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = q.float() * s
            scale[i, j] = s
    return codes, scale.to(torch.float8_e8m0fnu), expected


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out_dim, in_dim = w.shape
    blocks = w.view(out_dim, in_dim // 32, 32)
    s = pow2_ceil(blocks.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 6)
    q = blocks / s
    idx = (q.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)  # nearest magnitude (ties: lower code)
    sign = (q < 0).to(torch.uint8)
    codes = (idx.to(torch.uint8) | (sign << 3)).view(out_dim, in_dim)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    expected = (E2M1[idx] * torch.where(sign.bool(), -1.0, 1.0) * s).view(out_dim, in_dim)
    return packed, s.squeeze(-1).to(torch.float8_e8m0fnu), expected


def test_fp8_and_fp4_official_checkpoint_loads_exactly(tmp_path):
    cfg = tiny_config(vocab_size=259)
    w = synthetic_weights(cfg, seed=9)
    official = to_official_names(w)
    stored: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    n_fp8 = n_fp4 = 0
    for name, t in official.items():
        base = name[: -len(".weight")]
        if FP8_NAMES.search(name):
            stored[name], stored[base + ".scale"], expected[name] = quantize_fp8(t)
            n_fp8 += 1
        elif FP4_NAMES.search(name):
            stored[name], stored[base + ".scale"], expected[name] = quantize_fp4(t)
            n_fp4 += 1
        else:
            stored[name] = expected[name] = t
    assert n_fp8 > 20 and n_fp4 > 100
    (tmp_path / "q").mkdir()
    save_checkpoint(cfg, {}, tmp_path / "q")  # writes config.json (and an empty weights file we replace)
    save_file(stored, str(tmp_path / "q" / "model.safetensors"))
    _, loaded = load_checkpoint(tmp_path / "q")

    # the same dequantized values saved as plain float32 must load to identical tensors
    save_checkpoint(cfg, {}, tmp_path / "f")
    save_file({k: v.contiguous() for k, v in expected.items()}, str(tmp_path / "f" / "model.safetensors"))
    _, reference = load_checkpoint(tmp_path / "f")
    for k in reference:
        assert torch.equal(loaded[k], reference[k]), k
    # and the quantization really changed the weights (the scales were applied, not ignored)
    assert not torch.equal(reference["layers.0.attn.wq_a.weight"], w["layers.0.attn.wq_a.weight"])
    assert float((reference["layers.0.attn.wq_a.weight"] - w["layers.0.attn.wq_a.weight"]).abs().max()) < 0.05


def test_fp8_without_scale_is_an_error(tmp_path):
    cfg = tiny_config(vocab_size=259)
    official = to_official_names(synthetic_weights(cfg, seed=9))
    official["layers.0.attn.wq_a.weight"] = official["layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)
    save_checkpoint(cfg, {}, tmp_path)
    save_file(official, str(tmp_path / "model.safetensors"))
    from ds4x.weights.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.weight.*no scale"):
        load_checkpoint(tmp_path)
