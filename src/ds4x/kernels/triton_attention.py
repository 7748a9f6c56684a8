"""Triton kernels of the decode attention over stored rows (imported only when a Triton path runs).

`partial_kernel`: one launch per layer over its row sources (the sliding window, then the picked or closed
compressed rows; flash-decoding): a program runs an online softmax for a group of heads over one split of
consecutive blocks of rows, each row loaded and decoded once per program for both products, the next block's
bytes in flight while the current one is multiplied.
`combine_kernel` merges the splits' softmax states with the per-head sink logit. `prefill_kernel`: many queries
(a prefill chunk), one program per (query, group of heads) looping over that query's rows with an online softmax,
each block of rows decoded whole to float32 once and used for both products.

Precision on the GPU (SPLIT): a packed E4M3 value times its power-of-two scale is exact in bf16 and an FP16
RoPE value is exact in fp16, so the keys enter the tensor cores exactly; the float32 query and
probabilities are split into a high and a low part of that type (about 16 bits), fp32 accumulation. The
CPU interpreter has no bf16 matmul: there the dots take float32 operands. The kernel reads packed rows only:
unpacked (native) rows are packed by the caller, so both storages run the same code.
"""

import triton
import triton.language as tl

from ds4x.formats.pdl import wait_upstream
from ds4x.formats.rows_triton import _ue8m0_decode


@triton.jit
def _e4m3_scaled(b, sb, HW: tl.constexpr = False):
    """E4M3 codes ``b`` (bytes) times UE8M0 scales ``sb`` (int32) as float32, exactly: with HW by the GPU's E4M3 ->
    FP16 conversion (sm_89+; exact), else never through a float32 subnormal (compiled float multiplies may flush
    those to zero): normal codes by moving the exponent field (+120), subnormal codes as mantissa x 2^-9; then an
    exact power-of-two product."""
    if HW:
        v = b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        b = b.to(tl.int32)
        e = (b >> 3) & 15
        mag = tl.where(e == 0, ((b & 7).to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True),
                       ((b & 0x7F) << 20) + (120 << 23))
        v = (mag | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
    return v * _ue8m0_decode(sb)


@triton.jit
def _fp16_bytes(lo, hi):
    """Little-endian FP16 from its two bytes (int32)."""
    return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def closed_rows(pos, ratio, n):
    """The compressed rows a query at position ``pos`` sees in a store of ``n``: the windows of ``ratio`` closed by
    it (int32 arithmetic: an int64 division compiles to a called routine)."""
    return tl.minimum((pos + 1) // ratio, n)


@triton.jit
def _slot_rows(idx_ptr, pos_ptr, n, ring, offs, live, MODE: tl.constexpr):
    """The stored row of each slot ``offs`` of a source (-1: none, or not ``live``), see kernels/attention.Slots:
    modes 1 and 2 derive it from the query's position on the device, so the step needs no index tensors."""
    if MODE == 0:  # explicit
        idx = tl.load(idx_ptr + offs, mask=(offs < n) & live, other=-1)
    elif MODE == 1:  # sliding window over a ring of `ring` slots: slot j holds position pos - n + 1 + j
        # (int32 arithmetic, positions < 2^31: an int64 division compiles to a called routine)
        p = tl.load(pos_ptr).to(tl.int32) - (n - 1) + offs
        idx = tl.where((p >= 0) & (offs < n) & live, p % ring, -1)
    else:  # compressed rows whose window has closed: (pos + 1) // ring of them (ring = the compression ratio)
        idx = tl.where((offs < closed_rows(tl.load(pos_ptr).to(tl.int32), ring, n)) & live, offs, -1)
    return idx


@triton.jit
def empty_split(split, splits_a, blocks_a, pos_a, n_a, ring_a, blocks_b, pos_b, n_b, ring_b, BLOCK: tl.constexpr,
                MODE_A: tl.constexpr, MODE_B: tl.constexpr):
    """Whether split ``split`` starts past its source's closed compressed rows (mode 2; ``pos_*`` the query's
    position, loaded): it has no row to read. A captured step sizes the splits by the store's capacity, so at a
    short position most of a long session's splits are such."""
    empty = split < 0
    if MODE_A == 2:
        empty = (split < splits_a) & (split * blocks_a * BLOCK >= closed_rows(pos_a, ring_a, n_a))
    if MODE_B == 2:
        empty = empty | ((split >= splits_a)
                         & ((split - splits_a) * blocks_b * BLOCK >= closed_rows(pos_b, ring_b, n_b)))
    return empty


@triton.jit
def _packed_bytes(rows_ptr, idx, stride, NOPE: tl.constexpr, NC: tl.constexpr, D: tl.constexpr):
    """The raw bytes of the rows ``idx`` [BLOCK] (-1: none, read as zeros), by 64-value chunk: E4M3 codes
    [NC, BLOCK, 64] (NC: the NOPE / 64 chunks rounded up to a power of two, the extra ones 0) with their UE8M0
    scales [NC, BLOCK, 1], and the RoPE FP16 bytes [BLOCK, 64], low and high."""
    ok = idx >= 0
    row = rows_ptr + tl.where(ok, idx, 0).to(tl.int64) * stride
    chunk = tl.arange(0, NC)[:, None, None]
    live = ok[None, :, None] & (chunk < NOPE // 64)
    base = row[None, :, None] + chunk * 64
    codes = tl.load(base + tl.arange(0, 64)[None, None, :], mask=live, other=0)
    scales = tl.load(row[None, :, None] + NOPE + 2 * (D - NOPE) + chunk, mask=live, other=127)
    r = row[:, None] + NOPE + 2 * tl.arange(0, 64)[None, :]
    lo = tl.load(r, mask=ok[:, None], other=0)
    hi = tl.load(r + 1, mask=ok[:, None], other=0)
    return codes, scales, lo, hi


@triton.jit
def _dot_parts(a, k, acc, SPLIT: tl.constexpr):
    """acc + a @ k (batched when 3-D): with SPLIT, ``a`` (float32) as high + low parts of ``k``'s type."""
    if SPLIT:
        hi = a.to(k.dtype)
        lo = (a - hi.to(tl.float32)).to(k.dtype)
        acc = tl.dot(hi, k, acc)
        acc = tl.dot(lo, k, acc)
    else:
        acc = tl.dot(a, k, acc, input_precision="ieee")
    return acc


@triton.jit
def online_softmax_step(m, l, s):
    """One block of scores s [heads, rows] (-inf: no row) into the running max m and sum l -> (new max, the factor
    alpha for the old state, the block's probabilities, new sum). A Triton helper the Gluon kernel calls too."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    return m_new, alpha, p, l * alpha + tl.sum(p, axis=1)


@triton.jit
def _attend_split(q_nope, q_rope, rows_ptr, idx_ptr, pos_ptr, n, ring, stride, block0, n_blocks, scale,
                  HB: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, NC: tl.constexpr, BLOCK: tl.constexpr,
                  SPLIT: tl.constexpr, MODE: tl.constexpr):
    """Online softmax of the HB heads over ``n_blocks`` blocks of BLOCK slots from ``block0`` of one source ->
    (m, l, acc_nope [NC, HB, 64], acc_rope [HB, 64]). Each row is loaded once and decoded once for both products,
    and the next block's bytes are loaded before this block is multiplied, so the DRAM round trip overlaps the
    math. The non-RoPE products are batched by 64-value chunk (the warps split the chunks), so no warp holds a
    whole 512-value operand."""
    m = tl.full([HB], float("-inf"), tl.float32)
    l = tl.zeros([HB], tl.float32)
    acc_n = tl.zeros([NC, HB, 64], tl.float32)
    acc_r = tl.zeros([HB, 64], tl.float32)
    slots = tl.arange(0, BLOCK)
    idx = _slot_rows(idx_ptr, pos_ptr, n, ring, block0 * BLOCK + slots, n_blocks > 0, MODE)
    codes, scales, lo, hi = _packed_bytes(rows_ptr, idx, stride, NOPE, NC, D)
    i = 0
    while i < n_blocks:  # a while loop: the interpreter takes no tensor trip count in range()
        ok = idx >= 0
        k_nope = _e4m3_scaled(codes, scales.to(tl.int32), SPLIT)  # [NC, BLOCK, 64]
        k_rope = _fp16_bytes(lo.to(tl.int32), hi.to(tl.int32))  # [BLOCK, 64]
        idx = _slot_rows(idx_ptr, pos_ptr, n, ring, (block0 + i + 1) * BLOCK + slots, i + 1 < n_blocks, MODE)
        codes, scales, lo, hi = _packed_bytes(rows_ptr, idx, stride, NOPE, NC, D)
        if SPLIT:  # E4M3 x 2^k is exact in bf16, FP16 RoPE values are exact in fp16
            k_nope = k_nope.to(tl.bfloat16)
        else:
            k_rope = k_rope.to(tl.float32)
        s = tl.sum(_dot_parts(q_nope, tl.trans(k_nope, 0, 2, 1), tl.zeros([NC, HB, BLOCK], tl.float32), SPLIT), 0)
        s = _dot_parts(q_rope, tl.trans(k_rope), s, SPLIT)
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new, alpha, p, l = online_softmax_step(m, l, s)
        acc_n = _dot_parts(tl.broadcast_to(p[None, :, :], (NC, HB, BLOCK)), k_nope, acc_n * alpha[None, :, None],
                           SPLIT)
        acc_r = _dot_parts(p, k_rope, acc_r * alpha[:, None], SPLIT)
        m = m_new
        i += 1
    return m, l, acc_n, acc_r


@triton.jit
def partial_kernel(q_ptr, rows_a, idx_a, pos_a, n_a, ring_a, stride_a, splits_a, blocks_a,
                   rows_b, idx_b, pos_b, n_b, ring_b, stride_b, blocks_b, m_ptr, l_ptr, acc_ptr, scale,
                   store_a, store_b, index_a, index_b, n_split,
                   H: tl.constexpr, HP: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr,
                   NC: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr, MODE_A: tl.constexpr,
                   MODE_B: tl.constexpr, SKIP_EMPTY: tl.constexpr = False):
    """Program (split, group of HB heads, query): the softmax state of the heads over one split of two row
    sources: ``blocks_a`` blocks of BLOCK slots of source A per split for the first ``splits_a`` splits, then
    ``blocks_b`` of source B per split. A decode step has few rows per source, so the heads may be split over
    programs to keep more of the GPU busy (each group decodes the split's rows again). Query b (a batched decode
    step: one per session) reads its own stores (``store_*`` apart, 0 when shared), index rows (``index_*``
    apart) and position. SKIP_EMPTY: a split with no row to read (`empty_split`) stores m = -inf, l = 0 and no
    accumulator, which the merge (its SKIP_EMPTY) then does not read."""
    split = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    q_ptr += b * H * D
    rows_a += b * store_a
    rows_b += b * store_b
    idx_a += b * index_a
    idx_b += b * index_b
    pos_a += b
    pos_b += b
    m_ptr += b * n_split * HP
    l_ptr += b * n_split * HP
    acc_ptr += b * n_split * HP * D
    offs_h = tl.program_id(1) * HB + tl.arange(0, HB)
    if SKIP_EMPTY:
        p_a = tl.load(pos_a).to(tl.int32) if MODE_A == 2 else 0
        p_b = tl.load(pos_b).to(tl.int32) if MODE_B == 2 else 0
        if empty_split(split, splits_a, blocks_a, p_a, n_a, ring_a, blocks_b, p_b, n_b, ring_b, BLOCK, MODE_A,
                       MODE_B):
            tl.store(m_ptr + split * HP + offs_h, tl.full([HB], float("-inf"), tl.float32))
            tl.store(l_ptr + split * HP + offs_h, tl.zeros([HB], tl.float32))
            return
    h_ok = offs_h < H
    chunk = tl.arange(0, NC)[:, None, None]
    c64 = tl.arange(0, 64)
    nope_at = offs_h[None, :, None] * D + chunk * 64 + c64[None, None, :]  # [NC, HB, 64]
    nope_ok = h_ok[None, :, None] & (chunk < NOPE // 64)
    q_nope = tl.load(q_ptr + nope_at, mask=nope_ok, other=0.0).to(tl.float32)
    rope_at = offs_h[:, None] * D + NOPE + c64[None, :]
    q_rope = tl.load(q_ptr + rope_at, mask=h_ok[:, None], other=0.0).to(tl.float32)
    if split < splits_a:
        m, l, acc_n, acc_r = _attend_split(q_nope, q_rope, rows_a, idx_a, pos_a, n_a, ring_a, stride_a,
                                           split * blocks_a, blocks_a, scale, HB, D, NOPE, NC, BLOCK, SPLIT,
                                           MODE_A)
    else:
        m, l, acc_n, acc_r = _attend_split(q_nope, q_rope, rows_b, idx_b, pos_b, n_b, ring_b, stride_b,
                                           (split - splits_a) * blocks_b, blocks_b, scale, HB, D, NOPE, NC,
                                           BLOCK, SPLIT, MODE_B)
    tl.store(m_ptr + split * HP + offs_h, m)
    tl.store(l_ptr + split * HP + offs_h, l)
    out = acc_ptr + split * HP * D
    tl.store(out + nope_at, acc_n, mask=nope_ok)
    tl.store(out + rope_at, acc_r, mask=h_ok[:, None])


@triton.jit
def combine_kernel(m_ptr, l_ptr, acc_ptr, sinks_ptr, out_ptr, cos_ptr, sin_ptr, n_split, HP: tl.constexpr,
                   D: tl.constexpr, SB: tl.constexpr, N_ITER: tl.constexpr, ROPE: tl.constexpr, CB: tl.constexpr = 1,
                   PDL: tl.constexpr = False, SKIP_EMPTY: tl.constexpr = False):
    """Program (head, group of CB 64-value chunks, query): out = sum_s acc_s e^(m_s - top) / (sum_s l_s e^(m_s -
    top) + e^(sink - top)), rounded to out's dtype, over SB splits at a time. ROPE: the last chunk (the 64 RoPE
    dims) is rotated back first by the query's angles (cos / sin [queries, 32]) in interleaved pairs, the
    arithmetic of the inverse RoPE kernel. A program of all D / 64 chunks reads each split's m and l once where
    one per chunk read them D / 64 times and its programs waited on their loads in turn. Each iteration loads its
    splits' m, l and acc together and moves the running sums to a new top as an online softmax does, so a merge of
    one iteration waits on memory once (a first pass over m for the top was a second wait); with one iteration
    the arithmetic is the two-pass formula's. SKIP_EMPTY: a split whose m is -inf (every head's: a split the
    partial pass found empty, `empty_split`) has its accumulator, unwritten, left unread: its weight is 0 either
    way, so the bits are the same; the accumulator's load then waits on m's."""
    wait_upstream(PDL)
    h = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    m_ptr += b * n_split * HP
    l_ptr += b * n_split * HP
    acc_ptr += b * n_split * HP * D
    out_ptr += b * tl.num_programs(0) * D
    offs = tl.arange(0, SB)
    cols = tl.program_id(1) * CB * 64 + tl.arange(0, CB * 64)
    top = tl.load(sinks_ptr + h).to(tl.float32)
    denom = top * 0.0 + 1.0  # e^(sink - top)
    acc = tl.zeros([CB * 64], tl.float32)
    for i in range(N_ITER):  # a compile-time trip count (N_ITER * SB >= n_split): the interpreter needs one
        s0 = i * SB
        live = s0 + offs < n_split
        m = tl.load(m_ptr + (s0 + offs) * HP + h, mask=live, other=float("-inf"))
        lv = tl.load(l_ptr + (s0 + offs) * HP + h, mask=live, other=0.0)
        if SKIP_EMPTY:
            live = live & (m > float("-inf"))
        part = tl.load(acc_ptr + ((s0 + offs) * HP + h)[:, None] * D + cols[None, :], mask=live[:, None],
                       other=0.0).to(tl.float32)  # float32 or bf16 accumulators (attention.STATE_BF16)
        new_top = tl.maximum(top, tl.max(m, 0))
        alpha = tl.exp(top - new_top)
        w = tl.exp(m - new_top)  # 0 for empty blocks
        denom = denom * alpha + tl.sum(lv * w, 0)
        acc = acc * alpha + tl.sum(part * w[:, None], 0)
        top = new_top
    y = acc / denom
    if ROPE:
        even, odd = tl.split(tl.reshape(y, (CB * 32, 2)))
        pair = tl.arange(0, CB * 32)
        rope = (tl.program_id(1) * CB * 32 + pair) >= (D - 64) // 2  # pairs of the last chunk
        cs = tl.load(cos_ptr + b * 32 + pair % 32)
        sn = -tl.load(sin_ptr + b * 32 + pair % 32)
        dst = out_ptr + h * D + tl.program_id(1) * CB * 64 + 2 * pair
        # explicit FMAs: as the RoPE kernel's (no contraction choice)
        tl.store(dst, tl.where(rope, tl.fma(even, cs, -(odd * sn)), even).to(out_ptr.dtype.element_ty))
        tl.store(dst + 1, tl.where(rope, tl.fma(odd, cs, even * sn), odd).to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + h * D + cols, y.to(out_ptr.dtype.element_ty))


@triton.jit
def _rows(base, ok, NOPE: tl.constexpr, D: tl.constexpr):
    """Whole packed rows at ``base`` ([BLOCK, 1] pointers) as float32 [BLOCK, D], 0 where not ``ok``. (Building it
    as [BLOCK, D / 64, 64] so that each byte is loaded once was slower on the H200: 18.6 against 11.1 ms for a
    2,048-query CSA layer.)"""
    col = tl.arange(0, D)[None, :]
    nope = col < NOPE
    rope = NOPE + 2 * (col - NOPE)  # byte offset of a RoPE value (masked off for the others)
    b = tl.load(base + tl.where(nope, col, rope), mask=ok[:, None], other=0).to(tl.int32)
    hi = tl.load(base + rope + 1, mask=ok[:, None] & ~nope, other=0).to(tl.int32)
    sb = tl.load(base + NOPE + 2 * (D - NOPE) + col // 64, mask=ok[:, None] & nope, other=127).to(tl.int32)
    return tl.where(nope, _e4m3_scaled(b, sb), _fp16_bytes(b, hi).to(tl.float32))


@triton.jit
def _attend_rows(q, base, ok, m, l, acc, scale, NOPE: tl.constexpr, D: tl.constexpr):
    """One block of rows into the running softmax state (m, l, acc) of the HB heads in ``q`` [HB, D]. (The whole
    query is a tensor-core operand held by every warp: 255 registers and some spills at 16 heads x 16 rows x 4
    warps, yet faster on the H200 than taking it 64 values at a time without spills: 11.1 against 12.5 ms for a
    2,048-query CSA layer.)"""
    kv = _rows(base, ok, NOPE, D)
    s = tl.dot(q, tl.trans(kv), input_precision="tf32")
    s = tl.where(ok[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p, kv, input_precision="tf32")


@triton.jit(do_not_specialize=["n_src"])  # the compressed row count grows chunk by chunk: one compiled variant
def prefill_kernel(q_ptr, pos_ptr, win_ptr, ring, stride_win, src_ptr, idx_ptr, n_src, ratio, stride_src, sinks_ptr,
                   out_ptr, scale, H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr,
                   W: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, SRC: tl.constexpr):
    """Program (query t, group of HB heads): flash attention of one query over its sliding window (the W ring
    slots ending at its position) and, with SRC, its compressed rows: SRC 1 the K rows named in its row of
    ``idx`` (-1 = none), SRC 2 the closed ones of n_src rows ((position + 1) // ratio of them); then the sink.
    Operands enter the tensor cores as TF32: the stored values (E4M3 x power of two, FP16) and bf16-valued
    queries exactly, the probabilities rounded to 10 bits."""
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int32)  # int32 ring / ratio arithmetic: on int64 a called routine per slot
    offs_h = tl.program_id(1) * HB + tl.arange(0, HB)
    h_ok = offs_h < H
    cols = tl.arange(0, D)
    rows_hd = (t * H + offs_h).to(tl.int64)[:, None] * D + cols[None, :]
    q = tl.load(q_ptr + rows_hd, mask=h_ok[:, None], other=0.0).to(tl.float32)
    m = tl.full([HB], float("-inf"), tl.float32)
    l = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, D], tl.float32)
    for j0 in range(0, W, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        p = pos - (W - 1) + j
        ok = (p >= 0) & (j < W)
        base = win_ptr + tl.where(ok, p % ring, 0).to(tl.int64)[:, None] * stride_win
        m, l, acc = _attend_rows(q, base, ok, m, l, acc, scale, NOPE, D)
    if SRC == 1:
        for j0 in range(0, K, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            idx = tl.load(idx_ptr + t.to(tl.int64) * K + j, mask=j < K, other=-1)
            ok = idx >= 0
            base = src_ptr + tl.where(ok, idx, 0).to(tl.int64)[:, None] * stride_src
            m, l, acc = _attend_rows(q, base, ok, m, l, acc, scale, NOPE, D)
    elif SRC == 2:
        n_vis = closed_rows(pos, ratio, n_src)
        j0 = 0
        while j0 < n_vis:  # a trip count from a loaded value (a while loop: the interpreter has no such range)
            j = j0 + tl.arange(0, BLOCK)
            ok = j < n_vis
            base = src_ptr + tl.where(ok, j, 0).to(tl.int64)[:, None] * stride_src
            m, l, acc = _attend_rows(q, base, ok, m, l, acc, scale, NOPE, D)
            j0 += BLOCK
    sink = tl.load(sinks_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    top = tl.maximum(m, sink)
    w = tl.exp(m - top)
    tl.store(out_ptr + rows_hd, acc * (w / (l * w + tl.exp(sink - top)))[:, None], mask=h_ok[:, None])
