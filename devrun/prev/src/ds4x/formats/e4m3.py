"""E4M3 (OCP E4M3FN) values with power-of-two UE8M0 block scales.

This is the format of the 448 non-RoPE dims of every DeepSeek-V4 attention
row in ``native`` cache mode (DESIGN.md 3.2 and 5), and of the official
checkpoint's dense FP8 weights.

Semantics (per block of ``block`` values along the last dim), as in the
official DeepSeek-V4 ``inference/kernel.py`` (``act_quant`` with
``round_scale=True``):

1. ``amax = max(|x|)``, floored at ``fp32(1e-4)``.
2. ``t = fp32(amax * fp32(1/448))`` and ``e = ceil(log2(t))`` computed from the
   bits of ``t`` (``fast_log2_ceil``: exponent field - 127, plus one if any
   mantissa bit is set). The scale is ``2**e``.
3. ``q = clamp(x / 2**e, -448, 448)`` rounded to the nearest E4M3FN value, ties
   to even (hardware ``cvt.rn.satfinite``; ``torch.float8_e4m3fn`` casts are RNE
   too, checked bit for bit against the scalar reference in the tests).
4. Dequantized value: ``q * 2**e`` in float32 (exact: a power-of-two product).

Which reference we follow and whether they agree:

* Official kernel.py multiplies by ``fp32(1/448)`` and takes ceil(log2) from the
  bits. antirez/ds4 (``dsv4_fp8_kv_quantize_row_inplace_cpu`` in ``ds4.c`` and
  the CUDA ``fp8_kv_quantize_kernel``) computes ``ceilf(log2f(amax / 448.0f))``
  with a float log2. We follow the official bit arithmetic.
* ``fp32(amax / 448)`` and ``fp32(amax * fp32(1/448))`` differ in value for ~55%
  of inputs, but their ceil(log2) is identical for every normal fp32 ``amax``
  (checked exhaustively over a whole binade; the result is scale-invariant, see
  ``tests/test_formats.py``), so "division" and "official multiply" agree.
* ds4's float ``log2f`` disagrees with the exact ceil when ``t`` is a hair above
  a power of two: e.g. ``t = 2**-10 * (1 + 2**-23)`` has ``log2f(t)`` rounded to
  exactly -10.0, so ds4 picks scale ``2**-10`` (and then saturates that value
  at 448) where the official graph picks ``2**-9``. This is a measure-tiny set of
  inputs; we match the official graph there.

Negative zero and signs: the E4M3 sign bit always records the sign of the
input (``-0.0`` -> ``0x80``; a negative value that rounds to zero -> ``0x80``),
like the hardware cast in the official graph and torch's cast. ds4's CPU path
returns ``+0.0`` for an input ``-0.0``; the two are equal as numbers.

Non-finite input: a block whose values contain NaN or Inf gets exponent 128 (the
UE8M0 NaN byte 0xFF) and all-zero codes, so it dequantizes to NaN everywhere;
``rows.pack_kv_rows`` rejects such input before it is ever stored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds4x.formats.constants import device_constant

E4M3_MAX = 448.0
# The official kernel floors amax at the fp32 constant 1e-4 (ds4: 1.0e-4f).
E4M3_AMAX_FLOOR = 1e-4
# Exponent reported for a block holding NaN/Inf: UE8M0 byte 0xFF, which decodes to NaN.
NONFINITE_EXPONENT = 128
UE8M0_BIAS = 127

__all__ = [
    "E4M3_MAX",
    "E4M3_AMAX_FLOOR",
    "NONFINITE_EXPONENT",
    "UE8M0_BIAS",
    "ceil_log2_f32",
    "pow2_f32",
    "ue8m0_encode",
    "ue8m0_decode",
    "scale_to_float32",
    "block_scale_exponents",
    "blocks",
    "block_quantize",
    "block_dequantize",
    "e4m3_decode",
    "e4m3_block_scale_exponents",
    "e4m3_block_quantize",
    "e4m3_block_dequantize",
    "e4m3_block_roundtrip",
    "dequantize_fp8_block_weight",
]


# ---------------------------------------------------------------------------
# bit helpers shared with mxfp4.py
# ---------------------------------------------------------------------------


def ceil_log2_f32(t: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(t))`` for positive normal float32 ``t``, from its bits (int32).

    Why bits: a float log2 rounds ``log2(2**k * (1 + 2**-23))`` to exactly ``k`` once
    ``|k| >= 2``, so ``ceil`` misses the next power of two. This is the official
    kernel's ``fast_log2_ceil``. Non-finite ``t`` gives ``NONFINITE_EXPONENT``.
    """
    bits = t.contiguous().view(torch.int32)
    exp_field = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    e = exp_field - 127 + (mant != 0).to(torch.int32)
    return torch.where(exp_field == 0xFF, torch.full_like(e, NONFINITE_EXPONENT), e)


def pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """``2.0**e`` as float32 built from bits, exact for integer ``e`` in [-126, 127].

    Why not ``torch.exp2``: its result is only as good as the libm on the device.
    """
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def ue8m0_encode(e: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte of a power-of-two scale ``2**e``: ``e + 127`` (e in [-127, 128])."""
    return (e.to(torch.int32) + UE8M0_BIAS).to(torch.uint8)


def ue8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (uint8) -> float32 scales ``2**(b - 127)``; byte 0 is ``2**-127``
    (a float32 subnormal, exact) and byte 255 is NaN (OCP MX spec)."""
    bi = b.to(torch.int32)
    bits = bi << 23
    bits = torch.where(bi == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(bi == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def scale_to_float32(scale: torch.Tensor, what: str = "scale") -> torch.Tensor:
    """A checkpoint scale tensor as float32.

    ``float8_e8m0fnu`` (the official V4 checkpoints) and ``uint8`` (raw E8M0 bytes, as
    some MX checkpoints ship them) are decoded from their bits; float32/bfloat16/float16
    (DeepSeek-V3-style ``weight_scale_inv``) are used as stored.
    """
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is not None and scale.dtype == e8m0:
        return ue8m0_decode(scale.view(torch.uint8))
    if scale.dtype == torch.uint8:
        return ue8m0_decode(scale)
    if scale.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return scale.to(torch.float32)
    raise ValueError(
        f"{what}: unsupported dtype {scale.dtype}; expected float8_e8m0fnu, uint8 (raw E8M0) or a float dtype"
    )


def blocks(x: torch.Tensor, block: int, fn: str) -> torch.Tensor:
    """``x [..., n]`` as float32 ``[..., n / block, block]``; ``fn`` names the caller in errors."""
    if not torch.is_floating_point(x):
        raise ValueError(f"{fn}: expected a floating-point tensor, got {x.dtype}")
    if x.dim() == 0 or block <= 0 or x.shape[-1] % block != 0:
        raise ValueError(
            f"{fn}: last dim must be a positive multiple of block={block}, got shape {tuple(x.shape)}"
        )
    return x.to(torch.float32).unflatten(-1, (-1, block))


def block_scale_exponents(xb: torch.Tensor, floor: float, inv_max: float) -> torch.Tensor:
    """Per-block exponent ``ceil(log2(max(amax, floor) * fp32(inv_max)))`` of blocked
    float32 ``xb [..., nb, block]``; NONFINITE_EXPONENT where the block has NaN/Inf."""
    amax = xb.abs().amax(dim=-1)
    # float32 constants on purpose: the official kernel computes in fp32 throughout.
    floor_t = device_constant(floor, xb.device)
    inv_t = device_constant(inv_max, xb.device)
    t = torch.maximum(amax, floor_t) * inv_t
    e = ceil_log2_f32(t)
    # amax is NaN/Inf exactly when the block holds NaN/Inf (torch's amax propagates NaN).
    return torch.where(torch.isfinite(amax), e, torch.full_like(e, NONFINITE_EXPONENT))


def block_quantize(xb: torch.Tensor, floor: float, max_value: float,
                   encode: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared block quantizer of blocked float32 ``xb [..., nb, block]``: ``(codes [..., n], exponents)``.

    ``encode`` maps the scaled, clamped values to codes. Blocks with NaN/Inf get all-zero codes and
    NONFINITE_EXPONENT.
    """
    e = block_scale_exponents(xb, floor, 1.0 / max_value)
    bad = e == NONFINITE_EXPONENT
    # x * 2**-e is the same real number as x / 2**e, so the correctly rounded float32 results agree bit
    # for bit with the official division; for finite input 2**-e is a normal float32.
    inv = pow2_f32(torch.where(bad, torch.zeros_like(e), -e))
    codes = encode((xb * inv.unsqueeze(-1)).clamp(-max_value, max_value))
    codes = torch.where(bad.unsqueeze(-1), torch.zeros_like(codes), codes)
    return codes.flatten(-2), e


def block_dequantize(values: torch.Tensor, exponents: torch.Tensor, block: int) -> torch.Tensor:
    """Decoded code values ``[..., n]`` times their block's ``2**e`` (via the UE8M0 byte), float32."""
    scale = ue8m0_decode(ue8m0_encode(exponents))
    return (values.unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2)


# ---------------------------------------------------------------------------
# E4M3
# ---------------------------------------------------------------------------


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """E4M3FN codes (uint8) -> float32 values (0x7F/0xFF -> NaN, 0x80 -> -0.0)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"e4m3_decode: expected uint8 codes, got {codes.dtype}")
    return codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def e4m3_block_scale_exponents(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Per block of ``block`` values along the last dim, the int32 exponent ``e`` with
    ``2**e`` = the smallest power of two >= ``fp32(max(amax, 1e-4) / 448)``.

    Shape ``[..., n / block]``. Blocks holding NaN/Inf get ``NONFINITE_EXPONENT`` (128).
    """
    xb = blocks(x, block, "e4m3_block_scale_exponents")
    return block_scale_exponents(xb, E4M3_AMAX_FLOOR, 1.0 / E4M3_MAX)


def e4m3_block_quantize(x: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to ``(codes uint8 [..., n], exponents int32 [..., n / block])``.

    ``codes`` are E4M3FN bytes of ``x / 2**e`` (clamped to +-448, RNE); the scale byte
    of a block is ``ue8m0_encode(e)``. Blocks with NaN/Inf get all-zero codes.
    """
    xb = blocks(x, block, "e4m3_block_quantize")
    return block_quantize(xb, E4M3_AMAX_FLOOR, E4M3_MAX, lambda q: q.to(torch.float8_e4m3fn).view(torch.uint8))


def e4m3_block_dequantize(codes: torch.Tensor, exponents: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Inverse of :func:`e4m3_block_quantize`: ``decode(codes) * 2**e`` in float32."""
    return block_dequantize(e4m3_decode(codes), exponents, block)


def e4m3_block_roundtrip(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """The native-cache simulation: quantize to E4M3 with UE8M0 block scales and back.

    Returns float32 of the same shape. The model calls this on the 448 non-RoPE dims
    of each KV row (block 64).
    """
    codes, e = e4m3_block_quantize(x, block)
    return e4m3_block_dequantize(codes, e, block)


# ---------------------------------------------------------------------------
# checkpoint weights
# ---------------------------------------------------------------------------


def dequantize_fp8_block_weight(w: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Dense FP8 weight of the official checkpoint -> float32 ``[out, in]``.

    ``w``: ``float8_e4m3fn [out, in]`` (``uint8``/``int8`` are read as raw E4M3FN bits).
    ``scale``: ``[ceil(out/block), ceil(in/block)]``, one multiplier per 128x128 block;
    the last block row/column may be partial.

    Scale dtype on disk: the official DeepSeek-V4 ``inference/model.py`` ``Linear``
    allocates ``scale`` as ``torch.float8_e8m0fnu`` (config ``scale_fmt: "ue8m0"``),
    so V4 checkpoints store UE8M0; DeepSeek-V3 checkpoints store float32
    ``weight_scale_inv``. transformers' fine-grained FP8 integration accepts both
    (float32, or ``float8_e8m0fnu`` when ``scale_fmt == "ue8m0"``) and raw ``uint8``
    E8M0. All of these are accepted here (see :func:`scale_to_float32`). The scale is a
    multiplier (despite the ``_inv`` name): ``w_float = w * scale``.
    """
    if w.dim() != 2:
        raise ValueError(f"dequantize_fp8_block_weight: weight must be 2-D [out, in], got {tuple(w.shape)}")
    if w.dtype in (torch.uint8, torch.int8):
        w = w.contiguous().view(torch.float8_e4m3fn)
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequantize_fp8_block_weight: weight dtype must be float8_e4m3fn, got {w.dtype}")
    out_dim, in_dim = w.shape
    want = (-(-out_dim // block), -(-in_dim // block))
    if scale.dim() != 2 or tuple(scale.shape) != want:
        raise ValueError(
            f"dequantize_fp8_block_weight: scale shape must be {want} for weight {tuple(w.shape)} "
            f"and block {block}, got {tuple(scale.shape)}"
        )
    s = scale_to_float32(scale, "dequantize_fp8_block_weight scale").to(w.device)
    # Expand per block then crop: partial trailing blocks use their block's scale.
    s_full = s.repeat_interleave(block, dim=0)[:out_dim].repeat_interleave(block, dim=1)[:, :in_dim]
    return w.to(torch.float32) * s_full
