"""Rotary position embedding: partial, interleaved pairs, on the trailing dims of a head.

Sliding-only layers use plain RoPE (``rope_theta``); CSA/HCA layers (their raw rows, compressed
rows and indexer) use ``compress_rope_theta`` with YaRN frequency blending and no magnitude scaling.
"""

from __future__ import annotations

import math

import torch

from ds4x.config import SLIDING, ModelConfig, YarnScaling
from ds4x.kernels import norm_rope
from ds4x.kernels.dispatch import use_triton
from ds4x.model.norms import rms_norm


def _yarn_inv_freq(dim: int, base: float, y: YarnScaling) -> torch.Tensor:
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (y.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    # truncated correction range, as the reference implementations do
    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def rope_tables(cfg: ModelConfig) -> dict[str, tuple[torch.Tensor, float]]:
    """Inverse frequencies (and cos/sin magnitude) for the two rope kinds: 'main' and 'compress'."""
    dim = cfg.rope_head_dim
    main = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    y = cfg.compress_rope_scaling
    if y is None:
        compress = 1.0 / (cfg.compress_rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        return {"main": (main, 1.0), "compress": (compress, 1.0)}
    return {"main": (main, 1.0), "compress": (_yarn_inv_freq(dim, cfg.compress_rope_theta, y), y.attention_factor)}


def rope_kind(cfg: ModelConfig, layer: int) -> str:
    return "main" if cfg.attn_kinds[layer] == SLIDING else "compress"


def cos_sin(table: tuple[torch.Tensor, float], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, rope_dim/2] for integer positions [T]."""
    inv_freq, magnitude = table
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return freqs.cos() * magnitude, freqs.sin() * magnitude


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rotate the trailing ``2*cos.shape[-1]`` dims of ``x`` [T, ..., D] in interleaved pairs (2i, 2i+1).

    ``cos``/``sin`` are [T, rope_dim/2] and broadcast over the middle dims. ``inverse`` rotates by -angle
    (used on the attention output, so each value row contributes by relative distance only). ``dtype``: the
    result's (x's by default), the bits of ``apply_rope(...).to(dtype)``.
    """
    if use_triton(x.device) and norm_rope.rope_supported(x, cos):  # one launch, not a dozen (kernels.norm_rope)
        return norm_rope.rope_fused(x, cos, sin, inverse, dtype)
    if dtype is not None and dtype != x.dtype:
        return apply_rope(x, cos, sin, inverse).to(dtype)
    rd = cos.shape[-1] * 2
    extra = x.dim() - 2
    c = cos.reshape(cos.shape[0], *([1] * extra), cos.shape[1])
    s = sin.reshape(sin.shape[0], *([1] * extra), sin.shape[1])
    if inverse:
        s = -s
    rope = x[..., -rd:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rotated.to(x.dtype)], dim=-1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope(rms_norm(x, weight, eps), cos, sin)``; one launch on CUDA, with the bits of the two."""
    if use_triton(x.device) and norm_rope.norm_rope_supported(x, cos):
        return norm_rope.rms_norm_fused(x, weight, eps, (cos, sin))
    return apply_rope(rms_norm(x, weight, eps), cos, sin)
