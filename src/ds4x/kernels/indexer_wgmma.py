"""Indexer scoring from packed MXFP4 rows on Hopper tensor cores (Gluon, sm_90).

The same scores as `ds4x.kernels.triton_indexer.score_kernel` (exact operands, see `ds4x.kernels.indexer`; only
the float32 accumulation order inside the tensor core differs), with the data movement written out: a lane reads
the four words of one 32-value block of a row (so a block's scale is worked out once), decodes each word into E4M3
bytes (FP8_KEYS, the default: 8 bytes a word, by a table of the block's magnitudes) or fp16 pairs (four 32-bit
pairs) in row order and stores them with 16-byte stores into the key tile, and one ``wgmma`` multiplies the tile
[rows, 128] by the query [128, 64 heads] held in shared memory for the program's whole walk (PIPELINED, the
default: two 64-row key tiles, each tile's product running while the next is decoded; else one 128-row tile). The
Triton kernel moves the words and the decoded values through shared memory one 2-byte value at a time (its layouts
are the compiler's choice).

What bounds it (ncu, H100, 262,144 rows, at 84492d5's parent): the L1 / shared-memory pipe (L1/TEX 80% busy) at
0.47 instructions issued per scheduler. The row loads use 10.7 of each 32-byte sector a lane's load brings (a
warp's 4-byte loads span 8 rows), and the key stores had 2.4 times the wavefronts they need (fixed: the lanes'
order, see ``LW``). Fewer instructions alone did not help: one asm per word for the four pairs (the 32 masks after
the permutes gone, the query's elements permuted to match) and the rows' scales loaded again in the product's
layout (no convert through shared memory) were each 0.8-0.9 us slower (H100, not kept).

Two row tiles in flight per program instead of one (the words of the tile after next loaded too; 170 registers,
capped at 168 so that three programs stay on an SM) measured slower and were removed (H100, b82c8c3,
`scripts/compressed_kernels_ab.py`, 262,144 rows, us at 2 / 3 programs an SM: one tile ahead 16.7 / 16.6, two
17.9-18.1; the same bits): more bytes in flight is not what the kernel lacks.

Needs CUDA capability 9.x and Triton's Gluon; ``available`` says whether a call can run here.
"""

from __future__ import annotations

import torch

from ds4x.formats.triton_mode import HAVE_TRITON, interpret_mode

try:  # Gluon is experimental in Triton 3.x; without it the callers use the Triton kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAVE_GLUON = HAVE_TRITON
except Exception:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

BLOCK_N = 128  # rows per tile
WARPS = 4
# PIPELINED: two key tiles; each tile's product is issued asynchronously and the next tile is decoded into the other
# key tile while it runs (the default kernel waits for each product before it decodes the next tile). Tiles of
# PIPELINED_BLOCK_N rows: at 64, 96 registers and 48 KB of shared memory with the query (four programs an SM fit; the
# default: 130 and 48 KB, three), at 128 166 and 80 KB (two); offline sm_90, all eight wgmma steps of a tile issued
# back to back as in the default. H100, `scripts/compressed_kernels_ab.py --parts indexer` (9fded58), 262,144 rows,
# best of two, us: one tile 16.8 at 2 programs an SM, 16.5 at 3; pipelined 64 rows 16.1 at 3, 16.5 at 4; 128 rows
# 16.4 at 2; the same bits.
PIPELINED = True
PIPELINED_BLOCK_N = 64
# FP8_KEYS: keys and query as E4M3 and the product as an 8-bit wgmma (K 32 a step). Every E2M1 value is an E4M3
# value; a key block scaled relative to its row's largest scale (2^(s - s_max + 6), at most 384) and a query head
# relative to its largest value (into [128, 256)) stay exact while a block lies within 2^14 of its row's largest
# (2^12 of a head's) -- the fp16 operands' reach is 2^24. Half the key tile's bytes in shared memory (stores and the
# product's reads) and a byte-permute decode (a table of the block's 8 magnitudes, then two prmt a word half)
# instead of paired fp16 multiplies. Each K step's products (one 32-value block: integers below 2^13 times one power
# of two) are exact in the tensor core; their sum across blocks is added in float32 (Triton's
# max_num_imprecise_acc = 32), since the tensor core's own accumulation across steps is narrower: without it rows
# whose block scales lie 2^13 apart scored 1e-4 off (GPU test), though Hadamard-rotated rows gave the fp16 bits.
# Measured (H100, 726c635), us, the rows in L2 / from DRAM (`compressed_kernels_ab.py --parts indexer`) and the
# frontier's indexer at 1M (`ds4x bench frontier --weights q2 --experts 128 --contexts 1048576`): fp16 pipelined
# 64 rows, 3 an SM 14.7 / 16.7, 17.5; E4M3 the same 14.3 / 15.5, 16.1 (41 layers 1.395 -> 1.368 ms); E4M3 128 rows
# 21.7 (3 an SM), 17.2 (2); without the float32 sums 13.0 / 15.1 (64 rows) and 12.4 / 14.6, 15.3 (128 rows, 3).
# Same scores as fp16 operands wherever both are exact (every Hadamard-rotated test row). The float32 sums make each
# K step wait for its product (ptxas C7517), so PIPELINED no longer runs the product beside the next tile's decode
# with E4M3 operands; it measured faster than the fp16 pipeline all the same. Not kept: E5M2 keys by bit moves alone
# (E2M1 x 2^-14, no table, no scale in the bytes), each block's K=32 product scaled into float32 by its 2^(s - smax)
# (reach 2^100): 453 instructions a tile against 469 offline, but 166 registers, and slower (H100, 4adf64c, the
# same bits, us in L2 / from DRAM: 15.0 / 15.8 against 14.3 / 15.5; at 4 programs an SM 19.0 / 20.1)
FP8_KEYS = True
# Not kept: a program's first two tiles' rows loaded right after the upstream wait, before the query is loaded, scaled
# and stored (d8246bd, reverted; offline sm_90 the rows' loads then went out beside the query's instead of after its
# barrier). The same bits, but slower where it counts: the frontier's indexer (H100, `--weights q2 --experts 128`, two
# rounds) 16.1, 16.2 -> 16.6, 16.5 us at 1M, 3.3 -> 3.2 at 4K


def block_rows() -> int:
    """Rows per tile of the kernel as configured now."""
    return PIPELINED_BLOCK_N if PIPELINED else BLOCK_N


if HAVE_GLUON:
    from ds4x.formats.pdl import wait_upstream

    # Triton helpers: elementwise, so Gluon code may call them
    from ds4x.kernels.triton_indexer import exp2_f32, first_digit

    @gluon.jit
    def _scale_pair(e):
        # 2^e as two equal fp16 halves of one word, for integer e <= 15: subnormal down to 2^-24, 0 below
        normal = (gl.maximum(e, -14) + 15) << 10
        sub = 1 << gl.minimum(gl.maximum(e + 24, 0), 15)
        bits = gl.where(e >= -14, normal, gl.where(e >= -24, sub, 0))
        return bits | (bits << 16)

    @gluon.jit
    def _pairs(word, s, j: gl.constexpr):
        # pair j of a word of 8 E2M1 codes (byte j: elements 2j, 2j + 1) as two fp16 values E2M1 x 2^-14 x s: the
        # nibbles' sign and magnitude bits moved to fp16 bits 15 and 9..11 of each half, then one paired multiply
        return gl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 la, ua, t;
            shl.b32 la, $1, 4;  and.b32 la, la, 0x80808080;
            shl.b32 t, $1, 1;   and.b32 t, t, 0x0E0E0E0E;  or.b32 la, la, t;
            and.b32 ua, $1, 0x80808080;
            shr.b32 t, $1, 3;   and.b32 t, t, 0x0E0E0E0E;  or.b32 ua, ua, t;
            prmt.b32 $0, la, ua, $3;  and.b32 $0, $0, 0xFF00FF00;  mul.rn.f16x2 $0, $0, $2;
            }
            """,
            constraints="=r,r,r,r",
            args=[word, s, gl.full_like(word, 0x4000 + 0x1010 * j)],
            dtype=gl.int32,
            is_pure=True,
            pack=1,
        )

    @gluon.jit
    def _e4m3_table(d):
        # the E4M3 bytes of the 8 E2M1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6) times 2^d, entries 0-3 and 4-7 as two
        # words (d <= 6: no saturation; 0 for d < -126)
        return gl.inline_asm_elementwise(
            asm="""
            {
            .reg .pred u;  .reg .b32 f, z, a, b, c;  .reg .b16 p, q, r, s;
            setp.lt.s32 u, $2, -126;  add.s32 f, $2, 127;  shl.b32 f, f, 23;  selp.b32 f, 0, f, u;
            mov.b32 z, 0;
            mul.f32 a, f, 0f3F000000;  cvt.rn.satfinite.e4m3x2.f32 p, a, z;
            mul.f32 a, f, 0f3FC00000;  cvt.rn.satfinite.e4m3x2.f32 q, a, f;
            add.f32 a, f, f;  mul.f32 b, f, 0f40400000;  cvt.rn.satfinite.e4m3x2.f32 r, b, a;
            mul.f32 b, f, 0f40800000;  mul.f32 c, f, 0f40C00000;  cvt.rn.satfinite.e4m3x2.f32 s, c, b;
            mov.b32 $0, {p, q};  mov.b32 $1, {r, s};
            }
            """,
            constraints="=r,=r,r",
            args=[d],
            dtype=(gl.int32, gl.int32),
            is_pure=True,
            pack=1,
        )

    @gluon.jit
    def _e4m3_codes(word, t0, t1):
        # a word of 8 E2M1 codes (byte j: elements 2j, 2j + 1) as 8 E4M3 bytes in element order, two words: each
        # nibble's magnitude looked up in the table {t1, t0} by one byte permute per 4 codes, its sign bit moved to
        # bit 7 of its byte
        return gl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 m, g, h;
            and.b32 m, $2, 0x7777;  prmt.b32 m, $3, $4, m;
            prmt.b32 g, $2, 0, 0x1100;  and.b32 h, g, 0x00080008;  shl.b32 h, h, 4;  and.b32 g, g, 0x80008000;
            or.b32 m, m, g;  or.b32 $0, m, h;
            shr.u32 m, $2, 16;  and.b32 m, m, 0x7777;  prmt.b32 m, $3, $4, m;
            prmt.b32 g, $2, 0, 0x3322;  and.b32 h, g, 0x00080008;  shl.b32 h, h, 4;  and.b32 g, g, 0x80008000;
            or.b32 m, m, g;  or.b32 $1, m, h;
            }
            """,
            constraints="=r,=r,r,r,r",
            args=[word, t0, t1],
            dtype=(gl.int32, gl.int32),
            is_pure=True,
            pack=1,
        )

    @gluon.jit
    def _load_tile(tile, rows_ptr, n_rows, BN: gl.constexpr, LW: gl.constexpr):
        # a tile's code words [rows, 4 blocks, 4 words] (a lane holds one block of a row) and its scale words [rows]
        # (rows past n_rows: zero codes)
        RL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LW))
        r = tile * BN + gl.arange(0, BN, layout=RL)
        ok = r < n_rows
        base = rows_ptr + r.to(gl.int64) * 17
        blk = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))[None, :, None]
        wi = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))[None, None, :]
        at = base[:, None, None] + 4 * blk + wi
        return (gl.load(at, mask=ok[:, None, None] & (blk >= 0) & (wi >= 0), other=0),
                gl.load(base + 16, mask=ok, other=0x7F7F7F7F))

    @gluon.jit
    def _largest_scale(sw):
        # the largest of each row's four block scale bytes
        return gl.maximum(gl.maximum(sw & 255, (sw >> 8) & 255), gl.maximum((sw >> 16) & 255, (sw >> 24) & 255))

    @gluon.jit
    def _key_pairs(words, sw, smax, LW: gl.constexpr):
        """A tile's keys as fp16 pairs [rows, 64] in row order, each block scaled relative to its row's largest scale
        byte ``smax`` [rows]."""
        BN: gl.constexpr = words.shape[0]
        blk8 = 8 * gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))[None, :]
        # each block's scale relative to the row's, as an fp16 pair [rows, 4, 1]
        s = gl.expand_dims(_scale_pair(15 - (smax[:, None] - ((sw[:, None] >> blk8) & 255))), 2) + 0 * words
        # the four pairs of each word side by side: row order, 16 bytes a lane per word
        return gl.reshape(gl.join(gl.join(_pairs(words, s, 0), _pairs(words, s, 2)),
                                  gl.join(_pairs(words, s, 1), _pairs(words, s, 3))), [BN, 64])

    @gluon.jit
    def _key_bytes(words, sw, smax, LW: gl.constexpr):
        """A tile's keys as E4M3 [rows, 32 words] in row order, each block scaled by 2^(s - smax + 6) (see
        FP8_KEYS)."""
        BN: gl.constexpr = words.shape[0]
        blk8 = 8 * gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))[None, :]
        t0, t1 = _e4m3_table(((sw[:, None] >> blk8) & 255) - smax[:, None] + 6)
        lo, hi = _e4m3_codes(words, gl.expand_dims(t0, 2) + 0 * words, gl.expand_dims(t1, 2) + 0 * words)
        return gl.reshape(gl.join(lo, hi), [BN, 32])

    @gluon.jit
    def _tile_keys(keys, words, sw, LW: gl.constexpr, decode, FP8: gl.constexpr):
        """Decode a tile into the shared key tile ``keys`` (when ``decode``; the product that last read it has
        been waited for by every warp) and return its rows' largest scale bytes. FP8: E4M3 keys, else fp16."""
        BN: gl.constexpr = words.shape[0]
        SH32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        smax = _largest_scale(sw)
        if decode:
            if FP8:
                key_words = _key_bytes(words, sw, smax, LW)
            else:
                key_words = _key_pairs(words, sw, smax, LW)
            gl.thread_barrier()
            keys._reinterpret(gl.int32, [BN, 32 if FP8 else 64], SH32).store(key_words)
        fence_async_shared()
        gl.thread_barrier()
        return smax

    @gluon.jit
    def _scores_product(keys, q_smem, acc, zero, FP8: gl.constexpr, ASYNC: gl.constexpr):
        # keys [rows, 128] x the query -> [rows, heads], into acc's registers (its value unused). FP8: each K step of
        # 32 added into float32 (Triton's max_num_imprecise_acc); that sum starts from the accumulator given whatever
        # use_acc says (measured: the previous tile's scores came through), so from zeros
        if FP8:
            return warpgroup_mma(keys, q_smem.permute((1, 0)), zero, max_num_imprecise_acc=32, is_async=ASYNC)
        else:
            return warpgroup_mma(keys, q_smem.permute((1, 0)), acc, use_acc=False, is_async=ASYNC)

    @gluon.jit
    def _thread_index(like):
        # the thread's index in the program, as a tensor shaped and laid out as ``like``
        return gl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [like.to(gl.int32)], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _shared_bins(BINS: gl.constexpr, num_warps: gl.constexpr):
        # the program's histogram bins (BINS <= 256 words of static shared memory, declared here: once per kernel),
        # zeroed -> their shared address
        gl.static_assert(BINS <= 256, "the first level's bins: at most 256")
        BL: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        at = gl.inline_asm_elementwise(".shared .align 16 .b32 ds4x_index_bins[256];\n\t"
                                       "mov.u32 $0, ds4x_index_bins;", "=r,r", [gl.full([1], 0, gl.int32, BL)],
                                       dtype=gl.int32, is_pure=False, pack=1)
        base = gl.max(at, axis=0)
        b = gl.arange(0, BINS, layout=BL)
        gl.inline_asm_elementwise("st.shared.u32 [$1], 0;\n\tmov.u32 $0, 0;", "=r,r", [base + 4 * b],
                                  dtype=gl.int32, is_pure=False, pack=1)
        gl.thread_barrier()
        return base

    @gluon.jit
    def _count_digits(bins, score, r, n_rows, BITS: gl.constexpr, num_warps: gl.constexpr):
        # the scores' first radix digits (`first_digit`) counted into the shared ``bins``, each row once: in a layout
        # of one row a thread, which repeats a tile of fewer rows than threads in the threads past its length
        BN: gl.constexpr = score.shape[0]
        BL: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        digit = first_digit(gl.convert_layout(score, BL), BITS)
        rows = gl.convert_layout(r, BL)
        live = ((rows < n_rows) & (_thread_index(rows) < BN)).to(gl.int32)
        gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p red.shared.add.u32 [$1], 1; "
                                  "mov.u32 $0, 0; }", "=r,r,r", [bins + 4 * digit, live], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _flush_bins(bins, hist_ptr, BINS: gl.constexpr, num_warps: gl.constexpr):
        # the program's counts added to the row's histogram in global memory (most bins stay empty)
        BL: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        gl.thread_barrier()
        b = gl.arange(0, BINS, layout=BL)
        h = gl.inline_asm_elementwise("ld.shared.u32 $0, [$1];", "=r,r", [bins + 4 * b], dtype=gl.int32,
                                      is_pure=False, pack=1)
        gl.atomic_add(hist_ptr + b, h, mask=h > 0, sem="relaxed")

    @gluon.jit
    def _store_scores(acc, smax, wq, tile, out_ptr, n_rows, bins, HIST_BITS: gl.constexpr, KD: gl.constexpr):
        # acc = (q . k) * 2^(127 + KD - smax) * 2^(QD - e_h) (the keys' and query's scalings; wq holds the second);
        # both powers of two commute with the ReLU. HIST_BITS: the scores' first radix digits counted into ``bins``
        BN: gl.constexpr = acc.shape[0]
        ACC: gl.constexpr = acc.type.layout
        row_scale = gl.convert_layout(exp2_f32(smax - 127 - KD), gl.SliceLayout(1, ACC))
        score = gl.sum(gl.maximum(acc, 0.0) * wq[None, :], axis=1) * row_scale
        r = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
        gl.store(out_ptr + r, score, mask=r < n_rows)
        if HIST_BITS > 0:
            _count_digits(bins, score, r, n_rows, HIST_BITS, gl.num_warps())

    # counts change from call to call (prefill chunks): not specialized, as in triton_indexer (measured: a 16K
    # prefill compiled a second variant for 0.6 s in its timed part when the row count became a multiple of 16)
    @gluon.jit(do_not_specialize=["n_rows", "n_iter", "n_prog"])
    def score_kernel(q_ptr, w_ptr, rows_ptr, rows_stride, out_ptr, n_rows, count_ptr, count_stride, n_iter, n_prog,
                     scale, hist_ptr, hist_stride, H: gl.constexpr, DEVICE_COUNT: gl.constexpr,
                     num_warps: gl.constexpr, BN: gl.constexpr = BLOCK_N, PIPELINED: gl.constexpr = False,
                     PDL: gl.constexpr = False, HIST_BITS: gl.constexpr = 0, FP8: gl.constexpr = False):
        """Program (persistent over row tiles, query): as triton_indexer.score_kernel with PERSISTENT (HIST_BITS
        too). PIPELINED, FP8: see the module's switches PIPELINED, FP8_KEYS."""
        wait_upstream(PDL)
        bins = 0
        if HIST_BITS > 0:
            bins = _shared_bins(1 << HIST_BITS, num_warps)
        HP: gl.constexpr = 64
        # [rows, 4 blocks, 4 words]: a lane holds one block of a row; a warp's lanes run over 8 rows first, so that
        # each quarter-warp's 16-byte key stores (8 rows, one block) fall in 8 different bank groups of the 128-byte
        # swizzle (with 2 rows x 4 blocks, blocks b and b + 2 of a row shared a group: ncu counted 9.7 wavefronts a
        # store request; H100, 262,144 rows, 15.8 -> 14.7 us, the same bits). Lanes over fewer rows (one word a
        # lane: 2 rows a warp's load) and the rows loaded flat in 16-byte pieces through shared memory were each
        # slower (21.0 and 16.7-18.9 us; docs/PROFILE.md, eighteenth session)
        LW: gl.constexpr = gl.BlockedLayout([1, 1, 4], [8, 4, 1], [num_warps, 1, 1], [2, 0, 1])
        LQ: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])  # [64 heads, 128]
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HP, 32 if FP8 else 16])
        KD: gl.constexpr = 6 if FP8 else 1  # keys: E2M1 x 2^(s - smax + KD)
        QD: gl.constexpr = 7 if FP8 else 14  # query heads: values x 2^(QD - e_h), e_h its largest's exponent
        KT: gl.constexpr = gl.float8e4nv if FP8 else gl.float16
        SHK: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8 if FP8 else 16, rank=2)

        pid = gl.program_id(0)
        t = gl.program_id(1).to(gl.int64)
        q_ptr += t * H * 128
        rows_ptr += t * rows_stride
        w_ptr += t * H
        out_ptr += t * n_rows
        hist_ptr += t * hist_stride
        if DEVICE_COUNT:
            n_rows = gl.minimum(gl.load(count_ptr + t * count_stride).to(gl.int32), n_rows)

        # the query, per head scaled by 2^(QD - e_h) into the keys' type (exact for MXFP4 values), into shared
        # memory once
        h = gl.arange(0, HP, layout=gl.SliceLayout(1, LQ))
        kq = gl.arange(0, 128, layout=gl.SliceLayout(0, LQ))
        q = gl.load(q_ptr + h[:, None] * 128 + kq[None, :], mask=(h < H)[:, None] & (kq >= 0)[None, :], other=0.0)
        qmax = gl.max(gl.abs(q), axis=1)
        e_h = gl.where(qmax > 0, ((qmax.to(gl.int32, bitcast=True) >> 23) & 255) - 127, 0)
        e_h = gl.minimum(gl.maximum(e_h, -110), 127)
        q_smem = gl.allocate_shared_memory(KT, [HP, 128], SHK)
        q_smem.store((q * exp2_f32(QD - e_h)[:, None]).to(KT))
        hw = gl.arange(0, HP, layout=gl.SliceLayout(0, ACC))
        e_w = gl.convert_layout(e_h, gl.SliceLayout(0, ACC))
        wq = gl.load(w_ptr + hw, mask=hw < H, other=0.0) * scale * exp2_f32(e_w - QD)
        zero = gl.zeros([BN, HP], gl.float32, ACC)
        if PIPELINED:
            # tile i's product runs while tile i + 1 is decoded into the other key tile. One accumulator, waited
            # for before the scores are formed: with two (tile i's scores formed while tile i + 1's product ran),
            # ptxas found one's registers read inside the other's wgmma stage (LLVM's copies of the initial zeros)
            # and waited after every wgmma step
            k_smem = gl.allocate_shared_memory(KT, [2, BN, 128], SHK)
            n_mine = gl.maximum(gl.cdiv(gl.cdiv(n_rows, BN) - pid, n_prog), 0)  # this program's tiles with rows
            if n_mine > 0:
                words, sw = _load_tile(pid, rows_ptr, n_rows, BN, LW)
                next_words, next_sw = _load_tile(pid + n_prog, rows_ptr, n_rows, BN, LW)
                smax = _tile_keys(k_smem.index(0), words, sw, LW, True, FP8)
                acc = zero
                for i in range(n_mine):
                    acc = _scores_product(k_smem.index(i % 2), q_smem, acc, zero, FP8, True)
                    words, sw = next_words, next_sw
                    smax_next = _tile_keys(k_smem.index((i + 1) % 2), words, sw, LW, i + 1 < n_mine, FP8)
                    # loaded after the keys' fence: on sm_90 it is a MEMBAR.ALL.CTA, which by the timings waits for
                    # the thread's loads in flight (loaded before it, 3% slower); issued here they stay in flight
                    # across the product's wait and the scores
                    next_words, next_sw = _load_tile(pid + (i + 2) * n_prog, rows_ptr, n_rows, BN, LW)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    _store_scores(acc, smax, wq, pid + i * n_prog, out_ptr, n_rows, bins, HIST_BITS, KD)
                    smax = smax_next
        else:
            k_smem = gl.allocate_shared_memory(KT, [BN, 128], SHK)
            words, sw = _load_tile(pid, rows_ptr, n_rows, BN, LW)
            for it in range(n_iter):
                tile = pid + it * n_prog
                # in flight while this one is scored
                next_words, next_sw = _load_tile(tile + n_prog, rows_ptr, n_rows, BN, LW)
                if tile * BN < n_rows:  # uniform: the programs' last tiles may lie past the rows
                    smax = _tile_keys(k_smem, words, sw, LW, True, FP8)
                    acc = _scores_product(k_smem, q_smem, zero, zero, FP8, False)
                    _store_scores(acc, smax, wq, tile, out_ptr, n_rows, bins, HIST_BITS, KD)
                words = next_words
                sw = next_sw
        if HIST_BITS > 0:
            _flush_bins(bins, hist_ptr, 1 << HIST_BITS, num_warps)


def available(q: torch.Tensor, heads: int) -> bool:
    """Whether the kernel serves this query: CUDA on an sm_90 GPU with Gluon (not the interpreter), at most 64
    heads."""
    return (HAVE_GLUON and not interpret_mode() and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
            and heads <= 64)
