"""Hadamard-128 rotation of DeepSeek-V4 indexer keys and queries (before MXFP4).

Bit-level contract (float32 throughout):

* Sylvester butterfly, strides 1, 2, 4, ..., 64 in that order; at each stage the
  pair ``(a, b) = (x[i], x[i + stride])`` becomes ``(a + b, a - b)``.
* The ``1/sqrt(128)`` scale is applied ONCE at the end, as a float32 multiply by
  ``fp32(128 ** -0.5)`` (= fp32(0.08838834764831845)).

Why this order: antirez/ds4's CPU reference (``dsv4_hadamard128_inplace_cpu``) and
its CUDA kernel (``indexer_hadamard_fp4_kernel``) do exactly this. The official
graph calls ``fast_hadamard_transform.hadamard_transform(x, scale=128 ** -0.5)``,
whose CUDA kernel also runs the fp32 butterfly smallest stride first (in-thread
strides, then warp shuffles) and multiplies by the scale at the end, in
``store_output``; it differs only in reading and writing bfloat16. A per-stage
``1/sqrt(2)`` or a matmul with the scaled matrix would round differently.
"""

from __future__ import annotations

import torch

from ds4x.formats.constants import device_constant

HADAMARD_DIM = 128
# Python double 128**-0.5, rounded to float32 when used (as the C/CUDA code does).
HADAMARD_SCALE = 128**-0.5

__all__ = ["HADAMARD_DIM", "HADAMARD_SCALE", "hadamard128"]


def hadamard128(x: torch.Tensor) -> torch.Tensor:
    """Normalized Sylvester Hadamard transform of the last dim (must be 128), float32 out."""
    if not torch.is_floating_point(x) or x.dim() == 0 or x.shape[-1] != HADAMARD_DIM:
        raise ValueError(
            f"hadamard128: expected a floating-point tensor with last dim {HADAMARD_DIM}, "
            f"got {x.dtype} {tuple(x.shape)}"
        )
    y = x.to(torch.float32)
    stride = 1
    while stride < HADAMARD_DIM:
        # [..., groups, 2, stride]: index 0 holds x[i], index 1 holds x[i + stride].
        g = y.unflatten(-1, (HADAMARD_DIM // (2 * stride), 2, stride))
        a, b = g[..., 0, :], g[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        stride *= 2
    return y * device_constant(HADAMARD_SCALE, y.device)
