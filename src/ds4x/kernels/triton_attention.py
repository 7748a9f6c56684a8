"""Triton kernel of the decode attention over stored rows (imported only when a GPU path runs).

The row is handled in 64-value chunks (one E4M3 scale block each, then the RoPE chunk) so every tile stays
in registers; the eight chunks are written out because a Triton kernel cannot index a list of tiles.
"""

import triton
import triton.language as tl


@triton.jit
def _chunk(base, ok, c: tl.constexpr, NOPE_CHUNKS: tl.constexpr, NOPE: tl.constexpr, D: tl.constexpr,
           BLOCK: tl.constexpr, PACKED: tl.constexpr):
    """Values [BLOCK, 64] of chunk ``c`` of the rows at ``base`` (a [BLOCK, 1] pointer), 0 where not ``ok``."""
    c64 = tl.arange(0, 64)
    if PACKED:
        if c < NOPE_CHUNKS:
            b = tl.load(base + c * 64 + c64[None, :], mask=ok[:, None], other=0).to(tl.int32)
            e = (b >> 3) & 15
            mant = b & 7
            # E4M3FN: (8 + m) * 2^(e - 10), subnormal m * 2^-9; powers of two built from bits (exact)
            p2 = ((e + 117) << 23).to(tl.float32, bitcast=True)
            mag = tl.where(e == 0, mant.to(tl.float32) * 0.001953125, (8 + mant).to(tl.float32) * p2)
            mag = tl.where((e == 15) & (mant == 7), float("nan"), mag)
            sb = tl.load(base + NOPE + 2 * (D - NOPE) + c, mask=ok[:, None], other=127).to(tl.int32)
            sc = tl.where(sb == 0, 5.877471754111438e-39, (sb << 23).to(tl.float32, bitcast=True))
            sc = tl.where(sb == 255, float("nan"), sc)
            out = tl.where(b >= 128, -mag, mag) * sc
        else:  # the RoPE values: little-endian FP16
            lo = tl.load(base + NOPE + 2 * c64[None, :], mask=ok[:, None], other=0).to(tl.int32)
            hi = tl.load(base + NOPE + 2 * c64[None, :] + 1, mask=ok[:, None], other=0).to(tl.int32)
            out = (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        out = tl.load(base + c * 64 + c64[None, :], mask=ok[:, None], other=0.0)
    return out


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def partial_kernel(q_ptr, rows_ptr, idx_ptr, n, row_stride, m_ptr, l_ptr, acc_ptr, scale, split_offset,
                   ROWS: tl.constexpr, H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr,
                   NCHUNK: tl.constexpr, NOPE_CHUNKS: tl.constexpr, BLOCK: tl.constexpr, PACKED: tl.constexpr,
                   PREC: tl.constexpr):
    # The row is handled in 64-value chunks (E4M3 scale blocks, then the RoPE chunk) so every tile stays in
    # registers: decoded once per row tile, used for the logits and again for the weighted sum.
    split = tl.program_id(0)
    hg = tl.program_id(1)
    offs_h = hg * HB + tl.arange(0, HB)
    c64 = tl.arange(0, 64)
    q_row = q_ptr + offs_h[:, None] * D + c64[None, :]
    q_ok = offs_h[:, None] >= 0
    q0 = tl.load(q_row + 0 * 64, mask=q_ok & (NCHUNK > 0), other=0.0)
    q1 = tl.load(q_row + 1 * 64, mask=q_ok & (NCHUNK > 1), other=0.0)
    q2 = tl.load(q_row + 2 * 64, mask=q_ok & (NCHUNK > 2), other=0.0)
    q3 = tl.load(q_row + 3 * 64, mask=q_ok & (NCHUNK > 3), other=0.0)
    q4 = tl.load(q_row + 4 * 64, mask=q_ok & (NCHUNK > 4), other=0.0)
    q5 = tl.load(q_row + 5 * 64, mask=q_ok & (NCHUNK > 5), other=0.0)
    q6 = tl.load(q_row + 6 * 64, mask=q_ok & (NCHUNK > 6), other=0.0)
    q7 = tl.load(q_row + 7 * 64, mask=q_ok & (NCHUNK > 7), other=0.0)
    m_i = tl.full([HB], float("-inf"), tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc0 = tl.zeros([HB, 64], tl.float32)
    acc1 = tl.zeros([HB, 64], tl.float32)
    acc2 = tl.zeros([HB, 64], tl.float32)
    acc3 = tl.zeros([HB, 64], tl.float32)
    acc4 = tl.zeros([HB, 64], tl.float32)
    acc5 = tl.zeros([HB, 64], tl.float32)
    acc6 = tl.zeros([HB, 64], tl.float32)
    acc7 = tl.zeros([HB, 64], tl.float32)
    lo = split * ROWS
    hi = tl.minimum(lo + ROWS, n)
    for it in range(0, ROWS, BLOCK):
        offs_r = lo + it + tl.arange(0, BLOCK)
        idx = tl.load(idx_ptr + offs_r, mask=offs_r < hi, other=-1)
        ok = idx >= 0
        base = rows_ptr + tl.where(ok, idx, 0).to(tl.int64)[:, None] * row_stride
        s = tl.zeros([HB, BLOCK], tl.float32)
        k0 = tl.zeros([BLOCK, 64], tl.float32)
        k1 = tl.zeros([BLOCK, 64], tl.float32)
        k2 = tl.zeros([BLOCK, 64], tl.float32)
        k3 = tl.zeros([BLOCK, 64], tl.float32)
        k4 = tl.zeros([BLOCK, 64], tl.float32)
        k5 = tl.zeros([BLOCK, 64], tl.float32)
        k6 = tl.zeros([BLOCK, 64], tl.float32)
        k7 = tl.zeros([BLOCK, 64], tl.float32)
        if NCHUNK > 0:
            k0 = _chunk(base, ok, 0, NOPE_CHUNKS, NOPE, D, BLOCK, PACKED)
            s += _dot(q0, tl.trans(k0), PREC)
        if NCHUNK > 1:
            k1 = _chunk(base, ok, 1, NOPE_CHUNKS, NOPE, D, BLOCK, PACKED)
            s += _dot(q1, tl.trans(k1), PREC)
        if NCHUNK > 2:
            k2 = _chunk(base, ok, 2, NOPE_CHUNKS, NOPE, D, BLOCK, PACKED)
            s += _dot(q2, tl.trans(k2), PREC)
        if NCHUNK > 3:
            k3 = _chunk(base, ok, 3, NOPE_CHUNKS, NOPE, D, BLOCK, PACKED)
            s += _dot(q3, tl.trans(k3), PREC)
        if NCHUNK > 4:
            k4 = _chunk(base, ok, 4, NOPE_CHUNKS, NOPE, D, BLOCK, PACKED)
            s += _dot(q4, tl.trans(k4), PREC)
        if NCHUNK > 5:
            k5 = _chunk(base, ok, 5, NOPE_CHUNKS, NOPE, D, BLOCK, PACKED)
            s += _dot(q5, tl.trans(k5), PREC)
        if NCHUNK > 6:
            k6 = _chunk(base, ok, 6, NOPE_CHUNKS, NOPE, D, BLOCK, PACKED)
            s += _dot(q6, tl.trans(k6), PREC)
        if NCHUNK > 7:
            k7 = _chunk(base, ok, 7, NOPE_CHUNKS, NOPE, D, BLOCK, PACKED)
            s += _dot(q7, tl.trans(k7), PREC)
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if NCHUNK > 0:
            acc0 = acc0 * alpha[:, None] + _dot(p, k0, PREC)
        if NCHUNK > 1:
            acc1 = acc1 * alpha[:, None] + _dot(p, k1, PREC)
        if NCHUNK > 2:
            acc2 = acc2 * alpha[:, None] + _dot(p, k2, PREC)
        if NCHUNK > 3:
            acc3 = acc3 * alpha[:, None] + _dot(p, k3, PREC)
        if NCHUNK > 4:
            acc4 = acc4 * alpha[:, None] + _dot(p, k4, PREC)
        if NCHUNK > 5:
            acc5 = acc5 * alpha[:, None] + _dot(p, k5, PREC)
        if NCHUNK > 6:
            acc6 = acc6 * alpha[:, None] + _dot(p, k6, PREC)
        if NCHUNK > 7:
            acc7 = acc7 * alpha[:, None] + _dot(p, k7, PREC)
        m_i = m_new
    out = split + split_offset
    tl.store(m_ptr + out * H + offs_h, m_i)
    tl.store(l_ptr + out * H + offs_h, l_i)
    if NCHUNK > 0:
        tl.store(acc_ptr + (out * H + offs_h)[:, None] * D + 0 * 64 + c64[None, :], acc0)
    if NCHUNK > 1:
        tl.store(acc_ptr + (out * H + offs_h)[:, None] * D + 1 * 64 + c64[None, :], acc1)
    if NCHUNK > 2:
        tl.store(acc_ptr + (out * H + offs_h)[:, None] * D + 2 * 64 + c64[None, :], acc2)
    if NCHUNK > 3:
        tl.store(acc_ptr + (out * H + offs_h)[:, None] * D + 3 * 64 + c64[None, :], acc3)
    if NCHUNK > 4:
        tl.store(acc_ptr + (out * H + offs_h)[:, None] * D + 4 * 64 + c64[None, :], acc4)
    if NCHUNK > 5:
        tl.store(acc_ptr + (out * H + offs_h)[:, None] * D + 5 * 64 + c64[None, :], acc5)
    if NCHUNK > 6:
        tl.store(acc_ptr + (out * H + offs_h)[:, None] * D + 6 * 64 + c64[None, :], acc6)
    if NCHUNK > 7:
        tl.store(acc_ptr + (out * H + offs_h)[:, None] * D + 7 * 64 + c64[None, :], acc7)
