"""Triton products straight from GGML blocks (Q8_0, Q2_K, Q4_K, IQ2_XXS) for CUDA.

``y = x @ W.T`` where ``W`` is a :class:`~ds4x.formats.ggml_tensor.GGMLTensor` ``[N, K]`` (or an
expert of ``[E, N, K]``). The weight is never expanded to a dense buffer: each program reads its
rows' blocks, decodes them in registers and accumulates in float32.

Two kernels, one decode routine per type:

* ``_qmv_kernel`` (matrix-vector, 1 to ``MATVEC_MAX_ROWS`` activation rows): a program owns ``BN``
  output rows of one (activation row, expert) pair and walks K in chunks of ``BK``, multiplying the
  decoded tile element-wise by x and reducing once at the end.
* ``_qmm_kernel`` (skinny matrix, up to 64 rows at a time): the decoded ``[BN, BK]`` tile goes
  through ``tl.dot`` against ``BM`` activation rows (in x's dtype; float32 activations use TF32
  on GPU), for rows that share one expert.

Both take an optional expert id per (activation row, slot) pair: the routed-expert form
``y[t, j] = x[t] @ W[ids[t, j]].T`` (and the grouped output projection, whose groups are "experts"
of one row each). Above 64 rows :mod:`ds4x.kernels.linear` is better served by dequantizing once
and calling the dense GEMM, which ``quant_linear`` does.

Decode tiles are 4-D ``[BN, G, W, V]``: ``G`` scale groups of ``W * V`` weights, where one 16- or
32-bit word (or grid entry) yields ``V`` weights; the weights come out in their natural order, so x
is read contiguously. Byte layouts are documented in :mod:`ds4x.formats.ggml`. Scales, grids and
codes are decoded with the reference's float operations; only the summation order differs.

The interpreter (``TRITON_INTERPRET=1``) runs the same kernels on CPU tensors for parity tests;
like ``formats/rows_triton.py`` this module keeps a private copy of itself for the mode it was not
imported under.

Speed: not yet measured on a GPU (``python -m ds4x.kernels.quant_matmul [out.json [deadline_s]]``
runs parity and timing of every case on CUDA and prints a table). Static estimate from the sm_90
SASS of the matvec loop (thread instructions per weight; the issue limit is 128 per clock per SM):
Q8_0 ~10 (could reach the 60% bandwidth target), Q4_K ~11-12, Q2_K ~11-15, IQ2_XXS ~13-16, i.e.
about 15-25% of copy bandwidth for the 2-bit types, far from 50%: they need fewer instructions per
weight (several weights per integer op, or int8 dot products), not tuning.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from typing import Any

import torch

from ds4x.formats.ggml import GGMLQuantizationType, _iq2xxs_grid_cpu
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.formats.triton_mode import interpret_mode, module_for_current_mode

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAVE_TRITON = False

T = GGMLQuantizationType
# type -> (code for the kernels, weights per scale group S, block bytes, block weights)
_TYPES = {
    T.Q8_0: (8, 32, 34, 32),
    T.Q2_K: (10, 16, 84, 256),
    T.Q4_K: (12, 32, 144, 256),
    T.IQ2_XXS: (16, 32, 66, 256),
}
SUPPORTED = tuple(_TYPES)
MATVEC_MAX_ROWS = 4  # up to this many rows per (weight, expert) the matvec kernel wins (it re-reads W per row)
DOT_MAX_ROWS = 64  # above this quant_linear dequantizes once and uses the dense GEMM


_DEFINED_INTERPRETED = interpret_mode()


if HAVE_TRITON:

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _f16(ptr, off, mask):
        # fp16 field at an even byte offset -> float32
        return tl.load((ptr + off).to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _magic(q, BIAS: tl.constexpr):
        # int32 code in [0, 2**23) -> float32 (code - BIAS) without the quarter-rate I2F: the float
        # with bits 0x4B000000 | code is 2**23 + code, exactly
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + BIAS)

    # Tiles are built 4-D from the start ([BN, 1, 1, 1] row offsets, [1, G, 1, 1] groups,
    # [1, 1, W, 1] words, [1, 1, 1, V] values), so no layout conversion is needed between the
    # scale, word and value stages.

    @triton.jit
    def _tile_q8_0(wp, rowoff, rmask, k0, K, G: tl.constexpr):
        # [BN, G, 16, 2]: block = d (fp16) + 32 int8, read as 16 little-endian int16 words
        blk = k0 // 32 + tl.arange(0, G)[None, :, None, None]
        m = rmask & (blk * 32 < K)
        boff = rowoff + blk.to(tl.int64) * 34
        d = _f16(wp, boff, m)
        wi = tl.arange(0, 16)[None, None, :, None]
        words = tl.load((wp + boff + 2 + 2 * wi).to(tl.pointer_type(tl.int16)), mask=m, other=0,
                        eviction_policy="evict_first").to(tl.int32)
        v = tl.arange(0, 2)[None, None, None, :]
        q = _magic(((words >> (8 * v)) & 255) ^ 128, 128.0)  # int8 = (byte ^ 128) - 128
        return q * d

    @triton.jit
    def _tile_q2_k(wp, rowoff, rmask, k0, K, G: tl.constexpr):
        # [BN, G, 4, 4]: G sub-blocks of 16; sub-block j16 = 8h + 2k + jh of its block reads bit
        # pair k of bytes 16jh..16jh+15 of half h (4 int32 words)
        sb = k0 // 16 + tl.arange(0, G)[None, :, None, None]
        j16 = sb % 16
        m = rmask & (sb * 16 < K)
        boff = rowoff + (sb // 16).to(tl.int64) * 84
        d = _f16(wp, boff + 80, m)
        dmin = _f16(wp, boff + 82, m)
        sc = tl.load(wp + boff + j16, mask=m, other=0).to(tl.int32)
        dl = d * _magic(sc & 15, 0.0)
        ml = dmin * _magic(sc >> 4, 0.0)
        wi = tl.arange(0, 4)[None, None, :, None]
        woff = boff + 16 + 32 * (j16 // 8) + 16 * (j16 % 2) + 4 * wi
        words = tl.load((wp + woff).to(tl.pointer_type(tl.int32)), mask=m, other=0, eviction_policy="evict_first")
        v = tl.arange(0, 4)[None, None, None, :]
        q = _magic((words >> (8 * v + 2 * ((j16 // 2) % 4))) & 3, 0.0)
        return dl * q - ml

    @triton.jit
    def _tile_q4_k(wp, rowoff, rmask, k0, K, G: tl.constexpr):
        # [BN, G, 8, 4]: G sub-blocks of 32; sub-block i = 2c + hi of its block is nibble hi of the
        # 32 bytes (8 int32 words) of chunk c; 6-bit scale and min unpacked from the 12 scale bytes
        sbi = k0 // 32 + tl.arange(0, G)[None, :, None, None]
        i = sbi % 8
        m = rmask & (sbi * 32 < K)
        boff = rowoff + (sbi // 8).to(tl.int64) * 144
        d = _f16(wp, boff, m)
        dmin = _f16(wp, boff + 2, m)
        u = tl.load(wp + boff + 4 + i, mask=m, other=0).to(tl.int32)
        v8 = tl.load(wp + boff + 8 + i, mask=m, other=0).to(tl.int32)
        t = tl.load(wp + boff + i, mask=m, other=0).to(tl.int32)
        low = i < 4
        sc = tl.where(low, u & 63, (v8 & 15) | ((t >> 6) << 4))
        mn = tl.where(low, v8 & 63, (v8 >> 4) | ((u >> 6) << 4))
        dl = d * _magic(sc, 0.0)
        ml = dmin * _magic(mn, 0.0)
        wi = tl.arange(0, 8)[None, None, :, None]
        woff = boff + 16 + 32 * (i // 2) + 4 * wi
        words = tl.load((wp + woff).to(tl.pointer_type(tl.int32)), mask=m, other=0, eviction_policy="evict_first")
        v = tl.arange(0, 4)[None, None, None, :]
        q = _magic((words >> (8 * v + 4 * (i % 2))) & 15, 0.0)
        return dl * q - ml

    @triton.jit
    def _tile_iq2_xxs(wp, tabp, rowoff, rmask, k0, K, G: tl.constexpr, TABLE: tl.constexpr):
        # [BN, G, 8, 4]: G groups of 32 = 4 grid entries of 8 (t = 2 * entry + half: 4 weights);
        # signs: a 7-bit index + an even-parity 8th bit. TABLE=0: magnitudes from the grid as int32
        # words (4 bytes), signs bit by bit; TABLE=1: the 4 signed values straight from a float
        # table indexed by (grid entry, half, 4 sign bits): one 16-byte gather per 4 weights
        grp = k0 // 32 + tl.arange(0, G)[None, :, None, None]
        m = rmask & (grp * 32 < K)
        boff = rowoff + (grp // 8).to(tl.int64) * 66
        d = _f16(wp, boff, m)
        gb = boff + 2 + 8 * (grp % 8)
        lo = tl.load((wp + gb + 4).to(tl.pointer_type(tl.int16)), mask=m, other=0,
                     eviction_policy="evict_first").to(tl.int32) & 0xFFFF
        hi = tl.load((wp + gb + 6).to(tl.pointer_type(tl.int16)), mask=m, other=0,
                     eviction_policy="evict_first").to(tl.int32) & 0xFFFF
        aux = lo | (hi << 16)
        db = d * (0.5 + _magic((aux >> 28) & 15, 0.0)) * 0.25
        t = tl.arange(0, 8)[None, None, :, None]
        sub = t // 2
        half = t % 2
        idx = tl.load(wp + gb + sub, mask=m, other=0, eviction_policy="evict_first").to(tl.int32)
        s7 = (aux >> (7 * sub)) & 127
        p = s7 ^ (s7 >> 4)
        p = p ^ (p >> 2)
        p = (p ^ (p >> 1)) & 1
        mask8 = s7 | (p << 7)
        v = tl.arange(0, 4)[None, None, None, :]
        if TABLE:
            nib = (mask8 >> (4 * half)) & 15
            signed = tl.load(tabp + ((idx * 2 + half) * 16 + nib) * 4 + v)
        else:
            gw = tl.load(tabp + idx * 2 + half)
            mag = _magic((gw >> (8 * v)) & 255, 0.0)
            sbit = (mask8 >> (4 * half + v)) & 1
            signed = tl.where(sbit == 1, -mag, mag)
        return db * signed

    @triton.jit
    def _tile(QTYPE: tl.constexpr, wp, gridp, rowoff, rmask, k0, K, G: tl.constexpr, TABLE: tl.constexpr):
        if QTYPE == 8:
            out = _tile_q8_0(wp, rowoff, rmask, k0, K, G)
        elif QTYPE == 10:
            out = _tile_q2_k(wp, rowoff, rmask, k0, K, G)
        elif QTYPE == 12:
            out = _tile_q4_k(wp, rowoff, rmask, k0, K, G)
        else:
            out = _tile_iq2_xxs(wp, gridp, rowoff, rmask, k0, K, G, TABLE)
        return out

    @triton.jit
    def _mv_step(acc, QTYPE: tl.constexpr, wp, gridp, rowoff, rmask, xp, koff, k0, K, G: tl.constexpr,
                 TABLE: tl.constexpr):
        # One K chunk of the matvec. The kernels loop with `for` when compiled (pipelined) and with
        # `while` under the interpreter, whose `range` cannot take a runtime bound with numpy >= 2.
        w = _tile(QTYPE, wp, gridp, rowoff, rmask, k0, K, G, TABLE)
        xv = tl.load(xp + k0 + koff, mask=(k0 + koff) < K, other=0.0).to(tl.float32)
        return acc + w * xv

    @triton.jit
    def _mm_step(acc, QTYPE: tl.constexpr, wp, gridp, rowoff, rmask, xp, valid, kk, k0, K, G: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
                 TABLE: tl.constexpr):
        w = tl.reshape(_tile(QTYPE, wp, gridp, rowoff, rmask, k0, K, G, TABLE), (BN, BK)).to(DOT_DTYPE)
        xm = valid[:, None] & ((k0 + kk) < K)[None, :]
        xv = tl.load(xp + k0 + kk[None, :], mask=xm, other=0.0).to(DOT_DTYPE)
        return tl.dot(xv, tl.trans(w), acc, input_precision=PREC)

    @triton.jit
    def _qmv_kernel(x_ptr, w_ptr, grid_ptr, ids_ptr, y_ptr, N, K, row_bytes, expert_bytes, stride_x, stride_y,
                    X_DIV: tl.constexpr, HAS_IDS: tl.constexpr, QTYPE: tl.constexpr, S: tl.constexpr,
                    W: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TABLE: tl.constexpr,
                    INTERPRET: tl.constexpr):
        pid_n = tl.program_id(0)
        pair = tl.program_id(1)
        G: tl.constexpr = BK // S
        V: tl.constexpr = S // W
        xrow = pair // X_DIV
        if HAS_IDS:
            e = tl.load(ids_ptr + pair).to(tl.int64)
        else:
            e = 0
        wp = w_ptr + e * expert_bytes
        rows = pid_n * BN + tl.arange(0, BN)
        rmask = rows < N
        r4 = rows[:, None, None, None]
        rowoff = r4.to(tl.int64) * row_bytes
        koff = (tl.arange(0, G)[None, :, None, None] * S + tl.arange(0, W)[None, None, :, None] * V
                + tl.arange(0, V)[None, None, None, :])
        xp = x_ptr + xrow.to(tl.int64) * stride_x
        acc = tl.zeros((BN, G, W, V), dtype=tl.float32)
        if INTERPRET:  # see _mv_step
            k0 = 0
            while k0 < K:
                acc = _mv_step(acc, QTYPE, wp, grid_ptr, rowoff, r4 < N, xp, koff, k0, K, G, TABLE)
                k0 += BK
        else:
            for k0 in range(0, K, BK):
                acc = _mv_step(acc, QTYPE, wp, grid_ptr, rowoff, r4 < N, xp, koff, k0, K, G, TABLE)
        y = tl.reduce(tl.reduce(tl.reduce(acc, 3, _add), 2, _add), 1, _add)
        tl.store(y_ptr + pair.to(tl.int64) * stride_y + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _qmm_kernel(x_ptr, w_ptr, grid_ptr, c_expert, c_start, c_len, order_ptr, y_ptr, P, N, K, row_bytes,
                    expert_bytes, stride_x, stride_y, X_DIV: tl.constexpr, HAS_IDS: tl.constexpr,
                    QTYPE: tl.constexpr, S: tl.constexpr, W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr, TABLE: tl.constexpr,
                    INTERPRET: tl.constexpr):
        pid_n = tl.program_id(0)
        c = tl.program_id(1)
        G: tl.constexpr = BK // S
        j = tl.arange(0, BM)
        if HAS_IDS:
            e = tl.load(c_expert + c).to(tl.int64)
            n_valid = tl.load(c_len + c)
            valid = j < n_valid
            pairs = tl.load(order_ptr + tl.load(c_start + c) + j, mask=valid, other=0)
        else:
            e = 0
            pairs = c * BM + j
            valid = pairs < P
            n_valid = tl.minimum(P - c * BM, BM)
        wp = w_ptr + e * expert_bytes
        rows = pid_n * BN + tl.arange(0, BN)
        r4 = rows[:, None, None, None]
        rmask = (r4 < N) & (n_valid > 0)  # an empty chunk reads no weights
        rowoff = r4.to(tl.int64) * row_bytes
        xrows = (pairs // X_DIV).to(tl.int64)
        kk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        xp = x_ptr + xrows[:, None] * stride_x
        if INTERPRET:
            k0 = 0
            while k0 < K:
                acc = _mm_step(acc, QTYPE, wp, grid_ptr, rowoff, rmask, xp, valid, kk, k0, K, G, BN, BK, DOT_DTYPE,
                               PREC, TABLE)
                k0 += BK
        else:
            for k0 in range(0, K, BK):
                acc = _mm_step(acc, QTYPE, wp, grid_ptr, rowoff, rmask, xp, valid, kk, k0, K, G, BN, BK, DOT_DTYPE,
                               PREC, TABLE)
        yp = y_ptr + pairs.to(tl.int64)[:, None] * stride_y + rows[None, :]
        tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (rows < N)[None, :])


def _kernels() -> Any:
    """The module whose kernels match the current TRITON_INTERPRET mode."""
    if not HAVE_TRITON:
        raise RuntimeError("ds4x.kernels.quant_matmul needs the 'triton' package")
    return module_for_current_mode(__name__, __file__, _DEFINED_INTERPRETED)


# ---- host side ---------------------------------------------------------------------------------

def supports(w: GGMLTensor) -> bool:
    """Whether the kernels can multiply by ``w`` on its device."""
    if not HAVE_TRITON or w.qtype not in _TYPES or w.ndim not in (2, 3):
        return False
    if w.raw.device.type != "cuda" and not interpret_mode():
        return False
    align = 4 if w.qtype in (T.Q2_K, T.Q4_K) else 2  # widest word a kernel reads
    return w.raw.is_contiguous() and w.raw.data_ptr() % align == 0 and w.row_bytes % align == 0


@lru_cache(maxsize=8)
def _grid_words(device: torch.device) -> torch.Tensor:
    """IQ2_XXS grid as int32 [256 * 2]: entry g's 8 magnitudes, 4 bytes per word, little-endian."""
    mags = _iq2xxs_grid_cpu().to(torch.uint8).contiguous()  # (256, 8) values 8 / 25 / 43
    return mags.view(torch.int32).reshape(-1).to(device)


@lru_cache(maxsize=8)
def _sign_table(device: torch.device) -> torch.Tensor:
    """IQ2_XXS signed half-entries as float32 [256 * 2 * 16 * 4] (128 KiB): row (entry, half, s)
    holds magnitudes 4*half..4*half+3 of the entry, negated where bit j of the 4-bit s is set."""
    grid = _iq2xxs_grid_cpu().view(256, 2, 1, 4)
    bits = (torch.arange(16).view(16, 1) >> torch.arange(4)) & 1
    signs = (1.0 - 2.0 * bits.float()).view(1, 1, 16, 4)
    return (grid * signs).reshape(-1).contiguous().to(device)


IQ2_TABLE = False  # True: IQ2_XXS decode through _sign_table (a gather per 4 weights); unmeasured on GPU


def _dummy(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def matvec_config(qtype: GGMLQuantizationType, n: int, k: int) -> tuple[int, int, int]:
    """(BN, BK, num_warps) for the matvec kernel: enough programs to fill the GPU, ~4K-8K weights
    per program step."""
    block = _TYPES[qtype][3]
    bk = 1024 if k >= 1024 else max(block, 256)
    bn = 8 if n >= 16384 else 4
    bk = max(bk, block)
    while bk > block and bk // 2 >= k:
        bk //= 2
    return bn, bk, 4


def matmul_config(qtype: GGMLQuantizationType, m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, num_warps) for the tl.dot kernel (sizes without register spills on sm_90)."""
    if m <= 16:
        return 16, 64, 128, 4
    return (32 if m <= 32 else 64), 64, 128, 8


def _launch(x2: torch.Tensor, w: GGMLTensor, ids: torch.Tensor | None, x_div: int, n_pairs: int,
            rows_per_weight: int, config: tuple[int, ...] | None = None, force: str | None = None,
            table: bool | None = None) -> torch.Tensor:
    """y [n_pairs, N]: row p = x2[p // x_div] @ W[ids[p] if ids is not None else 0].T; ``rows_per_weight``
    (rows a weight matrix meets, on average) picks the kernel unless ``force`` is "mv" or "mm"."""
    mod = _kernels()
    code, s, _block_bytes, _ = _TYPES[w.qtype]
    wr = w.raw
    n, k = w.shape[-2], w.shape[-1]
    expert_bytes = n * w.row_bytes if w.ndim == 3 else 0
    dev = x2.device
    y = torch.empty((n_pairs, n), dtype=x2.dtype, device=dev)
    if n_pairs == 0 or n == 0:
        return y
    table = IQ2_TABLE if table is None else table
    if w.qtype == T.IQ2_XXS:
        grid_t = _sign_table(dev) if table else _grid_words(dev)
    else:
        grid_t = _dummy(dev)
    has_ids = ids is not None
    ids_t = ids.reshape(-1).to(torch.int32).contiguous() if has_ids else _dummy(dev)
    x2 = x2.contiguous()
    use_mv = force == "mv" or (force is None and rows_per_weight <= MATVEC_MAX_ROWS)
    wv = 8 if w.qtype == T.IQ2_XXS else {8: 16, 10: 4, 12: 8}[code]
    if use_mv:
        bn, bk, nw = config if config is not None else matvec_config(w.qtype, n, k)
        grid = (triton.cdiv(n, bn), n_pairs)
        mod._qmv_kernel[grid](x2, wr, grid_t, ids_t, y, n, k, w.row_bytes, expert_bytes, x2.stride(0),
                              y.stride(0), X_DIV=x_div, HAS_IDS=has_ids, QTYPE=code, S=s, W=wv, BN=bn, BK=bk,
                              TABLE=table, INTERPRET=interpret_mode(), num_warps=nw)
        return y
    bm, bn, bk, nw = config if config is not None else matmul_config(w.qtype, n_pairs, n, k)
    dot_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x2.dtype]
    if interpret_mode():  # the interpreter's tl.dot mishandles bfloat16; it computes exactly anyway
        dot_dtype = tl.float32
    prec = "tf32" if x2.dtype == torch.float32 and not interpret_mode() else "ieee"
    if has_ids:
        n_exp = w.shape[0] if w.ndim == 3 else 1
        ids_l = ids_t.long()
        order = torch.sort(ids_l, stable=True).indices.to(torch.int32)
        # scatter_add rather than bincount: no host sync, so the launch can live in a CUDA graph
        counts = torch.zeros(n_exp, dtype=torch.long, device=dev).scatter_add_(0, ids_l, torch.ones_like(ids_l))
        n_chunks = (counts + bm - 1) // bm
        first_chunk = torch.cumsum(n_chunks, 0) - n_chunks
        first_pair = torch.cumsum(counts, 0) - counts
        max_chunks = triton.cdiv(n_pairs, bm) + n_exp  # a static bound: no host sync
        slot = torch.arange(max_chunks, device=dev)
        c_exp = torch.searchsorted(first_chunk + n_chunks, slot, right=True).clamp(max=n_exp - 1)
        within = slot - first_chunk[c_exp]
        c_start = (first_pair[c_exp] + within * bm).to(torch.int32)
        c_len = torch.clamp(counts[c_exp] - within * bm, 0, bm)
        c_len = torch.where(within < n_chunks[c_exp], c_len, 0).to(torch.int32)
        c_exp = c_exp.to(torch.int32)
        grid = (triton.cdiv(n, bn), max_chunks)
    else:
        order = c_exp = c_start = c_len = _dummy(dev)
        grid = (triton.cdiv(n, bn), triton.cdiv(n_pairs, bm))
    mod._qmm_kernel[grid](x2, wr, grid_t, c_exp, c_start, c_len, order, y, n_pairs, n, k, w.row_bytes,
                          expert_bytes, x2.stride(0), y.stride(0), X_DIV=x_div, HAS_IDS=has_ids, QTYPE=code, S=s,
                          W=wv, BM=bm, BN=bn, BK=bk, DOT_DTYPE=dot_dtype, PREC=prec,
                          TABLE=table, INTERPRET=interpret_mode(), num_warps=nw)
    return y


def _check(x: torch.Tensor, w: GGMLTensor, what: str) -> None:
    if w.qtype not in _TYPES:
        raise ValueError(f"{what}: no kernel for {w.qtype.name} (have {', '.join(t.name for t in _TYPES)})")
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"{what}: x has {x.shape[-1]} features, the weight {w.shape[-1]}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{what}: activations must be float32/bfloat16/float16, got {x.dtype}")
    if x.device != w.device:
        raise ValueError(f"{what}: x is on {x.device}, the weight on {w.device}")


def quant_linear(x: torch.Tensor, w: GGMLTensor, *, config: tuple[int, ...] | None = None,
                 force: str | None = None, table: bool | None = None) -> torch.Tensor:
    """``x [..., K] @ w[N, K].T -> [..., N]`` in x's dtype. Above ``DOT_MAX_ROWS`` rows: dequantize
    once (torch, on the device) and use the dense GEMM."""
    _check(x, w, "quant_linear")
    if w.ndim != 2:
        raise ValueError(f"quant_linear: weight must be 2-D, got {list(w.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > DOT_MAX_ROWS and force is None:
        return torch.nn.functional.linear(x, w.dequantize(x.dtype))
    return _launch(x2, w, None, 1, x2.shape[0], x2.shape[0], config, force, table).reshape(*lead, w.shape[0])


def quant_matmul_routed(x: torch.Tensor, w: GGMLTensor, ids: torch.Tensor, *,
                        config: tuple[int, ...] | None = None, force: str | None = None,
                        table: bool | None = None) -> torch.Tensor:
    """Routed experts: ``x [T, K]``, ``w [E, N, K]``, ``ids [T, k]`` -> ``y [T, k, N]`` with
    ``y[t, j] = x[t] @ w[ids[t, j]].T``."""
    _check(x, w, "quant_matmul_routed")
    if w.ndim != 3 or x.ndim != 2 or ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"quant_matmul_routed: want x [T, K], w [E, N, K], ids [T, k]; got {list(x.shape)}, "
                         f"{list(w.shape)}, {list(ids.shape)}")
    t, kk = ids.shape
    y = _launch(x, w, ids, kk, t * kk, t, config, force, table)
    return y.reshape(t, kk, w.shape[1])


def quant_grouped_linear(x: torch.Tensor, w: GGMLTensor, groups: int, *,
                         config: tuple[int, ...] | None = None, force: str | None = None) -> torch.Tensor:
    """Block-diagonal product of kernels/linear.grouped_linear: x [T, G, in_g], w [G*out_g, in_g]."""
    _check(x, w, "quant_grouped_linear")
    t, g, kin = x.shape
    if g != groups or w.ndim != 2 or w.shape[0] % groups:
        raise ValueError(f"quant_grouped_linear: x {list(x.shape)} and weight {list(w.shape)} do not fit "
                         f"{groups} groups")
    out_g = w.shape[0] // groups
    wg = GGMLTensor(w.raw.view(groups, out_g, w.row_bytes), w.qtype, (groups, out_g, kin))
    ids = torch.arange(groups, device=x.device, dtype=torch.int32).repeat(t)
    y = _launch(x.reshape(t * g, kin), wg, ids, 1, t * g, t, config, force)
    return y.reshape(t, g, out_g)


# ---- benchmark (GPU): python -m ds4x.kernels.quant_matmul ---------------------------------------

_BENCH_CASES = (  # (what, type, N, K, skinny M=64 too): DeepSeek-V4-Flash shapes, most wanted first
    ("expert gate 4096->2048", T.IQ2_XXS, 2048, 4096, False),
    ("expert down 2048->4096", T.Q2_K, 4096, 2048, False),
    ("attn wo_b 8192->4096", T.Q8_0, 4096, 8192, True),
    ("attn wq_a 4096->1024", T.Q8_0, 1024, 4096, False),
    ("attn wq_b 1024->32768", T.Q8_0, 32768, 1024, False),
    ("expert gate 4096->2048", T.Q4_K, 2048, 4096, False),
)
_MV_CONFIGS = {  # (BN, BK, num_warps[, IQ2 sign table])
    T.Q8_0: ((4, 1024, 4), (8, 1024, 4)),
    T.Q2_K: ((4, 1024, 4), (8, 1024, 8)),
    T.Q4_K: ((4, 1024, 4),),
    T.IQ2_XXS: ((4, 1024, 4, True), (4, 1024, 4, False)),
}


def _bench(out_json: str | None = None, deadline_s: float = 1e9) -> int:  # pragma: no cover - needs a GPU
    """Parity and timing of every case; no new case starts after ``deadline_s`` seconds."""
    import json
    import time

    from triton.testing import do_bench

    from ds4x.formats.ggml import random_blocks

    t_start = time.perf_counter()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict[str, Any]] = []

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    def copy_bandwidth() -> float:
        src = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
        return 2 * src.numel() / (ms * 1e-3) / 1e9

    copy_bw = copy_bandwidth()
    log(f"{torch.cuda.get_device_name()} copy bandwidth {copy_bw:.0f} GB/s (read + write of 1 GiB)")

    def timed(fns: list, nbytes: int) -> tuple[float, float]:
        # every call reads its own weight copy (no L2 reuse); one CUDA graph of all calls, median
        for f in fns:
            f()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        ms = do_bench(graph.replay, warmup=20, rep=100, return_mode="median") / len(fns)
        return ms * 1e3, nbytes / (ms * 1e-3) / 1e9

    def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
        if not torch.isfinite(y).all():
            return float("nan")
        return float((y.double() - ref).norm() / ref.norm())

    def record(**kw: Any) -> None:
        rows.append(kw)
        if "us" in kw:
            log(f"{kw['qtype']:8} {kw['what']:24} M={kw['m']:<3} {kw['kernel']:10} {str(kw['config']):16} "
                f"{kw['us']:8.2f} us {kw['gbs']:7.0f} GB/s {kw['frac']:6.1%}  err {kw['err']:.1e}")
        else:
            log(f"{kw['qtype']:8} {kw['what']:24} {kw['kernel']}: {kw.get('error', '')}")

    for what, qt, n, k, skinny in _BENCH_CASES:
        if time.perf_counter() - t_start > deadline_s:
            record(qtype=qt.name, what=what, kernel="SKIPPED", error="deadline")
            continue
        try:
            one = random_blocks(qt, (n, k), gen, std=0.02)
            nbytes_w = one.numel()
            copies = max(2, min(64, (256 << 20) // nbytes_w))
            ws = [GGMLTensor(random_blocks(qt, (n, k), gen, std=0.02), qt, (n, k)) for _ in range(copies)]
            wd = ws[0].dequantize().double()
            # parity: matvec (fp32), skinny (tf32 and bf16), fresh random inputs each
            x1 = torch.randn(1, k, device=dev, generator=gen)
            e_mv = rel(quant_linear(x1, ws[0], force="mv"), x1.double() @ wd.T)
            x16 = torch.randn(16, k, device=dev, generator=gen)
            e_mm = rel(quant_linear(x16, ws[0], force="mm"), x16.double() @ wd.T)
            xb = torch.randn(64 if skinny else 16, k, device=dev, generator=gen).bfloat16()
            e_bf = rel(quant_linear(xb, ws[0], force="mm"), xb.double() @ wd.T)
            log(f"{qt.name} {what}: parity mv fp32 {e_mv:.1e}, mm tf32 {e_mm:.1e}, mm bf16 {e_bf:.1e}")
            ok = e_mv < 1e-5 and e_mm < 3e-3 and e_bf < 2e-2
            if not ok:
                record(qtype=qt.name, what=what, kernel="PARITY", error=f"FAILED {e_mv} {e_mm} {e_bf}")
            best = None
            for full in _MV_CONFIGS[qt]:
                cfg, tb = full[:3], (full[3] if len(full) > 3 else None)
                x = torch.randn(1, k, device=dev, generator=gen)
                y = quant_linear(x, ws[1], config=cfg, force="mv", table=tb)
                err = rel(y, x.double() @ ws[1].dequantize().double().T)
                us, gbs = timed([lambda w=w, x=x, c=cfg, tb=tb: quant_linear(x, w, config=c, force="mv", table=tb)
                                 for w in ws], nbytes_w + 4 * (k + n))
                record(qtype=qt.name, what=what, m=1, kernel="matvec", config=full, us=us, gbs=gbs,
                       frac=gbs / copy_bw, err=err)
                if best is None or us < best[0]:
                    best = (us, cfg, tb)
            for m in (64,) if skinny else ():
                x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
                err = rel(quant_linear(x, ws[1], force="mm"), x.double() @ ws[1].dequantize().double().T)
                us, gbs = timed([lambda w=w, x=x: quant_linear(x, w, force="mm") for w in ws[: max(2, copies // 2)]],
                                nbytes_w + 2 * m * (k + n))
                record(qtype=qt.name, what=what, m=m, kernel="skinny-bf16", config=matmul_config(qt, m, n, k),
                       us=us, gbs=gbs, frac=gbs / copy_bw, err=err)
            if what.startswith("expert") and qt != T.Q4_K:
                n_exp = 256
                experts = GGMLTensor(random_blocks(qt, (n_exp, n, k), gen, std=0.02), qt, (n_exp, n, k))
                x = torch.randn(1, k, device=dev, generator=gen)
                id_sets = [torch.randperm(n_exp, device=dev, generator=gen)[:6].view(1, 6).int() for _ in range(16)]
                y = quant_matmul_routed(x, experts, id_sets[0], config=best[1], table=best[2])
                ref = torch.stack([x[0].double() @ experts[int(e)].dequantize().double().T for e in id_sets[0][0]])
                err = rel(y[0], ref)
                us, gbs = timed([lambda i=i, x=x, e=experts, c=best[1], tb=best[2]:
                                 quant_matmul_routed(x, e, i, config=c, table=tb) for i in id_sets],
                                6 * nbytes_w + 4 * (k + 6 * n))
                record(qtype=qt.name, what=what + " x6 routed", m=1, kernel="routed-mv", config=(*best[1], best[2]),
                       us=us, gbs=gbs, frac=gbs / copy_bw, err=err)
                del experts
            del ws
            torch.cuda.empty_cache()
        except Exception as exc:  # keep measuring the other cases
            record(qtype=qt.name, what=what, kernel="ERROR", error=f"{type(exc).__name__}: {exc}"[:300])
    print("\n| type | case | M | kernel | config | us | GB/s | of copy | rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "us" in r:
            print(f"| {r['qtype']} | {r['what']} | {r['m']} | {r['kernel']} | {r['config']} | {r['us']:.2f} | "
                  f"{r['gbs']:.0f} | {r['frac']:.1%} | {r['err']:.1e} |")
        else:
            print(f"| {r['qtype']} | {r['what']} | | {r['kernel']} | {r.get('error', '')} | | | | |")
    print(f"copy bandwidth {copy_bw:.0f} GB/s; triton {triton.__version__}, torch {torch.__version__}; "
          f"total {time.perf_counter() - t_start:.0f} s")
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"copy_gbs": copy_bw, "rows": rows, "gpu": torch.cuda.get_device_name()}, f, indent=1,
                      default=str)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_bench(sys.argv[1] if len(sys.argv) > 1 else None, float(sys.argv[2]) if len(sys.argv) > 2 else 1e9))
