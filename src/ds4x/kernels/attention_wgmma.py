"""Decode attention over packed rows on Hopper tensor cores (Gluon, sm_90): all heads of a query per program.

The same partial pass as `ds4x.kernels.triton_attention.partial_kernel` (one launch per layer over the window and
the compressed rows, a program per split of consecutive row blocks, online softmax, `combine_kernel` merges the
splits with the sink), shaped for many rows: a program takes all (up to 64) heads, so each row is loaded and
decoded once per layer instead of once per group of heads, and both products run as ``wgmma`` with M = 64 heads.

Per program the query is split once into bf16 high and low parts (about 16 bits together) in shared memory,
[64, 512] each. Per block of ``BLOCK`` rows the threads decode the packed rows into a bf16 key tile [BLOCK, 512]
in shared memory: E4M3 codes times their power-of-two scale (exact in bf16) in columns 0-447, and the FP16 RoPE
values as a bf16 high part there (columns 448-511) plus a low part in a second tile that is zero elsewhere
(high + low is the FP16 value exactly). Then

    S = (q_hi + q_lo) K^T + (q_hi + q_lo)[:, 448:] K_lo[:, 448:]^T          [64, BLOCK]
    O = O e^(m_old - m_new) + (P_hi + P_lo) (K + K_lo)                        [64, 512]

with float32 accumulation. The results differ from the Triton kernel's in rounding (2-4e-6 relative measured; that
kernel is ~1e-5 from float32); packed and native rows run the same code here too. The next block's bytes are
loaded into registers before the current block is multiplied.

Where it stands (H200, see `ds4x.kernels.attention.WGMMA_CONFIG`): an HCA layer at 1M (8,194 rows + the window)
51 us against the Triton kernel's 85, a CSA layer's 640 rows 12.7 against 16.2 us. That is still ~10x the time
its 4.9 MB take at copy bandwidth. Not profiled yet; the sm_90 SASS shows what a block waits on: a chain of
synchronous wgmma calls (a wait after each), cross-warpgroup softmax reductions and layout moves through shared
memory (about a dozen barriers per block), and spilled wgmma descriptors (392 bytes of stack at 16-row blocks, 664
at 32). Next steps: asynchronous wgmma with the next block's decode overlapping, the softmax state kept per
warpgroup.

Needs CUDA capability 9.x and Triton's Gluon; ``available`` says whether a call can run here.
"""

from __future__ import annotations

import torch

from ds4x.formats.triton_mode import HAVE_TRITON, interpret_mode

try:  # Gluon is experimental in Triton 3.x; without it the callers use the Triton kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    HAVE_GLUON = HAVE_TRITON
except Exception:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

HEADS = 64  # the M of every product (fewer heads are padded)
WARPS = 8  # two warpgroups: each holds half of the [64, 512] output accumulator


if HAVE_GLUON:
    # Triton helpers (elementwise or reductions over a given axis), so Gluon code may call them
    from ds4x.kernels.triton_attention import _e4m3_scaled, _fp16_bytes, online_softmax_step

    @gluon.jit
    def _slot_rows(idx_ptr, pos_ptr, n, ring, offs, live, MODE: gl.constexpr):
        # the stored row of each slot (-1: none); see kernels/attention.Slots and triton_attention._slot_rows
        if MODE == 0:
            idx = gl.load(idx_ptr + offs, mask=(offs < n) & live, other=-1).to(gl.int64)
        elif MODE == 1:
            p = gl.load(pos_ptr).to(gl.int64) - (n - 1) + offs
            idx = gl.where((p >= 0) & (offs < n) & live, p % ring, -1)
        else:
            idx = gl.where((offs < gl.minimum((gl.load(pos_ptr).to(gl.int64) + 1) // ring, n)) & live,
                           offs.to(gl.int64), -1)
        return idx

    @gluon.jit
    def _fetch(rows_ptr, idx, stride, L3: gl.constexpr, NOPE: gl.constexpr, D: gl.constexpr):
        # the raw bytes of rows ``idx`` [BLOCK] (-1: none, read as zero codes with scale byte 127): E4M3 codes by
        # 64-value chunk [BLOCK, 8, 64] (chunk 7, the RoPE values' place, not read), the chunks' scale bytes
        # [BLOCK, 8, 1], and the RoPE FP16 low / high bytes [BLOCK, 1, 64]
        ok = (idx >= 0)[:, None, None]
        row = (rows_ptr + gl.where(idx >= 0, idx, 0) * stride)[:, None, None]
        chunk = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
        col = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
        nope = ok & (chunk < NOPE // 64)
        codes = gl.load(row + chunk * 64 + col, mask=nope & (col >= 0), other=0)
        scales = gl.load(row + NOPE + 2 * (D - NOPE) + chunk, mask=nope, other=127)
        rope = row + NOPE + 2 * col
        return codes, scales, gl.load(rope, mask=ok & (col >= 0), other=0), gl.load(rope + 1, mask=ok & (col >= 0),
                                                                                      other=0)

    @gluon.jit
    def _store_keys(raw, k_smem, klo_smem, BLOCK: gl.constexpr, NOPE: gl.constexpr, D: gl.constexpr,
                    L3: gl.constexpr):
        # one block's key tiles into shared memory, each with one store (see the module doc): the Triton kernel's
        # exact E4M3 x scale decode in float32 (the hardware conversion), rounded to bf16 (exact)
        codes, sbyte, lo, hi = raw
        nope = _e4m3_scaled(codes, sbyte.to(gl.int32), True)
        rope = _fp16_bytes(lo.to(gl.int32), hi.to(gl.int32)).to(gl.float32)
        rope_hi = rope.to(gl.bfloat16)
        chunk = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
        keys = gl.where(chunk < NOPE // 64, nope.to(gl.bfloat16), rope_hi)  # [BLOCK, 8, 64]
        k_smem.store(gl.reshape(keys, [BLOCK, D]))
        klo_smem.slice(NOPE, D - NOPE, dim=1).store(
            gl.reshape((rope - rope_hi.to(gl.float32)).to(gl.bfloat16), [BLOCK, D - NOPE]))

    @gluon.jit
    def _attend_split(q_hi, q_lo, k_smem, klo_smem, rows_ptr, idx_ptr, pos_ptr, n, ring, stride, block0, n_blocks,
                      scale, HALF: gl.constexpr, BLOCK: gl.constexpr, D: gl.constexpr, NOPE: gl.constexpr,
                      MODE: gl.constexpr, L3: gl.constexpr, S_ACC: gl.constexpr, O_ACC: gl.constexpr,
                      P_OP: gl.constexpr):
        # online softmax of all heads over n_blocks blocks of BLOCK slots from block0 of one source -> (m, l, o):
        # o is this program's half of the output columns
        HP: gl.constexpr = 64
        m = gl.full([HP], float("-inf"), gl.float32, gl.SliceLayout(1, S_ACC))
        l = gl.zeros([HP], gl.float32, gl.SliceLayout(1, S_ACC))
        o = gl.zeros([HP, D // 2], gl.float32, O_ACC)
        slots = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        idx = _slot_rows(idx_ptr, pos_ptr, n, ring, block0 * BLOCK + slots, n_blocks > 0, MODE)
        raw = _fetch(rows_ptr, idx, stride, L3, NOPE, D)
        for i in range(n_blocks):
            ok = gl.convert_layout(idx, gl.SliceLayout(0, S_ACC)) >= 0
            gl.thread_barrier()  # both warpgroups are past the products that read the previous tiles
            _store_keys(raw, k_smem, klo_smem, BLOCK, NOPE, D, L3)
            idx = _slot_rows(idx_ptr, pos_ptr, n, ring, (block0 + i + 1) * BLOCK + slots, i + 1 < n_blocks, MODE)
            raw = _fetch(rows_ptr, idx, stride, L3, NOPE, D)  # in flight while this block is multiplied
            fence_async_shared()
            gl.thread_barrier()
            s = gl.zeros([HP, BLOCK], gl.float32, S_ACC)
            s = warpgroup_mma(q_hi, k_smem.permute((1, 0)), s)
            s = warpgroup_mma(q_lo, k_smem.permute((1, 0)), s)
            s = warpgroup_mma(q_hi.slice(NOPE, D - NOPE, dim=1), klo_smem.slice(NOPE, D - NOPE, dim=1).permute((1, 0)),
                              s)
            s = warpgroup_mma(q_lo.slice(NOPE, D - NOPE, dim=1), klo_smem.slice(NOPE, D - NOPE, dim=1).permute((1, 0)),
                              s)
            s = gl.where(ok[None, :], s * scale, float("-inf"))
            m_new, alpha, p, l = online_softmax_step(m, l, s)
            p_hi = p.to(gl.bfloat16)
            p_lo = (p - p_hi.to(gl.float32)).to(gl.bfloat16)
            a_hi = gl.convert_layout(p_hi, P_OP)
            a_lo = gl.convert_layout(p_lo, P_OP)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_ACC))[:, None]
            v = k_smem.slice(HALF * (D // 2), D // 2, dim=1)
            o = warpgroup_mma(a_hi, v, o)
            o = warpgroup_mma(a_lo, v, o)
            if HALF == 1:  # the RoPE columns' low parts
                v_lo = klo_smem.slice(D // 2, D // 2, dim=1)
                o = warpgroup_mma(a_hi, v_lo, o)
                o = warpgroup_mma(a_lo, v_lo, o)
            m = m_new
        return m, l, o

    @gluon.jit
    def partial_kernel(q_ptr, rows_a, idx_a, pos_a, n_a, ring_a, stride_a, splits_a, blocks_a,
                       rows_b, idx_b, pos_b, n_b, ring_b, stride_b, blocks_b, m_ptr, l_ptr, acc_ptr, scale,
                       store_a, store_b, index_a, index_b, n_split,
                       H: gl.constexpr, D: gl.constexpr, NOPE: gl.constexpr, BLOCK: gl.constexpr,
                       MODE_A: gl.constexpr, MODE_B: gl.constexpr, num_warps: gl.constexpr):
        """Program (split, half, query): the softmax state of all heads over one split of the two row sources (as
        triton_attention.partial_kernel, with one group of 64 heads), the output's columns ``half`` x 256 on (two
        programs per split: the whole accumulator would take every register). Both halves compute the same scores
        and store the same m and l."""
        HP: gl.constexpr = 64
        WG: gl.constexpr = num_warps // 4
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 2, 16], [num_warps, 1, 1], [2, 1, 0])  # [BLOCK, 8, 64]
        LQ: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])  # [rows, 512] tiles
        S_ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                         instr_shape=[16, BLOCK // WG, 16])
        O_ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                         instr_shape=[16, D // 2 // WG, 16])
        P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_ACC, k_width=2)
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        split = gl.program_id(0)
        half = gl.program_id(1)
        b = gl.program_id(2).to(gl.int64)
        q_ptr += b * H * D
        m_ptr += b * n_split * HP
        l_ptr += b * n_split * HP
        acc_ptr += b * n_split * HP * D

        q_hi = gl.allocate_shared_memory(gl.bfloat16, [HP, D], SH)
        q_lo = gl.allocate_shared_memory(gl.bfloat16, [HP, D], SH)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK, D], SH)
        klo_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK, D], SH)
        # the query in one load (all of it in flight at once), split, and stored with one store per part
        h = gl.arange(0, HP, layout=gl.SliceLayout(1, LQ))[:, None]
        dq = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))[None, :]
        q = gl.load(q_ptr + h * D + dq, mask=(h < H) & (dq >= 0), other=0.0).to(gl.float32)
        hi = q.to(gl.bfloat16)
        q_hi.store(hi)
        q_lo.store((q - hi.to(gl.float32)).to(gl.bfloat16))
        klo_smem.store(gl.zeros([BLOCK, D], gl.bfloat16, LQ))  # the low key tile is zero outside the RoPE columns

        if split < splits_a:
            if half == 0:
                m, l, o = _attend_split(q_hi, q_lo, k_smem, klo_smem, rows_a + b * store_a, idx_a + b * index_a,
                                        pos_a + b, n_a, ring_a, stride_a, split * blocks_a, blocks_a, scale, 0, BLOCK,
                                        D, NOPE, MODE_A, L3, S_ACC, O_ACC, P_OP)
            else:
                m, l, o = _attend_split(q_hi, q_lo, k_smem, klo_smem, rows_a + b * store_a, idx_a + b * index_a,
                                        pos_a + b, n_a, ring_a, stride_a, split * blocks_a, blocks_a, scale, 1, BLOCK,
                                        D, NOPE, MODE_A, L3, S_ACC, O_ACC, P_OP)
        else:
            if half == 0:
                m, l, o = _attend_split(q_hi, q_lo, k_smem, klo_smem, rows_b + b * store_b, idx_b + b * index_b,
                                        pos_b + b, n_b, ring_b, stride_b, (split - splits_a) * blocks_b, blocks_b,
                                        scale, 0, BLOCK, D, NOPE, MODE_B, L3, S_ACC, O_ACC, P_OP)
            else:
                m, l, o = _attend_split(q_hi, q_lo, k_smem, klo_smem, rows_b + b * store_b, idx_b + b * index_b,
                                        pos_b + b, n_b, ring_b, stride_b, (split - splits_a) * blocks_b, blocks_b,
                                        scale, 1, BLOCK, D, NOPE, MODE_B, L3, S_ACC, O_ACC, P_OP)
        hs = gl.arange(0, HP, layout=gl.SliceLayout(1, S_ACC))
        gl.store(m_ptr + split * HP + hs, m)
        gl.store(l_ptr + split * HP + hs, l)
        ho = gl.arange(0, HP, layout=gl.SliceLayout(1, O_ACC))[:, None]
        do = half * (D // 2) + gl.arange(0, D // 2, layout=gl.SliceLayout(0, O_ACC))[None, :]
        gl.store(acc_ptr + split * HP * D + ho * D + do, o)


def available(q: torch.Tensor, heads: int, dim: int, nope: int) -> bool:
    """Whether the kernel serves this query: a CUDA query on an sm_90 GPU with Gluon (not the interpreter), at most
    64 heads, rows of 512 values of which 448 non-RoPE."""
    return (HAVE_GLUON and not interpret_mode() and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
            and heads <= HEADS and dim == 512 and nope == 448)
