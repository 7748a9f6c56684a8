"""Triton kernels for the packed KV / indexer rows (GPU fast path of rows.py).

Bit-identical to :mod:`ds4x.formats.rows` (the torch reference) and to
:mod:`ds4x.formats.scalar_reference`. ``ds4x.formats`` imports this module only when a
``*_triton`` name is first accessed, and this module imports without triton too (the
functions then raise a clear error when called), so ``ds4x`` never needs triton.

How they stay bit-exact on any backend (GPU or ``TRITON_INTERPRET=1``):

* Scales come from float bits (official ``fast_log2_ceil``), never from log2/exp2.
* ``x / 2**e`` is computed as ``x * 2**-e`` with ``2**-e`` built from bits: the same
  real number, so the same correctly rounded float32, and it avoids Triton's default
  fp32 division (``div.full.f32``, not correctly rounded).
* Rounding to E4M3 / E2M1 is integer arithmetic on the float32 bits (round half to
  even), not a float8 conversion instruction, so it needs no fp8 hardware and runs
  in the interpreter.
* Decoding builds float32 bit patterns directly; the dequantizing product is a
  power-of-two multiply, exact (subnormal results included; Triton does not flush
  denormals for a plain fp32 multiply).

Each program handles up to ``BLOCK_ROWS`` rows (`rows_per_program`). Inputs are made contiguous ``[N, width]``
(float32, or a half type that the kernel reads as float32) / uint8 ``[N, bytes]``; any leading shape is accepted
and restored. ``write_float_rows_triton`` stores unpacked rows into a float32 ring (the cast, the ring index and
the copy in one launch).
"""

from __future__ import annotations

from typing import Any

import torch

from .pdl import launch_options
from .rows import (
    INDEXER_DIM,
    INDEXER_ROW_BYTES,
    KV_BLOCK,
    KV_DIM,
    KV_ROPE_DIM,
    KV_ROW_BYTES,
    _check_byte_rows,
    _check_float_rows,
    _kv_dims,
    check_indexer_input,
    check_kv_input,
    kv_row_bytes,
)
from .triton_mode import HAVE_TRITON, interpret_mode, module_for_current_mode, tl, triton

__all__ = [
    "pack_kv_rows_triton",
    "unpack_kv_rows_triton",
    "pack_indexer_rows_triton",
    "unpack_indexer_rows_triton",
    "hadamard128_triton",
    "rotate_mxfp4_roundtrip_triton",
]

BLOCK_ROWS = 16

# triton.jit reads TRITON_INTERPRET when it decorates, i.e. when this module is imported.
# Remember the mode; a call made in the other mode loads a private copy of this file
# (see _kernels), so interpreter and compiled kernels can coexist in one process.
_DEFINED_INTERPRETED = interpret_mode()


if HAVE_TRITON:
    # The kernels live at module level because Triton (compiler and interpreter alike)
    # resolves the helper functions a kernel calls through the module's globals.
    from .pdl import wait_upstream

    @triton.jit
    def _pow2(e):
        # 2**e from bits; e int32 in [-126, 127].
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _ue8m0_decode(b):
        # UE8M0 byte (int32 0..255) -> float32: 0 -> 2**-127 (subnormal), 255 -> NaN.
        bits = b << 23
        bits = tl.where(b == 0, 0x00400000, bits)
        bits = tl.where(b == 255, 0x7FC00000, bits)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _row_max(v):
        # tl.reduce with our own combine instead of tl.max: tl.max is a Triton stdlib @jit
        # function, which the interpreter cannot call when triton was imported without
        # TRITON_INTERPRET=1; tl.reduce itself is patched by the interpreter.
        return tl.reduce(v, len(v.shape) - 1, _max_combine)

    @triton.jit
    def _block_exponent(v, FLOOR: tl.constexpr, INV_MAX: tl.constexpr):
        # v [..., B] float32 (blocks along the last axis) -> (e [...] int32, bad [...] bool).
        # e = ceil(log2(fp32(max(amax, FLOOR) * fp32(INV_MAX)))) from the bits; bad blocks (NaN/Inf) get e = 128.
        a = tl.abs(v)
        nonfinite = (v != v) | (a == float("inf"))
        bad = _row_max(nonfinite.to(tl.int32)) > 0
        amax = _row_max(tl.where(nonfinite, 0.0, a))
        t = tl.maximum(amax, FLOOR) * INV_MAX
        tb = t.to(tl.int32, bitcast=True)
        e = ((tb >> 23) & 0xFF) - 127 + ((tb & 0x7FFFFF) != 0).to(tl.int32)
        e = tl.where(bad, 128, e)
        return e, bad

    @triton.jit
    def _round_code(a, MB: tl.constexpr, BIAS: tl.constexpr):
        # Magnitude code of float32 a (0 <= a <= format max) in a minifloat with MB mantissa
        # bits and exponent bias BIAS, round half to even. Normal range: round the float32
        # bits at mantissa bit (23 - MB); a carry moves into the exponent naturally.
        # Subnormal range (a < 2**(1 - BIAS)): code = RNE(a / 2**(1 - BIAS - MB)) done on
        # the integer significand.
        u = a.to(tl.int32, bitcast=True)
        ef = u >> 23
        lsb = (u >> (23 - MB)) & 1
        code_n = ((u + ((1 << (22 - MB)) - 1) + lsb) >> (23 - MB)) - ((127 - BIAS) << MB)
        m = (u & 0x7FFFFF) | tl.where(ef > 0, 0x800000, 0)
        sh = (151 - BIAS - MB) - tl.maximum(ef, 1)
        sh = tl.minimum(tl.maximum(sh, 1), 30)  # >= 26 already rounds to 0; keeps shifts defined
        one = tl.full(sh.shape, 1, tl.int32)
        qi = m >> sh
        rem = m & ((one << sh) - 1)
        half = one << (sh - 1)
        up = (rem > half) | ((rem == half) & ((qi & 1) == 1))
        code_s = qi + up.to(tl.int32)
        return tl.where(ef >= 128 - BIAS, code_n, code_s)

    @triton.jit
    def _sign(v):
        return (v.to(tl.int32, bitcast=True) >> 31) & 1

    @triton.jit
    def _e4m3_value(c):
        # E4M3FN byte (int32 0..255) -> float32 (NaN for 0x7F/0xFF, -0.0 for 0x80).
        s = (c >> 7) & 1
        ef = (c >> 3) & 0xF
        mf = c & 0x7
        sub_bits = (mf.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m * 2**-9, exact
        bits = tl.where(ef == 0, sub_bits, ((ef + 120) << 23) | (mf << 20))
        bits = tl.where((ef == 15) & (mf == 7), 0x7FC00000, bits)
        return (bits | (s << 31)).to(tl.float32, bitcast=True)

    @triton.jit
    def _e2m1_value(c):
        # E2M1 code (int32 0..15) -> float32 (code 8 -> -0.0).
        s = (c >> 3) & 1
        ef = (c >> 1) & 0x3
        mf = c & 0x1
        bits = tl.where(ef == 0, tl.where(mf == 1, 0x3F000000, 0), ((ef + 126) << 23) | (mf << 22))
        return (bits | (s << 31)).to(tl.float32, bitcast=True)

    @triton.jit
    def _out_rows(rows, rmask, at_ptr, ring, batch, SCATTER: tl.constexpr):
        # where input row r goes: row r, or with SCATTER row at[r] mod ring of a ring of `ring` rows (of ring r
        # of a batch of rings when batch = ring, of the one ring when batch = 0)
        if SCATTER:
            # (the modulo in int32, positions < 2^31: on int64 it compiles to a called routine)
            slot = tl.load(at_ptr + rows, mask=rmask, other=0).to(tl.int32) % ring
            return slot.to(tl.int64) + rows.to(tl.int64) * batch
        return rows.to(tl.int64)

    @triton.jit
    def pack_kv_kernel(x_ptr, out_ptr, n_rows, at_ptr, ring, batch, BLOCK_R: tl.constexpr, NOPE_BLOCKS: tl.constexpr,
                       NB: tl.constexpr, SCATTER: tl.constexpr, PDL: tl.constexpr = False):
        # a row is NOPE_BLOCKS blocks of 64 E4M3 values, then 64 RoPE values (Flash: 7 blocks, 512 -> 583 bytes).
        # All blocks at once, [rows, NB (a power of two >= NOPE_BLOCKS), 64]: one wave of loads, where a loop over
        # the blocks issued each block's load only after the previous block's stores
        wait_upstream(PDL, RELEASE=True)
        DIM: tl.constexpr = NOPE_BLOCKS * 64 + 64
        BYTES: tl.constexpr = NOPE_BLOCKS * 64 + 128 + NOPE_BLOCKS
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        m2 = rmask[:, None]
        cols = tl.arange(0, 64)
        b = tl.arange(0, NB)[None, :]  # [1, NB]
        m3 = (m2 & (b < NOPE_BLOCKS))[:, :, None]
        at = b[:, :, None] * 64 + cols[None, None, :]  # [1, NB, 64]: offsets of the non-RoPE values
        rows64 = rows.to(tl.int64)
        x_row = x_ptr + rows64[:, None] * DIM
        v = tl.load(x_row[:, :, None] + at, mask=m3, other=0.0).to(tl.float32)
        r = tl.load(x_row + NOPE_BLOCKS * 64 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        dst = _out_rows(rows, rmask, at_ptr, ring, batch, SCATTER)
        o_row = out_ptr + dst[:, None] * BYTES
        e, bad = _block_exponent(v, 1e-4, 1.0 / 448.0)  # [rows, NB]
        inv = _pow2(tl.where(bad, 0, -e))
        a = tl.minimum(tl.abs(v) * inv[:, :, None], 448.0)
        code = _round_code(a, 3, 7) | (_sign(v) << 7)
        code = tl.where(bad[:, :, None], 0, code)
        tl.store(o_row[:, :, None] + at, code.to(tl.uint8), mask=m3)
        tl.store(o_row + NOPE_BLOCKS * 64 + 128 + b, (e + 127).to(tl.uint8), mask=m2 & (b < NOPE_BLOCKS))
        h = r.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        tl.store(o_row + NOPE_BLOCKS * 64 + 2 * cols[None, :], (h & 0xFF).to(tl.uint8), mask=m2)
        tl.store(o_row + NOPE_BLOCKS * 64 + 1 + 2 * cols[None, :], (h >> 8).to(tl.uint8), mask=m2)

    @triton.jit
    def write_rows_kernel(x_ptr, out_ptr, at_ptr, ring, batch, W: tl.constexpr, BLOCK_W: tl.constexpr,
                          PDL: tl.constexpr = False):
        # row r of x (any float type) -> float32 row at[r] mod ring of out (of ring r when batch = ring)
        wait_upstream(PDL, RELEASE=True)
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_W)
        v = tl.load(x_ptr + r * W + cols, mask=cols < W).to(tl.float32)
        dst = (tl.load(at_ptr + r).to(tl.int32) % ring).to(tl.int64) + r * batch  # int32 modulo, as in _out_rows
        tl.store(out_ptr + dst * W + cols, v, mask=cols < W)

    @triton.jit
    def unpack_kv_kernel(in_ptr, out_ptr, n_rows, BLOCK_R: tl.constexpr, NOPE_BLOCKS: tl.constexpr,
                         PDL: tl.constexpr = False):
        wait_upstream(PDL, RELEASE=True)
        DIM: tl.constexpr = NOPE_BLOCKS * 64 + 64
        BYTES: tl.constexpr = NOPE_BLOCKS * 64 + 128 + NOPE_BLOCKS
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        m2 = rmask[:, None]
        cols = tl.arange(0, 64)
        rows64 = rows.to(tl.int64)
        i_row = in_ptr + rows64[:, None] * BYTES
        o_row = out_ptr + rows64[:, None] * DIM
        for b in tl.static_range(NOPE_BLOCKS):
            c = tl.load(i_row + b * 64 + cols[None, :], mask=m2, other=0).to(tl.int32)
            sb = tl.load(in_ptr + rows64 * BYTES + NOPE_BLOCKS * 64 + 128 + b, mask=rmask, other=127).to(tl.int32)
            val = _e4m3_value(c) * _ue8m0_decode(sb)[:, None]
            tl.store(o_row + b * 64 + cols[None, :], val, mask=m2)
        lo = tl.load(i_row + NOPE_BLOCKS * 64 + 2 * cols[None, :], mask=m2, other=0).to(tl.int32)
        hi = tl.load(i_row + NOPE_BLOCKS * 64 + 1 + 2 * cols[None, :], mask=m2, other=0).to(tl.int32)
        h = (lo | (hi << 8)).to(tl.int16)
        tl.store(o_row + NOPE_BLOCKS * 64 + cols[None, :], h.to(tl.float16, bitcast=True).to(tl.float32), mask=m2)

    @triton.jit
    def _hadamard_rows(y, R: tl.constexpr):
        # The butterfly of ds4x.formats.hadamard on a [R, 128] float32 tile in registers, bit for bit: at stride s
        # the pair (a, b) = (y[i], y[i + s]) becomes (a + b, a - b), strides 1..64, then one scale multiply.
        for stage in tl.static_range(7):  # stride 1 << stage
            g = tl.permute(tl.reshape(y, (R, 64 >> stage, 2, 1 << stage)), (0, 1, 3, 2))  # [R, groups, s, (a, b)]
            a, b = tl.split(g)
            y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, 128))
        return y * 0.08838834764831845

    @triton.jit
    def hadamard128_kernel(x_ptr, out_ptr, n_rows, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
        wait_upstream(PDL, RELEASE=True)
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        m2 = (rows < n_rows)[:, None]
        cols = tl.arange(0, 128)
        rows64 = rows.to(tl.int64)
        y = tl.load(x_ptr + rows64[:, None] * 128 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows64[:, None] * 128 + cols[None, :], _hadamard_rows(y, BLOCK_R), mask=m2)

    @triton.jit
    def pack_indexer_kernel(x_ptr, out_ptr, n_rows, at_ptr, ring, batch, BLOCK_R: tl.constexpr, SCATTER: tl.constexpr,
                            ROTATE: tl.constexpr, VALUES: tl.constexpr, PDL: tl.constexpr = False):
        # A row is four 32-value blocks; element 2i goes to the low nibble and 2i+1 to the high nibble of a byte.
        # ROTATE: the Hadamard-128 rotation first (in registers). VALUES: write the float32 values the packed row
        # decodes to (code * scale, exact) instead of the bytes: the MXFP4 round trip in one launch.
        wait_upstream(PDL, RELEASE=True)
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        rows64 = rows.to(tl.int64)
        cols = tl.arange(0, 128)
        x = tl.load(x_ptr + rows64[:, None] * 128 + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        if ROTATE:
            x = _hadamard_rows(x, BLOCK_R)
        ve, vo = tl.split(tl.reshape(x, (BLOCK_R * 4, 16, 2)))  # [row-block, 16] even / odd elements
        blk = tl.arange(0, BLOCK_R * 4)
        bmask = (pid * BLOCK_R + blk // 4) < n_rows
        e0, bad0 = _block_exponent(ve, 6.0 * 2.0**-126, 1.0 / 6.0)
        e1, bad1 = _block_exponent(vo, 6.0 * 2.0**-126, 1.0 / 6.0)
        # block exponent = exponent of the larger half (ceil-log2 is monotone in amax)
        bad = bad0 | bad1
        e = tl.where(bad, 128, tl.maximum(e0, e1))
        inv = _pow2(tl.where(bad, 0, -e))
        ae = tl.minimum(tl.abs(ve) * inv[:, None], 6.0)
        ao = tl.minimum(tl.abs(vo) * inv[:, None], 6.0)
        ce = tl.where(bad[:, None], 0, _round_code(ae, 1, 1) | (_sign(ve) << 3))
        co = tl.where(bad[:, None], 0, _round_code(ao, 1, 1) | (_sign(vo) << 3))
        if VALUES:
            scale = _ue8m0_decode(e + 127)[:, None]
            vals = tl.reshape(tl.join(_e2m1_value(ce) * scale, _e2m1_value(co) * scale), (BLOCK_R, 128))
            tl.store(out_ptr + rows64[:, None] * 128 + cols[None, :], vals, mask=rmask[:, None])
        else:
            dst = _out_rows(pid * BLOCK_R + blk // 4, bmask, at_ptr, ring, batch, SCATTER)  # per row-block
            o = out_ptr + dst * 68
            j = tl.arange(0, 16)
            tl.store(o[:, None] + (blk % 4)[:, None] * 16 + j[None, :], (ce | (co << 4)).to(tl.uint8),
                     mask=bmask[:, None])
            tl.store(o + 64 + blk % 4, (e + 127).to(tl.uint8), mask=bmask)

    @triton.jit
    def unpack_indexer_kernel(in_ptr, out_ptr, n_rows, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
        wait_upstream(PDL, RELEASE=True)
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        m2 = rmask[:, None]
        j = tl.arange(0, 16)
        rows64 = rows.to(tl.int64)
        i_row = in_ptr + rows64[:, None] * 68
        o_row = out_ptr + rows64[:, None] * 128
        for b in tl.static_range(4):
            byte = tl.load(i_row + b * 16 + j[None, :], mask=m2, other=0).to(tl.int32)
            sb = tl.load(in_ptr + rows64 * 68 + 64 + b, mask=rmask, other=127).to(tl.int32)
            scale = _ue8m0_decode(sb)[:, None]
            tl.store(o_row + b * 32 + 2 * j[None, :], _e2m1_value(byte & 0xF) * scale, mask=m2)
            tl.store(o_row + b * 32 + 2 * j[None, :] + 1, _e2m1_value(byte >> 4) * scale, mask=m2)


def _kernels() -> Any:
    """The module whose kernels match the current TRITON_INTERPRET mode."""
    if not HAVE_TRITON:
        raise RuntimeError("ds4x.formats.rows_triton needs the 'triton' package (pip install triton)")
    return module_for_current_mode(__name__, __file__, _DEFINED_INTERPRETED)


def _check_device(t: torch.Tensor, fn: str) -> None:
    if not HAVE_TRITON:
        raise RuntimeError(f"{fn}: needs the 'triton' package (pip install triton)")
    if t.device.type != "cuda" and not interpret_mode():
        raise ValueError(
            f"{fn}: Triton kernels need a CUDA tensor (got {t.device}); use the torch version in "
            f"ds4x.formats.rows, or set TRITON_INTERPRET=1 to run the kernel in the interpreter"
        )


def rows_per_program(n_rows: int) -> tuple[int, int]:
    """(rows per program, warps) of a launch over ``n_rows`` rows: a few rows (a decode step's) get a program
    of one warp each, as a 16-row tile of one row did 16 rows' work and a warp-wide reduction is the shortest;
    many rows (a prefill chunk's) share programs of up to ``BLOCK_ROWS`` rows while the grid stays over two
    programs per multiprocessor of an H200."""
    per = 1
    while per < BLOCK_ROWS and n_rows >= 2 * per * 264:
        per *= 2
    return per, 1 if per == 1 else 4


def _launch(name: str, src: torch.Tensor, out: torch.Tensor, n_rows: int, *args: Any, **constexprs: int) -> None:
    mod = _kernels()
    if n_rows == 0:
        return
    per, warps = rows_per_program(n_rows)
    getattr(mod, name)[(triton.cdiv(n_rows, per),)](src, out, n_rows, *args, BLOCK_R=per, num_warps=warps,
                                                     **constexprs, **launch_options(src.device, "rows"))


def kv_rows_supported(dim: int, rope_dim: int) -> bool:
    """Whether the KV row kernels take rows of ``dim`` values with ``rope_dim`` RoPE dims."""
    return rope_dim == KV_ROPE_DIM and dim > rope_dim and (dim - rope_dim) % KV_BLOCK == 0


def _nope_blocks(dim: int, rope_dim: int, fn: str) -> int:
    if not kv_rows_supported(dim, rope_dim):
        raise ValueError(f"{fn}: rows of {dim} values with {rope_dim} RoPE dims are not supported by the kernel "
                         f"({KV_ROPE_DIM} RoPE dims after whole {KV_BLOCK}-value blocks)")
    return (dim - rope_dim) // KV_BLOCK


def _pack_out(src: torch.Tensor, width: int, out: torch.Tensor | None, at: torch.Tensor | None,
              fn: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(destination, row targets, ring size, rows per ring of a batch or 0) of a pack: a new [rows, width] tensor,
    or ``out``, a ring (see `_ring_out`)."""
    if (out is None) != (at is None):
        raise ValueError(f"{fn}: out and at go together")
    if out is None:
        return torch.empty((src.shape[0], width), dtype=torch.uint8, device=src.device), src, 1, 0
    return out, *_ring_out(src, out, at, torch.uint8, width, fn)


def _ring_out(src: torch.Tensor, out: torch.Tensor, at: torch.Tensor, dtype: torch.dtype, width: int,
              fn: str) -> tuple[torch.Tensor, int, int]:
    """(row targets, ring size, rows per ring or 0) for writing the rows of ``src`` into ``out``: a contiguous
    [ring, width] buffer whose row ``at[r] % ring`` receives row r, or a batch of rings [rows, ring, width] (the
    rings of a batched decode step) whose ring r receives row r there."""
    if (out.dtype != dtype or out.dim() not in (2, 3) or out.shape[-1] != width or not out.is_contiguous()
            or (out.dim() == 3 and out.shape[0] != src.shape[0])):
        kind = str(dtype).removeprefix("torch.")
        raise ValueError(f"{fn}: out must be a contiguous {kind} [ring, {width}] buffer or [{src.shape[0]}, ring, "
                         f"{width}] batch of rings, got {out.dtype} {tuple(out.shape)}")
    ring = out.shape[-2]
    return _ring_index(at, src, fn), ring, ring if out.dim() == 3 else 0


def _ring_index(at: torch.Tensor, src: torch.Tensor, fn: str) -> torch.Tensor:
    """``at`` checked as one integer ring row per row of ``src``, flat and contiguous."""
    if at.dtype not in (torch.int32, torch.int64) or at.numel() != src.shape[0] or at.device != src.device:
        raise ValueError(f"{fn}: at must hold one integer row index per input row on {src.device}, got {at.dtype} "
                         f"[{at.numel()}] on {at.device}")
    return at.reshape(-1).contiguous()


def pack_kv_rows_triton(x: torch.Tensor, *, validate: bool = True, rope_dim: int = KV_ROPE_DIM,
                        out: torch.Tensor | None = None, at: torch.Tensor | None = None) -> torch.Tensor:
    """Triton :func:`ds4x.formats.rows.pack_kv_rows`: ``[..., 512]`` float -> ``uint8 [..., 583]`` (other widths
    of whole 64-value blocks plus 64 RoPE dims too, as ``kv_row_bytes`` lays them out). With ``out`` and ``at``
    the rows are written into ``out`` (a ring of rows, or a batch of rings: `write_float_rows_triton`) at ``at %
    ring`` instead, in the same launch."""
    fn = "pack_kv_rows_triton"
    dim = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else KV_DIM
    nb = _nope_blocks(dim, rope_dim, fn)
    # unvalidated rows go in as they are (float32 or a half type: the kernel reads them as float32)
    xs = check_kv_input(x, fn, dim, rope_dim) if validate else _check_float_rows(x, dim, fn, to_float32=False)
    _check_device(xs, fn)
    lead = xs.shape[:-1]
    src = xs.reshape(-1, dim).contiguous()
    dst, targets, ring, batch = _pack_out(src, kv_row_bytes(dim, rope_dim), out, at, fn)
    _launch("pack_kv_kernel", src, dst, src.shape[0], targets, ring, batch, NOPE_BLOCKS=nb,
            NB=1 << (nb - 1).bit_length(), SCATTER=out is not None)
    return dst if out is not None else dst.reshape(*lead, dst.shape[-1])


def write_float_rows_triton(x: torch.Tensor, out: torch.Tensor, at: torch.Tensor) -> None:
    """Rows ``x`` [N, width] (float32 or a half type) into ``out`` (a contiguous float32 [ring, width] buffer) at rows
    ``at % ring``, as float32: what ``out.index_copy_(0, at % ring, x.float())`` does, in one launch; ``out`` may
    be a batch of rings [N, ring, width] (row r into ring r)."""
    fn = "write_float_rows_triton"
    width = out.shape[-1]
    src = _check_float_rows(x, width, fn, to_float32=False).reshape(-1, width).contiguous()
    _check_device(src, fn)
    targets, ring, batch = _ring_out(src, out, at, torch.float32, width, fn)
    if src.shape[0]:
        _kernels().write_rows_kernel[(src.shape[0],)](src, out, targets, ring, batch, W=width,
                                                      BLOCK_W=triton.next_power_of_2(width),
                                                      **launch_options(src.device, "rows"))


def unpack_kv_rows_triton(rows: torch.Tensor, *, rope_dim: int = KV_ROPE_DIM) -> torch.Tensor:
    """Triton :func:`ds4x.formats.rows.unpack_kv_rows`: ``uint8 [..., 583]`` -> float32 ``[..., 512]``."""
    fn = "unpack_kv_rows_triton"
    width = rows.shape[-1] if isinstance(rows, torch.Tensor) and rows.dim() else KV_ROW_BYTES
    dim, _ = _kv_dims(width, rope_dim)
    nb = _nope_blocks(dim, rope_dim, fn)
    _check_byte_rows(rows, width, fn)
    _check_device(rows, fn)
    lead = rows.shape[:-1]
    src = rows.reshape(-1, width).contiguous()
    out = torch.empty((src.shape[0], dim), dtype=torch.float32, device=src.device)
    _launch("unpack_kv_kernel", src, out, src.shape[0], NOPE_BLOCKS=nb)
    return out.reshape(*lead, dim)


def hadamard128_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton :func:`ds4x.formats.hadamard.hadamard128` (bit-identical): ``[..., 128]`` -> float32."""
    fn = "hadamard128_triton"
    xs = _check_float_rows(x, INDEXER_DIM, fn, to_float32=False)  # read as float32 by the kernel
    _check_device(xs, fn)
    lead = xs.shape[:-1]
    src = xs.reshape(-1, INDEXER_DIM).contiguous()
    out = torch.empty(src.shape, dtype=torch.float32, device=src.device)
    _launch("hadamard128_kernel", src, out, src.shape[0])
    return out.reshape(*lead, INDEXER_DIM)


def pack_indexer_rows_triton(x: torch.Tensor, *, validate: bool = True, out: torch.Tensor | None = None,
                             at: torch.Tensor | None = None, rotate: bool = False) -> torch.Tensor:
    """Triton :func:`ds4x.formats.rows.pack_indexer_rows`: ``[..., 128]`` float -> ``uint8 [..., 68]``; ``out`` and
    ``at`` as for :func:`pack_kv_rows_triton`. ``rotate``: pack ``hadamard128(x)`` (the rotation in the same
    launch)."""
    fn = "pack_indexer_rows_triton"
    xs = check_indexer_input(x, fn) if validate else _check_float_rows(x, INDEXER_DIM, fn, to_float32=False)
    _check_device(xs, fn)
    lead = xs.shape[:-1]
    src = xs.reshape(-1, INDEXER_DIM).contiguous()
    dst, targets, ring, batch = _pack_out(src, INDEXER_ROW_BYTES, out, at, fn)
    _launch("pack_indexer_kernel", src, dst, src.shape[0], targets, ring, batch, SCATTER=out is not None,
            ROTATE=rotate, VALUES=False)
    return dst if out is not None else dst.reshape(*lead, INDEXER_ROW_BYTES)


def rotate_mxfp4_roundtrip_triton(x: torch.Tensor) -> torch.Tensor:
    """``unpack_indexer_rows(pack_indexer_rows(hadamard128(x)))`` in one launch (bit-identical): ``[..., 128]``
    float -> float32, the values an indexer query scores with. Rows are not checked for NaN / Inf."""
    fn = "rotate_mxfp4_roundtrip_triton"
    xs = _check_float_rows(x, INDEXER_DIM, fn, to_float32=False)
    _check_device(xs, fn)
    lead = xs.shape[:-1]
    src = xs.reshape(-1, INDEXER_DIM).contiguous()
    out = torch.empty(src.shape, dtype=torch.float32, device=src.device)
    _launch("pack_indexer_kernel", src, out, src.shape[0], src, 1, 0, SCATTER=False, ROTATE=True, VALUES=True)
    return out.reshape(*lead, INDEXER_DIM)


def unpack_indexer_rows_triton(rows: torch.Tensor) -> torch.Tensor:
    """Triton :func:`ds4x.formats.rows.unpack_indexer_rows`: ``uint8 [..., 68]`` -> float32 ``[..., 128]``."""
    fn = "unpack_indexer_rows_triton"
    _check_byte_rows(rows, INDEXER_ROW_BYTES, fn)
    _check_device(rows, fn)
    lead = rows.shape[:-1]
    src = rows.reshape(-1, INDEXER_ROW_BYTES).contiguous()
    out = torch.empty((src.shape[0], INDEXER_DIM), dtype=torch.float32, device=src.device)
    _launch("unpack_indexer_kernel", src, out, src.shape[0])
    return out.reshape(*lead, INDEXER_DIM)
