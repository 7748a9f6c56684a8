"""Bit-exact tests of ds4x.formats (torch reference vs scalar reference vs hand decoding)."""

from __future__ import annotations

import math
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from ds4x import formats as F
from ds4x.formats import scalar_reference as S

# ---------------------------------------------------------------------------
# helpers (also used by test_formats_triton.py)
# ---------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns: exact comparison that tells -0.0 from 0.0 and matches NaN to NaN."""
    return t.contiguous().to(torch.float32).view(torch.int32)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    ba, bb = bits(a), bits(b)
    # all NaNs are one NaN for this comparison (payloads are not part of the contract)
    nan = torch.isnan(a) & torch.isnan(b)
    diff = (ba != bb) & ~nan
    if bool(diff.any()):
        idx = diff.nonzero()[:5].tolist()
        detail = [(i, a[tuple(i)].item(), b[tuple(i)].item()) for i in idx]
        raise AssertionError(f"{int(diff.sum())} values differ, first: {detail}")


def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def next_up(v: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(np.inf)))


def next_down(v: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(-np.inf)))


def hand_e4m3(code: int) -> float:
    """E4M3FN decoded from its bits, independently of the library: s eeee mmm, bias 7."""
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    mag = m * 2.0**-9 if e == 0 else (8 + m) * 2.0 ** (e - 10)
    return -mag if s else mag


def hand_e2m1(code: int) -> float:
    """E2M1 decoded from its bits: s ee m, bias 1; e == 0 is subnormal (m * 0.5)."""
    s, e, m = code >> 3, (code >> 1) & 0x3, code & 0x1
    mag = m * 0.5 if e == 0 else (2 + m) * 2.0 ** (e - 2)
    return -mag if s else mag


E4M3_POS = [hand_e4m3(c) for c in range(127)]
E2M1_POS = [hand_e2m1(c) for c in range(8)]


def _rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_rows(n: int, width: int, seed: int) -> torch.Tensor:
    """Gaussian rows at per-row magnitudes from 1e-30 to 1e30, with some outliers."""
    g = _rng(seed)
    x = torch.randn(n, width, generator=g)
    mag = 10.0 ** (torch.rand(n, 1, generator=g) * 60 - 30)
    out = torch.rand(n, width, generator=g) < 0.02
    x = torch.where(out, x * 100, x)
    return (x * mag).to(torch.float32)


def random_kv_rows(n: int, seed: int) -> torch.Tensor:
    """Random KV rows: wide-range non-RoPE part, RoPE part within FP16 range (down to subnormals)."""
    x = random_rows(n, 512, seed)
    g = _rng(seed + 1000)
    x[:, 448:] = torch.randn(n, 64, generator=g) * 10.0 ** (torch.rand(n, 1, generator=g) * 12.5 - 9)
    return x


def midpoints_e4m3() -> list[float]:
    """Every midpoint between adjacent non-negative E4M3 values, and the floats next to it."""
    vals = []
    for c in range(126):
        mid = (E4M3_POS[c] + E4M3_POS[c + 1]) / 2
        assert f32(mid) == mid
        vals += [mid, next_up(mid), next_down(mid)]
    return vals


def midpoints_e2m1() -> list[float]:
    vals = []
    for c in range(7):
        mid = (E2M1_POS[c] + E2M1_POS[c + 1]) / 2
        vals += [mid, next_up(mid), next_down(mid)]
    return vals


def adversarial_kv_rows() -> torch.Tensor:
    """KV rows [R, 512] that poke at every edge of the format."""
    rows = []

    def row(nope: list[float], rope: list[float] | None = None) -> None:
        nope = (nope * (448 // max(1, len(nope)) + 1))[:448] if nope else [0.0] * 448
        rope = (rope * (64 // max(1, len(rope)) + 1))[:64] if rope else [0.0] * 64
        rows.append(nope + rope)

    row([0.0], [0.0])
    row([-0.0], [-0.0])
    row([1e-30, -1e-30, 3e-35])  # amax far below the 1e-4 floor
    row([1e-40, -3e-42, 2.0**-149, -(2.0**-149)])  # float32 subnormals
    row([1e-4, -1e-4, 5e-5])  # exactly at the floor
    row([f32(1e-4) * 1.0000001, 1e-4])
    row([1e38, -3e38, 1.0, -(2.0**-100)])  # huge amax (no overflow on the way back)
    row([448.0, 449.0, 464.0, 480.0, -1000.0, 1e4, -1e5])  # at and beyond +-448
    row([-448.0, 448.0])
    # halfway between adjacent codes at scale 1 (each block holds 448 so the scale is 2**0)
    mids = midpoints_e4m3()
    for start in range(0, len(mids), 63 * 7):
        chunk = mids[start : start + 63 * 7]
        nope = []
        for b in range(7):
            part = chunk[63 * b : 63 * b + 63]
            part = part + [0.0] * (63 - len(part))
            nope += [448.0] + [(-v if (i % 2) else v) for i, v in enumerate(part)]
        row(nope, [1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 65504.0, 65519.0, -65519.0, 1e-7, 2.0**-24, 3e-8])
    # amax exactly at / just above a power-of-two scale boundary
    for k in (-20, -7, 0, 5, 60):
        row([448.0 * 2.0**k, 1.0 * 2.0**k, -3.0 * 2.0**k])
        row([next_up(448.0 * 2.0**k), 1.0 * 2.0**k])
        row([next_down(448.0 * 2.0**k), -(2.0**k)])
    # mixed scales per block
    mixed = []
    for b in range(7):
        mixed += [10.0 ** (b * 6 - 20) * ((i % 7) - 3.0) for i in range(64)]
    row(mixed, [float(i) * 1000 - 32000 for i in range(64)])
    return torch.tensor(rows, dtype=torch.float32)


def adversarial_indexer_rows() -> torch.Tensor:
    """Indexer rows [R, 128]."""
    rows = []

    def row(vals: list[float]) -> None:
        rows.append((vals * (128 // max(1, len(vals)) + 1))[:128])

    row([0.0])
    row([-0.0])
    row([1e-30, -1e-30])
    row([2.0**-127, -3 * 2.0**-128, 1e-45, -(2.0**-149), 2.0**-126])  # subnormal, near the floor
    row([6.0 * 2.0**-126, 7.052966104933725e-38, 7e-38])
    row([1e38, -2e38, 1.0])
    row([6.0, 6.5, 7.0, -100.0, 1e4])  # at and beyond +-6
    mids = midpoints_e2m1()
    row([6.0] + [(-v if i % 2 else v) for i, v in enumerate(mids)])
    for k in (-126, -60, -3, 0, 7, 100):
        row([6.0 * 2.0**k, 0.75 * 2.0**k, -(2.5 * 2.0**k)])
        row([next_up(6.0 * 2.0**k), 0.75 * 2.0**k])
        row([next_down(6.0 * 2.0**k), 5.0 * 2.0**k])
    return torch.tensor(rows, dtype=torch.float32)


# ---------------------------------------------------------------------------
# element formats
# ---------------------------------------------------------------------------


def test_e4m3_decode_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = torch.tensor([hand_e4m3(c) for c in range(256)], dtype=torch.float32)
    assert_bits_equal(F.e4m3_decode(codes), want)
    assert_bits_equal(torch.tensor([S.e4m3_value(c) for c in range(256)], dtype=torch.float32), want)
    assert hand_e4m3(0x7E) == 448.0 and hand_e4m3(0x01) == 2.0**-9 and hand_e4m3(0x08) == 2.0**-6
    assert math.copysign(1.0, F.e4m3_decode(torch.tensor([0x80], dtype=torch.uint8)).item()) < 0


def test_e2m1_decode_every_code():
    want = torch.tensor([hand_e2m1(c) for c in range(16)], dtype=torch.float32)
    assert_bits_equal(F.e2m1_decode(torch.arange(16)), want)
    assert [hand_e2m1(c) for c in range(8)] == list(F.E2M1_VALUES)
    assert_bits_equal(torch.tensor([S.e2m1_value(c) for c in range(16)], dtype=torch.float32), want)


def test_e4m3_rounds_half_to_even_at_every_midpoint():
    mids = midpoints_e4m3()
    vals = torch.tensor(mids + [-v for v in mids], dtype=torch.float32)
    # pad each 63 values with a 448 so every block has scale 2**0
    n = vals.numel()
    blocks = -(-n // 63)
    padded = torch.zeros(blocks * 63)
    padded[:n] = vals
    x = torch.cat((torch.full((blocks, 1), 448.0), padded.view(blocks, 63)), dim=1).flatten()
    codes, e = F.e4m3_block_quantize(x, 64)
    assert bool((e == 0).all())
    codes = codes.view(blocks, 64)[:, 1:].flatten()[:n].tolist()
    for v, c in zip(vals.tolist(), codes, strict=True):
        a = abs(v)
        lo = max(i for i in range(127) if E4M3_POS[i] <= a)
        if E4M3_POS[lo] == a or lo == 126:
            want = lo
        else:
            d_lo, d_hi = a - E4M3_POS[lo], E4M3_POS[lo + 1] - a
            want = lo if d_lo < d_hi else lo + 1 if d_hi < d_lo else (lo if lo % 2 == 0 else lo + 1)
        want |= 0x80 if v < 0 else 0
        assert c == want, (v, hex(c), hex(want))
        assert c == S.e4m3_code(v), (v, c)


def test_e2m1_rounds_half_to_even_at_every_midpoint():
    mids = midpoints_e2m1()
    q = torch.tensor(mids + [-v for v in mids], dtype=torch.float32)
    got = F.e2m1_encode(q).tolist()
    expect_mid = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}
    for v, c in zip(q.tolist(), got, strict=True):
        a = abs(v)
        if a in expect_mid:
            want = expect_mid[a]
        else:
            want = min(range(8), key=lambda i: abs(E2M1_POS[i] - a))
        want |= 8 if v < 0 else 0
        assert c == want, (v, c, want)
        assert c == S.e2m1_code(v)
    # saturation value and signed zero
    assert F.e2m1_encode(torch.tensor([6.0, -6.0, -0.0, 0.0])).tolist() == [7, 15, 8, 0]


# ---------------------------------------------------------------------------
# scale exponents
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "mxfp4"])
def test_scale_exponent_exact_at_powers_of_two(fmt):
    vmax, fn, block = (448.0, F.e4m3_block_scale_exponents, 64) if fmt == "e4m3" else (
        6.0, F.mxfp4_block_scale_exponents, 32)
    ks = list(range(-13, 110)) if fmt == "e4m3" else list(range(-126, 126))
    amaxes, want = [], []
    for k in ks:
        a = vmax * 2.0**k
        amaxes += [a, next_up(a), next_down(a)]
        want += [k, k + 1, k]
    x = torch.zeros(len(amaxes), block)
    x[:, 3] = torch.tensor(amaxes, dtype=torch.float32)
    x[1::2, 3] *= -1
    got = fn(x.flatten(), block).tolist()
    assert got == want
    # the float-log2 route really is wrong next to a power of two, which is why we use bits
    t = torch.tensor([2.0**-10 * (1 + 2.0**-23)], dtype=torch.float32)
    assert F.ceil_log2_f32(t).item() == -9
    assert torch.ceil(torch.log2(t)).item() == -10


def test_scale_exponent_floors():
    z = torch.zeros(3, 64)
    z[1] = 1e-30
    z[2, 0] = -5e-5
    # fp32(1e-4) * fp32(1/448) = 2.23e-7 -> 2**-22
    assert F.e4m3_block_scale_exponents(z, 64).flatten().tolist() == [-22, -22, -22]
    m = torch.zeros(4, 32)
    m[1] = 1e-45
    m[2, 5] = -(2.0**-127)
    m[3, 5] = 6.0 * 2.0**-126
    # the floor 6 * 2**-126 is exactly the amax of scale 2**-126 (UE8M0 byte 1)
    assert F.mxfp4_block_scale_exponents(m, 32).flatten().tolist() == [-126] * 4
    assert F.MXFP4_AMAX_FLOOR == 7.052966104933725e-38 == 6 * 2.0**-126
    assert f32(F.E4M3_AMAX_FLOOR) == S.E4M3_FLOOR


@pytest.mark.parametrize("vmax", [448.0, 6.0])
def test_division_and_official_multiply_give_the_same_exponent_over_a_binade(vmax):
    # ceil(log2(fp32(a / vmax))) == ceil(log2(fp32(a * fp32(1 / vmax)))) for all 2**23 floats
    # a in [1, 2); both results scale exactly with a power of two while they stay normal
    # (the amax floors guarantee that), so one binade covers every reachable amax.
    a = (torch.arange(2**23, dtype=torch.int32) | (127 << 23)).view(torch.float32)
    div = a / torch.tensor(vmax, dtype=torch.float32)
    mul = a * torch.tensor(1.0 / vmax, dtype=torch.float32)
    assert bool((div != mul).any())  # the values do differ ...
    assert torch.equal(F.ceil_log2_f32(div), F.ceil_log2_f32(mul))  # ... their exponents never


def test_ceil_log2_and_pow2_from_bits():
    e = torch.arange(-126, 128, dtype=torch.int32)
    p = F.pow2_f32(e)
    assert torch.equal(p, torch.tensor([2.0**k for k in range(-126, 128)], dtype=torch.float32))
    assert torch.equal(F.ceil_log2_f32(p), e)
    assert torch.equal(F.ceil_log2_f32(p * 1.5), e + 1)
    assert F.ceil_log2_f32(torch.tensor([math.inf, math.nan])).tolist() == [128, 128]


def test_ue8m0_bytes():
    e = torch.tensor([-127, -126, -22, 0, 120, 127, 128])
    b = F.ue8m0_encode(e)
    assert b.tolist() == [0, 1, 105, 127, 247, 254, 255]
    d = F.ue8m0_decode(b)
    assert d[:6].tolist() == [2.0**-127, 2.0**-126, 2.0**-22, 1.0, 2.0**120, 2.0**127]
    assert math.isnan(d[6].item())
    if hasattr(torch, "float8_e8m0fnu"):  # agrees with torch's own e8m0 decoding
        allb = torch.arange(255, dtype=torch.int32).to(torch.uint8)
        assert_bits_equal(F.ue8m0_decode(allb), allb.view(torch.float8_e8m0fnu).float())


# ---------------------------------------------------------------------------
# round trips vs the scalar reference
# ---------------------------------------------------------------------------


def _scalar_rows(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([fn(r) for r in x.tolist()], dtype=torch.float32)


def test_e4m3_roundtrip_matches_scalar_reference():
    x = torch.cat((random_rows(24, 448, seed=1), adversarial_kv_rows()[:, :448]))
    got = F.e4m3_block_roundtrip(x, 64)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert_bits_equal(got, _scalar_rows(S.e4m3_block_roundtrip, x))


def test_e4m3_roundtrip_properties():
    x = random_rows(64, 448, seed=2)
    y = F.e4m3_block_roundtrip(x)
    # idempotent, sign-preserving, within half an E4M3 step (relative 2**-4) of the input
    assert_bits_equal(F.e4m3_block_roundtrip(y), y)
    assert bool((torch.signbit(y) == torch.signbit(x)).all())
    e = F.e4m3_block_scale_exponents(x).repeat_interleave(64, dim=-1)
    step_floor = torch.ldexp(torch.ones_like(x), e - 9)  # smallest subnormal step at this scale
    assert bool(((y - x).abs() <= torch.maximum(x.abs() * 2.0**-4, step_floor)).all())
    assert bool((y.abs() <= torch.ldexp(torch.full_like(x, 448.0), e)).all())
    # other block sizes and leading shapes
    z = random_rows(6, 256, seed=3).view(2, 3, 256)
    assert_bits_equal(F.e4m3_block_roundtrip(z, 128), _scalar_rows(
        lambda r: S.e4m3_block_roundtrip(r, 128), z.view(6, 256)).view(2, 3, 256))


def test_e4m3_known_values():
    blk = torch.zeros(64)
    blk[:4] = torch.tensor([464.0, 448.0, 1.0, -0.0])
    # amax 464 -> scale 2: 464/2 = 232 is halfway between 224 (even) and 240 -> 224 -> 448
    y = F.e4m3_block_roundtrip(blk)
    assert y[:3].tolist() == [448.0, 448.0, 1.0]
    assert math.copysign(1.0, y[3].item()) < 0
    codes, e = F.e4m3_block_quantize(blk)
    assert e.tolist() == [1] and codes[:4].tolist() == [0x76, 0x76, 0x30, 0x80]


def test_mxfp4_roundtrip_matches_scalar_reference():
    x = torch.cat((random_rows(24, 128, seed=4), adversarial_indexer_rows()))
    got = F.mxfp4_roundtrip(x, 32)
    assert_bits_equal(got, _scalar_rows(S.mxfp4_roundtrip, x))
    assert_bits_equal(F.mxfp4_roundtrip(got), got)


def test_mxfp4_known_values():
    b = torch.zeros(32)
    b[:6] = torch.tensor([6.0, 5.0, -3.5, 0.25, 2.0**-130, -0.0])
    y = F.mxfp4_roundtrip(b)
    assert y[:5].tolist() == [6.0, 4.0, -4.0, 0.0, 0.0]
    assert math.copysign(1.0, y[5].item()) < 0
    # subnormal float32 inputs can round-trip exactly at the smallest scale 2**-126
    s = torch.zeros(32)
    s[:3] = torch.tensor([2.0**-127, 3 * 2.0**-128, -(2.0**-126)])
    assert F.mxfp4_roundtrip(s)[:3].tolist() == [2.0**-127, 2.0**-126, -(2.0**-126)]
    # near float32's max the dequantized value overflows, exactly as the fp32 official graph does
    big = torch.full((32,), 3.4e38)
    assert math.isinf(F.mxfp4_roundtrip(big)[0].item())
    assert math.isinf(S.mxfp4_roundtrip([3.4e38] * 32)[0])


def test_nonfinite_blocks_become_nan_not_numbers():
    x = torch.ones(2, 128)
    x[0, 5] = math.nan
    x[1, 100] = -math.inf
    y = F.mxfp4_roundtrip(x)
    assert bool(y[0, :32].isnan().all()) and bool((y[0, 32:] == 1).all())
    assert bool(y[1, 96:].isnan().all()) and bool((y[1, :96] == 1).all())
    z = F.e4m3_block_roundtrip(x)
    assert bool(z[0, :64].isnan().all()) and bool((z[0, 64:] == 1).all())
    assert F.e4m3_block_scale_exponents(x).tolist() == [[128, -8], [-8, 128]]
    assert_bits_equal(y, _scalar_rows(S.mxfp4_roundtrip, x))


def test_block_functions_reject_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="multiple of block"):
        F.e4m3_block_roundtrip(torch.zeros(100), 64)
    with pytest.raises(ValueError, match="multiple of block"):
        F.mxfp4_roundtrip(torch.zeros(33))
    with pytest.raises(ValueError, match="floating-point"):
        F.mxfp4_roundtrip(torch.zeros(32, dtype=torch.int32))


# ---------------------------------------------------------------------------
# Hadamard
# ---------------------------------------------------------------------------


def test_hadamard128_bits_match_scalar_butterfly():
    x = torch.cat((random_rows(8, 128, seed=5), adversarial_indexer_rows()[:6]))
    assert_bits_equal(F.hadamard128(x), _scalar_rows(S.hadamard128, x))


def test_hadamard128_is_the_normalized_sylvester_matrix():
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 128:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    x = torch.randn(5, 3, 128, generator=_rng(6))
    want = (x.double() @ h.T) / math.sqrt(128)
    got = F.hadamard128(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(F.hadamard128(got), x, rtol=1e-5, atol=1e-5)  # orthonormal, involution
    # the scale is one fp32 multiply at the end: H(e0) is exactly fp32(128**-0.5) everywhere
    e0 = torch.zeros(128)
    e0[0] = 1.0
    assert bool((F.hadamard128(e0) == f32(128**-0.5)).all())
    with pytest.raises(ValueError):
        F.hadamard128(torch.zeros(64))


# ---------------------------------------------------------------------------
# packed rows
# ---------------------------------------------------------------------------


def test_kv_row_invariant_and_scalar_reference():
    x = torch.cat((random_kv_rows(16, seed=7), adversarial_kv_rows()))
    rows = F.pack_kv_rows(x)
    assert rows.dtype == torch.uint8 and rows.shape == (x.shape[0], 583)
    want = torch.cat((F.e4m3_block_roundtrip(x[:, :448]), x[:, 448:].half().float()), dim=-1)
    assert_bits_equal(F.unpack_kv_rows(rows), want)
    for i in range(x.shape[0]):
        ref = S.pack_kv_row(x[i].tolist())
        assert bytes(rows[i].tolist()) == ref, i
    assert_bits_equal(F.unpack_kv_rows(rows), _scalar_rows(lambda r: S.unpack_kv_row(bytes(r)), rows))


def test_indexer_row_invariant_and_scalar_reference():
    x = torch.cat((random_rows(16, 128, seed=8), adversarial_indexer_rows()))
    rows = F.pack_indexer_rows(x)
    assert rows.dtype == torch.uint8 and rows.shape == (x.shape[0], 68)
    assert_bits_equal(F.unpack_indexer_rows(rows), F.mxfp4_roundtrip(x))
    for i in range(x.shape[0]):
        assert bytes(rows[i].tolist()) == S.pack_indexer_row(x[i].tolist()), i
    assert_bits_equal(F.unpack_indexer_rows(rows), _scalar_rows(lambda r: S.unpack_indexer_row(bytes(r)), rows))


def test_kv_row_byte_layout_decoded_by_hand():
    x = torch.cat((random_kv_rows(6, seed=9), adversarial_kv_rows()[:8]))
    rows = F.pack_kv_rows(x)
    exps = F.e4m3_block_scale_exponents(x[:, :448], 64)
    for i in range(x.shape[0]):
        data = bytes(rows[i].tolist())
        # 7 scale bytes at the end, exponent + 127
        assert list(data[576:583]) == [e + 127 for e in exps[i].tolist()]
        # 448 E4M3 codes, block b scaled by 2**e_b
        nope = [hand_e4m3(data[d]) * 2.0 ** (data[576 + d // 64] - 127) for d in range(448)]
        # 64 little-endian binary16 values
        rope = np.frombuffer(data[448:576], dtype="<f2").astype(np.float32).tolist()
        got = torch.tensor(nope + rope, dtype=torch.float32)
        assert_bits_equal(got, F.unpack_kv_rows(rows[i]))
        assert_bits_equal(torch.tensor(rope, dtype=torch.float32), x[i, 448:].half().float())


def test_kv_row_exact_bytes_of_a_hand_built_row():
    x = torch.zeros(512)
    x[0:4] = torch.tensor([448.0, -0.0, 1.0, -(2.0**-9)])  # block 0: scale 2**0
    x[64] = 3.0  # block 1: fp32(3 / 448) -> scale 2**-7, 3 * 2**7 = 384 = 0x7C
    x[448] = 1.0
    x[449] = -2.0
    x[511] = -0.0
    data = bytes(F.pack_kv_rows(x).tolist())
    assert data[0:4] == bytes([0x7E, 0x80, 0x38, 0x81])
    assert data[4:64] == bytes(60)
    assert data[64] == 0x7C and data[65:128] == bytes(63)
    assert data[448:452] == bytes([0x00, 0x3C, 0x00, 0xC0])
    assert data[574:576] == bytes([0x00, 0x80])
    assert list(data[576:583]) == [127, 120, 105, 105, 105, 105, 105]  # empty blocks: floor -> 2**-22


def test_indexer_row_nibble_order_and_bytes():
    x = torch.zeros(128)
    x[0], x[1] = 6.0, 0.5  # codes 7 (low nibble), 1 (high nibble) -> 0x17
    x[2], x[3] = -1.0, -0.0  # codes 0xA, 0x8 -> 0x8A
    x[33] = 1.5  # block 1: amax 1.5 -> scale 2**-2, 1.5 * 4 = 6 -> code 7 in the high nibble of byte 16
    data = bytes(F.pack_indexer_rows(x).tolist())
    assert data[0] == 0x17 and data[1] == 0x8A and data[2:16] == bytes(14)
    assert data[16] == 0x70 and data[17:64] == bytes(47)
    assert list(data[64:68]) == [127, 125, 1, 1]
    y = F.unpack_indexer_rows(torch.tensor(list(data), dtype=torch.uint8))
    assert y[:4].tolist() == [6.0, 0.5, -1.0, 0.0] and math.copysign(1, y[3].item()) < 0
    assert y[33].item() == 1.5
    # every byte decoded by hand: element 2i from the low nibble, 2i+1 from the high nibble
    r = F.pack_indexer_rows(random_rows(4, 128, seed=10))
    for row in r.tolist():
        codes = [c for byte in row[:64] for c in (byte & 0xF, byte >> 4)]
        vals = [hand_e2m1(c) * 2.0 ** (row[64 + j // 32] - 127) for j, c in enumerate(codes)]
        assert_bits_equal(torch.tensor(vals, dtype=torch.float32),
                          F.unpack_indexer_rows(torch.tensor(row, dtype=torch.uint8)))


def test_negative_zero_round_trips_as_negative_zero():
    x = torch.full((512,), -0.0)
    y = F.unpack_kv_rows(F.pack_kv_rows(x))
    assert bool(torch.signbit(y).all()) and bool((y == 0).all())
    i = F.unpack_indexer_rows(F.pack_indexer_rows(torch.full((128,), -0.0)))
    assert bool(torch.signbit(i).all()) and bool((i == 0).all())
    p = F.pack_kv_rows(x)
    assert bool((p[:448] == 0x80).all()) and p[448:576].tolist() == [0x00, 0x80] * 64


def test_pack_rejects_nonfinite_and_fp16_overflow():
    for bad, where in ((math.nan, 3), (math.inf, 100), (-math.inf, 447), (math.nan, 448), (math.inf, 511)):
        x = torch.zeros(2, 512)
        x[1, where] = bad
        with pytest.raises(ValueError, match="NaN/Inf"):
            F.pack_kv_rows(x)
    x = torch.zeros(512)
    x[500] = 70000.0
    with pytest.raises(ValueError, match="overflow FP16"):
        F.pack_kv_rows(x)
    x[500] = 65504.0
    F.pack_kv_rows(x)  # the largest FP16 value is fine
    for bad in (math.nan, math.inf, -math.inf):
        y = torch.zeros(3, 128)
        y[2, 77] = bad
        with pytest.raises(ValueError, match="NaN/Inf"):
            F.pack_indexer_rows(y)


def test_pack_without_validation_marks_bad_blocks_nan():
    x = torch.ones(512)
    x[70] = math.nan
    rows = F.pack_kv_rows(x, validate=False)
    assert rows[576 + 1].item() == 0xFF
    y = F.unpack_kv_rows(rows)
    assert bool(y[64:128].isnan().all()) and bool((y[:64] == 1).all()) and bool((y[128:] == 1).all())
    z = torch.ones(128)
    z[40] = -math.inf
    r = F.pack_indexer_rows(z, validate=False)
    assert r[65].item() == 0xFF and bool(F.unpack_indexer_rows(r)[32:64].isnan().all())


def test_rows_shapes_dtypes_and_errors():
    x = random_kv_rows(6, seed=11)
    flat = F.pack_kv_rows(x)
    assert torch.equal(F.pack_kv_rows(x.view(2, 3, 512)), flat.view(2, 3, 583))
    assert torch.equal(F.pack_kv_rows(x[0]), flat[0])
    assert F.unpack_kv_rows(flat.view(3, 2, 583)).shape == (3, 2, 512)
    assert F.pack_kv_rows(torch.zeros(0, 512)).shape == (0, 583)
    # lower-precision input is widened to float32 first
    xb = x.bfloat16()
    assert torch.equal(F.pack_kv_rows(xb), F.pack_kv_rows(xb.float()))
    xh = random_rows(3, 128, seed=12).clamp(-60000, 60000).half()
    assert torch.equal(F.pack_indexer_rows(xh), F.pack_indexer_rows(xh.float()))
    with pytest.raises(ValueError, match="multiple of 64 non-RoPE"):
        F.pack_kv_rows(torch.zeros(4, 511))
    with pytest.raises(ValueError, match="not a packed KV row"):
        F.unpack_kv_rows(torch.zeros(4, 582, dtype=torch.uint8))
    with pytest.raises(ValueError, match="floating-point"):
        F.pack_kv_rows(torch.zeros(4, 512, dtype=torch.int64))
    with pytest.raises(ValueError, match="uint8"):
        F.unpack_kv_rows(torch.zeros(4, 583, dtype=torch.int8))
    with pytest.raises(ValueError, match="last dim 68"):
        F.unpack_indexer_rows(torch.zeros(4, 67, dtype=torch.uint8))
    with pytest.raises(ValueError, match="last dim 128"):
        F.pack_indexer_rows(torch.zeros(4, 64))


def test_unpack_decodes_nan_codes_faithfully():
    rows = F.pack_kv_rows(torch.ones(512))
    rows[5] = 0x7F
    y = F.unpack_kv_rows(rows)
    assert math.isnan(y[5].item()) and y[4].item() == 1.0
    assert F.KV_ROW_BYTES == 583 and F.INDEXER_ROW_BYTES == 68


# ---------------------------------------------------------------------------
# checkpoint weights
# ---------------------------------------------------------------------------


def _random_e8m0(shape, seed) -> torch.Tensor:
    return torch.randint(100, 140, shape, generator=_rng(seed), dtype=torch.int32).to(torch.uint8)


def _independent_fp8_dequant(w_bytes: torch.Tensor, scale_f: list[list[float]], block: int) -> torch.Tensor:
    out = torch.empty(w_bytes.shape, dtype=torch.float32)
    wb = w_bytes.tolist()
    for r in range(w_bytes.shape[0]):
        for c in range(w_bytes.shape[1]):
            out[r, c] = f32(hand_e4m3(wb[r][c]) * scale_f[r // block][c // block])
    return out


@pytest.mark.parametrize("shape", [(256, 128), (200, 300), (130, 1)])
@pytest.mark.parametrize("scale_kind", ["e8m0", "uint8", "float32"])
def test_dequantize_fp8_block_weight(shape, scale_kind):
    if scale_kind == "e8m0" and not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("torch without float8_e8m0fnu")
    out_dim, in_dim = shape
    g = _rng(out_dim * in_dim)
    wb = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    wb[wb == 0x7F] = 0x7E  # keep NaN codes out of the independent float comparison
    wb[wb == 0xFF] = 0xFE
    sshape = (-(-out_dim // 128), -(-in_dim // 128))
    sb = _random_e8m0(sshape, seed=out_dim)
    if scale_kind == "e8m0":
        scale, sval = sb.view(torch.float8_e8m0fnu), [[2.0 ** (b - 127) for b in r] for r in sb.tolist()]
    elif scale_kind == "uint8":
        scale, sval = sb, [[2.0 ** (b - 127) for b in r] for r in sb.tolist()]
    else:
        scale = torch.rand(sshape, generator=g) * 1e-3
        sval = scale.tolist()
    got = F.dequantize_fp8_block_weight(wb.view(torch.float8_e4m3fn), scale)
    assert got.dtype == torch.float32 and got.shape == shape
    assert_bits_equal(got, _independent_fp8_dequant(wb, sval, 128))
    assert_bits_equal(F.dequantize_fp8_block_weight(wb, scale), got)  # raw bytes accepted


def test_dequantize_fp8_block_weight_errors():
    w = torch.zeros(200, 300, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale shape"):
        F.dequantize_fp8_block_weight(w, torch.ones(1, 2))
    with pytest.raises(ValueError, match="dtype"):
        F.dequantize_fp8_block_weight(torch.zeros(200, 300), torch.ones(2, 3))
    with pytest.raises(ValueError, match="unsupported dtype"):
        F.dequantize_fp8_block_weight(w, torch.ones(2, 3, dtype=torch.int32))


@pytest.mark.parametrize("in_dim", [96, 80, 2])
@pytest.mark.parametrize("scale_kind", ["e8m0", "uint8", "float32"])
@pytest.mark.parametrize("packed_dtype", [torch.int8, torch.uint8])
def test_dequantize_fp4_expert_weight(in_dim, scale_kind, packed_dtype):
    if scale_kind == "e8m0" and not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("torch without float8_e8m0fnu")
    out_dim = 5
    g = _rng(in_dim)
    pb = torch.randint(0, 256, (out_dim, in_dim // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    sshape = (out_dim, -(-in_dim // 32))
    sb = _random_e8m0(sshape, seed=in_dim + 1)
    if scale_kind == "float32":
        scale = torch.rand(sshape, generator=g)
        sval = scale.tolist()
    else:
        scale = sb.view(torch.float8_e8m0fnu) if scale_kind == "e8m0" else sb
        sval = [[2.0 ** (b - 127) for b in r] for r in sb.tolist()]
    got = F.dequantize_fp4_expert_weight(pb.view(packed_dtype), scale)
    assert got.dtype == torch.float32 and got.shape == (out_dim, in_dim)
    want = []
    for r, row in enumerate(pb.tolist()):
        vals = []
        for byte in row:
            vals += [hand_e2m1(byte & 0xF), hand_e2m1(byte >> 4)]  # element 2i low, 2i+1 high
        want.append([f32(v * sval[r][j // 32]) for j, v in enumerate(vals)])
    assert_bits_equal(got, torch.tensor(want, dtype=torch.float32))


def test_dequantize_fp4_expert_weight_matches_official_convert_table():
    # official convert.py: FP4_TABLE[low], FP4_TABLE[high], stacked low first; its table has +0.0 at 8
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    x = torch.randint(-128, 128, (4, 64), generator=_rng(13), dtype=torch.int32).to(torch.int8)
    scale = _random_e8m0((4, 4), seed=14)
    u = x.view(torch.uint8)
    vals = torch.stack((table[(u & 0x0F).long()], table[(u >> 4).long()]), dim=-1).flatten(1)
    want = vals * F.ue8m0_decode(scale).repeat_interleave(32, dim=1)
    got = F.dequantize_fp4_expert_weight(x, scale)
    assert torch.equal(got, want)  # == treats -0.0 and 0.0 alike: the only difference is the zero sign
    with pytest.raises(ValueError, match="scale shape"):
        F.dequantize_fp4_expert_weight(x, scale[:, :3])
    with pytest.raises(ValueError, match="dtype"):
        F.dequantize_fp4_expert_weight(x.float(), scale)


# ---------------------------------------------------------------------------
# packaging
# ---------------------------------------------------------------------------


def test_package_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, ds4x.formats as F\n"
        "x = torch.ones(512)\n"
        "assert F.unpack_kv_rows(F.pack_kv_rows(x)).eq(1).all()\n"
        "assert 'triton' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "try:\n"
        "    F.pack_kv_rows_triton(x)\n"
        "except RuntimeError as e:\n"
        "    assert 'triton' in str(e)\n"
        "else:\n"
        "    raise SystemExit('expected RuntimeError')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_kv_rows_of_other_widths_keep_the_layout():
    # a smaller model: 64 non-RoPE + 64 RoPE values -> 64 + 128 + 1 bytes, same field order
    assert F.kv_row_bytes(512, 64) == 583 and F.kv_row_bytes(128, 64) == 193 and F.kv_row_bytes(192, 64) == 258
    x = random_rows(9, 128, seed=21).clamp(-6e4, 6e4)
    rows = F.pack_kv_rows(x)
    assert rows.shape == (9, 193)
    expected = torch.cat([F.e4m3_block_roundtrip(x[:, :64]), x[:, 64:].half().float()], dim=-1)
    assert torch.equal(F.unpack_kv_rows(rows), expected)
    wide = torch.cat([x[:, :64], torch.zeros(9, 384), x[:, 64:]], dim=-1)  # same values inside a 512 row
    assert torch.equal(F.pack_kv_rows(wide)[:, 576], rows[:, 192])  # first block's scale byte
