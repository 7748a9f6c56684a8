"""Triton kernels of the decode attention over stored rows (imported only when a Triton path runs).

`partial_kernel`: one program per block of rows of one source (flash-decoding), all heads at once so each row
is decoded once per pass. Rows are handled in 64-value chunks (one E4M3 scale block each, then the RoPE chunk); pass 1
forms the logits, pass 2 decodes the chunks again for the weighted sum, so no tile outlives its chunk.
`combine_kernel` merges the blocks' softmax states with the per-head sink logit.

Precision on the GPU (SPLIT): a packed E4M3 value times its power-of-two scale is exact in bf16 and an FP16
RoPE value is exact in fp16, so the keys enter the tensor cores exactly; the float32 query and
probabilities are split into a high and a low part of that type (about 16 bits), fp32 accumulation. The
CPU interpreter has no bf16 matmul: there the dots take float32 operands. The kernel reads packed rows only:
unpacked (native) rows are packed by the caller, so both storages run the same code.
"""

import triton
import triton.language as tl


@triton.jit
def _chunk(base, ok, c: tl.constexpr, NOPE: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr):
    """Chunk ``c`` [BLOCK, 64] of the packed rows at ``base`` ([BLOCK, 1] pointers), 0 where not ``ok``: bf16
    (non-RoPE) or fp16 (RoPE) with SPLIT, else float32."""
    c64 = tl.arange(0, 64)
    if c < NOPE // 64:
        b = tl.load(base + c * 64 + c64[None, :], mask=ok[:, None], other=0).to(tl.int32)
        # E4M3 code -> float32 exactly, never through a float32 subnormal (compiled float multiplies may
        # flush those to zero): normal codes by moving the exponent field (+120), subnormal codes as
        # mantissa x 2^-9; then an exact power-of-two product
        e = (b >> 3) & 15
        mag = tl.where(e == 0, ((b & 7).to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True),
                       ((b & 0x7F) << 20) + (120 << 23))
        v = (mag | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
        sb = tl.load(base + NOPE + 2 * (D - NOPE) + c, mask=ok[:, None], other=127).to(tl.int32)
        sc = tl.where(sb == 0, 5.877471754111438e-39, (sb << 23).to(tl.float32, bitcast=True))
        sc = tl.where(sb == 255, float("nan"), sc)
        out = v * sc
        if SPLIT:
            out = out.to(tl.bfloat16)
    else:  # the RoPE values: little-endian FP16
        lo = tl.load(base + NOPE + 2 * c64[None, :], mask=ok[:, None], other=0).to(tl.int32)
        hi = tl.load(base + NOPE + 2 * c64[None, :] + 1, mask=ok[:, None], other=0).to(tl.int32)
        out = (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        if not SPLIT:
            out = out.to(tl.float32)
    return out


@triton.jit
def _dot_split(a, k, acc, SPLIT: tl.constexpr, TRANS: tl.constexpr):
    """acc + a @ k (or a @ k^T): with SPLIT, ``a`` (float32) as high + low parts of ``k``'s type."""
    if TRANS:
        k = tl.trans(k)
    if SPLIT:
        hi = a.to(k.dtype)
        lo = (a - hi.to(tl.float32)).to(k.dtype)
        acc = tl.dot(hi, k, acc)
        acc = tl.dot(lo, k, acc)
    else:
        acc = tl.dot(a, k, acc, input_precision="ieee")
    return acc


@triton.jit
def partial_kernel(q_ptr, rows_ptr, idx_ptr, pos_ptr, n, ring, stride, m_ptr, l_ptr, acc_ptr, scale, split_offset,
                   H: tl.constexpr, HP: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr,
                   BLOCK: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr):
    # program (row block, group of HB heads): a decode step has few rows per source, so the heads may be split
    # over programs to keep more of the GPU busy (each group decodes the block's rows again)
    blk = tl.program_id(0)
    pid = blk + split_offset  # this block's slot in the partial states (one launch per row source)
    offs_r = blk * BLOCK + tl.arange(0, BLOCK)
    # the stored row of each of the n slots (-1: none), see kernels/attention.Slots; modes 1 and 2 derive it from
    # the query's position on the device, so the step needs no index tensors
    if MODE == 0:  # explicit
        idx = tl.load(idx_ptr + offs_r, mask=offs_r < n, other=-1)
    elif MODE == 1:  # sliding window over a ring of `ring` slots: slot j holds position pos - n + 1 + j
        p = tl.load(pos_ptr) - (n - 1) + offs_r
        idx = tl.where((p >= 0) & (offs_r < n), p % ring, -1)
    else:  # compressed rows whose window has closed: (pos + 1) // ring of them (ring = the compression ratio)
        idx = tl.where(offs_r < tl.minimum((tl.load(pos_ptr) + 1) // ring, n), offs_r, -1)
    ok = idx >= 0
    base = rows_ptr + tl.where(ok, idx, 0).to(tl.int64)[:, None] * stride
    offs_h = tl.program_id(1) * HB + tl.arange(0, HB)
    h_ok = offs_h < H
    c64 = tl.arange(0, 64)
    q_row = q_ptr + offs_h[:, None] * D + c64[None, :]
    s = tl.zeros([HB, BLOCK], tl.float32)
    for c in tl.static_range(D // 64):
        q = tl.load(q_row + c * 64, mask=h_ok[:, None], other=0.0)
        s = _dot_split(q, _chunk(base, ok, c, NOPE, D, SPLIT), s, SPLIT, True)
    s = tl.where(ok[None, :], s * scale, float("-inf"))
    m = tl.max(s, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(s - m_safe[:, None])
    tl.store(m_ptr + pid * HP + offs_h, m)
    tl.store(l_ptr + pid * HP + offs_h, tl.sum(p, axis=1))
    out = acc_ptr + (pid * HP + offs_h)[:, None] * D + c64[None, :]
    for c in tl.static_range(D // 64):
        acc = _dot_split(p, _chunk(base, ok, c, NOPE, D, SPLIT), tl.zeros([HB, 64], tl.float32), SPLIT,
                         False)
        tl.store(out + c * 64, acc)


@triton.jit
def combine_kernel(m_ptr, l_ptr, acc_ptr, sinks_ptr, out_ptr, n_split, HP: tl.constexpr, D: tl.constexpr,
                   SB: tl.constexpr, N_ITER: tl.constexpr):
    """Program (head, 64-value chunk): out = sum_s acc_s e^(m_s - top) / (sum_s l_s e^(m_s - top) + e^(sink - top))."""
    h = tl.program_id(0)
    c = tl.program_id(1)
    offs = tl.arange(0, SB)
    sink = tl.load(sinks_ptr + h).to(tl.float32)
    top = sink
    for i in range(N_ITER):  # a compile-time trip count (N_ITER * SB >= n_split): the interpreter needs one
        s0 = i * SB
        top = tl.maximum(top, tl.max(tl.load(m_ptr + (s0 + offs) * HP + h, mask=s0 + offs < n_split,
                                             other=float("-inf")), 0))
    denom = tl.exp(sink - top)
    acc = tl.zeros([64], tl.float32)
    c64 = tl.arange(0, 64)
    for i in range(N_ITER):
        s0 = i * SB
        live = s0 + offs < n_split
        w = tl.exp(tl.load(m_ptr + (s0 + offs) * HP + h, mask=live, other=float("-inf")) - top)  # 0 for empty blocks
        denom += tl.sum(tl.load(l_ptr + (s0 + offs) * HP + h, mask=live, other=0.0) * w, 0)
        part = tl.load(acc_ptr + ((s0 + offs) * HP + h)[:, None] * D + c * 64 + c64[None, :], mask=live[:, None],
                       other=0.0)
        acc += tl.sum(part * w[:, None], 0)
    tl.store(out_ptr + h * D + c * 64 + c64, acc / denom)
