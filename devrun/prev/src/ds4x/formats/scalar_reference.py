"""Scalar reference of the storage formats: plain Python loops over one row.

Written for reading, not speed; used by the tests as the oracle the vectorized
torch code and the Triton kernels must match bit for bit, and as documentation of
the exact semantics. Float32 arithmetic is emulated on Python floats (doubles):
every +, -, * of two float32 values is computed in double and rounded once to
float32 with :func:`f32`. That is the correctly rounded float32 result, because a
double has more than 2 * 24 + 2 significand bits (no harmful double rounding).

Rounding to the E4M3 / E2M1 grids is done differently from the torch code on
purpose (nearest value in a table, ties to the even code), so the tests compare
independent implementations.
"""

from __future__ import annotations

import bisect
import math
import struct
from collections.abc import Sequence

# ---------------------------------------------------------------------------
# float32 emulation
# ---------------------------------------------------------------------------


def f32(v: float) -> float:
    """Round a Python float to the nearest float32 (ties to even); overflow -> +-inf."""
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:  # finite double beyond float32's range rounds to infinity
        return math.copysign(math.inf, v)


def f32_bits(v: float) -> int:
    """The 32 bits of float32 ``v`` as an unsigned int."""
    return struct.unpack("<I", struct.pack("<f", v))[0]


def bits_f32(b: int) -> float:
    """The float32 whose bits are ``b``."""
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def signbit(v: float) -> int:
    """1 for negative numbers and -0.0, else 0."""
    return 1 if math.copysign(1.0, v) < 0 else 0


def ceil_log2_f32(t: float) -> int:
    """ceil(log2(t)) for a positive normal float32 t, read from its bits: the exponent,
    plus one unless the mantissa is zero (t already a power of two)."""
    b = f32_bits(t)
    exp_field = (b >> 23) & 0xFF
    mant = b & 0x7FFFFF
    return exp_field - 127 + (1 if mant != 0 else 0)


# ---------------------------------------------------------------------------
# element formats
# ---------------------------------------------------------------------------


def e4m3_value(code: int) -> float:
    """Value of an E4M3FN byte: sign(1) exponent(4, bias 7) mantissa(3); exponent 0 is
    subnormal (m/8 * 2**-6); 0x7F and 0xFF are NaN; there is no infinity."""
    sign = -1.0 if code & 0x80 else 1.0
    exp_field = (code >> 3) & 0xF
    mant = code & 0x7
    if exp_field == 0xF and mant == 0x7:
        return math.nan
    if exp_field == 0:
        return sign * (mant / 8.0) * 2.0**-6
    return sign * (1.0 + mant / 8.0) * 2.0 ** (exp_field - 7)


# Non-negative finite E4M3 values by code 0..126 (ascending: the encoding is monotone).
E4M3_POSITIVE = [e4m3_value(c) for c in range(127)]
E2M1_POSITIVE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _nearest_code(a: float, grid: list[float]) -> int:
    """Index of the grid value nearest to a (0 <= a <= grid[-1]); a tie goes to the even
    index, which is the code whose mantissa LSB is 0 (round half to even)."""
    hi = bisect.bisect_left(grid, a)
    if hi < len(grid) and grid[hi] == a:
        return hi
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    if d_lo < d_hi:
        return lo
    if d_hi < d_lo:
        return hi
    return lo if lo % 2 == 0 else hi


def e4m3_code(v: float) -> int:
    """E4M3FN byte of float32 ``v`` with |v| <= 448: nearest value, ties to even, sign kept."""
    return _nearest_code(abs(v), E4M3_POSITIVE) | (signbit(v) << 7)


def e2m1_value(code: int) -> float:
    """Value of a 4-bit E2M1 code: sign in bit 3, magnitude index in bits 0..2."""
    mag = E2M1_POSITIVE[code & 0x7]
    return -mag if code & 0x8 else mag


def e2m1_code(v: float) -> int:
    """E2M1 code of float32 ``v`` with |v| <= 6: nearest value, ties to even, sign kept."""
    return _nearest_code(abs(v), E2M1_POSITIVE) | (signbit(v) << 3)


def ue8m0_value(byte: int) -> float:
    """Scale encoded by a UE8M0 byte: 2**(byte - 127); 255 is NaN."""
    return math.nan if byte == 255 else 2.0 ** (byte - 127)


# ---------------------------------------------------------------------------
# block quantization
# ---------------------------------------------------------------------------

E4M3_MAX = 448.0
E4M3_FLOOR = f32(1e-4)
E4M3_INV_MAX = f32(1.0 / 448.0)
E2M1_MAX = 6.0
E2M1_FLOOR = 6.0 * 2.0**-126
E2M1_INV_MAX = f32(1.0 / 6.0)


def block_exponent(block: Sequence[float], floor: float, inv_max: float) -> int:
    """Scale exponent of one block: ceil(log2(fp32(max(amax, floor) * fp32(1/max)))).

    128 (the UE8M0 NaN byte once biased) if the block holds NaN or Inf.
    """
    if any(not math.isfinite(v) for v in block):
        return 128
    amax = max(abs(v) for v in block)
    t = f32(max(amax, floor) * inv_max)
    return ceil_log2_f32(t)


def quantize_block(
    block: Sequence[float], fmt: str
) -> tuple[list[int], int]:
    """Quantize one block of float32 values to (codes, exponent); fmt is 'e4m3' or 'e2m1'."""
    if fmt == "e4m3":
        floor, inv_max, vmax, encode = E4M3_FLOOR, E4M3_INV_MAX, E4M3_MAX, e4m3_code
    elif fmt == "e2m1":
        floor, inv_max, vmax, encode = E2M1_FLOOR, E2M1_INV_MAX, E2M1_MAX, e2m1_code
    else:
        raise ValueError(f"unknown format {fmt!r}")
    e = block_exponent(block, floor, inv_max)
    if e == 128:
        return [0] * len(block), e
    codes = []
    for v in block:
        q = f32(v * 2.0**-e)  # = v / 2**e, rounded to float32 (matters only if subnormal)
        q = min(max(q, -vmax), vmax)
        codes.append(encode(q))
    return codes, e


def dequantize_block(codes: Sequence[int], e: int, fmt: str) -> list[float]:
    """Codes and exponent of one block -> float32 values (code value * 2**e)."""
    decode = e4m3_value if fmt == "e4m3" else e2m1_value
    scale = ue8m0_value(e + 127)
    return [f32(decode(c) * scale) for c in codes]


def block_roundtrip(row: Sequence[float], block: int, fmt: str) -> list[float]:
    """Quantize-dequantize a row block by block (the native-mode simulation)."""
    vals = [f32(v) for v in row]
    assert len(vals) % block == 0
    out: list[float] = []
    for start in range(0, len(vals), block):
        codes, e = quantize_block(vals[start : start + block], fmt)
        out.extend(dequantize_block(codes, e, fmt))
    return out


def e4m3_block_roundtrip(row: Sequence[float], block: int = 64) -> list[float]:
    return block_roundtrip(row, block, "e4m3")


def mxfp4_roundtrip(row: Sequence[float], block: int = 32) -> list[float]:
    return block_roundtrip(row, block, "e2m1")


# ---------------------------------------------------------------------------
# Hadamard-128
# ---------------------------------------------------------------------------


def hadamard128(row: Sequence[float]) -> list[float]:
    """Butterfly with strides 1..64, (a, b) -> (a + b, a - b), then * fp32(128**-0.5)."""
    x = [f32(v) for v in row]
    assert len(x) == 128
    stride = 1
    while stride < 128:
        for base in range(0, 128, 2 * stride):
            for i in range(base, base + stride):
                a, b = x[i], x[i + stride]
                x[i], x[i + stride] = f32(a + b), f32(a - b)
        stride *= 2
    scale = f32(128**-0.5)
    return [f32(v * scale) for v in x]


# ---------------------------------------------------------------------------
# packed rows
# ---------------------------------------------------------------------------


def _require_finite(vals: Sequence[float]) -> None:
    if any(not math.isfinite(v) for v in vals):
        raise ValueError("non-finite values are never stored")


def pack_kv_row(row: Sequence[float]) -> bytes:
    """512 values -> 583 bytes: 448 E4M3 codes, 64 little-endian FP16, 7 UE8M0 bytes."""
    vals = [f32(v) for v in row]
    assert len(vals) == 512
    _require_finite(vals)
    out = bytearray()
    scale_bytes = bytearray()
    for start in range(0, 448, 64):
        codes, e = quantize_block(vals[start : start + 64], "e4m3")
        out.extend(codes)
        scale_bytes.append(e + 127)
    for v in vals[448:]:
        out.extend(struct.pack("<e", v))  # IEEE binary16, round half to even
    out.extend(scale_bytes)
    assert len(out) == 583
    return bytes(out)


def unpack_kv_row(data: bytes) -> list[float]:
    """583 bytes -> 512 float32 values."""
    assert len(data) == 583
    out: list[float] = []
    for blk in range(7):
        e = data[576 + blk] - 127
        out.extend(dequantize_block(data[64 * blk : 64 * blk + 64], e, "e4m3"))
    for j in range(64):
        out.append(struct.unpack("<e", data[448 + 2 * j : 450 + 2 * j])[0])
    return out


def pack_indexer_row(row: Sequence[float]) -> bytes:
    """128 values -> 68 bytes: 64 bytes of E2M1 pairs (element 2i low nibble, 2i+1 high),
    then 4 UE8M0 bytes."""
    vals = [f32(v) for v in row]
    assert len(vals) == 128
    _require_finite(vals)
    codes: list[int] = []
    scale_bytes = bytearray()
    for start in range(0, 128, 32):
        c, e = quantize_block(vals[start : start + 32], "e2m1")
        codes.extend(c)
        scale_bytes.append(e + 127)
    out = bytearray(codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(64))
    out.extend(scale_bytes)
    return bytes(out)


def unpack_indexer_row(data: bytes) -> list[float]:
    """68 bytes -> 128 float32 values."""
    assert len(data) == 68
    codes: list[int] = []
    for byte in data[:64]:
        codes.extend((byte & 0xF, byte >> 4))
    out: list[float] = []
    for blk in range(4):
        out.extend(dequantize_block(codes[32 * blk : 32 * blk + 32], data[64 + blk] - 127, "e2m1"))
    return out
