"""Decode attention over packed rows on Hopper tensor cores (Gluon, sm_90): all heads of a query per program.

The same partial pass as `ds4x.kernels.triton_attention.partial_kernel` (one launch per layer over the window and
the compressed rows, a program per split of consecutive row blocks, online softmax, `combine_kernel` merges the
splits with the sink), shaped for many rows: a program takes all (up to 64) heads and all 512 output columns, so
each row is loaded, decoded and scored once per layer, and both products run as ``wgmma``. (A launch of few splits
may spread a split's output columns over 2 or 4 programs, each decoding and scoring all its rows: PARTS, see
`ds4x.kernels.attention.COLUMN_PARTS`.)

Per program the query is split once into bf16 high and low parts (about 16 bits together), stacked in shared
memory as one [128, 512] operand. Per block of ``BLOCK`` rows the threads decode the packed rows into a bf16 key
tile [BLOCK, 512] in shared memory: E4M3 codes times their power-of-two scale (exact in bf16) in columns 0-447, and
the FP16 RoPE values as a bf16 high part there (columns 448-511), with their low parts in a tile [BLOCK, 64] (high +
low is the FP16 value exactly). Then, with float32 accumulation,

    [S_hi; S_lo] = [q_hi; q_lo] K^T + [q_hi; q_lo][:, 448:] K_lo^T     [128, BLOCK]: one product per warpgroup
    S = S_hi + S_lo                                                     [64, BLOCK], through shared memory
    O = O e^(m_old - m_new) + (P_hi + P_lo) K                           [64, 512]: 256 columns per warpgroup
    O_r = O_r e^(m_old - m_new) + (P_hi + P_lo) K_lo                    [64, 64], added to O's RoPE columns last

The results differ from the Triton kernel's in rounding (5e-6 relative to float64 measured, that kernel 3e-6);
packed and native rows run the same code here too. While a block is multiplied, its successor's rows are on their
way to L2 (one bulk prefetch per row).

Where it stands (H200, 2026-12-03, graph-replayed, see `ds4x.kernels.attention.WGMMA_CONFIG`): an HCA layer at
1M (8,194 rows + the window) 32-35 us (the first kernel of this kind, two programs per split each computing all
scores for half the columns, 49; the Triton kernel 85); a CSA layer's 640 rows 13.5, the window alone 12.3 (the
Triton kernel 16.1 and 11.7). Still ~10x what the bytes take at copy bandwidth. ncu at HCA 1M (111 programs, one
per multiprocessor, ~4.7 blocks each) puts 19% of the warp samples before the block loop (the query's load, split
and shared-memory store: 128 KB per program), 62% in it and 19% after it (the 128 KB partial state's stores, which
wait on the memory pipeline's queue, and their drain); in the loop no one stall dominates (long scoreboard on the
row bytes, barriers, wgmma waits, issue). Leaving parts out (an earlier version): without the row decode 37.3 ->
31.7 us, without the score product 31.1, without the output product 34.7, without all three 25.3. So each
program's fixed cost and its serial chain of per-block steps are what cost; writing the partial state through
shared memory with 16-byte stores did not help (window 12.3 -> 13.2 us, HCA 1M unchanged).

Observed from inside (`scripts/attention_phases.py`, stamps in a copy of this kernel, H100, 389dd87, bf16 query):
every program spends ~1.4 us on the query (64 KB read, 128 KB stored to shared memory), 5,300-5,800 cycles (~3.1 us)
on each 16-row block, and 2.3-4.0 us storing its 128 KB partial state and the RoPE columns' atomics; the merge
launch then takes 2.7 us (8 splits) to 4.7 us (111). Window 128 10.8 us a call (partial pass 8.4 + merge 2.7),
HCA at 1M 28.5 (23.8 + 4.7). So a split's fixed costs are ~4 us and a block ~3 us: fewer, longer splits need a
cheaper block first. The two phases now copy the bf16 query into shared memory by cp.async (`_copy_query`, QUERY_ASYNC)
while the first block is decoded: ~0.3-0.5 us less a call.

A bf16 query (the model's) has a zero low part, so half of the score products multiply zeros. Stacking such a
query by column halves instead ([q[:, :256]; q[:, 256:]] against the key tile stored again as its two halves: 24
HGMMA a block against 40, 118 KB of shared memory against 156) measured level and was removed (H100, 42a413d,
`scripts/compressed_kernels_ab.py`, us split / halves: window 12.2 / 12.3, CSA top-512 at 1M 12.7 / 12.6,
HCA at 4K 12.2 / 11.9, HCA at 1M 31.9 / 32.4): the score product is not what bounds a block.

A block's rows are loaded by aligned 4-byte words, two a thread's group of 4 codes (three for its 4 RoPE values)
and a funnel shift, not byte by byte (56 -> 30 loads a thread a block); each block's live rows are found again
in the scores' layout rather than converted, and the two phases keep the scores' running maximum element-wise,
reduced once after the blocks (8 -> 3 barriers a block). Bit-identical; H100, 16317e5 against its parent tree,
us in L2 / from DRAM: HCA at 1M 25.7 / 26.9 -> 24.1 / 25.0 (a phase-1 block ~3,900 -> ~3,300 cycles), the window,
CSA top-512 and HCA at 4K level (10.3-11.5 / 10.4-12.2). Loading each block's words a block ahead (registers
carried across the loop, decoded after the next block's loads are issued) measured the same (24.2 / 24.8) and
was not kept: the row loads' latency is not what a block waits on.

Needs CUDA capability 9.x and Triton's Gluon; ``available`` says whether a call can run here.
"""

from __future__ import annotations

import torch

from ds4x.formats.triton_mode import HAVE_TRITON, interpret_mode

try:  # Gluon is experimental in Triton 3.x; without it the callers use the Triton kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = HAVE_TRITON
except Exception:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

HEADS = 64  # the M of every product (fewer heads are padded)
WARPS = 8  # two warpgroups: each holds half of the [64, 512] output accumulator


if HAVE_GLUON:
    # Triton helpers (elementwise or reductions over a given axis), so Gluon code may call them
    from ds4x.formats.pdl import wait_upstream
    from ds4x.formats.rows_triton import _ue8m0_decode
    from ds4x.kernels.triton_attention import closed_rows, empty_split, online_softmax_step

    @gluon.jit
    def _slot_rows(idx_ptr, pos, n, ring, offs, live, MODE: gl.constexpr):
        # the stored row of each slot (-1: none) as int32, ``pos`` the query's position read once (modes 1 and 2);
        # see kernels/attention.Slots and triton_attention._slot_rows. No arithmetic on a loaded index here: the
        # caller's next loads need not wait for it
        if MODE == 0:
            idx = gl.load(idx_ptr + offs, mask=(offs < n) & live, other=-1)
        elif MODE == 1:  # int32 arithmetic (positions < 2^31): an int64 division is a called routine
            p = pos - (n - 1) + offs
            idx = gl.where((p >= 0) & (offs < n) & live, p % ring, -1)
        else:
            idx = gl.where((offs < closed_rows(pos, ring, n)) & live, offs, -1)
        return idx

    @gluon.jit
    def _prefetch_rows(rows_ptr, idx, stride, ROW: gl.constexpr):
        # ask L2 for the bytes of rows ``idx`` (-1: none): one bulk prefetch per row over the 16-byte granules it
        # touches (the address aligned here: a batch's stores need not be), so that the decode of the next block
        # reads L2 instead of waiting on DRAM
        gl.inline_asm_elementwise(
            "{ .reg .b64 a, e; .reg .b32 n; .reg .pred p; setp.ge.s32 p, $3, 0; and.b64 a, $1, -16; "
            "add.s64 e, $1, $2; and.b64 e, e, -16; sub.s64 e, e, a; cvt.u32.u64 n, e; "
            "@p cp.async.bulk.prefetch.L2.global [a], n; mov.u32 $0, 0; }",
            "=r,l,l,r", [rows_ptr + gl.where(idx >= 0, idx, 0).to(gl.int64) * stride,
                         gl.full_like(idx, ROW + 15).to(gl.int64), idx.to(gl.int32)],
            dtype=gl.int32, is_pure=False, pack=1)

    # the inline asm's common start: the aligned address ``a`` of a group's first byte ($2), the funnel shift ``sh``
    # (bits) to its byte, the predicate ``p`` of the group being live ($6); words w0, w1 declared
    _ALIGNED_WORDS = gl.constexpr("""
            .reg .b64 a;  .reg .b32 w0, w1, sh;  .reg .pred p;
            setp.ne.s32 p, $6, 0;
            and.b64 a, $2, -4;  cvt.u32.u64 sh, $2;  and.b32 sh, sh, 3;  shl.b32 sh, sh, 3;
            """)

    @gluon.jit
    def _e4m3_words(at, live, scale):
        # 4 consecutive E4M3 codes a thread (a group of 4 elements, the first's byte address ``at``, the group
        # ``live``) x their power-of-two ``scale`` as bf16 (0 where not live): two aligned word loads and a funnel
        # shift instead of four byte loads (rows start at any byte), the GPU's E4M3 -> FP16 conversion (exact), then
        # the same float32 product and rounding as `triton_attention._e4m3_scaled`
        return gl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 v, h01, h23;  .reg .b16 c01, c23, x0, x1, x2, x3;  .reg .f32 f0, f1, f2, f3;
            """ + _ALIGNED_WORDS + """
            mov.b32 w0, 0;  mov.b32 w1, 0;
            @p ld.global.b32 w0, [a];
            @p ld.global.b32 w1, [a + 4];
            shf.r.wrap.b32 v, w0, w1, sh;
            mov.b32 {c01, c23}, v;
            cvt.rn.f16x2.e4m3x2 h01, c01;  cvt.rn.f16x2.e4m3x2 h23, c23;
            mov.b32 {x0, x1}, h01;  mov.b32 {x2, x3}, h23;
            cvt.f32.f16 f0, x0;  cvt.f32.f16 f1, x1;  cvt.f32.f16 f2, x2;  cvt.f32.f16 f3, x3;
            mul.rn.f32 f0, f0, $10;  mul.rn.f32 f1, f1, $10;  mul.rn.f32 f2, f2, $10;  mul.rn.f32 f3, f3, $10;
            cvt.rn.bf16x2.f32 $0, f1, f0;  cvt.rn.bf16x2.f32 $1, f3, f2;
            }
            """,
            constraints="=r,=r,l,l,l,l,r,r,r,r,r,r,r,r",
            args=[at.to(gl.int64), live.to(gl.int32), scale], dtype=gl.bfloat16, is_pure=True, pack=4)

    @gluon.jit
    def _fp16_words(at, live):
        # 4 consecutive little-endian FP16 values a thread (8 bytes from ``at``, the group ``live``; 0 where not):
        # three aligned word loads and two funnel shifts instead of eight byte loads
        return gl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 w2;
            """ + _ALIGNED_WORDS + """
            mov.b32 w0, 0;  mov.b32 w1, 0;  mov.b32 w2, 0;
            @p ld.global.b32 w0, [a];
            @p ld.global.b32 w1, [a + 4];
            @p ld.global.b32 w2, [a + 8];
            shf.r.wrap.b32 $0, w0, w1, sh;  shf.r.wrap.b32 $1, w1, w2, sh;
            }
            """,
            constraints="=r,=r,l,l,l,l,r,r,r,r",
            args=[at.to(gl.int64), live.to(gl.int32)], dtype=gl.float16, is_pure=True, pack=4)

    @gluon.jit
    def _store_keys(rows_ptr, idx, stride, keys, at, klo_smem, BLOCK: gl.constexpr, NOPE: gl.constexpr,
                    D: gl.constexpr, L3: gl.constexpr, PARTS: gl.constexpr):
        # rows ``idx`` [BLOCK] (-1: none, stored as zeros) decoded into shared memory, the block's columns by part
        # into tiles ``keys``[at .. at + PARTS - 1] [BLOCK, D / PARTS], one store a part: the E4M3 codes x their
        # power-of-two scale (the Triton kernel's exact decode, then bf16: exact) by 64-value chunk [BLOCK, 8 /
        # PARTS, 64], the RoPE values' place (chunk 7) holding their bf16 high parts, and the RoPE values' low parts
        # [BLOCK, 64] (high + low is the FP16 value exactly). L3 gives each thread 4 consecutive values (the word
        # loads' groups)
        CP: gl.constexpr = 8 // PARTS  # 64-value chunks a part
        ok = (idx >= 0)[:, None, None]
        row = (rows_ptr + gl.where(idx >= 0, idx, 0).to(gl.int64) * stride)[:, None, None]
        col = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
        for part in gl.static_range(PARTS):
            chunk = part * CP + gl.arange(0, CP, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
            nope = ok & (chunk < NOPE // 64)
            sbyte = gl.load(row + NOPE + 2 * (D - NOPE) + chunk, mask=nope, other=127).to(gl.int32)
            keys_part = _e4m3_words(row + chunk * 64 + col, nope & (col >= 0), _ue8m0_decode(sbyte))
            if part == PARTS - 1:  # the RoPE values (chunk 7)
                rope = _fp16_words(row + NOPE + 2 * col, ok & (col >= 0)).to(gl.float32)
                rope_hi = rope.to(gl.bfloat16)
                keys_part = gl.where(chunk < NOPE // 64, keys_part, rope_hi)
                klo_smem.store(gl.reshape((rope - rope_hi.to(gl.float32)).to(gl.bfloat16), [BLOCK, D - NOPE]))
            keys.index(at + part).store(gl.reshape(keys_part, [BLOCK, D // PARTS]))

    @gluon.jit
    def _score_products(q1, keys, at, keys_lo, s, NOPE: gl.constexpr, PARTS: gl.constexpr):
        # S = q K^T, issued asynchronously over the block's column parts ``keys``[at ..] in order (the k16 steps of
        # one product over all columns, in the same order: the same bits, a GPU test), then the RoPE columns' low
        # parts' product added
        C: gl.constexpr = keys.shape[2]
        D: gl.constexpr = PARTS * C
        for part in gl.static_range(PARTS):
            s = warpgroup_mma(q1.slice(part * C, C, dim=1), keys.index(at + part).permute((1, 0)), s,
                              use_acc=part > 0, is_async=True)
        return warpgroup_mma(q1.slice(NOPE, D - NOPE, dim=1), keys_lo.permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _block_rows(i, na, a0, b0, idx_a, pos_a, n_a, ring_a, idx_b, pos_b, n_b, ring_b, slots, live,
                    BLOCK: gl.constexpr, MODE_A: gl.constexpr, MODE_B: gl.constexpr):
        # the stored rows of a program's block i: blocks 0 .. na-1 are source A's a0, a0 + 1, ..., the rest source
        # B's b0, b0 + 1, ...; both sources' slots under masks, no branch, so that the index loads (mode 0) are on
        # their way while the loads after them go out
        in_a = i < na
        from_a = _slot_rows(idx_a, pos_a, n_a, ring_a, (a0 + i) * BLOCK + slots, live & in_a, MODE_A)
        from_b = _slot_rows(idx_b, pos_b, n_b, ring_b, (b0 + i - na) * BLOCK + slots, live & (i >= na), MODE_B)
        return gl.where(in_a, from_a, from_b)

    @gluon.jit
    def _decode_block(i, idx, rows_ptr, stride, keys, k_at, klo_dst, na, nb, a0, b0, rows_a, stride_a, idx_a, pos_a,
                      n_a, ring_a, rows_b, stride_b, idx_b, pos_b, n_b, ring_b, slots, BLOCK: gl.constexpr,
                      NOPE: gl.constexpr, D: gl.constexpr, MODE_A: gl.constexpr, MODE_B: gl.constexpr,
                      L3: gl.constexpr, OK_L: gl.constexpr, REUSED: gl.constexpr, PARTS: gl.constexpr = 1):
        # block i's rows ``idx`` (at rows_ptr, stride) decoded into the key tiles (its PARTS column parts
        # ``keys``[k_at ..] and the RoPE low parts ``klo_dst``; REUSED: tiles the previous
        # block's products read, so every warp waits until they are done), and block i + 1's rows found and asked
        # of L2 -> (block i's live rows in layout OK_L, block i + 1's rows, their source's pointer and stride).
        # The next block's rows are found first: an index read (mode 0) then waits alongside this block's row loads
        ROW: gl.constexpr = NOPE + 2 * (D - NOPE) + NOPE // 64  # packed row bytes
        nxt = _block_rows(i + 1, na, a0, b0, idx_a, pos_a, n_a, ring_a, idx_b, pos_b, n_b, ring_b, slots,
                          i + 1 < na + nb, BLOCK, MODE_A, MODE_B)
        # the live rows found again in the scores' layout (arithmetic, or an index read from L1) rather than
        # converted: a conversion is a shared-memory round trip with two barriers a block
        ok = _block_rows(i, na, a0, b0, idx_a, pos_a, n_a, ring_a, idx_b, pos_b, n_b, ring_b,
                         gl.arange(0, BLOCK, layout=OK_L), i < na + nb, BLOCK, MODE_A, MODE_B) >= 0
        if REUSED:
            gl.thread_barrier()
        _store_keys(rows_ptr, idx, stride, keys, k_at, klo_dst, BLOCK, NOPE, D, L3, PARTS)
        if i + 1 < na:
            rows_ptr, stride = rows_a, stride_a
        else:
            rows_ptr, stride = rows_b, stride_b
        _prefetch_rows(rows_ptr, nxt, stride, ROW)  # the next block's bytes on their way to L2
        return ok, nxt, rows_ptr, stride

    @gluon.jit
    def _copy_query(q_ptr, H: gl.constexpr, HP: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
        # a bf16 query [H, D] copied into a swizzled [HP, D] tile by cp.async (16 bytes a copy; heads past H masked:
        # their rows never reach the output), one commit group: the first block's rows are decoded while it arrives,
        # and the first score product waits for it (async_copy.wait_group) -> the tile
        QA: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        h = gl.arange(0, HP, layout=gl.SliceLayout(1, QA))[:, None]
        d = gl.arange(0, D, layout=gl.SliceLayout(0, QA))[None, :]
        q1 = gl.allocate_shared_memory(gl.bfloat16, [HP, D], SH)
        async_copy.async_copy_global_to_shared(q1, q_ptr + h * D + d, mask=(h < H) & (d >= 0))
        async_copy.commit_group()
        return q1

    @gluon.jit
    def _two_phase_blocks(q_in, rows_ptr, stride, idx, na, nb, a0, b0, rows_a, stride_a, idx_a, pos_a, n_a, ring_a,
                          rows_b, stride_b, idx_b, pos_b, n_b, ring_b, slots, scale, part, HP: gl.constexpr,
                          D: gl.constexpr, NOPE: gl.constexpr, BLOCK: gl.constexpr, MODE_A: gl.constexpr,
                          MODE_B: gl.constexpr, MAXB: gl.constexpr, L3: gl.constexpr, S_L: gl.constexpr,
                          O_ACC: gl.constexpr, R_ACC: gl.constexpr, num_warps: gl.constexpr,
                          OVERLAP: gl.constexpr = False, Q_ASYNC: gl.constexpr = False, PARTS: gl.constexpr = 1,
                          ROPE_COPY: gl.constexpr = False):
        # A program's (at most MAXB) blocks in two phases instead of the online loop, for a bf16 query (its value is
        # its high part: one [64, 512] operand): first every block's rows decoded into a key tile of its own and its
        # scores [64, BLOCK] kept in shared memory, with the running maximum only; then each block's probabilities
        # against the final maximum and their products with the block's keys added to the accumulator, the
        # products issued back to back. No [64, 512] rescale per block and no wait on a product per block. OVERLAP:
        # block j + 1 is decoded while block j's score product runs (each block has its own key tile; the one
        # accumulator is waited for within the block, so no wgmma is in flight across the loop). -> (m, l, o, o_r) as
        # the online loop leaves them (to float rounding). Q_ASYNC: ``q_in`` is the query's tile on its way
        # (`_copy_query`), waited for before the first score product. PARTS: the key tiles held as that many column
        # parts; every score product runs over all of them, the output products over part ``part`` only (o: [64,
        # 512 / PARTS]); o_r, the RoPE columns' low parts' products, is computed by every part (``part`` is not a
        # constant) and used by the last. ROPE_COPY: the output products of the RoPE columns run a second time into
        # an accumulator o_h in o_r's layout ([64, 64]: each element the same products in the same order as o's, so
        # the same bits), so that o_h + o_r is the state's RoPE columns without a float32 trip through shared memory;
        # else o_h is o_r (unused). -> (m, l, o, o_r, o_h)
        RD: gl.constexpr = D - NOPE
        gl.static_assert(not ROPE_COPY or PARTS == 1)
        S1_ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                          instr_shape=[16, BLOCK // (num_warps // 4), 16])
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        PSH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HP, BLOCK], gl.bfloat16)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        if Q_ASYNC:
            q1 = q_in
        else:
            q1 = gl.allocate_shared_memory(gl.bfloat16, [HP, D], SH, q_in.to(gl.bfloat16))
        keys = gl.allocate_shared_memory(gl.bfloat16, [MAXB * PARTS, BLOCK, D // PARTS], SH)  # block j: j * PARTS..
        keys_lo = gl.allocate_shared_memory(gl.bfloat16, [MAXB, BLOCK, RD], SH)
        scores = gl.allocate_shared_memory(gl.float32, [MAXB, HP, BLOCK], PLAIN)
        probs = gl.allocate_shared_memory(gl.bfloat16, [2 * MAXB, HP, BLOCK], PSH)  # per block: high, low parts
        top = gl.full([HP, BLOCK], float("-inf"), gl.float32, S1_ACC)  # the running maximum, element-wise
        n_blocks = na + nb
        s = gl.zeros([HP, BLOCK], gl.float32, S1_ACC)
        if OVERLAP:
            ok, idx, rows_ptr, stride = _decode_block(0, idx, rows_ptr, stride, keys, 0, keys_lo.index(0), na,
                                                      nb, a0, b0, rows_a, stride_a, idx_a, pos_a, n_a, ring_a,
                                                      rows_b, stride_b, idx_b, pos_b, n_b, ring_b, slots, BLOCK, NOPE,
                                                      D, MODE_A, MODE_B, L3, gl.SliceLayout(0, S1_ACC), False, PARTS)
            if Q_ASYNC:
                async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()
        for j in range(n_blocks):
            if OVERLAP:
                ok_j = ok
                s = _score_products(q1, keys, j * PARTS, keys_lo.index(j), s, NOPE, PARTS)
                if j + 1 < n_blocks:
                    ok, idx, rows_ptr, stride = _decode_block(j + 1, idx, rows_ptr, stride, keys, (j + 1) * PARTS,
                                                              keys_lo.index(j + 1), na, nb, a0, b0, rows_a, stride_a,
                                                              idx_a, pos_a, n_a, ring_a, rows_b, stride_b, idx_b,
                                                              pos_b, n_b, ring_b, slots, BLOCK, NOPE, D, MODE_A,
                                                              MODE_B, L3, gl.SliceLayout(0, S1_ACC), False, PARTS)
                    fence_async_shared()
                    gl.thread_barrier()
            else:
                ok_j, idx, rows_ptr, stride = _decode_block(j, idx, rows_ptr, stride, keys, j * PARTS,
                                                            keys_lo.index(j), na, nb, a0, b0, rows_a, stride_a,
                                                            idx_a, pos_a, n_a, ring_a, rows_b, stride_b, idx_b,
                                                            pos_b, n_b, ring_b, slots, BLOCK, NOPE, D, MODE_A,
                                                            MODE_B, L3, gl.SliceLayout(0, S1_ACC), False, PARTS)
                if Q_ASYNC:  # (nothing outstanding after the first block)
                    async_copy.wait_group(0)
                fence_async_shared()
                gl.thread_barrier()
                s = _score_products(q1, keys, j * PARTS, keys_lo.index(j), s, NOPE, PARTS)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            s = gl.where(ok_j[None, :], s * scale, float("-inf"))
            scores.index(j).store(s)
            top = gl.maximum(top, s)
        # the heads' maxima reduced once, not per block (a reduction across the warpgroups is four barriers)
        m = gl.convert_layout(gl.max(top, axis=1), gl.SliceLayout(1, S_L))
        gl.thread_barrier()  # every block's scores are stored
        m_safe = gl.where(m == float("-inf"), 0.0, m)
        l = gl.zeros([HP], gl.float32, gl.SliceLayout(1, S_L))
        # async accumulators from the start: the loop carries them across products it does not wait for
        o = warpgroup_mma_init(gl.zeros([HP, D // PARTS], gl.float32, O_ACC))
        o_r = warpgroup_mma_init(gl.zeros([HP, RD], gl.float32, R_ACC))
        o_h = warpgroup_mma_init(gl.zeros([HP, RD], gl.float32, R_ACC)) if ROPE_COPY else o_r
        for j in range(na + nb):
            p = gl.exp(scores.index(j).load(S_L) - m_safe[:, None])
            l += gl.sum(p, axis=1)
            p_hi = p.to(gl.bfloat16)
            probs.index(2 * j).store(p_hi)
            probs.index(2 * j + 1).store((p - p_hi.to(gl.float32)).to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            o = warpgroup_mma(probs.index(2 * j), keys.index(j * PARTS + part), o, is_async=True)
            o = warpgroup_mma(probs.index(2 * j + 1), keys.index(j * PARTS + part), o, is_async=True)
            o_r = warpgroup_mma(probs.index(2 * j), keys_lo.index(j), o_r, is_async=True)
            o_r = warpgroup_mma(probs.index(2 * j + 1), keys_lo.index(j), o_r, is_async=True)
            if ROPE_COPY:
                rope = keys.index(j).slice(NOPE, RD, dim=1)  # (one part: the whole row)
                o_h = warpgroup_mma(probs.index(2 * j), rope, o_h, is_async=True)
                o_h = warpgroup_mma(probs.index(2 * j + 1), rope, o_h, is_async=True)
        if ROPE_COPY:
            o, o_r, o_h = warpgroup_mma_wait(num_outstanding=0, deps=(o, o_r, o_h))
        else:
            o, o_r = warpgroup_mma_wait(num_outstanding=0, deps=(o, o_r))
            o_h = o_r
        return m, l, o, o_r, o_h

    # the partial state's shared tile: 128-byte swizzled float32 rows, as the TMA descriptor's boxes need them
    _STATE_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))

    @gluon.jit
    def _stage_state(o, o_r, NOPE: gl.constexpr):
        # the partial accumulator [64, 512] written to a swizzled shared tile (_STATE_LAYOUT) and the
        # RoPE columns' low-part products added there: one tile of the whole state, no global atomic per element
        HP: gl.constexpr = o.shape[0]
        D: gl.constexpr = o.shape[1]
        stage = gl.allocate_shared_memory(gl.float32, [HP, D], _STATE_LAYOUT)
        stage.store(o)
        gl.thread_barrier()
        rope = stage.slice(NOPE, D - NOPE, dim=1)
        rope.store(rope.load(o_r.type.layout) + o_r)
        return stage

    @gluon.jit
    def _store_state_tma(o, o_r, acc_desc, row, NOPE: gl.constexpr):
        # the partial accumulator stored by the TMA unit from a swizzled stage (a warp's 8-byte pieces of 8 rows fall
        # in different banks): one bulk copy per 32 columns (a 128-byte swizzled box), in place of 64 global 8-byte
        # stores a thread over 8 rows each (~4,300 cycles a program by the stamps) and a global atomic add per RoPE
        # element
        D: gl.constexpr = o.shape[1]
        BOX: gl.constexpr = acc_desc.block_type.shape[1]
        stage = _stage_state(o, o_r, NOPE)
        fence_async_shared()
        gl.thread_barrier()
        for c in gl.static_range(D // BOX):
            tma.async_copy_shared_to_global(acc_desc, [row, c * BOX], stage.slice(c * BOX, BOX, dim=1))
        tma.store_wait(0)

    @gluon.jit
    def _store_state_bf16(o, o_r, acc_ptr, NOPE: gl.constexpr, num_warps: gl.constexpr):
        # the partial accumulator rounded once to bf16 after its RoPE columns' low parts are added (half the bytes
        # to store and for the merge to read back), read from the stage 64 columns at a time as 16-byte pieces of
        # rows and stored in order
        HP: gl.constexpr = o.shape[0]
        D: gl.constexpr = o.shape[1]
        stage = _stage_state(o, o_r, NOPE)
        gl.thread_barrier()
        LB: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])  # [rows, 64]
        h = gl.arange(0, HP, layout=gl.SliceLayout(1, LB))[:, None]
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, LB))[None, :]
        for j in gl.static_range(D // 64):
            part = stage.slice(j * 64, 64, dim=1).load(LB)
            gl.store(acc_ptr + h * D + j * 64 + c, part.to(gl.bfloat16))

    # the bf16 state's shared tile: 128-byte swizzled bf16 rows (64 columns), the TMA descriptor's boxes
    _STATE_BF16_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))

    @gluon.jit
    def _store_state_bf16_tma(o, rope, acc_desc, row, NOPE: gl.constexpr):
        # the bf16 state rounded in registers (o's columns, then its RoPE columns from ``rope`` = o_h + o_r, the
        # `_two_phase_blocks` ROPE_COPY sums) into a swizzled bf16 tile (64 KB, against the 128 KB float32 stage
        # `_store_state_bf16` reads back) and stored by the TMA unit, one box per 64 columns
        HP: gl.constexpr = o.shape[0]
        D: gl.constexpr = o.shape[1]
        BOX: gl.constexpr = acc_desc.block_type.shape[1]
        stage = gl.allocate_shared_memory(gl.bfloat16, [HP, D], _STATE_BF16_LAYOUT)
        stage.store(o.to(gl.bfloat16))
        gl.thread_barrier()  # the RoPE columns written over o's
        stage.slice(NOPE, D - NOPE, dim=1).store(rope.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        for c in gl.static_range(D // BOX):
            tma.async_copy_shared_to_global(acc_desc, [row, c * BOX], stage.slice(c * BOX, BOX, dim=1))
        tma.store_wait(0)

    # row and block counts change with the context in a prefill chunk (HCA rows), an explicit index's width with a
    # prompt's length (CSA's top-k of a short context): one compiled variant
    @gluon.jit(do_not_specialize=["n_a", "splits_a", "blocks_a", "n_b", "blocks_b", "n_split", "index_a", "index_b"])
    def partial_kernel(q_ptr, rows_a, idx_a, pos_a, n_a, ring_a, stride_a, splits_a, blocks_a,
                       rows_b, idx_b, pos_b, n_b, ring_b, stride_b, blocks_b, m_ptr, l_ptr, acc_ptr, scale,
                       store_a, store_b, index_a, index_b, n_split, sinks_ptr, out_ptr, acc_desc,
                       H: gl.constexpr, D: gl.constexpr, NOPE: gl.constexpr, BLOCK: gl.constexpr,
                       MODE_A: gl.constexpr, MODE_B: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = False,
                       WHOLE: gl.constexpr = False, TWO_PHASE: gl.constexpr = 0, OVERLAP: gl.constexpr = False,
                       TMA_STATE: gl.constexpr = False, Q_ASYNC: gl.constexpr = False,
                       SKIP_EMPTY: gl.constexpr = False, STATE_BF16: gl.constexpr = False,
                       PARTS: gl.constexpr = 1):
        """Program (split, query): the softmax state of all heads over one split of the two row sources (as
        triton_attention.partial_kernel with one group of 64 heads): m, l and the output accumulator [64, 512].
        WHOLE: program (0, query) over all ``blocks_a`` blocks of source A then all ``blocks_b`` of B, and the
        output with the sink applied (as combine_kernel, without inverse RoPE) stored to out [H, D] float32.
        TWO_PHASE (> 0; a bf16 query, programs of at most that many blocks): the blocks by `_two_phase_blocks`
        instead of the online loop; the same state to float rounding. Q_ASYNC (with TWO_PHASE): the query copied to
        shared memory by cp.async (`_copy_query`), not through registers; the same bits. SKIP_EMPTY (not WHOLE): a
        split with no row to read (`triton_attention.empty_split`) stores m = -inf, l = 0 and no accumulator, as
        triton_attention.partial_kernel's. STATE_BF16 (not WHOLE): the accumulator stored to a bf16 acc
        buffer, rounded once after its RoPE columns' low parts are added (m and l stay float32). PARTS (with
        TWO_PHASE, global float32 stores): program (split, part, query) computes every score of its split but the
        output product and the state's stores of columns part x 512 / PARTS onwards only (m and l stored by part 0,
        the RoPE columns' low parts added by the last): a split's 128 KB of stores spread over PARTS programs, with
        the same bits (test_hopper_attention_column_parts_give_the_same_bits, H100). STATE_BF16 with TMA_STATE (and
        TWO_PHASE): the bf16 state rounded in registers, its RoPE columns from a second accumulator of their products
        (`_two_phase_blocks` ROPE_COPY) plus the low parts', and stored by the TMA unit from a bf16 tile
        (`_store_state_bf16_tma`; ``acc_desc`` a bf16 descriptor); the same bits as without TMA_STATE."""
        HP: gl.constexpr = 64
        RD: gl.constexpr = D - NOPE
        ROW: gl.constexpr = NOPE + 2 * RD + NOPE // 64  # packed row bytes
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 2, 16], [num_warps, 1, 1], [2, 1, 0])  # [BLOCK, 8, 64]
        gl.static_assert(PARTS == 1 or (TWO_PHASE > 0 and not (WHOLE or TMA_STATE or STATE_BF16)))
        gl.static_assert(not (STATE_BF16 and TMA_STATE) or TWO_PHASE > 0)
        split = gl.program_id(0)
        if PARTS > 1:
            part = gl.program_id(1)
        else:
            part = 0  # constant: the masks below fold away
        b = gl.program_id(2).to(gl.int64)
        slots = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        wait_upstream(PDL)
        LQ: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])  # [rows, 512] tiles
        # S2 = [q_hi; q_lo] K^T: warpgroup 0 the high parts' products, warpgroup 1 the low parts'
        S2_ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, BLOCK, 16])
        # the softmax's layout: each warp holds whole rows (reductions by shuffles, no barrier)
        S_L: gl.constexpr = gl.BlockedLayout([1, BLOCK // 4], [32 // 4, 4], [num_warps, 1], [1, 0])
        O_ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                         instr_shape=[16, D // PARTS // (num_warps // 4), 16])
        R_ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                         instr_shape=[16, RD // (num_warps // 4), 16])
        P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_ACC, k_width=2)
        PR_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=R_ACC, k_width=2)
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])

        # the program's blocks: na of source A from block a0, then nb of source B from block b0
        zero = split * 0  # a runtime zero: both branches below define tensors
        if WHOLE:
            a0, na, b0, nb = zero, blocks_a + zero, zero, blocks_b + zero
        elif split < splits_a:
            a0, na, b0, nb = split * blocks_a, blocks_a + zero, zero, zero
        else:
            a0, na, b0, nb = zero, zero, (split - splits_a) * blocks_b, blocks_b + zero
        rows_a += b * store_a
        rows_b += b * store_b
        idx_a += b * index_a
        idx_b += b * index_b
        # the query's positions (slot modes 1 and 2), read once: each block's slots are arithmetic on them
        if MODE_A == 0:
            pos_a = zero
        else:
            pos_a = gl.load(pos_a + b).to(gl.int32)
        if MODE_B == 0:
            pos_b = zero
        else:
            pos_b = gl.load(pos_b + b).to(gl.int32)
        if SKIP_EMPTY:
            if empty_split(split, splits_a, blocks_a, pos_a, n_a, ring_a, blocks_b, pos_b, n_b, ring_b, BLOCK,
                           MODE_A, MODE_B):
                hs = gl.arange(0, HP, layout=gl.SliceLayout(1, S_L))
                base = b * n_split * HP + split * HP
                gl.store(m_ptr + base + hs, gl.full([HP], float("-inf"), gl.float32, gl.SliceLayout(1, S_L)),
                         mask=part == 0)
                gl.store(l_ptr + base + hs, gl.zeros([HP], gl.float32, gl.SliceLayout(1, S_L)), mask=part == 0)
                return
        # the query's loads first: they need no index, so they are on their way while the first block's rows are
        # found (a device position or an index read) and asked of L2
        if Q_ASYNC:
            q_in = _copy_query(q_ptr + b * H * D, H, HP, D, num_warps)
        else:
            h = gl.arange(0, HP, layout=gl.SliceLayout(1, LQ))[:, None]
            dq = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))[None, :]
            q_in = gl.load(q_ptr + b * H * D + h * D + dq, mask=(h < H) & (dq >= 0), other=0.0)
        idx = _block_rows(0, na, a0, b0, idx_a, pos_a, n_a, ring_a, idx_b, pos_b, n_b, ring_b, slots, na + nb > 0,
                          BLOCK, MODE_A, MODE_B)
        if na > 0:
            rows_ptr, stride = rows_a, stride_a
        else:
            rows_ptr, stride = rows_b, stride_b
        _prefetch_rows(rows_ptr, idx, stride, ROW)

        if TWO_PHASE > 0:  # a bf16 query, at most TWO_PHASE blocks a program
            m, l, o, o_r, o_h = _two_phase_blocks(q_in, rows_ptr, stride, idx, na, nb, a0, b0, rows_a, stride_a,
                                                  idx_a, pos_a, n_a, ring_a, rows_b, stride_b, idx_b, pos_b, n_b,
                                                  ring_b, slots, scale, part, HP, D, NOPE, BLOCK, MODE_A, MODE_B,
                                                  TWO_PHASE, L3, S_L, O_ACC, R_ACC, num_warps, OVERLAP, Q_ASYNC,
                                                  PARTS, STATE_BF16 and TMA_STATE)
        else:
            q2 = gl.allocate_shared_memory(gl.bfloat16, [2 * HP, D], SH)  # [q_hi; q_lo]
            k_tiles = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK, D], SH)  # one column part
            k_smem = k_tiles.index(0)
            klo_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK, RD], SH)
            s_smem = gl.allocate_shared_memory(gl.float32, [2 * HP, BLOCK], PLAIN)
            q = q_in.to(gl.float32)
            q_hi = q.to(gl.bfloat16)
            q2.slice(0, HP, dim=0).store(q_hi)
            q2.slice(HP, HP, dim=0).store((q - q_hi.to(gl.float32)).to(gl.bfloat16))

            m = gl.full([HP], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
            l = gl.zeros([HP], gl.float32, gl.SliceLayout(1, S_L))
            o = gl.zeros([HP, D], gl.float32, O_ACC)
            o_r = gl.zeros([HP, RD], gl.float32, R_ACC)  # the RoPE columns' products with the keys' low parts
            for i in range(na + nb):
                ok, idx, rows_ptr, stride = _decode_block(i, idx, rows_ptr, stride, k_tiles, 0, klo_smem, na, nb, a0,
                                                          b0, rows_a, stride_a, idx_a, pos_a, n_a, ring_a, rows_b,
                                                          stride_b, idx_b, pos_b, n_b, ring_b, slots, BLOCK, NOPE, D,
                                                          MODE_A, MODE_B, L3, gl.SliceLayout(0, S_L), True)
                fence_async_shared()
                gl.thread_barrier()
                s2 = warpgroup_mma(q2, k_smem.permute((1, 0)), gl.zeros([2 * HP, BLOCK], gl.float32, S2_ACC),
                                   is_async=True)
                s2 = warpgroup_mma(q2.slice(NOPE, RD, dim=1), klo_smem.permute((1, 0)), s2, is_async=True)
                s2 = warpgroup_mma_wait(num_outstanding=0, deps=(s2,))
                s_smem.store(s2)
                gl.thread_barrier()
                s = s_smem.slice(0, HP, dim=0).load(S_L) + s_smem.slice(HP, HP, dim=0).load(S_L)
                s = gl.where(ok[None, :], s * scale, float("-inf"))
                m_new, alpha, p, l = online_softmax_step(m, l, s)
                p_hi = p.to(gl.bfloat16)
                p_lo = (p - p_hi.to(gl.float32)).to(gl.bfloat16)
                alpha = gl.convert_layout(alpha, gl.SliceLayout(1, O_ACC))
                o = o * alpha[:, None]
                o_r = o_r * gl.convert_layout(alpha, gl.SliceLayout(1, R_ACC))[:, None]
                a_hi = gl.convert_layout(p_hi, P_OP)
                a_lo = gl.convert_layout(p_lo, P_OP)
                o = warpgroup_mma(a_hi, k_smem, o, is_async=True)
                o = warpgroup_mma(a_lo, k_smem, o, is_async=True)
                o_r = warpgroup_mma(gl.convert_layout(a_hi, PR_OP), klo_smem, o_r, is_async=True)
                o_r = warpgroup_mma(gl.convert_layout(a_lo, PR_OP), klo_smem, o_r, is_async=True)
                o, o_r = warpgroup_mma_wait(num_outstanding=0, deps=(o, o_r))
                m = m_new
        hs = gl.arange(0, HP, layout=gl.SliceLayout(1, S_L))
        ho = gl.arange(0, HP, layout=gl.SliceLayout(1, O_ACC))[:, None]
        do = gl.arange(0, D // PARTS, layout=gl.SliceLayout(0, O_ACC))[None, :]
        hr = gl.arange(0, HP, layout=gl.SliceLayout(1, R_ACC))[:, None]
        dr = NOPE + gl.arange(0, RD, layout=gl.SliceLayout(0, R_ACC))[None, :]
        if WHOLE:  # the sink's share of the softmax, then out = o / (sum of weights)
            sink = gl.load(sinks_ptr + hs, mask=hs < H, other=0.0).to(gl.float32)
            top = gl.maximum(m, sink)
            w = gl.exp(m - top)
            f = w / (l * w + gl.exp(sink - top))
            o = o * gl.convert_layout(f, gl.SliceLayout(1, O_ACC))[:, None]
            o_r = o_r * gl.convert_layout(f, gl.SliceLayout(1, R_ACC))[:, None]
            gl.store(out_ptr + b * H * D + ho * D + do, o, mask=(ho < H) & (do >= 0))
            at = out_ptr + b * H * D + hr * D + dr
            r_ok = (hr < H) & (dr >= 0)
        else:
            base = b * n_split * HP + split * HP
            gl.store(m_ptr + base + hs, m, mask=part == 0)
            gl.store(l_ptr + base + hs, l, mask=part == 0)
            if STATE_BF16 and TMA_STATE:
                _store_state_bf16_tma(o, o_h + o_r, acc_desc, base.to(gl.int32), NOPE)  # noqa: F821 - two phases
            elif STATE_BF16:
                _store_state_bf16(o, o_r, acc_ptr + base * D, NOPE, num_warps)
            elif TMA_STATE:
                _store_state_tma(o, o_r, acc_desc, base.to(gl.int32), NOPE)
            else:
                gl.store(acc_ptr + base * D + part * (D // PARTS) + ho * D + do, o)
            at = acc_ptr + base * D + hr * D + dr
            r_ok = (hr >= 0) & (dr >= 0) & (part == PARTS - 1)
        if WHOLE or not (TMA_STATE or STATE_BF16):
            gl.thread_barrier()  # the RoPE columns' sums are written: add the low parts' products
            # one add per element onto the stored sum, no round trip (the hardware float atomic flushes subnormals)
            gl.atomic_add(at, o_r, mask=r_ok, sem="relaxed")


def state_descriptor(acc: torch.Tensor) -> TensorDescriptor:
    """The TMA descriptor of a partial state buffer [..., 64, D] as the partial kernel's TMA_STATE stores it: rows of
    D, boxes of 64 rows x 128 bytes (the swizzle's width) of `_stage_state`'s float32 tile (32 columns) or
    `_store_state_bf16_tma`'s bf16 one (64 columns)."""
    if acc.dtype == torch.bfloat16:
        return TensorDescriptor.from_tensor(acc.view(-1, acc.shape[-1]), [HEADS, 64], _STATE_BF16_LAYOUT.value)
    return TensorDescriptor.from_tensor(acc.view(-1, acc.shape[-1]), [HEADS, 32], _STATE_LAYOUT.value)


def available(q: torch.Tensor, heads: int, dim: int, nope: int) -> bool:
    """Whether the kernel serves this query: a CUDA query on an sm_90 GPU with Gluon (not the interpreter), at most
    64 heads, rows of 512 values of which 448 non-RoPE."""
    return (HAVE_GLUON and not interpret_mode() and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
            and heads <= HEADS and dim == 512 and nope == 448)
