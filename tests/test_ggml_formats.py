"""GGML block formats in torch vs the numpy reference in the `gguf` package (bit-exact)."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from ds4x.formats import ggml  # noqa: E402

QUANT = [T.Q8_0, T.Q2_K, T.Q4_K, T.IQ2_XXS]
PLAIN = [T.F32, T.F16, T.BF16, T.I32]
# byte offsets of the fp16 scale fields inside a block
F16_FIELDS = {T.Q8_0: [0], T.Q2_K: [80, 82], T.Q4_K: [0, 2], T.IQ2_XXS: [0]}


def ref_dequant(raw: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.I32:
        return raw.view(np.int32)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return np.ascontiguousarray(gguf.quants.dequantize(raw, qtype))


def bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.cpu().numpy()
    return np.ascontiguousarray(a).view(np.uint32)


def row_bytes(qtype: T, n: int) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return n // block_size * type_size


def finite_f16_bits(rng: np.random.Generator, size: int) -> np.ndarray:
    """Random fp16 bit patterns over all finite values (zeros, subnormals, negatives included)."""
    h = rng.integers(0, 1 << 16, size=size, dtype=np.uint32)
    h = np.where((h & 0x7C00) == 0x7C00, h & ~np.uint32(0x4000), h)  # exponent 31 -> 27
    return h.astype(np.uint16)


def valid_raw(qtype: T, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bytes in GGUF layout, with every fp16 scale field set to a finite value."""
    raw = rng.integers(0, 256, size=(*shape[:-1], row_bytes(qtype, shape[-1])), dtype=np.uint8)
    if qtype in F16_FIELDS:
        type_size = GGML_QUANT_SIZES[qtype][1]
        blocks = raw.reshape(-1, type_size)
        for off in F16_FIELDS[qtype]:
            blocks[:, off : off + 2] = finite_f16_bits(rng, blocks.shape[0]).view(np.uint8).reshape(-1, 2)
    elif qtype in (T.F16, T.F32):
        dt = np.float16 if qtype == T.F16 else np.float32
        raw = rng.standard_normal(shape).astype(dt).view(np.uint8).reshape(raw.shape)
    elif qtype == T.BF16:  # the top halves of float32 values
        f32 = rng.standard_normal(shape).astype(np.float32)
        raw = (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(raw.shape)
    return raw


def shapes_for(qtype: T) -> list[tuple[int, ...]]:
    bs = GGML_QUANT_SIZES[qtype][0]
    return [(bs,), (3, 2 * bs), (2, 3, bs), (4, 4096)]


# ---------------------------------------------------------------------------------------------
# dequantize vs gguf


@pytest.mark.parametrize("qtype", QUANT + PLAIN, ids=lambda t: t.name)
def test_dequant_valid_blocks_bit_exact(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    for shape in shapes_for(qtype):
        raw = valid_raw(qtype, shape, rng)
        ref = ref_dequant(raw, qtype).reshape(shape)
        if qtype != T.I32:
            assert np.isfinite(ref).all()
        out = ggml.dequantize(torch.from_numpy(raw), qtype, shape)
        assert out.shape == shape
        assert out.dtype == (torch.int32 if qtype == T.I32 else torch.float32)
        assert np.array_equal(bits(out), bits(ref)), (qtype.name, shape)


@pytest.mark.parametrize("qtype", QUANT + PLAIN, ids=lambda t: t.name)
def test_dequant_raw_random_bytes(qtype: T) -> None:
    """Fully random bytes (NaN/Inf scales possible): bit-exact wherever the reference is finite."""
    rng = np.random.default_rng(100 + int(qtype))
    shape = (8, 4096)
    raw = rng.integers(0, 256, size=(8, row_bytes(qtype, 4096)), dtype=np.uint8)
    ref = ref_dequant(raw, qtype).reshape(shape)
    out = ggml.dequantize(torch.from_numpy(raw), qtype, shape).numpy()
    if qtype == T.I32:
        assert np.array_equal(out, ref)
        return
    fin = np.isfinite(ref)
    assert fin.mean() > 0.8  # the comparison below is not vacuous
    assert np.array_equal(bits(out)[fin], bits(ref)[fin])
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    assert np.array_equal(np.isinf(out), np.isinf(ref))


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_half_types_every_bit_pattern(qtype: T) -> None:
    """All 65536 patterns, NaN payloads included (torch's own fp16 cast quiets signalling NaNs)."""
    raw = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.uint8)
    ref = ref_dequant(raw, qtype)
    out = ggml.dequantize(torch.from_numpy(raw.copy()), qtype, (1 << 16,))
    assert np.array_equal(bits(out), bits(ref))


def test_raw_layouts_and_alignment() -> None:
    """1-D, 2-D, non-contiguous and misaligned (odd storage offset) raw tensors all decode the same."""
    rng = np.random.default_rng(7)
    cases = [(T.F32, (4, 512)), (T.I32, (4, 512)), (T.BF16, (4, 512)), (T.F16, (4, 512)), (T.Q4_K, (4, 512))]
    cases += [(qtype, (GGML_QUANT_SIZES[qtype][0],)) for qtype in QUANT]  # a single block
    for qtype, shape in cases:
        raw = torch.from_numpy(valid_raw(qtype, shape, rng))
        want = ggml.dequantize(raw, qtype, shape)
        want = bits(want)
        assert np.array_equal(bits(ggml.dequantize(raw.reshape(-1), qtype, shape)), want)
        big = torch.zeros(raw.numel() + 1, dtype=torch.uint8)
        big[1:] = raw.reshape(-1)
        assert np.array_equal(bits(ggml.dequantize(big[1:], qtype, shape)), want)  # storage offset 1
        wide = torch.zeros(*raw.shape[:-1], raw.shape[-1] * 2, dtype=torch.uint8)
        wide[..., ::2] = raw
        assert np.array_equal(bits(ggml.dequantize(wide[..., ::2], qtype, shape)), want)  # strided
    raw = torch.from_numpy(valid_raw(T.F32, (8,), rng))
    out = ggml.dequantize(raw, T.F32, (8,))
    out.zero_()
    assert raw.any()  # the result does not alias the input


# ---------------------------------------------------------------------------------------------
# a second, independent oracle: per-weight scalar decoders written from the format description


def _f16(b: bytes, off: int) -> np.float32:
    return np.float32(np.frombuffer(b[off : off + 2], dtype=np.float16)[0])


def scalar_q8_0(b: bytes) -> list[np.float32]:
    d = _f16(b, 0)
    return [np.float32(q) * d for q in struct.unpack("32b", b[2:34])]


def scalar_q2_k(b: bytes) -> list[np.float32]:
    d, dmin = _f16(b, 80), _f16(b, 82)
    out = []
    for i in range(256):
        half, k, j = i // 128, (i % 128) // 32, i % 32
        q = (b[16 + 32 * half + j] >> (2 * k)) & 3
        sc = b[i // 16]
        out.append(d * np.float32(sc & 15) * np.float32(q) - dmin * np.float32(sc >> 4))
    return out


def scalar_q4_k(b: bytes) -> list[np.float32]:
    d, dmin = _f16(b, 0), _f16(b, 2)
    s = b[4:16]
    out = []
    for i in range(256):
        sub = i // 32
        if sub < 4:
            sc, m = s[sub] & 63, s[sub + 4] & 63
        else:
            sc = (s[sub + 4] & 15) | ((s[sub - 4] >> 6) << 4)
            m = (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4)
        byte = b[16 + 32 * (i // 64) + i % 32]
        q = byte & 15 if (i // 32) % 2 == 0 else byte >> 4
        out.append(d * np.float32(sc) * np.float32(q) - dmin * np.float32(m))
    return out


def scalar_iq2_xxs(b: bytes) -> list[np.float32]:
    gguf.quants.IQ2_XXS.init_grid()
    grid = gguf.quants.IQ2_XXS.grid.reshape(256, 8)
    d = _f16(b, 0)
    out = []
    for g in range(8):
        idx = b[2 + 8 * g : 6 + 8 * g]
        (word,) = struct.unpack("<I", b[6 + 8 * g : 10 + 8 * g])
        db = d * (np.float32(0.5) + np.float32(word >> 28)) * np.float32(0.25)
        for k in range(4):
            s7 = (word >> (7 * k)) & 127
            signs = s7 | ((bin(s7).count("1") & 1) << 7)
            for j in range(8):
                w = db * grid[idx[k], j]
                out.append(-w if (signs >> j) & 1 else w)
    return out


SCALAR = {T.Q8_0: scalar_q8_0, T.Q2_K: scalar_q2_k, T.Q4_K: scalar_q4_k, T.IQ2_XXS: scalar_iq2_xxs}


@pytest.mark.parametrize("qtype", QUANT, ids=lambda t: t.name)
def test_scalar_reference(qtype: T) -> None:
    rng = np.random.default_rng(3)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = valid_raw(qtype, (3 * block_size,), rng)
    with np.errstate(all="ignore"):
        want = np.array(
            [w for i in range(3) for w in SCALAR[qtype](raw[i * type_size : (i + 1) * type_size].tobytes())],
            dtype=np.float32,
        )
    out = ggml.dequantize(torch.from_numpy(raw), qtype, (3 * block_size,))
    assert np.array_equal(bits(out), bits(want))


def test_iq2_xxs_tables_match_gguf() -> None:
    ksigns = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
    assert np.array_equal(ggml._iq2xxs_sign_masks().numpy(), ksigns)
    gguf.quants.IQ2_XXS.init_grid()
    assert np.array_equal(ggml._iq2xxs_grid_cpu().numpy(), gguf.quants.IQ2_XXS.grid.reshape(256, 8))


# ---------------------------------------------------------------------------------------------
# sizes, errors


def test_size_table() -> None:
    for qtype in QUANT + PLAIN:
        assert ggml.QUANT_SIZES[qtype] == tuple(GGML_QUANT_SIZES[qtype])
    assert ggml.quantized_nbytes(T.Q8_0, (4096, 1024)) == 4096 * 32 * 34
    assert ggml.quantized_nbytes(int(T.IQ2_XXS), (256, 2048, 4096)) == 256 * 2048 * 16 * 66
    assert ggml.quantized_nbytes(T.F16, (3, 5)) == 30
    assert ggml.quantized_nbytes(T.F32, ()) == 4


def test_errors() -> None:
    raw = torch.zeros(row_bytes(T.Q4_K, 512) - 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q4_K.*needs 288 bytes.*287"):
        ggml.dequantize(raw, T.Q4_K, (512,))
    with pytest.raises(ValueError, match=r"IQ2_XXS.*needs 132 bytes.*133"):
        ggml.dequantize(torch.zeros(133, dtype=torch.uint8), T.IQ2_XXS, (512,))
    with pytest.raises(ValueError, match=r"Q2_K.*not a multiple of the block size 256"):
        ggml.dequantize(torch.zeros(84, dtype=torch.uint8), T.Q2_K, (2, 128))
    with pytest.raises(ValueError, match=r"Q8_0.*block size 32"):
        ggml.quantized_nbytes(T.Q8_0, (33,))
    with pytest.raises(ValueError, match="Q4_0 is not supported"):
        ggml.dequantize(torch.zeros(18, dtype=torch.uint8), T.Q4_0, (32,))
    with pytest.raises(ValueError, match="unknown GGML type"):
        ggml.quantized_nbytes(12345, (32,))
    with pytest.raises(TypeError, match="uint8"):
        ggml.dequantize(torch.zeros(8, dtype=torch.float32), T.F32, (8,))
    with pytest.raises(ValueError, match="multiple of 32"):
        ggml.quantize_q8_0(torch.zeros(4, 48))


# ---------------------------------------------------------------------------------------------
# Q8_0 quantization


def test_quantize_q8_0_bit_exact() -> None:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((16, 4096)).astype(np.float32) * rng.uniform(1e-4, 30, (16, 1)).astype(np.float32)
    x[0, :32] = 0  # all-zero block: d = 0
    x[1, :32] = np.arange(32) - 15.5
    x[2, :32] = np.r_[127.0, -np.arange(31) - 0.5]  # d = 1 exactly, codes -0.5, -1.5, ... tie away
    x[3, 32:64] = 1e-30  # tiny values
    # near-ties: values (k + 1/2) * d for the block's own d, so codes depend on the last bit of d and 1/d
    amax = rng.uniform(1e-3, 10, (128, 1)).astype(np.float32)
    k = rng.integers(-127, 127, (128, 32))
    ties = (amax.astype(np.float64) * (k + 0.5) / 127).astype(np.float32)
    ties[:, 0] = amax[:, 0]
    for arr in (x, ties, x[:3].reshape(3, 2, 2048), x[4].astype(np.float16)):
        want = gguf.quants.quantize(arr, T.Q8_0)
        got = ggml.quantize_q8_0(torch.from_numpy(arr))
        assert got.dtype == torch.uint8 and tuple(got.shape) == want.shape
        assert np.array_equal(got.numpy(), want)
    rt = ggml.dequantize(ggml.quantize_q8_0(torch.from_numpy(x)), T.Q8_0, x.shape).numpy()
    assert np.abs(rt - x).max() <= np.abs(x).max() / 127


# ---------------------------------------------------------------------------------------------
# synthetic blocks


@pytest.mark.parametrize("qtype", QUANT + [T.F16, T.BF16, T.F32], ids=lambda t: t.name)
@pytest.mark.parametrize("std", [0.02, 0.5])
def test_random_blocks(qtype: T, std: float) -> None:
    shape = (32, 4096)
    raw = ggml.random_blocks(qtype, shape, torch.Generator().manual_seed(1), std=std)
    assert raw.dtype == torch.uint8 and tuple(raw.shape) == (32, row_bytes(qtype, 4096))
    again = ggml.random_blocks(qtype, shape, torch.Generator().manual_seed(1), std=std)
    assert torch.equal(raw, again)  # deterministic given the generator
    if qtype in F16_FIELDS:  # scale fields: finite, positive, and not all the same
        blocks = raw.numpy().reshape(-1, GGML_QUANT_SIZES[qtype][1])
        for off in F16_FIELDS[qtype]:
            d = blocks[:, off : off + 2].copy().view(np.float16).ravel()
            assert np.isfinite(d).all() and (d > 0).all() and len(np.unique(d)) > 10
    w = ggml.dequantize(raw, qtype, shape)
    assert torch.isfinite(w).all()
    assert 0.8 < w.std().item() / std < 1.25
    assert abs(w.mean().item()) < 0.05 * std
    ref = ref_dequant(raw.numpy(), qtype)  # valid blocks for the reference decoder too
    assert np.array_equal(bits(w), bits(ref.reshape(shape)))


def test_random_blocks_errors() -> None:
    with pytest.raises(ValueError, match="I32"):
        ggml.random_blocks(T.I32, (4,))
    with pytest.raises(ValueError, match="std"):
        ggml.random_blocks(T.Q8_0, (32,), std=0.0)
    with pytest.raises(ValueError, match="Q2_K.*block size"):
        ggml.random_blocks(T.Q2_K, (100,))


# ---------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", QUANT + PLAIN, ids=lambda t: t.name)
def test_cuda_bit_exact(qtype: T) -> None:
    rng = np.random.default_rng(50 + int(qtype))
    shape = (64, 4096)
    raw = valid_raw(qtype, shape, rng)
    ref = ref_dequant(raw, qtype).reshape(shape)
    out = ggml.dequantize(torch.from_numpy(raw).cuda(), qtype, shape)
    assert out.is_cuda
    assert np.array_equal(bits(out), bits(ref))
    if qtype in (T.F16, T.BF16):
        raw = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.uint8)
        out = ggml.dequantize(torch.from_numpy(raw.copy()).cuda(), qtype, (1 << 16,))
        assert np.array_equal(bits(out), bits(ref_dequant(raw, qtype)))


@pytest.mark.gpu
def test_cuda_quantize_and_random_blocks() -> None:
    rng = np.random.default_rng(12)
    x = rng.standard_normal((64, 4096)).astype(np.float32) * rng.uniform(1e-4, 30, (64, 1)).astype(np.float32)
    got = ggml.quantize_q8_0(torch.from_numpy(x).cuda())
    assert got.is_cuda and np.array_equal(got.cpu().numpy(), gguf.quants.quantize(x, T.Q8_0))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for qtype in QUANT:
        raw = ggml.random_blocks(qtype, (64, 4096), gen, std=0.02)
        assert raw.is_cuda
        w = ggml.dequantize(raw, qtype, (64, 4096))
        assert 0.8 < w.std().item() / 0.02 < 1.25
        assert np.array_equal(bits(w), bits(ref_dequant(raw.cpu().numpy(), qtype).reshape(64, 4096)))
