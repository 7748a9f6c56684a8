"""Indexer scoring from packed MXFP4 rows on Hopper tensor cores (Gluon, sm_90).

The same scores as `ds4x.kernels.triton_indexer.score_kernel` (same exact fp16 operands, see
`ds4x.kernels.indexer`; only the float32 accumulation order inside the tensor core differs), with the data
movement written out: a lane reads the four words of one 32-value block of a row (so a block's scale is worked
out once), decodes each word into four 32-bit pairs of fp16 values in row order and stores them with 16-byte
stores into the key tile, and one ``wgmma`` multiplies the tile [128 rows, 128] by the query [128, 64 heads]
held in shared memory for the program's whole walk. The Triton kernel moves the words and the decoded values
through shared memory one 2-byte value at a time (its layouts are the compiler's choice).

Two row tiles in flight per program instead of one (the words of the tile after next loaded too; 170 registers,
capped at 168 so that three programs stay on an SM) measured slower and were removed (H100, b82c8c3,
`scripts/compressed_kernels_ab.py`, 262,144 rows, us at 2 / 3 programs an SM: one tile ahead 16.7 / 16.6, two
17.9-18.1; the same bits): more bytes in flight is not what the kernel lacks.

``score_regs_kernel`` (behind ``REGISTER_KEYS``, not yet timed on a GPU) skips the key tile's trip through shared
memory: each thread decodes its rows' words straight into the registers of the wgmma A operand (the query's
columns permuted to match, see the kernel), so a tile costs no shared-memory stores and no barriers, and the
tensor cores read only the query from shared memory. Compiled offline for sm_90 (`scripts/kernel_sass.py indexer
--regs`): 339 instructions per 64-row tile per thread against 732 per 128-row tile for ``score_kernel`` (which
also stores 32 KB and crosses three barriers a tile), no local memory.

Needs CUDA capability 9.x and Triton's Gluon; ``available`` says whether a call can run here.
"""

from __future__ import annotations

import functools

import torch

from ds4x.formats.triton_mode import HAVE_TRITON, interpret_mode

try:  # Gluon is experimental in Triton 3.x; without it the callers use the Triton kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    HAVE_GLUON = HAVE_TRITON
except Exception:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

BLOCK_N = 128  # rows per tile
WARPS = 4
# score_regs_kernel (keys decoded into the product's registers) instead of score_kernel; its rows per tile,
# persistent programs per SM, and whether the product overlaps the next tile's decode. Off until timed on the GPU
# (`scripts/compressed_kernels_ab.py --parts indexer` A/Bs both kernels); the defaults here are a first guess
# from the register counts (sm_90, offline: 105 registers at 64 rows, 185 at 128, 122 pipelined at 64; 108 at
# 256 rows on 16 warps)
REGISTER_KEYS = False
REGS_BLOCK_N = 64
REGS_PROGRAMS_PER_SM = 4
REGS_PIPELINE = False
REGS_WARPS = 4  # 16: one program an SM (4 warpgroups, 64 rows each per tile) loads the query once


if HAVE_GLUON:
    from ds4x.formats.pdl import wait_upstream
    from ds4x.kernels.triton_indexer import exp2_f32  # a Triton helper: elementwise, so Gluon code may call it

    _BLOCK_N = gl.constexpr(BLOCK_N)

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
    def _word_pairs(word, s):
        # the four pairs of a word of 8 E2M1 codes (pair j: byte j, elements 2j, 2j + 1) as in _pairs, the bytes of
        # the high parts interleaved once and the zero low bytes taken from a zero register (no masking per pair)
        return gl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 la, ua, t, lu0, lu1, z;
            mov.b32 z, 0;
            shl.b32 la, $4, 4;  and.b32 la, la, 0x80808080;
            shl.b32 t, $4, 1;   and.b32 t, t, 0x0E0E0E0E;  or.b32 la, la, t;
            and.b32 ua, $4, 0x80808080;
            shr.b32 t, $4, 3;   and.b32 t, t, 0x0E0E0E0E;  or.b32 ua, ua, t;
            prmt.b32 lu0, la, ua, 0x5140;  prmt.b32 lu1, la, ua, 0x7362;
            prmt.b32 $0, lu0, z, 0x1404;  mul.rn.f16x2 $0, $0, $5;
            prmt.b32 $1, lu0, z, 0x3424;  mul.rn.f16x2 $1, $1, $5;
            prmt.b32 $2, lu1, z, 0x1404;  mul.rn.f16x2 $2, $2, $5;
            prmt.b32 $3, lu1, z, 0x3424;  mul.rn.f16x2 $3, $3, $5;
            }
            """,
            constraints="=r,=r,=r,=r,r,r",
            args=[word, s],
            dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
            is_pure=True,
            pack=1,
        )

    @gluon.jit
    def _load_tile(tile, rows_ptr, n_rows, LW: gl.constexpr, BN: gl.constexpr):
        # a tile's code words [BN rows, 4 blocks, 4 words] (a lane holds one block of a row) and its scale words
        # [rows] (rows past n_rows: zero codes)
        RL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LW))
        r = tile * BN + gl.arange(0, BN, layout=RL)
        ok = r < n_rows
        base = rows_ptr + r.to(gl.int64) * 17
        blk = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))[None, :, None]
        wi = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))[None, None, :]
        at = base[:, None, None] + 4 * blk + wi
        return (gl.load(at, mask=ok[:, None, None] & (blk >= 0) & (wi >= 0), other=0),
                gl.load(base + 16, mask=ok, other=0x7F7F7F7F))

    # counts change from call to call (prefill chunks): not specialized, as in triton_indexer (measured: a 16K
    # prefill compiled a second variant for 0.6 s in its timed part when the row count became a multiple of 16)
    @gluon.jit(do_not_specialize=["n_rows", "n_iter", "n_prog"])
    def score_kernel(q_ptr, w_ptr, rows_ptr, rows_stride, out_ptr, n_rows, count_ptr, count_stride, n_iter, n_prog,
                     scale, H: gl.constexpr, DEVICE_COUNT: gl.constexpr, num_warps: gl.constexpr,
                     PDL: gl.constexpr = False):
        """Program (persistent over row tiles, query): as triton_indexer.score_kernel with PERSISTENT."""
        wait_upstream(PDL)
        HP: gl.constexpr = 64
        LW: gl.constexpr = gl.BlockedLayout([1, 1, 4], [8, 4, 1], [num_warps, 1, 1], [2, 1, 0])  # [rows, 4, 4] words
        LQ: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])  # [64 heads, 128]
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HP, 16])
        SH16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SH32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)

        pid = gl.program_id(0)
        t = gl.program_id(1).to(gl.int64)
        q_ptr += t * H * 128
        rows_ptr += t * rows_stride
        w_ptr += t * H
        out_ptr += t * n_rows
        if DEVICE_COUNT:
            n_rows = gl.minimum(gl.load(count_ptr + t * count_stride).to(gl.int32), n_rows)

        q_smem, wq = _query_tile(q_ptr, w_ptr, H, LQ, ACC, SH16, False, scale)
        k_smem = gl.allocate_shared_memory(gl.float16, [_BLOCK_N, 128], SH16)
        k_words = k_smem._reinterpret(gl.int32, [_BLOCK_N, 64], SH32)
        blk8 = 8 * gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))[None, :]

        words, sw = _load_tile(pid, rows_ptr, n_rows, LW, _BLOCK_N)
        for it in range(n_iter):
            tile = pid + it * n_prog
            # the next tile's words in flight while this one is scored
            next_words, next_sw = _load_tile(tile + n_prog, rows_ptr, n_rows, LW, _BLOCK_N)
            if tile * _BLOCK_N < n_rows:  # uniform: the programs' last tiles may lie past the rows
                smax = gl.maximum(gl.maximum(sw & 255, (sw >> 8) & 255), gl.maximum((sw >> 16) & 255, (sw >> 24) & 255))
                # each block's scale relative to the row's, as an fp16 pair [rows, 4, 1]
                s = gl.expand_dims(_scale_pair(15 - (smax[:, None] - ((sw[:, None] >> blk8) & 255))), 2) + 0 * words
                # the four pairs of each word side by side: row order, 16 bytes a lane per word
                pairs = gl.reshape(gl.join(gl.join(_pairs(words, s, 0), _pairs(words, s, 2)),
                                           gl.join(_pairs(words, s, 1), _pairs(words, s, 3))), [_BLOCK_N, 64])
                gl.thread_barrier()  # every warp is past the previous tile's product
                k_words.store(pairs)
                fence_async_shared()
                gl.thread_barrier()
                acc = warpgroup_mma(k_smem, q_smem.permute((1, 0)), gl.zeros([_BLOCK_N, HP], gl.float32, ACC))
                # acc = (q . k) * 2^(128 - smax) * 2^(14 - e_h); both powers of two commute with the ReLU
                row_scale = gl.convert_layout(exp2_f32(smax - 128), gl.SliceLayout(1, ACC))
                score = gl.sum(gl.maximum(acc, 0.0) * wq[None, :], axis=1) * row_scale
                r = tile * _BLOCK_N + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, ACC))
                gl.store(out_ptr + r, score, mask=r < n_rows)
            words = next_words
            sw = next_sw


    @gluon.jit
    def _query_tile(q_ptr, w_ptr, H: gl.constexpr, LQ: gl.constexpr, ACC: gl.constexpr, SH16: gl.constexpr,
                    PERMUTED: gl.constexpr, scale):
        # the query, per head scaled by 2^(14 - e_h) into fp16 (exact for MXFP4 values), in shared memory [64, 128];
        # PERMUTED: its columns in the order the register key tile holds them (see score_regs_kernel); and the head
        # weights with scale and 2^(e_h - 14) folded in
        HP: gl.constexpr = 64
        h = gl.arange(0, HP, layout=gl.SliceLayout(1, LQ))
        kq = gl.arange(0, 128, layout=gl.SliceLayout(0, LQ))
        if PERMUTED:
            kq = 32 * ((kq >> 1) & 3) + 8 * (kq >> 5) + 4 * ((kq >> 4) & 1) + 2 * ((kq >> 3) & 1) + (kq & 1)
        q = gl.load(q_ptr + h[:, None] * 128 + kq[None, :], mask=(h < H)[:, None] & (kq >= 0)[None, :], other=0.0)
        qmax = gl.max(gl.abs(q), axis=1)
        e_h = gl.where(qmax > 0, ((qmax.to(gl.int32, bitcast=True) >> 23) & 255) - 127, 0)
        e_h = gl.minimum(gl.maximum(e_h, -110), 127)
        q_smem = gl.allocate_shared_memory(gl.float16, [HP, 128], SH16)
        q_smem.store((q * exp2_f32(14 - e_h)[:, None]).to(gl.float16))
        hw = gl.arange(0, HP, layout=gl.SliceLayout(0, ACC))
        e_w = gl.convert_layout(e_h, gl.SliceLayout(0, ACC))
        wq = gl.load(w_ptr + hw, mask=hw < H, other=0.0) * scale * exp2_f32(e_w - 14)
        return q_smem, wq

    @gluon.jit
    def _register_keys(words, sw, LW: gl.constexpr, DOT_A: gl.constexpr, BN: gl.constexpr):
        # the key tile [BN, 128] fp16 in the wgmma A operand's registers, columns permuted as score_regs_kernel says,
        # and each row's largest block scale
        blk = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))
        smax = gl.maximum(gl.maximum(sw & 255, (sw >> 8) & 255), gl.maximum((sw >> 16) & 255, (sw >> 24) & 255))
        # this lane's block scale relative to the row's, as an fp16 pair [rows, 4, 1]
        s = gl.expand_dims(_scale_pair(15 - (smax[:, None] - ((sw[:, None] >> (8 * blk[None, :])) & 255))), 2)
        p0, p1, p2, p3 = _word_pairs(words, s + 0 * words)
        # pairs [rows, block, word, b, a] of byte j = 2a + b, then their halves e, ordered as the A operand's columns
        # 32 word + 16 a + 8 b + 2 block + e
        pairs = gl.join(gl.join(p0, p1), gl.join(p2, p3))
        halves = gl.join((pairs & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True),
                         (pairs >> 16).to(gl.int16).to(gl.float16, bitcast=True))
        keys = gl.reshape(gl.permute(halves, (0, 2, 4, 3, 1, 5)), [BN, 128])
        return gl.convert_layout(keys, DOT_A), smax

    @gluon.jit
    def _store_scores(acc, smax, wq, out_ptr, tile, n_rows, ACC: gl.constexpr, BN: gl.constexpr):
        # acc = (q . k) * 2^(128 - smax) * 2^(14 - e_h); both powers of two commute with the ReLU
        row_scale = gl.convert_layout(exp2_f32(smax - 128), gl.SliceLayout(1, ACC))
        score = gl.sum(gl.maximum(acc, 0.0) * wq[None, :], axis=1) * row_scale
        r = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
        gl.store(out_ptr + r, score, mask=r < n_rows)

    @gluon.jit(do_not_specialize=["n_rows", "n_iter", "n_prog"])
    def score_regs_kernel(q_ptr, w_ptr, rows_ptr, rows_stride, out_ptr, n_rows, count_ptr, count_stride, n_iter,
                          n_prog, scale, H: gl.constexpr, DEVICE_COUNT: gl.constexpr, BN: gl.constexpr,
                          LW: gl.constexpr, PIPE: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = False):
        """As score_kernel, with the key tile decoded straight into the registers of the product's A operand: no
        shared-memory store of the keys, no barrier. A thread of the wgmma A layout holds, per row, the pairs k =
        2(l % 4) + {0, 1} + 8j of each 16 columns; the columns are permuted (in the query too, which does not change
        the dot products) so that the pairs a thread holds are exactly one MXFP4 block of its row (lane l % 4 holds
        block l % 4): its four code words and one scale. PIPE: the product runs asynchronously while the next
        tile is decoded."""
        wait_upstream(PDL)
        HP: gl.constexpr = 64
        LQ: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])  # [64 heads, 128]
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HP, 16])
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        SH16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        pid = gl.program_id(0)
        t = gl.program_id(1).to(gl.int64)
        q_ptr += t * H * 128
        rows_ptr += t * rows_stride
        w_ptr += t * H
        out_ptr += t * n_rows
        if DEVICE_COUNT:
            n_rows = gl.minimum(gl.load(count_ptr + t * count_stride).to(gl.int32), n_rows)
        q_smem, wq = _query_tile(q_ptr, w_ptr, H, LQ, ACC, SH16, True, scale)
        fence_async_shared()
        gl.thread_barrier()
        q_t = q_smem.permute((1, 0))

        words, sw = _load_tile(pid, rows_ptr, n_rows, LW, BN)
        if PIPE:
            keys, smax = _register_keys(words, sw, LW, DOT_A, BN)
            words, sw = _load_tile(pid + n_prog, rows_ptr, n_rows, LW, BN)
            for it in range(n_iter):
                tile = pid + it * n_prog
                acc = warpgroup_mma(keys, q_t, gl.zeros([BN, HP], gl.float32, ACC), is_async=True)
                next_words, next_sw = _load_tile(tile + 2 * n_prog, rows_ptr, n_rows, LW, BN)
                next_keys, next_smax = _register_keys(words, sw, LW, DOT_A, BN)
                acc, keys = warpgroup_mma_wait(num_outstanding=0, deps=(acc, keys))
                _store_scores(acc, smax, wq, out_ptr, tile, n_rows, ACC, BN)
                keys, smax = next_keys, next_smax
                words, sw = next_words, next_sw
        else:
            for it in range(n_iter):
                tile = pid + it * n_prog
                # the next tile's words in flight while this one is scored
                next_words, next_sw = _load_tile(tile + n_prog, rows_ptr, n_rows, LW, BN)
                if tile * BN < n_rows:  # uniform: the programs' last tiles may lie past the rows
                    keys, smax = _register_keys(words, sw, LW, DOT_A, BN)
                    acc = warpgroup_mma(keys, q_t, gl.zeros([BN, HP], gl.float32, ACC))
                    _store_scores(acc, smax, wq, out_ptr, tile, n_rows, ACC, BN)
                words = next_words
                sw = next_sw

@functools.cache
def word_layout(bn: int, warps: int = WARPS):
    """The layout of score_regs_kernel's code words [bn rows, 4 blocks, 4 words]: each (row, block) where the wgmma
    A operand (``warps`` warps, 16 rows each per 64-row product, M = bn) holds that row's pairs of the block's
    permuted columns."""
    warp_rows = [[16 << i, 0, 0] for i in range(warps.bit_length() - 1)]
    repeats = [[16 * warps << i, 0, 0] for i in range((bn // (16 * warps)).bit_length() - 1)]
    lanes = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]] + repeats, lane_bases=lanes,
                                      warp_bases=warp_rows, block_bases=[], shape=[bn, 4, 4])


def available(q: torch.Tensor, heads: int) -> bool:
    """Whether the kernel serves this query: CUDA on an sm_90 GPU with Gluon (not the interpreter), at most 64
    heads."""
    return (HAVE_GLUON and not interpret_mode() and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
            and heads <= 64)
