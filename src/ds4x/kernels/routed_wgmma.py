"""Routed experts from 2-bit blocks on Hopper tensor cores (Gluon, sm_90): each weight tile decoded once per chunk.

``y[p] = x[p // x_div] @ W[ids[p]].T`` for ``W`` [E, N, K] in IQ2_XXS (routed gate / up) or Q2_K (routed
down), bf16 activations. The (activation row, expert) pairs are sorted by expert and cut into chunks of up to
``BT`` pairs of one expert (the same chunk tables as the skinny kernel in :mod:`ds4x.kernels.quant_matmul`, built
on the device, so a launch can live in a CUDA graph). A program owns ``BN`` weight rows of one chunk's expert and
walks K in steps of 128: its threads decode the step's ``[BN, 128]`` tile to bf16 in registers, store it to shared
memory, and one ``wgmma`` multiplies it by the chunk's ``[BT, 128]`` activations (``acc[BN, BT]`` in float32). The
matvec decodes an expert once per pair; here a tile is decoded once for all pairs of the chunk, and the
multiply-adds go to the tensor cores.

Decoded weights are the bits of ``dequantize_gpu(w, torch.bfloat16)``: each weight is computed in float32 exactly as
the format defines it, then rounded once to bf16 (IQ2_XXS: ``d * (0.5 + s) / 4 * grid * sign``; Q2_K:
``d * sc * q - dmin * m``). The decode works on pairs of weights (one 32-bit word of two bf16):

* IQ2_XXS: per 32-weight group the three scaled magnitudes (8, 25, 43 times the group scale) are rounded to bf16
  once and packed into two words; a byte permute (``prmt``) per pair picks the two weights' bf16 bytes with a
  selector computed from their level indices (read per 8-weight grid entry from a 512-byte table of 2-bit
  fields), and an XOR with a mask computed from the stored sign bits (the 8th sign is the parity of the 7) sets
  the signs. Wider tables that held the selectors and sign masks (4 KB + 2 KB) needed fewer instructions but were
  slower: a random gather costs an L1 cycle per distinct 128-byte line it touches.
* Q2_K: per 16-weight sub-block the four values ``dl * q - ml`` (q = 0..3) are rounded and packed into two words;
  the selector of a pair is computed from its two 2-bit codes.

Stored as words through a 32-bit view of the bf16 tile's shared memory (the 128-byte swizzle is a function of the
byte address, so both views place every byte alike). Double-buffered: the tile of step i + 1 is decoded while the
wgmma of step i runs; the raw block fields are loaded two steps ahead and the activations one step ahead.

Where it pays (H200, Flash shapes, 256 experts, 6 per token; ``WGMMA_MIN_PAIRS_PER_EXPERT`` in quant_matmul): from
a few pairs per expert, i.e. prompts and prefill chunks. A decode step of 32 sessions (0.75 pairs per expert)
stays on the matvec, which reads each expert's blocks once per pair but runs many more programs.

Row results depend only on the row's own pair, not on which other pairs share its chunk (the tensor core sums each
output element over K in a fixed order), so a session's bits do not depend on the batch it is decoded in as long as
this kernel serves it. They differ from the matvec's (which multiplies exact float32 weights).

Two variants wait for a GPU to time them (`scripts/routed_wgmma_ab.py`, `bash scripts/device_ab.sh routed`), both
off; the default path compiles to the same sm_90 SASS as before them (`scripts/kernel_sass.py routed`):

* ``ASYNC_ACTIVATIONS``: the activations come by cp.async into three shared buffers instead of through registers
  one step ahead. At 64-128 pairs a chunk those registers (BT of them a thread, twice) are what the tile lacks:
  IQ2_XXS (128, 64, 4), the prompts' tile, compiles to 255 registers and 144 bytes of spills with them, 202
  registers and none without (but 128 KB of shared memory, one CTA an SM).
* ``REGISTER_WEIGHTS`` (with ``ASYNC_ACTIVATIONS``): the decoded words go straight into the registers of the
  wgmma's A operand, so the weight tile never passes through shared memory. A lane already decodes one 32-weight
  group (IQ2_XXS) or one unit (Q2_K) of a row per step, which is what the A layout gives a lane once the step's
  columns are permuted; the activations are copied to shared memory in the same permuted order, in 4-byte pieces.
  (64, 64, 4): 128 registers, 48 KB of shared memory (four CTAs an SM) against 197 and 64 KB.

Needs CUDA capability 9.x and Triton's Gluon (``triton.experimental.gluon``); there is no interpreter path, so
``available`` is False on CPU and the callers keep their other kernels.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ds4x.formats.ggml import GGMLQuantizationType, _iq2xxs_grid_cpu
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.formats.triton_mode import HAVE_TRITON, interpret_mode, triton

T = GGMLQuantizationType
_CODES = {T.IQ2_XXS: 16, T.Q2_K: 10}  # the kernel's QTYPE

try:  # Gluon is experimental in Triton 3.x; without it the callers use the other kernels
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAVE_GLUON = HAVE_TRITON
except Exception:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False


if HAVE_GLUON:

    @gluon.jit
    def _prmt(a, b, sel):
        # byte i of the result: byte (sel >> 4 i) & 7 of the 8 bytes b:a
        return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _bf16x2(lo, hi):
        # two float32 -> one word of two bf16 (round to nearest even), lo in the low half
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _ld16(p):
        return gl.load(p.to(gl.pointer_type(gl.uint16))).to(gl.int32)

    @gluon.jit
    def _fetch_iq2_xxs(rowp, k0, grp, K, SPLIT: gl.constexpr):
        # the raw fields of the K step at k0 (128 weights = 4 groups of 32): the block scale, and per group the
        # four grid indices (two uint16) and the sign / scale word (two uint16; blocks are only 2-byte aligned).
        # SPLIT rows: a group's 8 bytes at 8 * group, the block scales after the K / 4 code bytes
        if SPLIT:
            dp = rowp + K // 4 + 2 * (k0 // 256)
            gp = rowp + 8 * (k0 // 32 + grp)
        else:
            dp = rowp + (k0 // 256) * 66
            gp = dp + 2 + 8 * ((k0 % 256) // 32 + grp)  # [BN, 4, 1, 1]
        return _ld16(dp), _ld16(gp), _ld16(gp + 2), _ld16(gp + 4), _ld16(gp + 6)

    @gluon.jit
    def _popc(v):
        return gl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [v], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _words_iq2_xxs(d16, lo, hi, a_lo, a_hi, levels_tab, ent, pw):
        # [BN, 4, 4, 4] words: pair pw of grid entry ent of each group; a thread holds whole groups, so a group's
        # scale and scaled magnitudes are computed once. The entry's levels come from a 512-byte table (random
        # gathers cost L1 cycles per distinct line: wider tables were slower), the pair's selector and sign
        # mask are computed from them and from the stored sign bits
        d = d16.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        aux = a_lo | (a_hi << 16)
        db = d * (((aux >> 28) & 15).to(gl.float32) * 0.25 + 0.125)
        va = _bf16x2(db * 8.0, db * 25.0)
        vb = _bf16x2(db * 43.0, db * 43.0)
        gi = (gl.where(ent < 2, lo, hi) >> (8 * (ent % 2))) & 255
        levels = gl.load(levels_tab + gi).to(gl.int32)  # weight j's level (0, 1, 2: 8, 25, 43) at bits 2j, 2j + 1
        x = (levels >> (4 * pw)) & 15  # the pair's two levels
        sel = ((x & 3) | ((x >> 2) << 8)) * 0x22 + 0x1010
        s7 = (aux >> (7 * ent)) & 127
        s8 = s7 | ((_popc(s7) & 1) << 7)
        neg = ((s8 >> (2 * pw)) * 0x40008000) & -2147450880  # 0x80008000: bit 15 from sign 2 pw, bit 31 from 2 pw + 1
        return _prmt(va + 0 * sel, vb + 0 * sel, sel) ^ neg

    @gluon.jit
    def _fetch_step(rowp, k0, grp, K, QTYPE: gl.constexpr):
        # one K step's raw fields of the tile's rows, by the weights' type (see the kernel's QTYPE)
        if QTYPE == 16 or QTYPE == 17:
            return _fetch_iq2_xxs(rowp, k0, grp, K, QTYPE == 17)
        else:
            return _fetch_q2_k(rowp, k0, grp)

    @gluon.jit
    def _fetch_q2_k(rowp, k0, unit):
        # the raw fields of the K step at k0 (half h of a block: 4 bit pairs kk x 2 sub-blocks jj x 16 weights): d
        # and dmin, the 8 scale bytes of the half (sub-block 8 h + 2 kk + jj), and the two code words of unit
        # 2 jj + u (code bytes 16 jj + 8 u .. + 7 of the half, which hold its 8 weights in each of the 4 bit pairs)
        h = (k0 % 256) // 128
        bp = rowp + (k0 // 256) * 84
        qp = bp + 16 + 32 * h + 8 * unit  # [BN, 4, 1, 1]
        i32 = gl.pointer_type(gl.int32)
        return (gl.load((bp + 80).to(i32)), gl.load((bp + 8 * h).to(i32)), gl.load((bp + 8 * h + 4).to(i32)),
                gl.load(qp.to(i32)), gl.load((qp + 4).to(i32)))

    @gluon.jit
    def _words_q2_k(dd, s_lo, s_hi, q0, q1, unit, kk, pw):
        # [BN, 4, 4, 4] words: pair pw of unit `unit` in bit pair kk (weights 32 kk + 8 unit + 2 pw, + 1)
        d = (dd & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        dmin = (dd >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        sc = (gl.where(kk < 2, s_lo, s_hi) >> (16 * (kk % 2) + 8 * (unit // 2))) & 255  # [BN, 4, 4, 1]
        dl = d * (sc & 15).to(gl.float32)
        ml = dmin * (sc >> 4).to(gl.float32)
        va = _bf16x2(-ml, dl - ml)
        vb = _bf16x2(dl * 2.0 - ml, dl * 3.0 - ml)
        q = gl.where(pw < 2, q0, q1) >> (16 * (pw % 2))  # code bytes of weights 2 pw, 2 pw + 1
        codes = (q >> (2 * kk)) & 0x0303  # the first weight's code in byte 0, the second's in byte 1
        sel = codes * 0x22 + 0x1010  # nibbles 2 c0, 2 c0 + 1, 2 c1, 2 c1 + 1: value c's bytes in b:a
        return _prmt(va + 0 * sel, vb + 0 * sel, sel)

    @gluon.jit
    def _register_operand(words, BN: gl.constexpr, DOT_A: gl.constexpr):
        # words [BN, t, a, b] (pairs of two bf16 in `register_words_layout`) -> the A operand [BN, 128] bf16 whose
        # column 32 a + 8 b + 2 t + e is half e of pair (t, a, b): the place the operand's layout gives that pair
        halves = gl.join((words & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True),
                         (words >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True))
        return gl.convert_layout(gl.reshape(gl.permute(halves, (0, 2, 3, 1, 4)), [BN, 128]), DOT_A)

    @gluon.constexpr_function
    def register_words_layout(bn: int, warps: int):
        """The layout of REG_W's decoded words [bn rows, 4 (t), 4 (a), 4 (b)]: the thread that holds the wgmma A
        operand's (row, columns 32 a + 8 b + 2 t + {0, 1}) holds word (row, t, a, b) (4 warps of 16 rows per 64-row
        product; rows past 16 x warps repeat in registers)."""
        regs = [[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 2, 0], [8, 0, 0, 0]]
        regs += [[16 * warps << i, 0, 0, 0] for i in range((bn // (16 * warps)).bit_length() - 1)]
        lanes = [[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes,
                                          warp_bases=[[16 << i, 0, 0, 0] for i in range(warps.bit_length() - 1)],
                                          block_bases=[], shape=[bn, 4, 4, 4])

    @gluon.constexpr_function
    def words_layout(warps: int):
        """The layout of the decoded words when they go through shared memory: a thread holds a group / unit of a
        row, and a warp's lanes run over 8 rows of one group first, so a quarter-warp's 16-byte stores meet 8 bank
        groups of the 128-byte swizzle (lanes over 2 rows x 4 groups met groups g and g + 2 of a row in one: H100,
        `scripts/routed_wgmma_ab.py`, the default tiles 4-6% faster at 1,024 / 4,096 tokens, Q2_K at 130 18%)."""
        return gl.BlockedLayout([1, 1, 4, 4], [8, 4, 1, 1], [warps, 1, 1, 1], [3, 2, 0, 1])

    @gluon.jit
    def _routed_wgmma_kernel(x_ptr, w_ptr, tab_ptr, c_expert, c_start, c_len, order_ptr, y_ptr, N, K, row_bytes,
                             expert_bytes, stride_x, stride_y, X_DIV: gl.constexpr, QTYPE: gl.constexpr,
                             BT: gl.constexpr, BN: gl.constexpr, REG_W: gl.constexpr,
                             X_ASYNC: gl.constexpr, num_warps: gl.constexpr):
        """L4 (made here from REG_W, BN and num_warps: Triton passes a kernel's constexprs to its JIT hooks as JSON,
        which a layout argument broke under `ds4x.kernels.jit_watch`): the layout of the decoded step as words [rows,
        4, 4, 4 pairs]: IQ2_XXS [rows, group, grid entry, pair] (a thread holds a group), Q2_K [rows, unit, bit pair,
        pair] (a thread holds a unit's 8 code bytes).
        REG_W: the words go straight into the registers of the wgmma A operand (L4 = `register_words_layout`: a
        thread holds its rows' pairs where that operand wants them, the step's columns permuted, in x too, to
        match), so the weights never pass through shared memory; else they are stored to a shared tile in k order.
        X_ASYNC: the activations come by cp.async into three shared buffers (the copy of step i + 1 in flight while
        step i decodes) instead of through registers one step ahead, which at 64-128 pairs a chunk took 64-128
        registers a thread and made the tile spill."""
        STEP: gl.constexpr = 128
        if REG_W:
            L4: gl.constexpr = register_words_layout(BN, num_warps)
        else:
            L4: gl.constexpr = words_layout(num_warps)
        LX: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (STEP // 8), STEP // 8], [num_warps, 1], [1, 0])
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BT, 16])
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        SH16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SH32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)

        c = gl.program_id(1)
        n_valid = gl.load(c_len + c)
        if n_valid > 0:  # the chunk table has a static length; chunks past the used ones are empty
            row0 = gl.program_id(0) * BN
            e = gl.load(c_expert + c).to(gl.int64)
            first = gl.load(c_start + c)
            if not REG_W:
                w_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, STEP], SH16)
            x_smem = gl.allocate_shared_memory(gl.bfloat16, [3 if X_ASYNC else 2, BT, STEP], SH16)

            rows = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
            # rows past N decode row N - 1 (never stored), so no weight load needs a mask
            rowp = w_ptr + e * expert_bytes + gl.minimum(rows, N - 1).to(gl.int64)[:, None, None, None] * row_bytes
            grp = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
            grp = grp[None, :, None, None]
            ent = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
            ent = ent[None, None, :, None]
            pw = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
            pw = pw[None, None, None, :]

            t_x = gl.arange(0, BT, layout=gl.SliceLayout(1, LX))
            pair_x = gl.load(order_ptr + first + gl.minimum(t_x, n_valid - 1))  # padding rows repeat the last
            xrow = x_ptr + (pair_x // X_DIV).to(gl.int64)[:, None] * stride_x
            kx = gl.arange(0, STEP, layout=gl.SliceLayout(0, LX))[None, :]
            if REG_W:  # column k of the A operand holds weight phys(k) of the step (see register_words_layout)
                a_, b_, t_, e_ = kx >> 5, (kx >> 3) & 3, (kx >> 1) & 3, kx & 1
                if QTYPE == 16 or QTYPE == 17:
                    kx = 32 * t_ + 8 * a_ + 2 * b_ + e_
                else:
                    kx = 32 * a_ + 8 * t_ + 2 * b_ + e_
                kx = gl.max_contiguous(gl.multiple_of(kx, [1, 2]), [1, 2])  # pairs stay whole: 4-byte copies

            acc = gl.zeros([BN, BT], gl.float32, layout=ACC)
            n_steps = K // STEP
            # raw fields are fetched two steps ahead and the activations one step ahead (registers), so the
            # DRAM latency overlaps the decode of earlier steps
            a0, a1, a2, a3, a4 = _fetch_step(rowp, 0, grp, K, QTYPE)
            b0, b1, b2, b3, b4 = _fetch_step(rowp, gl.minimum(STEP, K - STEP), grp, K, QTYPE)
            if X_ASYNC:
                async_copy.async_copy_global_to_shared(x_smem.index(0), xrow + kx)
                async_copy.commit_group()
            else:
                xt = gl.load(xrow + kx)
            for i in range(n_steps):
                k0 = i * STEP
                s = i % 2
                k2 = gl.minimum(k0 + 2 * STEP, K - STEP)  # past the end: fetch the last step again (unused)
                if X_ASYNC:
                    c0, c1, c2, c3, c4 = _fetch_step(rowp, k2, grp, K, QTYPE)
                if QTYPE == 16 or QTYPE == 17:
                    words = _words_iq2_xxs(a0, a1, a2, a3, a4, tab_ptr, ent, pw)
                else:
                    words = _words_q2_k(a0, a1, a2, a3, a4, grp, ent, pw)
                    if not REG_W:
                        words = gl.permute(words, (0, 2, 1, 3))
                x_at = xrow + gl.multiple_of(gl.minimum(k0 + STEP, K - STEP), STEP) + kx
                if REG_W:
                    a_op = _register_operand(words, BN, DOT_A)
                gl.thread_barrier()  # every warp has seen the wgmma of step i - 2 (the last reader of buffer s) retire
                if X_ASYNC:  # step i + 1's activations into the buffer step i - 2 read (past the end: unused)
                    async_copy.async_copy_global_to_shared(x_smem.index((i + 1) % 3), x_at)
                    async_copy.commit_group()
                if not REG_W:
                    w_smem.index(s)._reinterpret(gl.int32, [BN, STEP // 2], SH32).store(
                        gl.reshape(words, [BN, STEP // 2]))
                if X_ASYNC:
                    xs = x_smem.index(i % 3)
                    async_copy.wait_group(1)  # this thread's copies of step i are in
                else:
                    xs = x_smem.index(s)
                    xs.store(xt)
                fence_async_shared()
                gl.thread_barrier()
                # at most one wgmma in flight: the buffers written next were read by the one just retired
                if REG_W:
                    # synchronous: with the next step decoded while this product ran (its operand kept alive as a
                    # wait's dependency), the products were wrong at 64 and 128 pairs a chunk and at 128 rows on 8
                    # warps (H100, 6aad713); that sm_90 SASS rewrote R88, an A register of the product in flight, at
                    # the top of the next step
                    acc = warpgroup_mma(a_op, xs.permute((1, 0)), acc)
                else:
                    acc = warpgroup_mma(w_smem.index(s), xs.permute((1, 0)), acc, is_async=True)
                if not X_ASYNC:
                    # loaded after the fence above (on sm_90 a MEMBAR.ALL.CTA, which by the timings waits for the
                    # thread's loads in flight), so they stay in flight until the next step's fence. H100, us,
                    # prompts' tiles, before / after: IQ2_XXS gate 1,024 tokens 2,430 / 2,378, 4,096 tokens 2,651 /
                    # 2,529; Q2_K down 1,464 / 1,440 and 2,338 / 2,292. With X_ASYNC they stay before it: after it
                    # its x async tiles measured 2-42% slower (most 12-23%)
                    c0, c1, c2, c3, c4 = _fetch_step(rowp, k2, grp, K, QTYPE)
                    x_next = gl.load(x_at)
                if not REG_W:
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                a0, a1, a2, a3, a4 = b0, b1, b2, b3, b4
                b0, b1, b2, b3, b4 = c0, c1, c2, c3, c4
                if not X_ASYNC:
                    xt = x_next
            if not REG_W:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if X_ASYNC:  # the last step's spare copy lands before the CTA's shared memory can go to another
                async_copy.wait_group(0)
            r_o = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
            t_o = gl.arange(0, BT, layout=gl.SliceLayout(0, ACC))
            pair_o = gl.load(order_ptr + first + gl.minimum(t_o, n_valid - 1))
            yp = y_ptr + pair_o.to(gl.int64)[None, :] * stride_y + r_o[:, None]
            gl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=(r_o < N)[:, None] & (t_o < n_valid)[None, :])


@lru_cache(maxsize=8)
def iq2_xxs_levels(device: torch.device) -> torch.Tensor:
    """uint16 [256] as int16: grid entry g's 8 level indices (magnitudes 8 / 25 / 43 -> 0 / 1 / 2), weight j at
    bits 2j, 2j + 1."""
    mags = _iq2xxs_grid_cpu()
    level = (mags > 8).long() + (mags > 25).long()
    packed = (level << (2 * torch.arange(8))).sum(1)
    return ((packed + 2**15) % 2**16 - 2**15).to(torch.int16).to(device)


def hopper(device: torch.device) -> bool:
    """Whether the kernel can run on ``device`` (an sm_90 GPU, Gluon present, not the interpreter)."""
    return (HAVE_GLUON and not interpret_mode() and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] == 9)


def available(x: torch.Tensor, w: GGMLTensor) -> bool:
    """Whether :func:`routed_wgmma` can run this product here."""
    return (x.dtype == torch.bfloat16 and w.qtype in _CODES and w.ndim == 3
            and (w.layout != "split" or w.qtype == T.IQ2_XXS) and w.shape[-1] % 256 == 0
            and w.raw.is_contiguous() and w.raw.data_ptr() % 16 == 0
            and w.row_bytes % 4 == 0 and hopper(x.device))


# the weights decoded straight into the wgmma's register operand (`_routed_wgmma_kernel` REG_W), with its own tiles
# (64 weight rows a program: 128 take too many registers); off until timed on a GPU (scripts/routed_wgmma_ab.py)
REGISTER_WEIGHTS = False
# the activations by cp.async into shared memory (`_routed_wgmma_kernel` X_ASYNC) instead of through registers; off
# until timed on a GPU
ASYNC_ACTIVATIONS = False
# the kernel's variants by name: (REGISTER_WEIGHTS, ASYNC_ACTIVATIONS), for A/Bs and tests
VARIANTS = {"shared": (False, False), "x async": (False, True), "regs": (True, True)}


def register_weights_fit(bn: int, warps: int) -> bool:
    """Whether REGISTER_WEIGHTS serves a tile of ``bn`` rows on ``warps`` warps (whole 16-row slices per warp)."""
    return bn % (16 * warps) == 0


def wgmma_config(qtype: GGMLQuantizationType, pairs_per_expert: float) -> tuple[int, int, int]:
    """(BT pairs per chunk, BN rows per program, warps) for ``pairs_per_expert`` pairs per expert on average: the
    fastest measured (H200, Flash expert shapes, 256 experts x 6 per token at 130 / 1,024 / 4,096 tokens; see
    docs/PROFILE.md)."""
    if REGISTER_WEIGHTS:  # not measured: 64 rows on 4 warps, the chunk as wide as the shared-memory configs'
        return (16, 64, 4) if pairs_per_expert <= 16 else (64, 64, 4) if pairs_per_expert <= 48 else (128, 64, 4)
    if qtype == T.IQ2_XXS:
        return (16, 128, 4) if pairs_per_expert <= 16 else (128, 64, 4)
    return (16, 64, 4) if pairs_per_expert <= 16 else (64, 128, 4) if pairs_per_expert <= 48 else (128, 128, 8)


def chunk_tables(ids: torch.Tensor, n_exp: int, bt: int) -> tuple[torch.Tensor, ...]:
    """(order, chunk expert, chunk first sorted pair, chunk length, chunk count bound): the pairs sorted by expert
    and cut into chunks of at most ``bt`` pairs of one expert, on the device without a host sync (the bound is
    static: ceil(pairs / bt) + experts; chunks past the used ones have length 0), so a launch over them can live in
    a CUDA graph. Also the skinny kernel's chunks (quant_matmul)."""
    dev = ids.device
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices.to(torch.int32)
    # scatter_add rather than bincount: no host sync
    counts = torch.zeros(n_exp, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    n_chunks = (counts + bt - 1) // bt
    first_chunk = torch.cumsum(n_chunks, 0) - n_chunks
    first_pair = torch.cumsum(counts, 0) - counts
    bound = -(-flat.numel() // bt) + n_exp
    slot = torch.arange(bound, device=dev)
    c_exp = torch.searchsorted(first_chunk + n_chunks, slot, right=True).clamp(max=n_exp - 1)
    within = slot - first_chunk[c_exp]
    c_start = (first_pair[c_exp] + within * bt).to(torch.int32)
    c_len = torch.clamp(counts[c_exp] - within * bt, 0, bt)
    c_len = torch.where(within < n_chunks[c_exp], c_len, 0).to(torch.int32)
    return order, c_exp.to(torch.int32), c_start, c_len, bound


def routed_wgmma(x: torch.Tensor, w: GGMLTensor, ids: torch.Tensor, x_div: int,
                 config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y [P, N] (P = ids.numel()), row p = x[p // x_div] @ W[ids[p]].T; x bf16 [rows, K] on a Hopper GPU."""
    if not available(x, w):
        raise RuntimeError("routed_wgmma needs bf16 CUDA activations on sm_90, Gluon, and IQ2_XXS / Q2_K experts")
    n_exp, n, k = w.shape
    flat = ids.reshape(-1)
    y = torch.empty((flat.numel(), n), dtype=x.dtype, device=x.device)
    if flat.numel() == 0:
        return y
    x = x.contiguous()
    bt, bn, nw = config if config is not None else wgmma_config(w.qtype, flat.numel() / n_exp)
    order, c_exp, c_start, c_len, bound = chunk_tables(flat, n_exp, bt)
    tab = iq2_xxs_levels(x.device) if w.qtype == T.IQ2_XXS else c_len  # Q2_K reads no table
    grid = (triton.cdiv(n, bn), bound)
    reg_w = REGISTER_WEIGHTS and register_weights_fit(bn, nw)
    _routed_wgmma_kernel[grid](x, w.raw, tab, c_exp, c_start, c_len, order, y, n, k, w.row_bytes,
                               n * w.row_bytes, x.stride(0), y.stride(0), X_DIV=x_div,
                               QTYPE=_CODES[w.qtype] + (w.layout == "split"), BT=bt, BN=bn, REG_W=reg_w,
                               X_ASYNC=ASYNC_ACTIVATIONS, num_warps=nw)
    return y

