"""Decode attention over many rows in two passes (Triton): the scores of every row block, then the outputs.

The one-pass kernels (`ds4x.kernels.triton_attention.partial_kernel`, `ds4x.kernels.attention_wgmma`) run a
chain of small blocks per program with an online softmax, and every split writes a whole [64, 512] partial state.
An HCA layer at 1M (8,194 rows) then costs each program a few serial blocks plus a large fixed cost (the query in,
the 128 KB state out), which no blocking of one pass removes. Here the work is cut the other way:

- `score_kernel`, a program per block of BLOCK slots (of the window, then the compressed rows): all heads' scores
  S = scale q k^T over the block [HP, BLOCK] (float32) and their maximum per head, both to a scratch buffer;
- `value_kernel`, a program per (split of BPS consecutive blocks, 64-value column chunk): the split's maximum m per
  head from the blocks' maxima, p = e^(S - m), l = sum p, and acc = p V over those 64 columns only, so a program
  holds a [HP, 64] accumulator and each split's [HP, D] partial state is written once, in D / 64 pieces;
- `triton_attention.combine_kernel` merges the splits with the sink, as for the one-pass kernels.

Both passes are one block deep per step, with many programs in flight, so no program pays for a long chain. The
rows are read twice (keys, then values), the second time from L2.

Precision on the GPU (SPLIT): the E4M3 values times their power-of-two scale are exact in bf16, an FP16 RoPE value
is a bf16 high + low pair, a float32 query (or probability) is a bf16 high + low pair (a bf16 query has no low
part and is multiplied once), float32 accumulation: as the Hopper one-pass kernel, about 1e-5 relative. The CPU
interpreter multiplies float32 operands.
"""

import triton
import triton.language as tl

from ds4x.formats.pdl import wait_upstream
from ds4x.kernels.triton_attention import _e4m3_scaled, _fp16_bytes, _slot_rows


@triton.jit
def _product(a, k, acc, SPLIT: tl.constexpr, A_LO: tl.constexpr, K_LO: tl.constexpr):
    """acc + a @ k. With SPLIT (tensor cores): bf16 operands, ``a`` also as a low part where A_LO, ``k`` where K_LO
    (float32 values that bf16 does not hold exactly); else float32 operands."""
    if SPLIT:
        a_hi = a.to(tl.bfloat16)
        k_hi = k.to(tl.bfloat16)
        acc = tl.dot(a_hi, k_hi, acc)
        if A_LO:
            a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(a_lo, k_hi, acc)
        if K_LO:
            k_lo = (k - k_hi.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(a_hi, k_lo, acc)
            if A_LO:
                acc = tl.dot((a - a_hi.to(tl.float32)).to(tl.bfloat16), k_lo, acc)
    else:
        acc = tl.dot(a.to(tl.float32), k.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _block_source(t, blocks_a, slots, live, idx_a, pos_a, n_a, ring_a, idx_b, pos_b, n_b, ring_b,
                  BLOCK: tl.constexpr, MODE_A: tl.constexpr, MODE_B: tl.constexpr):
    """The stored rows (int64, -1: none) of block ``t`` of the two sources: blocks 0 .. blocks_a - 1 are source A's,
    the rest source B's; and whether they come from A."""
    if t < blocks_a:
        idx = _slot_rows(idx_a, pos_a, n_a, ring_a, t * BLOCK + slots, live, MODE_A).to(tl.int64)
    else:
        idx = _slot_rows(idx_b, pos_b, n_b, ring_b, (t - blocks_a) * BLOCK + slots, live, MODE_B).to(tl.int64)
    return idx


# the row counts grow with the context in a prefill chunk and the index width with a prompt: one compiled variant
@triton.jit(do_not_specialize=["n_a", "blocks_a", "n_b", "n_blocks", "index_a", "index_b"])
def score_kernel(q_ptr, rows_a, idx_a, pos_a, n_a, ring_a, stride_a, blocks_a, rows_b, idx_b, pos_b, n_b, ring_b,
                 stride_b, s_ptr, top_ptr, scale, store_a, store_b, index_a, index_b, n_blocks,
                 H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, BLOCK: tl.constexpr,
                 SPLIT: tl.constexpr, Q_LO: tl.constexpr, MODE_A: tl.constexpr, MODE_B: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Program (block, -, query): S [HP, BLOCK] = scale q k^T of the block's rows (-inf where a slot has no row) to
    s [queries, n_blocks, HP, BLOCK] and its maximum over the block to top [queries, n_blocks, HP]."""
    wait_upstream(PDL)
    t = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    rows_a += b * store_a
    rows_b += b * store_b
    slots = tl.arange(0, BLOCK)
    idx = _block_source(t, blocks_a, slots, True, idx_a + b * index_a, pos_a + b, n_a, ring_a, idx_b + b * index_b,
                        pos_b + b, n_b, ring_b, BLOCK, MODE_A, MODE_B)
    if t < blocks_a:
        rows_ptr, stride = rows_a, stride_a
    else:
        rows_ptr, stride = rows_b, stride_b
    ok = idx >= 0
    row = rows_ptr + tl.where(ok, idx, 0) * stride
    h = tl.arange(0, HP)[:, None]
    c64 = tl.arange(0, 64)
    q_at = q_ptr + b * H * D + h * D + c64[None, :]
    s = tl.zeros([HP, BLOCK], tl.float32)
    for c in tl.static_range(NOPE // 64):
        qc = tl.load(q_at + c * 64, mask=h < H, other=0.0).to(tl.float32)
        codes = tl.load(row[:, None] + c * 64 + c64[None, :], mask=ok[:, None], other=0)
        sb = tl.load(row + NOPE + 2 * (D - NOPE) + c, mask=ok, other=127).to(tl.int32)
        s = _product(qc, tl.trans(_e4m3_scaled(codes, sb[:, None], SPLIT)), s, SPLIT, Q_LO, False)
    qr = tl.load(q_at + NOPE, mask=h < H, other=0.0).to(tl.float32)
    at = row[:, None] + NOPE + 2 * c64[None, :]
    lo = tl.load(at, mask=ok[:, None], other=0).to(tl.int32)
    hi = tl.load(at + 1, mask=ok[:, None], other=0).to(tl.int32)
    s = _product(qr, tl.trans(_fp16_bytes(lo, hi).to(tl.float32)), s, SPLIT, Q_LO, True)
    s = tl.where(ok[None, :], s * scale, float("-inf"))
    base = (b * n_blocks + t) * HP
    tl.store(s_ptr + (base + h) * BLOCK + slots[None, :], s)
    tl.store(top_ptr + base + tl.arange(0, HP), tl.max(s, axis=1))


@triton.jit(do_not_specialize=["n_a", "blocks_a", "n_b", "n_blocks", "n_split", "index_a", "index_b"])
def value_kernel(s_ptr, top_ptr, rows_a, idx_a, pos_a, n_a, ring_a, stride_a, blocks_a, rows_b, idx_b, pos_b, n_b,
                 ring_b, stride_b, m_ptr, l_ptr, acc_ptr, store_a, store_b, index_a, index_b, n_blocks, n_split,
                 HP: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, BLOCK: tl.constexpr, BPS: tl.constexpr,
                 SPLIT: tl.constexpr, MODE_A: tl.constexpr, MODE_B: tl.constexpr, PDL: tl.constexpr = False):
    """Program (split, 64-value chunk, query): over the split's BPS blocks, m = the heads' maximum score, l = sum
    e^(S - m) and acc = sum e^(S - m) V for the chunk's columns -> the split's softmax state (m, l [queries,
    n_split, HP], acc [queries, n_split, HP, D]) as `combine_kernel` reads it; m = -inf, l = 0, acc = 0 where no
    block of the split has a row."""
    wait_upstream(PDL)
    split = tl.program_id(0)
    j = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows_a += b * store_a
    rows_b += b * store_b
    idx_a += b * index_a
    idx_b += b * index_b
    h = tl.arange(0, HP)
    t0 = split * BPS
    ts = t0 + tl.arange(0, BPS)
    tops = tl.load(top_ptr + (b * n_blocks + ts[:, None]) * HP + h[None, :], mask=(ts < n_blocks)[:, None],
                   other=float("-inf"))
    m = tl.max(tops, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    slots = tl.arange(0, BLOCK)
    c64 = tl.arange(0, 64)
    l = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, 64], tl.float32)
    for i in range(BPS):  # a compile-time trip count: the interpreter takes no tensor one
        t = t0 + i
        live = t < n_blocks
        s = tl.load(s_ptr + ((b * n_blocks + t) * HP + h[:, None]) * BLOCK + slots[None, :], mask=live,
                    other=float("-inf"))
        p = tl.exp(s - m_safe[:, None])
        l += tl.sum(p, axis=1)
        idx = _block_source(t, blocks_a, slots, live, idx_a, pos_a + b, n_a, ring_a, idx_b, pos_b + b, n_b, ring_b,
                            BLOCK, MODE_A, MODE_B)
        if t < blocks_a:
            rows_ptr, stride = rows_a, stride_a
        else:
            rows_ptr, stride = rows_b, stride_b
        ok = idx >= 0
        row = rows_ptr + tl.where(ok, idx, 0) * stride
        if j < NOPE // 64:
            codes = tl.load(row[:, None] + j * 64 + c64[None, :], mask=ok[:, None], other=0)
            sb = tl.load(row + NOPE + 2 * (D - NOPE) + j, mask=ok, other=127).to(tl.int32)
            acc = _product(p, _e4m3_scaled(codes, sb[:, None], SPLIT), acc, SPLIT, True, False)
        else:
            at = row[:, None] + NOPE + 2 * c64[None, :]
            lo = tl.load(at, mask=ok[:, None], other=0).to(tl.int32)
            hi = tl.load(at + 1, mask=ok[:, None], other=0).to(tl.int32)
            acc = _product(p, _fp16_bytes(lo, hi).to(tl.float32), acc, SPLIT, True, True)
    base = (b * n_split + split) * HP
    tl.store(acc_ptr + (base + h[:, None]) * D + j * 64 + c64[None, :], acc)
    if j == 0:
        tl.store(m_ptr + base + h, m)
        tl.store(l_ptr + base + h, l)
