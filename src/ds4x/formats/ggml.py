"""GGML tensor formats (the ones in the ds4 GGUF) decoded with torch ops.

Everything here works on raw bytes: a ``uint8`` tensor holding a tensor's data exactly as it sits in
the GGUF file (rows of blocks, little-endian), on any device. The dequantizers are vectorized over
all blocks at once and are bit-exact to the numpy reference ``gguf.quants.dequantize``: every float
operation below is the same IEEE float32 operation, in the same order, as the reference. Keep it that
way when editing (no fused multiply-adds, no division by Python scalars, which CUDA turns into a
multiply by the reciprocal).

Shapes are logical, row-major torch shapes: the last dimension is the contiguous one (GGUF's
``ne[0]``), i.e. GGUF dims ``[in, out]`` are the torch shape ``(out, in)``. Blocks never straddle
rows, so the last dimension must be a multiple of the type's block size.

Block layouts (``QK_K`` = 256; all multi-byte fields little-endian; fp16 = IEEE half):

* F32 / F16 / BF16 / I32: plain arrays, 4 / 2 / 2 / 4 bytes per element.
* Q8_0, 32 weights in 34 bytes: ``d`` fp16 @0, ``qs`` 32 x int8 @2.  ``w = d * q``.
* Q2_K, 256 weights in 84 bytes: ``scales`` 16 bytes @0 (one per 16-weight sub-block: low nibble
  scale, high nibble min), ``qs`` 64 bytes @16 (2-bit codes), ``d`` fp16 @80, ``dmin`` fp16 @82.
  ``w = (d * scale) * q - (dmin * min)``.  Code order: the 64 ``qs`` bytes are two 32-byte halves,
  each covering 128 weights; weight ``32 * k + j`` of a half is bits ``2k..2k+1`` of byte ``j``.
* Q4_K, 256 weights in 144 bytes: ``d`` fp16 @0, ``dmin`` fp16 @2, ``scales`` 12 bytes @4 (eight
  6-bit scales and eight 6-bit mins, one per 32-weight sub-block, packed as below), ``qs`` 128 bytes
  @16 (4-bit codes).  ``w = (d * scale) * q - (dmin * min)``.  Code order: four 32-byte chunks, each
  covering 64 weights: the low nibbles of the chunk are its first 32 weights, the high nibbles the
  next 32.  Scale packing, for sub-blocks ``i < 4``: ``scale = b[i] & 63``, ``min = b[i+4] & 63``; for
  ``i >= 4``: ``scale = (b[i+4] & 15) | (b[i-4] >> 6) << 4``, ``min = (b[i+4] >> 4) | (b[i] >> 6) << 4``.
* IQ2_XXS, 256 weights in 66 bytes: ``d`` fp16 @0, then eight 8-byte groups of 32 weights each.  In a
  group, bytes 0..3 are indices into a fixed 256-entry grid of 8 magnitudes from {8, 25, 43} (one
  index per 8 weights); bytes 4..7 are a uint32 whose bits 0..27 are four 7-bit sign indices (one
  per 8 weights, into a table of the 128 even-parity 8-bit sign masks: 7 free bits plus a parity bit)
  and bits 28..31 a 4-bit scale ``s``.  ``w = (d * (0.5 + s) * 0.25) * grid * sign``.

The IQ2_XXS grid is read from the ``gguf`` package at first use (it is a fixed table of the format);
the sign masks are computed.  Everything else is self-contained; ``gguf`` supplies the type enum and
block sizes when installed.
"""

from __future__ import annotations

import math
from enum import IntEnum
from functools import lru_cache

import torch
import torch.nn.functional as F

try:  # the enum and size table from the gguf package, when installed
    from gguf import GGML_QUANT_SIZES as _GGUF_QUANT_SIZES
    from gguf import GGMLQuantizationType
except ImportError:  # pragma: no cover - exercised only without the optional dependency
    _GGUF_QUANT_SIZES = None

    class GGMLQuantizationType(IntEnum):  # type: ignore[no-redef]
        """The subset of ``ggml_type`` values this module handles (same numbers as ggml)."""

        F32 = 0
        F16 = 1
        Q8_0 = 8
        Q2_K = 10
        Q4_K = 12
        IQ2_XXS = 16
        I32 = 26
        BF16 = 30


__all__ = [
    "QK_K",
    "QUANT_SIZES",
    "SUPPORTED_TYPES",
    "GGMLQuantizationType",
    "dequantize",
    "nonfinite_scale_blocks",
    "quantize_q8_0",
    "quantized_nbytes",
    "random_blocks",
]

T = GGMLQuantizationType
QK_K = 256

# (weights per block, bytes per block) for the types handled here.
_SIZES: dict[int, tuple[int, int]] = {
    T.F32: (1, 4),
    T.F16: (1, 2),
    T.BF16: (1, 2),
    T.I32: (1, 4),
    T.Q8_0: (32, 34),
    T.Q2_K: (QK_K, 84),
    T.Q4_K: (QK_K, 144),
    T.IQ2_XXS: (QK_K, 66),
}
if _GGUF_QUANT_SIZES is not None:  # same numbers; keep ourselves honest against the package
    for _t, _bs in _SIZES.items():
        assert tuple(_GGUF_QUANT_SIZES[T(_t)]) == _bs, (T(_t).name, _bs)

QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {T(t): bs for t, bs in _SIZES.items()}
"""``{type: (block_size, type_size)}``: weights per block and bytes per block."""

SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(QUANT_SIZES)


# byte offsets, within a block, of its fp16 scale fields (d, and dmin where the type has one)
_SCALE_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q8_0: (0,), T.Q2_K: (80, 82), T.Q4_K: (0, 2), T.IQ2_XXS: (0,)}


def nonfinite_scale_blocks(raw: torch.Tensor, qtype: GGMLQuantizationType | int) -> int:
    """How many blocks of ``raw`` (uint8, whole blocks of ``qtype`` in the file's layout) have a NaN or infinite
    fp16 scale: such a block decodes to NaN weights. Reads only the scales' high bytes (exponent all ones)."""
    t = _qtype(qtype)
    blocks = raw.reshape(-1, QUANT_SIZES[t][1])
    bad = torch.zeros(blocks.shape[0], dtype=torch.bool, device=raw.device)
    for off in _SCALE_FIELDS.get(t, ()):
        bad |= (blocks[:, off + 1] & 0x7C) == 0x7C
    return int(bad.sum())


def _qtype(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    try:
        t = T(int(qtype))
    except ValueError:
        raise ValueError(f"unknown GGML type {qtype!r}") from None
    if t not in QUANT_SIZES:
        supported = ", ".join(s.name for s in SUPPORTED_TYPES)
        raise ValueError(f"GGML type {t.name} is not supported (supported: {supported})")
    return t


def _row_len(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block_size = QUANT_SIZES[qtype][0]
    n = shape[-1] if len(shape) else 1
    if any(s < 0 for s in shape):
        raise ValueError(f"{qtype.name}: negative dimension in shape {tuple(shape)}")
    if n % block_size:
        raise ValueError(
            f"{qtype.name}: last dimension {n} of shape {tuple(shape)} is not a multiple of "
            f"the block size {block_size}"
        )
    return n


def quantized_nbytes(qtype: GGMLQuantizationType | int, shape: tuple[int, ...]) -> int:
    """Bytes taken by a tensor of logical ``shape`` (last dim contiguous) stored as ``qtype``."""
    t = _qtype(qtype)
    shape = tuple(int(s) for s in shape)
    _row_len(t, shape)
    block_size, type_size = QUANT_SIZES[t]
    return math.prod(shape) // block_size * type_size


# ----------------------------------------------------------------------------------------------
# small helpers


def _as_dtype(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret contiguous uint8 ``flat`` as ``dtype`` along its last dim (copying first if its
    storage offset is misaligned for ``dtype``)."""
    try:
        return flat.view(dtype)
    except RuntimeError:
        return flat.clone().view(dtype)


_INT32_SIGN = -(2**31)  # 0x80000000 as an int32


def _fp16_to_f32(pairs: torch.Tensor) -> torch.Tensor:
    """``(..., 2)`` uint8 little-endian fp16 bit patterns -> float32 ``(...)``.

    Finite values and infinities convert exactly with torch's cast. NaNs are rebuilt from their
    bits (sign, all-ones exponent, payload shifted up by 13) so signalling NaNs keep their payload
    unquieted, as numpy's conversion does; torch's cast would set the quiet bit.
    """
    f = _as_dtype(pairs.contiguous(), torch.float16).squeeze(-1).float()
    lo = pairs[..., 0].to(torch.int32)
    hi = pairs[..., 1].to(torch.int32)
    mant = ((hi & 0x03) << 8) | lo
    is_nan = ((hi & 0x7C) == 0x7C) & (mant != 0)
    nan_bits = (mant << 13) | 0x7F800000
    nan_bits = torch.where(hi >= 0x80, nan_bits | _INT32_SIGN, nan_bits)
    return torch.where(is_nan, nan_bits, f.view(torch.int32)).view(torch.float32)


def _f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block, as float32 ``(n_blocks, 1)``."""
    return _fp16_to_f32(blocks[:, offset : offset + 2]).unsqueeze(-1)


def _put_f16_field(blocks: torch.Tensor, offset: int, values: torch.Tensor) -> None:
    """Store float ``values`` ``(n_blocks,)`` as fp16 at byte ``offset`` of every block."""
    blocks[:, offset : offset + 2] = values.to(torch.float16).contiguous().view(torch.uint8).view(-1, 2)


def _shifts(bits: list[int], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.uint8, device=device).view(shape)


# ----------------------------------------------------------------------------------------------
# IQ2_XXS tables


@lru_cache(maxsize=1)
def _iq2xxs_grid_cpu() -> torch.Tensor:
    """The IQ2_XXS grid as float32 ``(256, 8)``, decoded from the table in the ``gguf`` package.

    ``gguf`` stores each grid entry as 2 bytes of four 2-bit codes (low bits first) indexing the
    magnitudes ``grid_map`` = (0x08, 0x19, 0x2b), the whole table hex-encoded.
    """
    try:
        from gguf.quants import IQ2_XXS
    except ImportError as e:  # pragma: no cover
        raise ImportError("IQ2_XXS needs the grid table from the `gguf` package (pip install gguf)") from e
    packed = torch.frombuffer(bytearray(bytes.fromhex(IQ2_XXS.grid_hex.decode("ascii"))), dtype=torch.uint8)
    codes = (packed.view(256, 2, 1) >> _shifts([0, 2, 4, 6], (1, 1, 4), packed.device)) & 3
    magnitudes = torch.tensor(IQ2_XXS.grid_map, dtype=torch.float32)
    assert magnitudes.tolist() == [8.0, 25.0, 43.0]
    return magnitudes[codes.reshape(256, 8).long()]


def _iq2xxs_sign_masks() -> torch.Tensor:
    """The 128 IQ2_XXS sign masks (uint8): the 7-bit index plus an even-parity 8th bit."""
    i = torch.arange(128, dtype=torch.int32)
    parity = sum((i >> b) & 1 for b in range(7)) & 1
    return (i | (parity << 7)).to(torch.uint8)


@lru_cache(maxsize=8)
def _iq2xxs_signed_grid(device: torch.device) -> torch.Tensor:
    """Every (grid entry, sign mask) pair: float32 ``(256 * 128, 8)``, row ``g * 128 + s`` =
    ``grid[g] * signs[s]``. Applying a sign is exact, so ``db * (grid * sign)`` has the same bits as
    ``(db * grid) * sign``, and one table lookup replaces two."""
    bits = (_iq2xxs_sign_masks().view(128, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    signs = 1.0 - 2.0 * bits.float()  # (128, 8), bit set -> -1.0
    table = _iq2xxs_grid_cpu().view(256, 1, 8) * signs.view(1, 128, 8)
    return table.view(256 * 128, 8).to(device)


# ----------------------------------------------------------------------------------------------
# per-type block decoders: (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32


def _deq_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16_field(blocks, 0)
    q = blocks[:, 2:].view(torch.int8).float()
    return q * d


def _deq_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d = _f16_field(blocks, 80)
    dmin = _f16_field(blocks, 82)
    dl = (d * (scales & 0x0F).float()).view(n, 16, 1)  # per 16-weight sub-block scale
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)  # ... and offset
    # 2 halves x 4 bit-pairs x 32 bytes = 256 codes in weight order
    qs = blocks[:, 16:80].reshape(n, 2, 1, 32)
    q = ((qs >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), blocks.device)) & 3).reshape(n, 16, 16).float()
    return (dl * q - ml).view(n, QK_K)


def _q4_k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12 scale bytes of Q4_K into eight 6-bit scales and eight 6-bit mins."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat([a & 63, (c & 0x0F) | ((a >> 6) << 4)], dim=1)
    mins = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=1)
    return scale, mins


def _deq_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16_field(blocks, 0)
    dmin = _f16_field(blocks, 2)
    scale, mins = _q4_k_scale_min(blocks[:, 4:16])
    dl = (d * scale.float()).view(n, 8, 1)  # per 32-weight sub-block scale
    ml = (dmin * mins.float()).view(n, 8, 1)  # ... and offset
    # 4 chunks x (low nibbles, high nibbles) x 32 bytes = 256 codes in weight order
    qs = blocks[:, 16:144].reshape(n, 4, 1, 32)
    q = ((qs >> _shifts([0, 4], (1, 1, 2, 1), blocks.device)) & 0x0F).reshape(n, 8, 32).float()
    return (dl * q - ml).view(n, QK_K)


def _deq_iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16_field(blocks, 0)  # (n, 1)
    groups = blocks[:, 2:].reshape(n, 8, 8)  # 8 groups of 32 weights
    # bytes 4..7 of a group: four 7-bit sign indices (bits 0..27) and the 4-bit scale (bits 28..31)
    word = groups[:, :, 4:8].to(torch.int32)
    word = word[..., 0] | (word[..., 1] << 8) | (word[..., 2] << 16) | ((word[..., 3] & 0x0F) << 24)
    s = (groups[:, :, 7] >> 4).float()  # (n, 8)
    db = (d * (0.5 + s) * 0.25).view(n, 8, 1, 1)
    shifts = torch.tensor([0, 7, 14, 21], dtype=torch.int32, device=blocks.device)
    sign_idx = (word.unsqueeze(-1) >> shifts) & 127  # (n, 8, 4): one per 8 weights
    grid_idx = groups[:, :, 0:4].to(torch.int32)  # (n, 8, 4): one per 8 weights
    signed = F.embedding(grid_idx * 128 + sign_idx, _iq2xxs_signed_grid(blocks.device))  # (n, 8, 4, 8)
    return (db * signed).view(n, QK_K)


_BLOCK_DECODERS = {
    T.Q8_0: _deq_q8_0,
    T.Q2_K: _deq_q2_k,
    T.Q4_K: _deq_q4_k,
    T.IQ2_XXS: _deq_iq2_xxs,
}


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode the raw bytes of a GGML tensor into a new tensor of logical ``shape``.

    ``raw`` is a ``uint8`` tensor of any shape (e.g. 1-D as sliced from a memory-mapped GGUF, or
    ``(rows, row_bytes)``) whose element count is ``quantized_nbytes(qtype, shape)``; the result lives
    on ``raw``'s device and is float32 (int32 for I32). It never aliases ``raw``.
    """
    t = _qtype(qtype)
    shape = tuple(int(s) for s in shape)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        got = raw.dtype if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise TypeError(f"{t.name}: raw data must be a uint8 torch tensor, got {got}")
    expected = quantized_nbytes(t, shape)
    if raw.numel() != expected:
        raise ValueError(
            f"{t.name}: shape {shape} needs {expected} bytes, but raw data has {raw.numel()} bytes"
        )
    flat = raw.reshape(-1)
    if t == T.F32:
        out = _as_dtype(flat, torch.float32).clone()
    elif t == T.I32:
        out = _as_dtype(flat, torch.int32).clone()
    elif t == T.F16:
        out = _fp16_to_f32(flat.view(-1, 2))
    elif t == T.BF16:  # bf16 is the top half of an fp32: shift the bits up
        out = (_as_dtype(flat, torch.int16).to(torch.int32) << 16).view(torch.float32)
    else:
        type_size = QUANT_SIZES[t][1]
        out = _BLOCK_DECODERS[t](flat.view(-1, type_size))
    return out.reshape(shape)


# ----------------------------------------------------------------------------------------------
# Q8_0 quantization


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """Quantize ``x`` (last dim a multiple of 32) to Q8_0 bytes ``(*x.shape[:-1], x.shape[-1] // 32 * 34)``.

    Bit-exact to ``gguf.quants.quantize(x, Q8_0)`` (which matches ggml's reference quantizer) for
    finite inputs: per block ``d = max|x| / 127`` in float32, codes ``round(x * (1 / d))`` with ties
    away from zero, ``d`` stored as fp16 (round to nearest even).
    """
    if x.ndim == 0 or x.shape[-1] % 32:
        raise ValueError(f"Q8_0: last dimension of shape {tuple(x.shape)} is not a multiple of 32")
    blocks = x.float().reshape(-1, 32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    d = amax / torch.full_like(amax, 127.0)  # tensor divisor: a true division on every device
    inv = torch.where(d == 0, torch.zeros_like(d), torch.reciprocal(d))
    v = blocks * inv
    a = v.abs()
    fl = a.floor()
    q = torch.sign(v) * (fl + (a - fl >= 0.5).float())  # round half away from zero
    out = torch.cat([d.to(torch.float16).view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 34)


# ----------------------------------------------------------------------------------------------
# synthetic blocks for benchmarks


def _uniform_int_moments(lo: int, hi: int) -> tuple[float, float]:
    """Mean and variance of an integer uniform on ``[lo, hi]``."""
    k = hi - lo + 1
    return (lo + hi) / 2, (k * k - 1) / 12


_JITTER = 0.4  # per-block scale factor uniform in [1 - J/2, 1 + J/2]
_JITTER_M2 = 1 + _JITTER**2 / 12  # its second moment

_FP16_TINY = 2.0**-24  # smallest positive fp16 (subnormal)
_FP16_MAX = 65504.0


def random_blocks(
    qtype: GGMLQuantizationType | int,
    shape: tuple[int, ...],
    generator: torch.Generator | None = None,
    *,
    std: float = 0.02,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """SYNTHETIC DATA FOR BENCHMARKS: random but valid raw bytes of a ``qtype`` tensor of ``shape``.

    Not a quantization of anything: codes are uniform random and the scale fields are chosen so that
    ``dequantize(...)`` of the result has mean about 0 and standard deviation about ``std``. Scale
    fields are finite and positive (each block's scale is jittered by +-20% so that a kernel reading
    the wrong block's scale shows up). Supports Q8_0, Q2_K, Q4_K, IQ2_XXS, and F32/F16/BF16 (normal
    noise). Generated with torch ops on ``device`` (default: the generator's device, else CPU); the
    result is ``uint8`` of shape ``(*shape[:-1], row_bytes)``.
    """
    t = _qtype(qtype)
    shape = tuple(int(s) for s in shape)
    if device is None:
        device = generator.device if generator is not None else torch.device("cpu")
    device = torch.device(device)
    nbytes = quantized_nbytes(t, shape)
    out_shape = (*shape[:-1], quantized_nbytes(t, shape[-1:])) if shape else (nbytes,)
    if not (std > 0 and math.isfinite(std)):
        raise ValueError(f"random_blocks: std must be positive and finite, got {std}")
    kw = {"generator": generator, "device": device}

    if t in (T.F32, T.F16, T.BF16):
        dtype = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[t]
        x = (torch.randn(math.prod(shape), **kw) * std).to(dtype)
        return x.view(torch.uint8).reshape(out_shape)
    if t == T.I32:
        raise ValueError("random_blocks: I32 is not a weight format")

    block_size, type_size = QUANT_SIZES[t]
    n = math.prod(shape) // block_size
    blocks = torch.randint(0, 256, (n, type_size), dtype=torch.uint8, **kw)  # random codes
    jitter = 1 - _JITTER / 2 + _JITTER * torch.rand(n, **kw)

    def base_scale(unit_var: float) -> float:
        # std of the weights is (scale field) * sqrt(unit_var * E[jitter^2])
        return std / math.sqrt(unit_var * _JITTER_M2)

    if t == T.Q8_0:
        # codes uniform in [-127, 127] (ggml never writes -128)
        blocks[:, 2:] = torch.randint(-127, 128, (n, 32), dtype=torch.int8, **kw).view(torch.uint8)
        d = base_scale(_uniform_int_moments(-127, 127)[1]) * jitter
        _put_f16_field(blocks, 0, d.clamp(_FP16_TINY, _FP16_MAX))
    elif t in (T.Q2_K, T.Q4_K):
        # w = d*sc*q - dmin*m with q uniform on [0, qmax]; sc, m uniform on [lo, hi]; dmin = d * E[q]
        # so the mean is 0 and Var(w)/d^2 = E[sc^2] Var(q) + E[q]^2 2 Var(sc).
        qmax, lo, hi = (3, 8, 15) if t == T.Q2_K else (15, 32, 63)
        mq, vq = _uniform_int_moments(0, qmax)
        ms, vs = _uniform_int_moments(lo, hi)
        d = base_scale((ms * ms + vs) * vq + mq * mq * 2 * vs) * jitter
        dmin = d * mq
        n_sub = 16 if t == T.Q2_K else 8  # sub-blocks per block
        sc = torch.randint(lo, hi + 1, (n, n_sub), dtype=torch.uint8, **kw)
        mn = torch.randint(lo, hi + 1, sc.shape, dtype=torch.uint8, **kw)
        if t == T.Q2_K:
            blocks[:, 0:16] = sc | (mn << 4)
            _put_f16_field(blocks, 80, d.clamp(_FP16_TINY, _FP16_MAX))
            _put_f16_field(blocks, 82, dmin.clamp(_FP16_TINY, _FP16_MAX))
        else:
            # pack eight 6-bit scales and mins into 12 bytes (see the module docstring)
            blocks[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
            blocks[:, 8:12] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
            blocks[:, 12:16] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
            _put_f16_field(blocks, 0, d.clamp(_FP16_TINY, _FP16_MAX))
            _put_f16_field(blocks, 2, dmin.clamp(_FP16_TINY, _FP16_MAX))
    elif t == T.IQ2_XXS:
        # Random bytes are already valid codes: grid indices, sign indices and the 4-bit scale s
        # (uniform 0..15). Signs are +-1 with mean 0, so Var(w)/d^2 = E[((0.5 + s) / 4)^2] E[grid^2].
        ms, vs = _uniform_int_moments(0, 15)
        grid_m2 = float((_iq2xxs_grid_cpu() ** 2).mean())
        d = base_scale(((ms + 0.5) ** 2 + vs) / 16 * grid_m2) * jitter
        _put_f16_field(blocks, 0, d.clamp(_FP16_TINY, _FP16_MAX))
    return blocks.reshape(out_shape)
