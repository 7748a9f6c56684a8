"""RMSNorm in float32 (weights are float32), cast back to the working dtype."""

from __future__ import annotations

import torch

from ds4x.kernels import norm_rope
from ds4x.kernels.dispatch import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if use_triton(x.device):  # one launch instead of six (`ds4x.kernels.norm_rope`)
        return norm_rope.rms_norm_fused(x, weight, eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)
