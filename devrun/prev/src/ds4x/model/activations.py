"""Sigmoid, SiLU and softplus written through ``exp`` so an element's value does not depend on the tensor's size.

torch's CPU kernels for ``sigmoid``, ``silu`` and ``softplus`` evaluate full SIMD chunks and the leftover
tail with different approximations, so one row's values change with how many rows share the tensor (and
with where the row sits). ``exp``, ``log1p`` and IEEE arithmetic give the same value in both paths (measured
with torch 2.13 on x86; tests/test_batch.py checks it), so these forms keep a batched step bit-identical
to a step of one session. They match torch's functions to within an ulp or so.
"""

from __future__ import annotations

import torch


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), and x itself above 20 (as torch's softplus with its default threshold)."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))
