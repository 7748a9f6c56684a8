"""MXFP4: E2M1 values with a UE8M0 power-of-two scale per 32 values.

Used by the DeepSeek-V4 indexer (keys and queries, after the Hadamard-128
rotation) in ``native`` mode, and by the official checkpoint's routed experts.

E2M1 code (4 bits) = ``sign << 3 | magnitude index``; magnitude index 0..7 means
{0, 0.5, 1, 1.5, 2, 3, 4, 6} (bit 2..1 exponent with bias 1, bit 0 mantissa).

Semantics per block (official ``inference/kernel.py`` ``fp4_quant_kernel``):

1. ``amax = max(|x|)`` floored at ``6 * 2**-126`` (= 7.052966104933725e-38, the
   constant ds4.c writes out as ``7.052966104933725e-38f``; it is exactly the value
   whose scale is the smallest normal power of two, ``2**-126``).
2. ``e = ceil(log2(fp32(amax * fp32(1/6))))`` from the float's bits (official
   ``fast_round_scale``; ds4 uses ``ceilf(log2f(amax / 6.0f))``, which can miss by
   one when ``amax/6`` is a hair above a power of two, see e4m3.py).
3. ``q = clamp(x / 2**e, -6, 6)`` rounded to the nearest E2M1 value, ties to even
   (to the even magnitude index: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
   2.5 -> 2, 3.5 -> 4, 5 -> 4; ds4's search breaks ties the same way).
4. Dequantized value: ``q * 2**e`` in float32 (exact).

The sign bit records the sign of the input, so ``-0.0`` and negative values that
round to zero are stored as code 8 (``-0.0``). A block holding NaN/Inf gets exponent
128 (UE8M0 byte 0xFF = NaN) and zero codes, i.e. it dequantizes to NaN.
"""

from __future__ import annotations

import torch

from ds4x.formats.constants import device_constant

from .e4m3 import (
    block_dequantize,
    block_quantize,
    block_scale_exponents,
    blocks,
    scale_to_float32,
)

E2M1_MAX = 6.0
# 6 * 2**-126: the official kernel's floor (ds4.c spells it 7.052966104933725e-38f).
MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126
# Magnitudes by index; the full 16-entry table has the negatives at 8..15 (8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLE = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)

__all__ = [
    "E2M1_MAX",
    "MXFP4_AMAX_FLOOR",
    "E2M1_VALUES",
    "e2m1_decode",
    "e2m1_encode",
    "mxfp4_block_scale_exponents",
    "mxfp4_quantize",
    "mxfp4_dequantize",
    "mxfp4_roundtrip",
    "dequantize_fp4_expert_weight",
]


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (integer tensor, values 0..15) -> float32 (code 8 -> -0.0)."""
    table = device_constant(tuple(_E2M1_TABLE), codes.device)
    return table[codes.to(torch.long) & 0xF]


def e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """float32 ``q`` with ``|q| <= 6`` -> nearest E2M1 code (uint8), ties to even.

    Counting the midpoints below ``|q|`` gives the magnitude index; at a midpoint
    whose upper neighbour has an even index (0.75, 1.75, 3.5) we round up, at the
    others (0.25, 1.25, 2.5, 5) down. Exact: the midpoints are float32 values.
    """
    a = q.abs()
    idx = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return idx | (torch.signbit(q).to(torch.uint8) << 3)


def mxfp4_block_scale_exponents(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Per-block int32 exponent ``e``: ``2**e`` = smallest power of two >= ``fp32(amax/6)``,
    amax floored at ``6 * 2**-126``; 128 for blocks holding NaN/Inf."""
    xb = blocks(x, block, "mxfp4_block_scale_exponents")
    return block_scale_exponents(xb, MXFP4_AMAX_FLOOR, 1.0 / E2M1_MAX)


def mxfp4_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to ``(codes uint8 [..., n] in 0..15, exponents int32 [..., n / block])``."""
    return block_quantize(blocks(x, block, "mxfp4_quantize"), MXFP4_AMAX_FLOOR, E2M1_MAX, e2m1_encode)


def mxfp4_dequantize(codes: torch.Tensor, exponents: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Inverse of :func:`mxfp4_quantize`: ``e2m1(codes) * 2**e`` in float32."""
    return block_dequantize(e2m1_decode(codes), exponents, block)


def mxfp4_roundtrip(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The native indexer simulation: MXFP4 quantize and dequantize, float32 out.

    Note: for |x| within a factor 1.5 of float32's max the dequantized value can
    overflow to inf (e.g. 3.4e38 -> 4 * 2**126 = 2**128), exactly as in the official
    fp32 graph; no real activation is anywhere near that.
    """
    codes, e = mxfp4_quantize(x, block)
    return mxfp4_dequantize(codes, e, block)


def dequantize_fp4_expert_weight(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Routed-expert weight of the official checkpoint -> float32 ``[out, in]``.

    ``packed``: ``[out, in/2]``, ``int8`` as stored on disk (or ``uint8``, or
    ``float4_e2m1fn_x2``), two E2M1 codes per byte: element ``2i`` in the LOW nibble,
    ``2i+1`` in the HIGH nibble; sign in bit 3 of each nibble.
    ``scale``: ``[out, ceil(in/32)]``, one UE8M0 scale per 32 consecutive inputs.

    Findings: the official ``inference/convert.py`` (``cast_e2m1fn_to_e4m3fn``) asserts
    the on-disk weight is ``torch.int8`` and decodes ``low = x & 0x0F`` then
    ``high = (x >> 4) & 0x0F``, stacked as ``[low, high]`` (low nibble first), through
    ``FP4_TABLE = [0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, ..., -6]``; its ``model.py`` holds
    the weight as ``float4_e2m1fn_x2 [out, in//2]`` with ``scale`` as
    ``float8_e8m0fnu [out, in//32]``. transformers' ``Fp8Dequantize._unpack_fp4`` uses
    the same nibble order (int8 storage, low nibble first) and accepts float32 or
    float8_e8m0fnu (or raw uint8 E8M0) scales. All of these scale dtypes are accepted.
    One deliberate difference: code 8 decodes to ``-0.0`` here (IEEE, transformers)
    where convert.py's table has ``+0.0``; only the sign of an exact zero differs.
    """
    if packed.dim() != 2:
        raise ValueError(
            f"dequantize_fp4_expert_weight: packed weight must be 2-D [out, in/2], got {tuple(packed.shape)}"
        )
    fp4x2 = getattr(torch, "float4_e2m1fn_x2", None)
    if packed.dtype == torch.int8 or (fp4x2 is not None and packed.dtype == fp4x2):
        packed = packed.contiguous().view(torch.uint8)
    if packed.dtype != torch.uint8:
        raise ValueError(
            f"dequantize_fp4_expert_weight: packed weight dtype must be int8/uint8/float4_e2m1fn_x2, "
            f"got {packed.dtype}"
        )
    out_dim, in_dim = packed.shape[0], 2 * packed.shape[1]
    want = (out_dim, -(-in_dim // block))
    if scale.dim() != 2 or tuple(scale.shape) != want:
        raise ValueError(
            f"dequantize_fp4_expert_weight: scale shape must be {want} for packed weight "
            f"{tuple(packed.shape)} and block {block}, got {tuple(scale.shape)}"
        )
    s = scale_to_float32(scale, "dequantize_fp4_expert_weight scale").to(packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    vals = e2m1_decode(codes)
    return vals * s.repeat_interleave(block, dim=1)[:, :in_dim]
