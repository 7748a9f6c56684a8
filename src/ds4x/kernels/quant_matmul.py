"""Triton products straight from GGML blocks (Q8_0, Q2_K, Q4_K, IQ2_XXS) for CUDA.

``y = x @ W.T`` where ``W`` is a :class:`~ds4x.formats.ggml_tensor.GGMLTensor` ``[N, K]`` (or an
expert of ``[E, N, K]``). The weight is never expanded to a dense buffer: each program reads its
rows' blocks, decodes them in registers and accumulates in float32.

Two kernels:

* ``_qmv_kernel`` (matvec, 1 to ``MATVEC_MAX_ROWS`` activation rows per weight): a program owns R
  weight rows of one (activation row, expert) pair and walks K in steps of U "units". Its tile is
  ``[U, R]``: one unit per thread (lanes and warps along K), the R rows in each thread's registers.
  A unit is the run of weights one thread decodes at once, sized so that scales apply to in-thread
  sums (Q8_0: a quarter block, 8 weights; Q4_K: one code word, 8; Q2_K: 16 code bytes, 64;
  IQ2_XXS: one 32-weight group). Every tile keeps that one layout, so nothing goes through shared
  memory until the final sum; weight loads are unmasked 2/4/8-byte loads (rows past N read row N - 1).
* ``_qmm_kernel`` (skinny matrix, up to ``DOT_MAX_ROWS`` rows): the decoded ``[BN, BK]`` tile goes
  through ``tl.dot`` against ``BM`` activation rows (in x's dtype; float32 activations use TF32 on
  GPU), for rows that share one expert. Its 4-D tiles ``[BN, G, W, V]`` decode G scale groups of
  W * V weights in their natural order.

A batched decode step (mirrors on, see ``use_dense_mirrors``) sends 2 to ``TOKEN_TILE_MAX_ROWS`` rows of a split
Q8_0 product, and `dense_token_tile` 2 to ``DENSE_TOKEN_TILE_MAX_ROWS`` rows of a dense 16-bit one, to
``_token_tile_kernel``: a program owns R weight rows and the rows' tokens, loads each weight word once and
multiplies it into every token (Q8_0: dp4a against x quantized once per 16 values by ``quantize_activations``), so
the weights are read once for the batch instead of once per row (the matvec) or as a 2-byte mirror.

Routed products with a few or more pairs per expert (prompts, prefill chunks) go on Hopper to a third kernel,
:mod:`ds4x.kernels.routed_wgmma` (IQ2_XXS / Q2_K tiles decoded once per chunk of an expert's pairs into shared memory,
multiplied on the tensor cores; see ``WGMMA_MIN_PAIRS_PER_EXPERT``).

The routed Q2_K matvec of a batched step reads x quantized once per row (``Q2_K_PREPARED_ACTIVATIONS``, from
``Q2_K_PREPARED_MIN_PAIRS`` pairs). Such choices are module attributes (A/B switches: that one, ``EXPERT_PAIRS``,
``PREPARED_ACTIVATIONS``); ``scripts/device_ab.sh`` times them in a batched decode step.

Both take an optional expert id per (activation row, slot) pair: the routed-expert form
``y[t, j] = x[t] @ W[ids[t, j]].T`` (and the grouped output projection, whose groups are "experts"
of one row each). Above 64 rows ``quant_linear`` / ``quant_grouped_linear`` decode the weight once with
``_dequant_kernel`` (``dequantize_gpu``: the skinny kernel's tiles, stored) and call the dense GEMM; routed
products past the matvec's range with bf16 activations decode the experts a slice at a time and call
``torch._grouped_mm`` (prefill: see ``GROUPED_SCRATCH_BYTES``). Byte layouts are in :mod:`ds4x.formats.ggml`.

Float path (all types; Q8_0 and Q4_K only have this one): weights are decoded exactly (the
reference's float operations for scales and codes); sums are ``scale * sum(code * x)`` per scale
group, so only rounding order differs from dequantize-then-matmul (relative error ~1e-7).

Int8-activation path (Q8_0, Q2_K and IQ2_XXS, the default for all three, see ``INT8_ACTIVATIONS``;
``int8=`` or DS4X_QUANT_ACT=float / int8 chooses): each program quantizes its x slice to int8, one scale per
16 values (Q8_0: per 8, its unit; round to nearest), and multiplies codes with integer dot products
(``dp4a``); the Q2_K min term uses the exact float sum of x. Relative error ~5e-3 to 8e-3 on random data
(tests allow 2e-2). The weights are still exact; the CPU reference never quantizes activations. The routed gate /
up of a decode step (``quant_routed_swiglu``: both products and SwiGLU in one matvec launch) may instead read x
quantized once beforehand by ``quantize_activations`` (the same quantization, so the same bits).

Batch invariance: the matvec computes every (row, expert) pair alone with a configuration chosen
without looking at the number of rows, so a row gets the same bits with 1 to ``MATVEC_MAX_ROWS``
rows in the call (checked bitwise on an H200 for 1, 3 and 16 rows). Past that the skinny kernel
(TF32 / bf16 tensor cores) and then the dense GEMM give other bits, as do the token tile and the mirrors, which
serve batched rows only where mirrors are on (the server's batched decode, where batch invariance is not asked).

The interpreter (``TRITON_INTERPRET=1``) runs the same kernels on CPU tensors for parity tests
(``dp4a`` and byte permutes are emulated there); like ``formats/rows_triton.py`` this module keeps a
private copy of itself for the mode it was not imported under.

Speed (``scripts/quant_matmul_bench.py [out.json | out_dir [deadline_s]]``: parity and timing of every
case; H200, 2026-12-02, copy bandwidth ~4,220 GB/s, random valid blocks, CUDA-graph replay over weight
copies; benchmarks/quant_matmul_h200.json and the ledger). 1 activation row, share of copy bandwidth:
Q8_0 in split rows (what the model runs on CUDA; file blocks in brackets) wo_b 8192->4096 57.9% (49.5%), wo_a
grouped 55.3% (48.7%), wq_b 1024->32768 48.6% (46.8%), wq_a 4096->1024 ~23% (4.5 MB: 4.4 us, launch and ramp
dominate); IQ2_XXS expert gate 4096->2048 (cd8ee19): 6 routed experts 15.2% float / 15.1% int8 (20.2 / 20.3 us),
12 (gate and up stacked) 17.5% / 17.3% (35.2 / 35.5 us), one expert 8.8% / 7.9%; Q2_K expert down 2048->4096: 6
experts 29.7% int8 / 19.7% float, one expert 15.4% / 9.1%; Q4_K 13.1% (c24abde). The targets (60% Q8_0, 50% for
the 2-bit types) are not reached. One expert is 2.2-2.8 MB, about 0.6 us of reading: its 4-7 us are launch, DRAM
latency and the final reduction. IQ2_XXS reads its grid as 4-bit level indices from a 1 KB table and ORs in
the signs from a 512-byte table indexed by the 7 stored sign bits (the parity sign included), so one byte
permute per 4 weights gives signed levels; the earlier form that derived the signs with bit arithmetic ran
43% (float) / 48% (int8) more sm_90 instructions and took 44.1 us for 12 slots. Q8_0 runs ~6.5 instructions per
weight with no layout conversion in its loop. With more rows
the matvec re-reads W per row but still beats the skinny kernel: Q8_0 wo_b 2 / 4 / 8 / 16 rows 23.4 / 39.1 /
72.5 / 139 us against 234 / 233 us for 8 / 16 rows, hence ``MATVEC_MAX_ROWS = 16``; 6 routed IQ2_XXS experts
for 8 tokens: 159 us (the skinny kernel took 4.3 ms in an earlier run).

2026-12-04 (H200, int8 activations, the configurations of `matvec_config`): IQ2_XXS routed gate / up, 12 slots,
in split rows 22.8 us (26.8%); the 12 slots' instructions, not their table reads, bound it: keeping the grid and
sign tables in shared memory instead of reading them through L1 changed nothing with int8 activations. Q2_K
routed down 11.9 us (32.6%). Q8_0 split rows: wq_b 66%, wo_a grouped 66%, wo_b 69%, output head 97%, shared
gate / up 56%, shared down 39%, wq_a 21%.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from typing import Any, NamedTuple

import torch

from ds4x.formats.ggml import GGMLQuantizationType, _iq2xxs_grid_cpu
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.formats.pdl import launch_options
from ds4x.formats.triton_mode import HAVE_TRITON, interpret_mode, module_for_current_mode, tl, triton
from ds4x.kernels import routed_wgmma
from ds4x.memory import free_memory

T = GGMLQuantizationType
log = logging.getLogger(__name__)
# type -> (code for the kernels, weights per scale group S, block bytes, block weights, matvec unit weights)
_TYPES = {
    T.Q8_0: (8, 32, 34, 32, 8),
    T.Q2_K: (10, 16, 84, 256, 64),
    T.Q4_K: (12, 32, 144, 256, 8),
    T.IQ2_XXS: (16, 32, 66, 256, 32),
}
SUPPORTED = tuple(_TYPES)
# dense 16-bit weights through the matvec (`dense_linear`): GGML type -> the same fields (8 weights a unit)
_DENSE_TYPES = {T.BF16: (30, 1, 2, 1, 8), T.F16: (1, 1, 2, 1, 8)}
_DENSE_QTYPE = {torch.bfloat16: T.BF16, torch.float16: T.F16}
# Dense 16-bit weights multiply through the matvec up to this many rows: cuBLAS picks split-K GEMM kernels at a
# few rows, which reached ~0.7 TB/s on the Flash compressor / indexer / router shapes of a decode step (H200,
# 4K decode profile at 4270d51: 981 us over 273 launches for ~0.7 GB)
DENSE_MATVEC_MAX_ROWS = 4
MATVEC_MAX_ROWS = 16  # up to this many rows per (weight, expert) the matvec kernel wins (it re-reads W per row)
DOT_MAX_ROWS = 64  # above this quant_linear dequantizes once and uses the dense GEMM
# routed experts (prefill spreads T * k pairs over the experts): where the matvec stops winning, by type. H200,
# 2026-12-01, Flash shapes, 256 experts, k = 6, ms matvec / skinny: IQ2_XXS gate 4096->2048 at 128 / 256 / 512 /
# 2048 tokens (3 / 6 / 12 / 48 pairs per expert) 2.56 / 3.91, 5.10 / 4.07, 10.18 / 4.36, 40.7 / 6.17; Q2_K down
# 2048->4096 at 512 / 2048 tokens 3.21 / 6.95, 13.28 / 9.92
ROUTED_MATVEC_MAX_ROWS = {T.IQ2_XXS: 4, T.Q2_K: 32}
# Types whose matvec quantizes the activations to int8 unless told otherwise (DS4X_QUANT_ACT=float turns it off
# everywhere). A whole decode step measures the gain (H200, full Flash q2 mix, seed 0, f5a3847, back to back): 4K
# 8.99 -> 8.55 ms, 1M 10.17 -> 9.76 (in isolation the IQ2_XXS kernel was no faster, cd8ee19: 12 routed slots 35.5
# us int8 against 35.2; Q8_0 wo_b 58.1 -> 63.6% of copy bandwidth, the others within 2%). What it costs the
# trained tiny model (scripts/act_quant_quality.py, emulated on the CPU with Q8_0 weights, 512 held-out tokens):
# activations per 8 values move the logits by 1.2% RMS, per 16 by 1.7%, against 1.5% for Q8_0 weights instead of
# float32 ones; the mean log-likelihood within 0.001 nats of float activations either way.
INT8_ACTIVATIONS = frozenset({T.Q2_K, T.Q8_0, T.IQ2_XXS})
# Past the routed matvec's range, bf16 activations outside a CUDA-graph capture take the grouped path: decode the
# experts to bf16 (dequantize_gpu) a slice at a time, then one torch._grouped_mm per slice. H200, Flash shapes, 2,048
# tokens x 6 of 256 experts, ms grouped / best skinny config / default skinny config: IQ2_XXS gate 3.64 / 4.58 / 6.17,
# Q2_K down 3.67 / 6.12 / 9.91 (scripts/prefill_sweep.py). The decode writes and the GEMM reads every bf16 weight
# once (2 x 4.3 GB per matrix), so the path is bandwidth-bound on its scratch, not on the blocks.
GROUPED_SCRATCH_BYTES = 1 << 30  # bf16 experts decoded at once (the GEMM per slice needs one host sync)
# Dense mirrors (off unless ``use_dense_mirrors(True)``: the server's batched decode turns them on). From
# MIRROR_MIN_ROWS rows a Q8_0 matrix multiplies through a copy of itself decoded once to the activations' dtype
# (kept on the weight) and the dense GEMM, which reads 2 bytes per weight once, where the matvec reads ~1.06
# bytes per weight per row and the skinny kernel, with one program per 64 output rows, is latency-bound. H200,
# bf16, us blocks / mirror at 1, 2, 3 rows (32 rows): wq_b 1024->32768 14.1 / 18.1, 26.0 / 18.3, 37.9 / 18.4
# (81.9 / 19.3); wo_b 8192->4096 11.7 / 21.7, 22.2 / 21.7, 31.4 / 21.9 (160.5 / 23.1); wo_a grouped 11.9 / 18.4,
# 22.5 / 18.2; head 129280 x 4096 158.8 / 237.9, 315.4 / 237.6; wq_a 4096->1024 3.2 / 6.5, 4.7 / 6.6, 6.1 / 6.6,
# 7.4 / 6.5 at 4 rows. The 259 mirrors of Flash q2 take ~9.6 GB; 32 sessions' step 175 -> 149 ms.
# Routed products with at least this many (row, expert) pairs per expert on average go to the Hopper tensor-core
# kernel (kernels/routed_wgmma.py: each weight tile decoded once per chunk of pairs of one expert) where it runs;
# DS4X_ROUTED_WGMMA=off keeps them on the matvec / grouped paths. H200 (7173fca), Flash shapes, 256 experts, 6 per
# token, us matvec or grouped / tensor-core kernel at 32 / 130 / 512 / 1,024 / 4,096 tokens (0.75 / 3 / 12 / 24 / 96
# pairs per expert): IQ2_XXS gate 412 / 770, 1,644 / 1,227, 3,801 (grouped) / 1,427, 3,930 (grouped) / 2,390,
# 4,010 (grouped) / 2,557; Q2_K down 212 / 532, 822 / 851, 3,676 (grouped) / 1,011, 3,751 (grouped; the matvec
# ~6,400) / 1,472, 4,086 (grouped) / 2,370. The thresholds sit between measured points (none between 3 and 12).
WGMMA_MIN_PAIRS_PER_EXPERT = {T.IQ2_XXS: 2, T.Q2_K: 4}
MIRROR_TYPES = frozenset({T.Q8_0})
MIRROR_MIN_ROWS = 2
# Where mirrors are on, 2 .. TOKEN_TILE_MAX_ROWS rows of a Q8_0 product (split rows, int8 activations) take
# `_token_tile_kernel` instead: x quantized once per 16 values (`quantize_activations`), each weight word loaded
# once and multiplied into up to 8 tokens by dp4a, so it reads the ~1.06 bytes per weight once where the mirror
# reads 2. H200, Flash shapes, us bf16 mirror + cuBLAS / token tile at 2, 4, 8 rows (devrun/q8_tokens.py at
# 02ed158, graphs over weight copies, x quantized beforehand): wq_a 4096->1024 7.9 / 4.3, 7.8 / 4.4, 7.7 / 4.8;
# wq_b 1024->32768 19.5 / 10.9, 19.8 / 12.4, 19.7 / 16.5; wo_a grouped 19.7 / 11.2, 19.4 / 12.6, 20.1 / 15.9;
# wo_b 8192->4096 22.4 / 12.3, 22.8 / 13.7, 23.0 / 17.4; 4096->4096 13.6 / 7.7, 13.5 / 8.2, 13.5 / 10.0;
# 2048->4096 7.3 / 5.0, 7.3 / 5.4, 7.3 / 6.1. Its dp4a count grows with the tokens (2.1 TB/s of blocks at 8 rows),
# so more rows keep the mirror.
TOKEN_TILE_MAX_ROWS = 8
# Dense 16-bit weights (`dense_token_tile`, the compressor / indexer / router projections) up to this many rows: in
# a batched step against cuBLAS (H200, flash:q2, replayed step, ms, ledger rows of 0fb1600): 4 sessions 9.96-9.97
# against 10.25-10.27, 8 sessions 14.62-14.64 against 14.50-14.52 (at 8 rows its FMAs bound it)
DENSE_TOKEN_TILE_MAX_ROWS = 4
# Most tokens a program of the token tile takes (more rows: programs over token blocks, each re-reading its rows)
TILE_TOKENS = {"q8_0": 8, "dense": 4}
MIRROR_RESERVE_BYTES = 4 << 30  # device memory a mirror must leave free
_mirrors = {"on": False, "refused": False}


_DEFINED_INTERPRETED = interpret_mode()


if HAVE_TRITON:
    from ds4x.formats.pdl import wait_upstream

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

    # ---- skinny-matrix tiles ------------------------------------------------------------------------
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
        words = tl.load((wp + boff + 2 + 2 * wi).to(tl.pointer_type(tl.int16)), mask=m, other=0).to(tl.int32)
        v = tl.arange(0, 2)[None, None, None, :]
        q = _magic(((words >> (8 * v)) & 255) ^ 128, 128.0)  # int8 = (byte ^ 128) - 128
        return q * d

    @triton.jit
    def _tile_q8_0_split(wp, rowoff, rmask, k0, K, G: tl.constexpr):
        # [BN, G, 8, 4]: split-layout Q8_0 rows (GGMLTensor.split): block blk's 32 codes are the 8 int32 words
        # at byte 32 blk of the row, its fp16 scale is at byte K + 2 blk
        blk = k0 // 32 + tl.arange(0, G)[None, :, None, None]
        m = rmask & (blk * 32 < K)
        d = _f16(wp, rowoff + K + 2 * blk, m)
        wi = tl.arange(0, 8)[None, None, :, None]
        words = tl.load((wp + rowoff + 32 * blk + 4 * wi).to(tl.pointer_type(tl.int32)), mask=m, other=0)
        v = tl.arange(0, 4)[None, None, None, :]
        q = _magic(((words >> (8 * v)) & 255) ^ 128, 128.0)
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
        words = tl.load((wp + woff).to(tl.pointer_type(tl.int32)), mask=m, other=0)
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
        words = tl.load((wp + woff).to(tl.pointer_type(tl.int32)), mask=m, other=0)
        v = tl.arange(0, 4)[None, None, None, :]
        q = _magic((words >> (8 * v + 4 * (i % 2))) & 15, 0.0)
        return dl * q - ml

    @triton.jit
    def _tile_iq2_xxs(wp, gridp, rowoff, rmask, k0, K, G: tl.constexpr, SPLIT: tl.constexpr):
        # [BN, G, 8, 4]: G groups of 32 = 4 grid entries of 8 (t = 2 * entry + half: 4 weights);
        # signs: a 7-bit index + an even-parity 8th bit; magnitudes from the grid as int32 words. SPLIT rows: a
        # group's 8 bytes at 8 * group, the block scales after the K / 4 code bytes
        grp = k0 // 32 + tl.arange(0, G)[None, :, None, None]
        m = rmask & (grp * 32 < K)
        if SPLIT:
            d = _f16(wp, rowoff + K // 4 + 2 * (grp // 8), m)
            gb = rowoff + 8 * grp
        else:
            boff = rowoff + (grp // 8).to(tl.int64) * 66
            d = _f16(wp, boff, m)
            gb = boff + 2 + 8 * (grp % 8)
        lo = tl.load((wp + gb + 4).to(tl.pointer_type(tl.int16)), mask=m, other=0).to(tl.int32) & 0xFFFF
        hi = tl.load((wp + gb + 6).to(tl.pointer_type(tl.int16)), mask=m, other=0).to(tl.int32) & 0xFFFF
        aux = lo | (hi << 16)
        db = d * (0.5 + _magic((aux >> 28) & 15, 0.0)) * 0.25
        t = tl.arange(0, 8)[None, None, :, None]
        sub = t // 2
        half = t % 2
        idx = tl.load(wp + gb + sub, mask=m, other=0).to(tl.int32)
        s7 = (aux >> (7 * sub)) & 127
        p = s7 ^ (s7 >> 4)
        p = p ^ (p >> 2)
        p = (p ^ (p >> 1)) & 1
        mask8 = s7 | (p << 7)
        v = tl.arange(0, 4)[None, None, None, :]
        gw = tl.load(gridp.to(tl.pointer_type(tl.int32)) + idx * 2 + half)
        mag = _magic((gw >> (8 * v)) & 255, 0.0)
        sbit = (mask8 >> (4 * half + v)) & 1
        return db * tl.where(sbit == 1, -mag, mag)

    @triton.jit
    def _tile(QTYPE: tl.constexpr, wp, gridp, rowoff, rmask, k0, K, G: tl.constexpr):
        if QTYPE == 8:
            out = _tile_q8_0(wp, rowoff, rmask, k0, K, G)
        elif QTYPE == 9:
            out = _tile_q8_0_split(wp, rowoff, rmask, k0, K, G)
        elif QTYPE == 10:
            out = _tile_q2_k(wp, rowoff, rmask, k0, K, G)
        elif QTYPE == 12:
            out = _tile_q4_k(wp, rowoff, rmask, k0, K, G)
        else:
            out = _tile_iq2_xxs(wp, gridp, rowoff, rmask, k0, K, G, QTYPE == 17)
        return out

    # ---- matvec units ------------------------------------------------------------------------------
    # The matvec tile is [U, R]: U "units" along K (one per thread, spread over the lanes and warps)
    # times R weight rows (in each thread's registers). A unit is the run of weights one thread decodes
    # at once, sized so that its scales apply to whole in-thread sums: it loads its own bytes (plain
    # 2- and 4-byte loads, never masked: rows past N read row N - 1 and U divides K's units), its x
    # values (16-byte vector loads, shared by the R rows), and returns its R partial dot products.
    # Everything stays in one layout, so no tile goes through shared memory until the final sum.

    @triton.jit
    def _ld16(p):
        return tl.load(p.to(tl.pointer_type(tl.uint16))).to(tl.int32)

    @triton.jit
    def _ld32(p):
        return tl.load(p.to(tl.pointer_type(tl.int32)))

    @triton.jit
    def _h2f(h):
        # the fp16 in the low 16 bits of an int32 -> float32
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _x4(xp, k):
        # x[k .. k+3] (k [U, 1], a multiple of 4) as four float32 [U, 1]. 16-bit x: one 8-byte load, the values
        # taken apart with bit operations in the tile's own layout (a [U, 4] vector load compiled for sm_90 into
        # 2-byte loads moved between lanes through shared memory, with a barrier per 4 values)
        if xp.dtype.element_ty == tl.bfloat16 or xp.dtype.element_ty == tl.float16:
            w = tl.load((xp + k).to(tl.pointer_type(tl.int64)))
            lo = w.to(tl.int32)
            hi = (w >> 32).to(tl.int32)
            if xp.dtype.element_ty == tl.bfloat16:  # bf16 is the top half of a float32
                x0 = (lo << 16).to(tl.float32, bitcast=True)
                x1 = (lo & -65536).to(tl.float32, bitcast=True)
                x2 = (hi << 16).to(tl.float32, bitcast=True)
                x3 = (hi & -65536).to(tl.float32, bitcast=True)
            else:
                x0, x1, x2, x3 = _h2f(lo), _h2f(lo >> 16), _h2f(hi), _h2f(hi >> 16)
        else:
            v = tl.load(xp + k + tl.arange(0, 4)[None, :]).to(tl.float32)
            a, b = tl.split(tl.reshape(v, (v.shape[0], 2, 2)))
            x0, x2 = tl.split(a)
            x1, x3 = tl.split(b)
            x0, x1, x2, x3 = x0[:, None], x1[:, None], x2[:, None], x3[:, None]
        return x0, x1, x2, x3

    @triton.jit
    def _dot4f(q, sh: tl.constexpr, bits: tl.constexpr, xp, k):
        # sum over bytes v of code((q >> (8v + sh)) & (2**bits - 1)) * x[k + v], and sum of x[k .. k+3]
        x0, x1, x2, x3 = _x4(xp, k)
        m: tl.constexpr = (1 << bits) - 1
        s = (_magic((q >> sh) & m, 0.0) * x0 + _magic((q >> (8 + sh)) & m, 0.0) * x1
             + _magic((q >> (16 + sh)) & m, 0.0) * x2 + _magic((q >> (24 + sh)) & m, 0.0) * x3)
        return s, (x0 + x1) + (x2 + x3)

    @triton.jit
    def _qbits(v, inv):
        # round(v * inv) in the low byte: adding 1.5 * 2**23 leaves the rounded integer in the low mantissa bits
        return (v * inv + 12582912.0).to(tl.int32, bitcast=True)

    @triton.jit
    def _pack4(a, b, c, d, INTERPRET: tl.constexpr):
        # the low bytes of a, b, c, d as one little-endian word (three byte permutes on the GPU)
        if INTERPRET:
            out = (a & 255) | ((b & 255) << 8) | ((c & 255) << 16) | (d << 24)
        else:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t1, t2; prmt.b32 t1, $1, $2, 0x0040; prmt.b32 t2, $3, $4, 0x0040; "
                "prmt.b32 $0, t1, t2, 0x5410; }", "=r,r,r,r,r", [a, b, c, d], dtype=tl.int32, is_pure=True, pack=1)
        return out

    @triton.jit
    def _qword(a, b, c, d, inv, INTERPRET: tl.constexpr):
        # round(v * inv) of four values as one word of 4 little-endian int8 codes
        return _pack4(_qbits(a, inv), _qbits(b, inv), _qbits(c, inv), _qbits(d, inv), INTERPRET)

    @triton.jit
    def _amax4(a, b, c, d):
        return tl.maximum(tl.maximum(tl.abs(a), tl.abs(b)), tl.maximum(tl.abs(c), tl.abs(d)))

    @triton.jit
    def _xq8(xp, k, INTERPRET: tl.constexpr):
        # x[k .. k+7] quantized to int8 for integer dot products (Q8_0's int8-activation path): two words of 4
        # little-endian codes and the scale (x ~ scale * code)
        a0, a1, a2, a3 = _x4(xp, k)
        b0, b1, b2, b3 = _x4(xp, k + 4)
        amax = tl.maximum(_amax4(a0, a1, a2, a3), _amax4(b0, b1, b2, b3))
        inv = tl.where(amax > 0, 127.0 / amax, 0.0)
        return _qword(a0, a1, a2, a3, inv, INTERPRET), _qword(b0, b1, b2, b3, inv, INTERPRET), amax * (1.0 / 127.0)

    @triton.jit
    def _xq16(xp, k, INTERPRET: tl.constexpr):
        # x[k .. k+15] quantized to int8 for integer dot products (the int8-activation path): four words of
        # 4 little-endian codes, the scale (x ~ scale * code) and the float sum of the 16 values
        a0, a1, a2, a3 = _x4(xp, k)
        b0, b1, b2, b3 = _x4(xp, k + 4)
        c0, c1, c2, c3 = _x4(xp, k + 8)
        d0, d1, d2, d3 = _x4(xp, k + 12)
        amax = tl.maximum(tl.maximum(_amax4(a0, a1, a2, a3), _amax4(b0, b1, b2, b3)),
                          tl.maximum(_amax4(c0, c1, c2, c3), _amax4(d0, d1, d2, d3)))
        inv = tl.where(amax > 0, 127.0 / amax, 0.0)
        w0 = _qword(a0, a1, a2, a3, inv, INTERPRET)
        w1 = _qword(b0, b1, b2, b3, inv, INTERPRET)
        w2 = _qword(c0, c1, c2, c3, inv, INTERPRET)
        w3 = _qword(d0, d1, d2, d3, inv, INTERPRET)
        sx = (((a0 + a1) + (a2 + a3)) + ((b0 + b1) + (b2 + b3))) + (((c0 + c1) + (c2 + c3)) + ((d0 + d1) + (d2 + d3)))
        return w0, w1, w2, w3, amax * (1.0 / 127.0), sx

    @triton.jit
    def _xq16_prepared(xqp, xsp, g):
        # what _xq16 returns for values 16 g .. 16 g + 15, from `quantize_activations`' buffers: one 16-byte load
        # of the four code words, one of the scale
        v = tl.load(xqp + 4 * g + tl.arange(0, 4)[None, :])
        a, b = tl.split(tl.reshape(v, (v.shape[0], 2, 2)))
        w0, w2 = tl.split(a)
        w1, w3 = tl.split(b)
        return w0[:, None], w1[:, None], w2[:, None], w3[:, None], tl.load(xsp + g)

    @triton.jit
    def _dp4a(a, b, acc, INTERPRET: tl.constexpr, UNSIGNED_A: tl.constexpr = False):
        # acc + the sum of the 4 products of the signed bytes of a and b (one IDP4A on the GPU); UNSIGNED_A: a's
        # bytes unsigned
        if INTERPRET:
            for i in tl.static_range(4):
                if UNSIGNED_A:
                    ai = (a >> (8 * i)) & 255
                else:
                    ai = (a << (24 - 8 * i)) >> 24
                acc += ai * ((b << (24 - 8 * i)) >> 24)
            out = acc
        else:
            asm: tl.constexpr = "dp4a.u32.s32 $0, $1, $2, $3;" if UNSIGNED_A else "dp4a.s32.s32 $0, $1, $2, $3;"
            out = tl.inline_asm_elementwise(asm, "=r,r,r,r", [a, b, acc], dtype=tl.int32, is_pure=True, pack=1)
        return out

    @triton.jit
    def _q8_0_split_words(rowp, c, kb):
        # a split row's unit c: its 8 codes as the 8-byte word at byte 8c, its block's fp16 scale (at byte
        # kb + 2 (c // 4)) as float32
        return tl.load((rowp + 8 * c).to(tl.pointer_type(tl.int64))), _h2f(_ld16(rowp + kb + 2 * (c // 4)))

    @triton.jit
    def _mv_q8_0(rowp, c, xp, kb, SPLIT: tl.constexpr, ACT8: tl.constexpr, INTERPRET: tl.constexpr):
        # unit: weights 8c .. 8c+7 = quarter c % 4 of block c // 4. File blocks: fp16 d, then 32 int8 at byte 2
        # (the quarter is 4 uint16 words, 2-byte aligned only). Split rows: `_q8_0_split_words`. Both give the
        # same bits
        if SPLIT:
            q, d = _q8_0_split_words(rowp, c, kb)
            out = _dot_q8_0(q, d, rowp, c, xp, SPLIT, ACT8, INTERPRET)
        else:
            out = _dot_q8_0(0, _h2f(_ld16(rowp + (c // 4) * 34)), rowp, c, xp, SPLIT, ACT8, INTERPRET)
        return out

    @triton.jit
    def _dot_q8_0(q, d, rowp, c, xp, SPLIT: tl.constexpr, ACT8: tl.constexpr, INTERPRET: tl.constexpr):
        # unit c's 8 products with x times d: split rows from their word q, file blocks loaded here from their
        # quarter. ACT8: the 8 codes are signed bytes already, so two integer dot products with x quantized per 8
        # values
        qp = rowp + (c // 4) * 34 + 2 + (c % 4) * 8  # (file blocks)
        if ACT8:
            x0, x1, dx = _xq8(xp, c * 8, INTERPRET)
            if SPLIT:
                lo = q.to(tl.int32)
                hi = (q >> 32).to(tl.int32)
            else:
                lo = _ld16(qp) | (_ld16(qp + 2) << 16)
                hi = _ld16(qp + 4) | (_ld16(qp + 6) << 16)
            return (dx * _dp4a(hi, x1, _dp4a(lo, x0, tl.zeros_like(lo), INTERPRET), INTERPRET).to(tl.float32)) * d
        s = tl.zeros((c.shape[0], rowp.shape[1]), tl.float32)
        for half in tl.static_range(2):
            x0, x1, x2, x3 = _x4(xp, c * 8 + 4 * half)
            if SPLIT:
                wd = (q >> (32 * half)).to(tl.int32)
                a = (wd & 0xFFFF) ^ 0x8080  # int8 = (byte ^ 128) - 128
                b = ((wd >> 16) & 0xFFFF) ^ 0x8080
            else:
                a = _ld16(qp + 4 * half) ^ 0x8080
                b = _ld16(qp + 4 * half + 2) ^ 0x8080
            s += (_magic(a & 255, 128.0) * x0 + _magic(a >> 8, 128.0) * x1
                  + _magic(b & 255, 128.0) * x2 + _magic(b >> 8, 128.0) * x3)
        return s * d

    @triton.jit
    def _mv_q4_k(rowp, c, xp):
        # unit: code word c % 8 of chunk ch = (c // 8) % 4 of block c // 32; its low nibbles are weights
        # 64 ch + 4 (c % 8) + 0..3 (sub-block 2 ch), its high nibbles the same + 32 (sub-block 2 ch + 1)
        ch = (c // 8) % 4
        bp = rowp + (c // 32) * 144
        dd = _ld32(bp)
        s0 = _ld32(bp + 4)
        s1 = _ld32(bp + 8)
        s2 = _ld32(bp + 12)
        q = _ld32(bp + 16 + 32 * ch + 4 * (c % 8))
        k = (c // 32) * 256 + 64 * ch + 4 * (c % 8)
        out = tl.zeros((c.shape[0], rowp.shape[1]), tl.float32)
        for hi in tl.static_range(2):
            sh = 8 * ((2 * ch + hi) % 4)  # sub-block i = 2 ch + hi reads byte i % 4 of the three scale words
            u = (s0 >> sh) & 255
            v = (s1 >> sh) & 255
            t = (s2 >> sh) & 255
            sc = tl.where(ch < 2, u & 63, (t & 15) | ((u >> 6) << 4))
            mn = tl.where(ch < 2, v & 63, (t >> 4) | ((v >> 6) << 4))
            dot, xs = _dot4f(q, 4 * hi, 4, xp, k + 32 * hi)
            out += (_h2f(dd) * _magic(sc, 0.0)) * dot - (_h2f(dd >> 16) * _magic(mn, 0.0)) * xs
        return out

    @triton.jit
    def _mv_q2_k(rowp, c, xp, xqp, xsp, xsump, ACT8: tl.constexpr, XQ: tl.constexpr, INTERPRET: tl.constexpr):
        # unit: code bytes 16 jj .. 16 jj + 15 (jj = c % 2) of half h = (c // 2) % 2 of block c // 4 (4 words).
        # Bit pair kk of these bytes holds the 16 weights 128 h + 32 kk + 16 jj + 0..15, sub-block
        # 8 h + 2 kk + jj, whose scale byte is byte jj + 2 (kk % 2) of scale word 2 h + kk // 2.
        # w = d * (sc & 15) * q - dmin * (sc >> 4), so each sub-block adds d * sc_lo * sum(q x) - dmin * sc_hi * sum(x).
        # XQ: x's 16-value groups quantized beforehand (codes, scale and float sum of group k / 16), not here
        h = (c // 2) % 2
        jj = c % 2
        bp = rowp + (c // 4) * 84
        dd = _ld32(bp + 80)
        sw0 = _ld32(bp + 8 * h)
        sw1 = _ld32(bp + 8 * h + 4)
        qp = bp + 16 + 32 * h + 16 * jj
        q0 = _ld32(qp)
        q1 = _ld32(qp + 4)
        q2 = _ld32(qp + 8)
        q3 = _ld32(qp + 12)
        k = (c // 4) * 256 + 128 * h + 16 * jj
        a = tl.zeros((c.shape[0], rowp.shape[1]), tl.float32)
        b = tl.zeros((c.shape[0], rowp.shape[1]), tl.float32)
        for kk in tl.static_range(4):
            if kk < 2:
                sc = (sw0 >> (8 * jj + 16 * kk)) & 255
            else:
                sc = (sw1 >> (8 * jj + 16 * (kk - 2))) & 255
            if ACT8:
                if XQ:
                    x0, x1, x2, x3, dx = _xq16_prepared(xqp, xsp, (k + 32 * kk) // 16)
                    sx = tl.load(xsump + (k + 32 * kk) // 16)
                else:
                    x0, x1, x2, x3, dx, sx = _xq16(xp, k + 32 * kk, INTERPRET)
                # the bit pairs masked in place, not shifted down: the sum is 4^kk times the codes', which the
                # x scale takes back (a power of two: the same bits), one multiply a unit instead of a shift a word
                pairs = ((0x03030303 << (2 * kk)) ^ 0x80000000) - 0x80000000  # as an int32
                dxk = dx * (1.0 / (1 << (2 * kk)))
                isum = _dp4a(q0 & pairs, x0, tl.zeros_like(q0), INTERPRET, True)
                isum = _dp4a(q1 & pairs, x1, isum, INTERPRET, True)
                isum = _dp4a(q2 & pairs, x2, isum, INTERPRET, True)
                isum = _dp4a(q3 & pairs, x3, isum, INTERPRET, True)
                a += dxk * (isum * (sc & 15)).to(tl.float32)
            else:
                s0, x0 = _dot4f(q0, 2 * kk, 2, xp, k + 32 * kk)
                s1, x1 = _dot4f(q1, 2 * kk, 2, xp, k + 32 * kk + 4)
                s2, x2 = _dot4f(q2, 2 * kk, 2, xp, k + 32 * kk + 8)
                s3, x3 = _dot4f(q3, 2 * kk, 2, xp, k + 32 * kk + 12)
                sx = (x0 + x1) + (x2 + x3)
                a += ((s0 + s1) + (s2 + s3)) * _magic(sc & 15, 0.0)
            b += sx * _magic(sc >> 4, 0.0)
        return _h2f(dd) * a - _h2f(dd >> 16) * b

    @triton.jit
    def _permute(a, sel, b, INTERPRET: tl.constexpr):
        # byte i of the result: byte (sel >> 4 i) & 7 of the 8 bytes b:a (one prmt on the GPU)
        if INTERPRET:
            out = tl.zeros_like(sel)
            for i in tl.static_range(4):
                k = (sel >> (4 * i)) & 7
                byte = tl.where(k < 4, a >> (8 * (k & 3)), b >> (8 * (k & 3))) & 255
                out |= byte << (8 * i)
        else:
            out = tl.inline_asm_elementwise("prmt.b32 $0, $1, $3, $2;", "=r,r,r,r", [a, sel, b], dtype=tl.int32,
                                            is_pure=True, pack=1)
        return out

    @triton.jit
    def _byte_magic(word, magic, V: tl.constexpr, INTERPRET: tl.constexpr):
        # byte V of the int32 ``word`` as the float 2^23 + byte: one byte permute on the GPU, of ``word`` and
        # ``magic`` (0x4B000000, a value read from memory, so that the permute keeps its selector immediate)
        if INTERPRET:
            out = (((word >> (8 * V)) & 255) | magic).to(tl.float32, bitcast=True)
        else:
            m = tl.broadcast_to(magic, word.shape)
            if V == 0:
                out = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7440;", "=r,r,r", [word, m],
                                                dtype=tl.float32, is_pure=True, pack=1)
            elif V == 1:
                out = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7441;", "=r,r,r", [word, m],
                                                dtype=tl.float32, is_pure=True, pack=1)
            elif V == 2:
                out = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7442;", "=r,r,r", [word, m],
                                                dtype=tl.float32, is_pure=True, pack=1)
            else:
                out = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7443;", "=r,r,r", [word, m],
                                                dtype=tl.float32, is_pure=True, pack=1)
        return out

    @triton.jit
    def _selectors(g01, g23, aux, tables):
        # the permute selectors of a unit's 4 grid entries, grid nibbles | sign bits: the 8 table entries in one
        # tl.gather from the register copy of the tables, which goes through shared memory (measured against
        # 8 gathers from global memory, H200, routed gate / up at one token: the same with int8 activations,
        # float activations 30.6 against 31.7 us in the file's blocks, 28.4 against 39.9 in split rows). Computing
        # the 4 sign words instead of gathering them (half the lookups, ~14 integer operations a word) lost: routed
        # gate / up at 8 tokens 149.5 against 115.9 us, at one 23.6 against 19.3 (H200, 9b23302; PROFILE)
        i0 = tl.join(g01 & 255, 256 + (aux & 127))
        i1 = tl.join(g01 >> 8, 256 + ((aux >> 7) & 127))
        i2 = tl.join(g23 & 255, 256 + ((aux >> 14) & 127))
        i3 = tl.join(g23 >> 8, 256 + ((aux >> 21) & 127))
        idx = tl.join(tl.join(i0, i1), tl.join(i2, i3))
        n: tl.constexpr = g01.shape[0] * g01.shape[1] * 8
        v = tl.reshape(tl.gather(tables, tl.reshape(idx, (n,)), 0), idx.shape)
        a, b = tl.split(v)
        a0, a1 = tl.split(a)
        b0, b1 = tl.split(b)
        g0, s0 = tl.split(a0)
        g1, s1 = tl.split(a1)
        g2, s2 = tl.split(b0)
        g3, s3 = tl.split(b1)
        return g0 | s0, g1 | s1, g2 | s2, g3 | s3

    @triton.jit
    def _iq2_xxs_words(rowp, c, gridp, tables, kb, SPLIT: tl.constexpr, ACT8: tl.constexpr,
                       INTERPRET: tl.constexpr):
        # unit: group c % 8 (32 weights) of block c // 8: 4 grid indices (one per 8 weights) and a word of four
        # 7-bit sign indices plus a 4-bit scale, at byte 2 + 8 (c % 8) (2-byte aligned only: uint16 loads; in
        # split rows one 8-byte load). The tables (see _iq2_xxs_tables): grid entry g's 8 level indices as
        # nibbles, and for each 7-bit sign index the sign of each of the 8 weights (the 8th: the parity of the
        # 7) as bit 2 of that weight's nibble, so that one byte permute per 4 weights picks signed magnitudes
        # from two words of levels: signed int8 for the integer dot products, else 64 + the signed magnitude,
        # which one more permute per weight turns into the float 2^23 + 64 + signed magnitude. Returns the
        # unit's scale and its 8 words of 4 weights (word 2 j + h: weights 8 j + 4 h .. 8 j + 4 h + 3)
        if SPLIT:  # the unit's 8 bytes at 8c (one load), the block's scale at kb + 2 (c // 8)
            q = tl.load((rowp + 8 * c).to(tl.pointer_type(tl.int64)))
            lo = q.to(tl.int32)
            g01 = lo & 0xFFFF
            g23 = (lo >> 16) & 0xFFFF
            aux = (q >> 32).to(tl.int32)
            d = _ld16(rowp + kb + 2 * (c // 8))
        else:
            bp = rowp + (c // 8) * 66
            gp = bp + 2 + 8 * (c % 8)
            g01 = _ld16(gp)
            g23 = _ld16(gp + 2)
            aux = _ld16(gp + 4) | (_ld16(gp + 6) << 16)
            d = _ld16(bp)
        db = _h2f(d) * (0.5 + _magic((aux >> 28) & 15, 0.0)) * 0.25
        if ACT8:
            # the same two words for every lane, read at a lane-dependent address: as uniform values the compiler
            # moved them into a register before every byte permute (sm_90 SASS: 8 moves per 32 weights and row)
            pos_levels = tl.load(gridp + 385 + 4 * (c & 1))
            neg_levels = tl.load(gridp + 386 + 4 * (c & 1))
        else:
            pos_levels = tl.load(gridp + 387)
            neg_levels = tl.load(gridp + 388)
        sel0, sel1, sel2, sel3 = _selectors(g01, g23, aux, tables)
        p, n = pos_levels, neg_levels
        return (db, _permute(p, sel0, n, INTERPRET), _permute(p, sel0 >> 16, n, INTERPRET),
                _permute(p, sel1, n, INTERPRET), _permute(p, sel1 >> 16, n, INTERPRET),
                _permute(p, sel2, n, INTERPRET), _permute(p, sel2 >> 16, n, INTERPRET),
                _permute(p, sel3, n, INTERPRET), _permute(p, sel3 >> 16, n, INTERPRET))

    @triton.jit
    def _iq2_xxs_dots(db, w0, w1, w2, w3, w4, w5, w6, w7, c, xp, xqp, xsp, xqp1, xsp1, XQ: tl.constexpr,
                      TWO: tl.constexpr, INTERPRET: tl.constexpr):
        # the unit's products with int8 activations: two 16-value groups of x (quantized once per token, or
        # here), each a chain of four dp4a over the signed words; TWO (XQ only): also with the second token's x at
        # xqp1 / xsp1, each word used for both tokens at once (so no word outlives its two products)
        out = tl.zeros(w0.shape, tl.float32)
        out1 = out
        for half in tl.static_range(2):  # 16 weights: grid entries 2 half, 2 half + 1
            if XQ:  # quantized once per token (quantize_activations), not once per program
                x0, x1, x2, x3, dx = _xq16_prepared(xqp, xsp, 2 * c + half)
                if TWO:
                    y0, y1, y2, y3, dy = _xq16_prepared(xqp1, xsp1, 2 * c + half)
            else:
                x0, x1, x2, x3, dx, sx = _xq16(xp, c * 32 + 16 * half, INTERPRET)
            if half == 0:
                wa, wb, wc, wd = w0, w1, w2, w3
            else:
                wa, wb, wc, wd = w4, w5, w6, w7
            dots = _dp4a(wb, x1, _dp4a(wa, x0, tl.zeros_like(w0), INTERPRET), INTERPRET)
            if TWO:
                dots1 = _dp4a(wb, y1, _dp4a(wa, y0, tl.zeros_like(w0), INTERPRET), INTERPRET)
                dots1 = _dp4a(wd, y3, _dp4a(wc, y2, dots1, INTERPRET), INTERPRET)
                out1 += dy * dots1.to(tl.float32)
            dots = _dp4a(wd, x3, _dp4a(wc, x2, dots, INTERPRET), INTERPRET)
            out += dx * dots.to(tl.float32)
        return db * out, db * out1

    @triton.jit
    def _mv_iq2_xxs(rowp, c, xp, xqp, xsp, gridp, tables, kb, SPLIT: tl.constexpr, ACT8: tl.constexpr,
                    XQ: tl.constexpr, INTERPRET: tl.constexpr):
        db, w0, w1, w2, w3, w4, w5, w6, w7 = _iq2_xxs_words(rowp, c, gridp, tables, kb, SPLIT, ACT8, INTERPRET)
        if ACT8:
            out, _ = _iq2_xxs_dots(db, w0, w1, w2, w3, w4, w5, w6, w7, c, xp, xqp, xsp, xqp, xsp, XQ, False,
                                   INTERPRET)
        else:
            magic = tl.load(gridp + 384)
            out = tl.zeros(w0.shape, tl.float32)
            for half in tl.static_range(2):
                s = tl.zeros(w0.shape, tl.float32)
                for e in tl.static_range(2):
                    j = 2 * half + e
                    for w in tl.static_range(2):
                        if j == 0:
                            biased = w0 if w == 0 else w1
                        elif j == 1:
                            biased = w2 if w == 0 else w3
                        elif j == 2:
                            biased = w4 if w == 0 else w5
                        else:
                            biased = w6 if w == 0 else w7
                        x0, x1, x2, x3 = _x4(xp, c * 32 + 8 * j + 4 * w)
                        s += (_byte_magic(biased, magic, 0, INTERPRET) - 8388672.0) * x0
                        s += (_byte_magic(biased, magic, 1, INTERPRET) - 8388672.0) * x1
                        s += (_byte_magic(biased, magic, 2, INTERPRET) - 8388672.0) * x2
                        s += (_byte_magic(biased, magic, 3, INTERPRET) - 8388672.0) * x3
                out += s
            out = db * out
        return out

    @triton.jit
    def _mv_dense(rowp, c, xp, BF16: tl.constexpr):
        # unit: weights 8c .. 8c+7 of a dense 16-bit row, two 8-byte words of four weights each
        if BF16:
            wp = rowp.to(tl.pointer_type(tl.bfloat16))
        else:
            wp = rowp.to(tl.pointer_type(tl.float16))
        s = tl.zeros((c.shape[0], rowp.shape[1]), tl.float32)
        for half in tl.static_range(2):
            w0, w1, w2, w3 = _x4(wp, c * 8 + 4 * half)
            x0, x1, x2, x3 = _x4(xp, c * 8 + 4 * half)
            s += w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3
        return s

    @triton.jit
    def _mv_unit(QTYPE: tl.constexpr, ACT8: tl.constexpr, rowp, c, xp, xqp, xsp, xsump, gridp, tables, kb,
                 XQ: tl.constexpr, INTERPRET: tl.constexpr):
        # kb: bytes of codes per row (the split layouts' scale offset); tables: IQ2_XXS's, in registers; XQ: the
        # activations' int8 codes and scales at xqp / xsp (IQ2_XXS, Q2_K) and their groups' sums at xsump (Q2_K)
        if QTYPE == 30 or QTYPE == 1:
            out = _mv_dense(rowp, c, xp, QTYPE == 30)
        elif QTYPE == 8 or QTYPE == 9:
            out = _mv_q8_0(rowp, c, xp, kb, QTYPE == 9, ACT8, INTERPRET)
        elif QTYPE == 10:
            out = _mv_q2_k(rowp, c, xp, xqp, xsp, xsump, ACT8, XQ, INTERPRET)
        elif QTYPE == 12:
            out = _mv_q4_k(rowp, c, xp)
        else:
            out = _mv_iq2_xxs(rowp, c, xp, xqp, xsp, gridp, tables, kb, QTYPE == 17, ACT8, XQ, INTERPRET)
        return out

    @triton.jit
    def _swiglu_rows(w_ptr, e, pid_n, N, row_bytes, expert_bytes, up_bytes, R: tl.constexpr):
        # a SwiGLU tile's R weight rows: R / 2 gate rows of expert e and the same rows of the up expert, up_bytes
        # further on (rows past N read row N - 1, never stored, so no weight load needs a mask)
        j = tl.arange(0, R)
        rows = pid_n * (R // 2) + j % (R // 2)
        base = w_ptr + e * expert_bytes + (j >= R // 2).to(tl.int64)[None, :] * up_bytes
        return base + tl.minimum(rows, N - 1).to(tl.int64)[None, :] * row_bytes

    @triton.jit
    def _swiglu_store(y, y_ptr, pair, pid_n, N, limit, stride_y, R: tl.constexpr):
        # swiglu(gate, up) of a SwiGLU tile's sums y [R] into row ``pair`` of y_ptr (the SwiGLU kernel's bits: gate
        # and up rounded to y's dtype first)
        gate, up = tl.split(tl.trans(tl.reshape(y, (2, R // 2))))
        g = tl.minimum(gate.to(y_ptr.dtype.element_ty).to(tl.float32), limit)
        u = tl.minimum(tl.maximum(up.to(y_ptr.dtype.element_ty).to(tl.float32), -limit), limit)
        cols = pid_n * (R // 2) + tl.arange(0, R // 2)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(y_ptr + pair.to(tl.int64) * stride_y + cols, h.to(y_ptr.dtype.element_ty), mask=cols < N)

    @triton.jit
    def _iq2_xxs_tables_tile(grid_ptr):
        # the grid and sign tables (_iq2_xxs_tables) in registers, for tl.gather
        t = tl.arange(0, 512)
        return tl.load(grid_ptr + t, mask=t < 384, other=0)

    @triton.jit
    def _qmv_block(pid_n, pair, e, xp, xqp, xsp, xsump, w_ptr, grid_ptr, tables, y_ptr, N, n_units, row_bytes,
                   expert_bytes, up_bytes, limit, stride_y, QTYPE: tl.constexpr, ACT8: tl.constexpr, R: tl.constexpr,
                   U: tl.constexpr, SWIGLU: tl.constexpr, XQ: tl.constexpr, INTERPRET: tl.constexpr,
                   PRELOAD: tl.constexpr = False, PDL: tl.constexpr = False):
        # row block pid_n of pair ``pair`` (expert e, x at xp / xqp / xsp / xsump): its R rows' K loop and store;
        # PRELOAD: the kernel's wait for upstream (PDL) comes here, after the weights' loads
        if SWIGLU:
            rowp = _swiglu_rows(w_ptr, e, pid_n, N, row_bytes, expert_bytes, up_bytes, R)
        else:
            rows = pid_n * R + tl.arange(0, R)
            # rows past N read row N - 1 (never stored), so no weight load needs a mask
            rowp = w_ptr + e * expert_bytes + tl.minimum(rows, N - 1).to(tl.int64)[None, :] * row_bytes
        acc = tl.zeros((U, R), dtype=tl.float32)
        kb = n_units * 8  # split rows (Q8_0, IQ2_XXS): 8 code bytes per unit
        if PRELOAD:
            # split Q8_0 rows whose whole K is one step (U == n_units, host side): the weights are loaded before
            # the wait for the kernels upstream (they write x, never the weights), so the words are on their way
            # while the kernel before this one finishes
            c = tl.arange(0, U)[:, None]
            q, d = _q8_0_split_words(rowp, c, kb)
            wait_upstream(PDL, RELEASE=True)
            acc += _dot_q8_0(q, d, rowp, c, xp, True, ACT8, INTERPRET)
        elif INTERPRET:  # `range` of the interpreter cannot take a runtime bound with numpy >= 2
            u0 = 0
            while u0 < n_units:
                acc += _mv_unit(QTYPE, ACT8, rowp, u0 + tl.arange(0, U)[:, None], xp, xqp, xsp, xsump, grid_ptr,
                                tables, kb, XQ, INTERPRET)
                u0 += U
        else:
            for u0 in range(0, n_units, U):  # U divides n_units (host side)
                acc += _mv_unit(QTYPE, ACT8, rowp, u0 + tl.arange(0, U)[:, None], xp, xqp, xsp, xsump, grid_ptr,
                                tables, kb, XQ, INTERPRET)
        y = tl.sum(acc, axis=0)
        if SWIGLU:
            _swiglu_store(y, y_ptr, pair, pid_n, N, limit, stride_y, R)
        else:
            tl.store(y_ptr + pair.to(tl.int64) * stride_y + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)

    @triton.jit
    def _qmv_kernel(x_ptr, xq_ptr, xs_ptr, xsum_ptr, w_ptr, grid_ptr, ids_ptr, y_ptr, N, n_units, row_bytes,
                    expert_bytes, up_bytes, limit, stride_x, stride_y, X_DIV: tl.constexpr, HAS_IDS: tl.constexpr,
                    QTYPE: tl.constexpr, ACT8: tl.constexpr, R: tl.constexpr, U: tl.constexpr, SWIGLU: tl.constexpr,
                    XQ: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
                    PRELOAD: tl.constexpr = False):
        # SWIGLU: the tile's R rows are R / 2 gate rows of expert e and the same rows of the up expert; the program
        # stores swiglu(gate, up) for its R / 2 rows, so the routed gate / up product and SwiGLU are one launch.
        # PRELOAD (`_qmv_block`; no expert ids, which upstream writes): nothing before the block touches memory
        pair = tl.program_id(1)
        if not PRELOAD:
            wait_upstream(PDL, RELEASE=True)
        if HAS_IDS:
            e = tl.load(ids_ptr + pair).to(tl.int64)
        else:
            e = 0
        xrow = (pair // X_DIV).to(tl.int64)
        xp = x_ptr + xrow * stride_x
        # XQ: x's row quantized per 16 values, K / 4 code words and K / 16 scales (and sums) a row
        if QTYPE == 10:
            n_groups = n_units * 4  # Q2_K units of 64 weights
        else:
            n_groups = n_units * 2  # IQ2_XXS units of 32
        xqp = xq_ptr + xrow * (4 * n_groups)
        xsp = xs_ptr + xrow * n_groups
        xsump = xsum_ptr + xrow * n_groups
        if QTYPE == 16 or QTYPE == 17:
            tables = _iq2_xxs_tables_tile(grid_ptr)
        else:
            tables = 0
        _qmv_block(tl.program_id(0), pair, e, xp, xqp, xsp, xsump, w_ptr, grid_ptr, tables, y_ptr, N, n_units,
                   row_bytes, expert_bytes, up_bytes, limit, stride_y, QTYPE, ACT8, R, U, SWIGLU, XQ, INTERPRET,
                   PRELOAD, PDL)

    @triton.jit
    def _expert_units(rowp, grid_ptr, tables, kb, n_units, xq0, xs0, xq1, xs1, R: tl.constexpr, U: tl.constexpr,
                      TWO: tl.constexpr, INTERPRET: tl.constexpr):
        # _qmv_expert_pairs_kernel's K loop: each unit of the expert's rows decoded once, multiplied by one token's
        # x codes or (TWO) two tokens'; the per-token sums [U, R] (the second is the first without TWO)
        acc0 = tl.zeros((U, R), dtype=tl.float32)
        acc1 = tl.zeros((U, R), dtype=tl.float32)
        u0 = 0
        while u0 < n_units:
            c = u0 + tl.arange(0, U)[:, None]
            db, w0, w1, w2, w3, w4, w5, w6, w7 = _iq2_xxs_words(rowp, c, grid_ptr, tables, kb, True, True, INTERPRET)
            o0, o1 = _iq2_xxs_dots(db, w0, w1, w2, w3, w4, w5, w6, w7, c, xq0, xq0, xs0, xq1, xs1, True, TWO,
                                   INTERPRET)
            acc0 += o0
            if TWO:
                acc1 += o1
            u0 += U
        return acc0, acc1

    @triton.jit
    def _qmv_expert_pairs_kernel(xq_ptr, xs_ptr, w_ptr, grid_ptr, ids_ptr, y_ptr, N, n_units, n_pairs, row_bytes,
                                 expert_bytes, up_bytes, limit, stride_y, X_DIV: tl.constexpr, R: tl.constexpr,
                                 U: tl.constexpr, PB: tl.constexpr, INTERPRET: tl.constexpr,
                                 PDL: tl.constexpr = False):
        # _qmv_kernel's routed IQ2_XXS gate / up + SwiGLU (split rows, x quantized beforehand) with each expert's
        # rows decoded once for two of its pairs: program (row block, pair) runs only where its pair is the first
        # of its expert, and then all of that expert's pairs, two at a time, each with the operations (the bits)
        # of _qmv_kernel's program for that pair
        wait_upstream(PDL, RELEASE=True)
        pid_n = tl.program_id(0)
        slot = tl.program_id(1)
        allp = tl.arange(0, PB)
        e = tl.load(ids_ptr + slot)
        match = tl.load(ids_ptr + allp, mask=allp < n_pairs, other=-1) == e
        if tl.min(tl.where(match, allp, PB)) == slot:
            rowp = _swiglu_rows(w_ptr, e.to(tl.int64), pid_n, N, row_bytes, expert_bytes, up_bytes, R)
            kb = n_units * 8
            tables = _iq2_xxs_tables_tile(grid_ptr)
            left = match
            n_left = tl.sum(match.to(tl.int32))
            while n_left > 0:
                p0 = tl.min(tl.where(left, allp, PB))
                left = left & (allp != p0)
                p1 = tl.min(tl.where(left, allp, PB))
                left = left & (allp != p1)
                two = n_left > 1
                p1 = tl.where(two, p1, p0)
                xq0 = xq_ptr + (p0 // X_DIV).to(tl.int64) * (8 * n_units)
                xs0 = xs_ptr + (p0 // X_DIV).to(tl.int64) * (2 * n_units)
                xq1 = xq_ptr + (p1 // X_DIV).to(tl.int64) * (8 * n_units)
                xs1 = xs_ptr + (p1 // X_DIV).to(tl.int64) * (2 * n_units)
                if two:  # the unit loop compiled twice: with one token it carries no second token's work
                    acc0, acc1 = _expert_units(rowp, grid_ptr, tables, kb, n_units, xq0, xs0, xq1, xs1, R, U, True,
                                               INTERPRET)
                else:
                    acc0, acc1 = _expert_units(rowp, grid_ptr, tables, kb, n_units, xq0, xs0, xq0, xs0, R, U, False,
                                               INTERPRET)
                _swiglu_store(tl.sum(acc0, axis=0), y_ptr, p0, pid_n, N, limit, stride_y, R)
                if two:
                    _swiglu_store(tl.sum(acc1, axis=0), y_ptr, p1, pid_n, N, limit, stride_y, R)
                n_left -= 2

    @triton.jit
    def _xq16_kernel(x_ptr, codes_ptr, scales_ptr, sums_ptr, n_groups, stride_x, G: tl.constexpr,
                     SUMS: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
        # program (group block, row): _xq16 of G groups of 16 values, stored (G divides n_groups: no masks); SUMS:
        # also the groups' float sums
        wait_upstream(PDL, RELEASE=True)
        row = tl.program_id(1).to(tl.int64)
        g = tl.program_id(0) * G + tl.arange(0, G)[:, None]
        w0, w1, w2, w3, dx, sx = _xq16(x_ptr + row * stride_x, 16 * g, INTERPRET)
        if SUMS:
            tl.store(sums_ptr + row * n_groups + g, sx)
        cp = codes_ptr + row * (4 * n_groups) + 4 * g
        tl.store(cp, w0)
        tl.store(cp + 1, w1)
        tl.store(cp + 2, w2)
        tl.store(cp + 3, w3)
        tl.store(scales_ptr + row * n_groups + g, dx)

    @triton.jit
    def _q8_token_unit(rowp, xq64, xsp, kb, u0, U: tl.constexpr, R: tl.constexpr, TOK: tl.constexpr,
                       INTERPRET: tl.constexpr):
        # unit c: weights 16c .. 16c+15 of R split Q8_0 rows (16 code bytes, one load, and the scale of block
        # c // 2) times TOK tokens' x codes of the same 16 values (one load) and their scale: [U, R, TOK] sums
        c = u0 + tl.arange(0, U)[:, None, None]
        d = _h2f(_ld16(rowp + kb + 2 * (c // 2)))
        pair = tl.arange(0, 2)[None, None, None, :]
        qa, qb = tl.split(tl.load((rowp + 16 * c).to(tl.pointer_type(tl.int64))[:, :, :, None] + pair))
        xa, xb = tl.split(tl.load(xq64[:, :, :, None] + 2 * c[:, :, :, None] + pair))
        dot = _dp4a(qa.to(tl.int32), xa.to(tl.int32), tl.zeros((U, R, TOK), tl.int32), INTERPRET)
        dot = _dp4a((qa >> 32).to(tl.int32), (xa >> 32).to(tl.int32), dot, INTERPRET)
        dot = _dp4a(qb.to(tl.int32), xb.to(tl.int32), dot, INTERPRET)
        dot = _dp4a((qb >> 32).to(tl.int32), (xb >> 32).to(tl.int32), dot, INTERPRET)
        return (tl.load(xsp + c) * dot.to(tl.float32)) * d

    @triton.jit
    def _dense_token_unit(wp, xp, u0, U: tl.constexpr, R: tl.constexpr, TOK: tl.constexpr):
        # unit c: weights 4c .. 4c+3 of R dense 16-bit rows (one 8-byte load each) times the same 4 values of TOK
        # tokens' 16-bit x: [U, R, TOK] float32 sums
        k = 4 * (u0 + tl.arange(0, U)[:, None, None])
        w0, w1, w2, w3 = _x4(wp, k)
        x0, x1, x2, x3 = _x4(xp, k)
        return w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3

    @triton.jit
    def _token_unit(QTYPE: tl.constexpr, wp, xp, xq64, xsp, kb, u0, U: tl.constexpr, R: tl.constexpr,
                    TOK: tl.constexpr, INTERPRET: tl.constexpr):
        if QTYPE == 9:
            out = _q8_token_unit(wp, xq64, xsp, kb, u0, U, R, TOK, INTERPRET)
        else:
            out = _dense_token_unit(wp, xp, u0, U, R, TOK)
        return out

    @triton.jit
    def _token_tile_kernel(x_ptr, xq_ptr, xs_ptr, w_ptr, y_ptr, N, n_units, row_bytes, n_tok, groups, stride_y,
                           QTYPE: tl.constexpr, R: tl.constexpr, U: tl.constexpr, TOK: tl.constexpr,
                           INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
        # program (R rows, TOK tokens, group): y[t, g N + rows] = x[t, g] @ W_g[rows].T, each weight word loaded
        # once for the TOK tokens (the matvec loads it once per token). QTYPE 9: split Q8_0 rows (bytes at w_ptr)
        # and x quantized per 16 values (`quantize_activations` of x as [T * groups, K]) at xq_ptr / xs_ptr, units
        # of 16 weights; else dense 16-bit rows (w_ptr typed) and 16-bit x [T * groups, K], units of 4 weights
        pid_n = tl.program_id(0)
        pid_t = tl.program_id(1)
        g = tl.program_id(2).to(tl.int64)
        wait_upstream(PDL, RELEASE=True)
        rows = pid_n * R + tl.arange(0, R)
        # rows past N read row N - 1 and tokens past n_tok the last token (never stored): no load needs a mask
        row = (g * N + tl.minimum(rows, N - 1)).to(tl.int64)[None, :, None]
        x_row = tl.minimum(pid_t * TOK + tl.arange(0, TOK), n_tok - 1).to(tl.int64)[None, None, :] * groups + g
        if QTYPE == 9:
            wp = w_ptr + row * row_bytes
            xp = x_ptr
            xq64 = xq_ptr.to(tl.pointer_type(tl.int64)) + x_row * (2 * n_units)
            xsp = xs_ptr + x_row * n_units
        else:
            wp = w_ptr + row * (4 * n_units)
            xp = x_ptr + x_row * (4 * n_units)
            xq64 = xq_ptr
            xsp = xs_ptr
        kb = n_units * 16  # split Q8_0 rows: the codes' bytes, then the scales
        acc = tl.zeros((U, R, TOK), dtype=tl.float32)
        if INTERPRET:  # `range` of the interpreter cannot take a runtime bound with numpy >= 2
            u0 = 0
            while u0 < n_units:
                acc += _token_unit(QTYPE, wp, xp, xq64, xsp, kb, u0, U, R, TOK, INTERPRET)
                u0 += U
        else:
            for u0 in range(0, n_units, U):  # U divides n_units (host side)
                acc += _token_unit(QTYPE, wp, xp, xq64, xsp, kb, u0, U, R, TOK, INTERPRET)
        y = tl.sum(acc, axis=0)  # [R, TOK]
        t = pid_t * TOK + tl.arange(0, TOK)[None, :]
        tl.store(y_ptr + t.to(tl.int64) * stride_y + g * N + rows[:, None], y.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < N) & (t < n_tok))

    @triton.jit
    def _mm_step(acc, QTYPE: tl.constexpr, wp, gridp, rowoff, rmask, xp, valid, kk, k0, K, G: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
                 ):
        w = tl.reshape(_tile(QTYPE, wp, gridp, rowoff, rmask, k0, K, G), (BN, BK)).to(DOT_DTYPE)
        xm = valid[:, None] & ((k0 + kk) < K)[None, :]
        xv = tl.load(xp + k0 + kk[None, :], mask=xm, other=0.0).to(DOT_DTYPE)
        return tl.dot(xv, tl.trans(w), acc, input_precision=PREC)

    @triton.jit
    def _qmm_kernel(x_ptr, w_ptr, grid_ptr, c_expert, c_start, c_len, order_ptr, y_ptr, P, N, K, row_bytes,
                    expert_bytes, stride_x, stride_y, X_DIV: tl.constexpr, HAS_IDS: tl.constexpr,
                    QTYPE: tl.constexpr, S: tl.constexpr, W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
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
                               PREC)
                k0 += BK
        else:
            for k0 in range(0, K, BK):
                acc = _mm_step(acc, QTYPE, wp, grid_ptr, rowoff, rmask, xp, valid, kk, k0, K, G, BN, BK, DOT_DTYPE,
                               PREC)
        yp = y_ptr + pairs.to(tl.int64)[:, None] * stride_y + rows[None, :]
        tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (rows < N)[None, :])



    @triton.jit
    def _dequant_kernel(w_ptr, grid_ptr, out_ptr, N, K, row_bytes, expert_bytes, QTYPE: tl.constexpr,
                        S: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # program (row block, K block, expert): the skinny kernel's decoded tile, stored in out's dtype
        e = tl.program_id(2).to(tl.int64)
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        r4 = rows[:, None, None, None]
        k0 = tl.program_id(1) * BK
        tile = tl.reshape(_tile(QTYPE, w_ptr + e * expert_bytes, grid_ptr, r4.to(tl.int64) * row_bytes, r4 < N, k0,
                                K, BK // S), (BN, BK))
        kk = k0 + tl.arange(0, BK)
        out = out_ptr + (e * N + rows.to(tl.int64))[:, None] * K + kk[None, :]
        tl.store(out, tile.to(out_ptr.dtype.element_ty), mask=(rows < N)[:, None] & (kk < K)[None, :])


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
    align = 8 if w.layout == "split" else 4 if w.qtype in (T.Q2_K, T.Q4_K) else 2  # widest word a kernel reads
    return w.raw.is_contiguous() and w.raw.data_ptr() % align == 0 and w.row_bytes % align == 0


def kernel_layout(w: GGMLTensor) -> GGMLTensor:
    """``w`` in the layout these kernels read fastest: Q8_0 and IQ2_XXS rows split into codes and scales
    (:meth:`GGMLTensor.split`) when every row and its scales then start 8-byte aligned (a row's Q8_0 codes a
    multiple of 128 bytes, IQ2_XXS rows of a multiple of 4 blocks), so a matvec unit's code bytes are one 8-byte
    load; anything else as it is. IQ2_XXS split rows: routed gate / up at one token 27.5 -> 25.3 us (H200, 12
    slots of 4096 -> 2048 experts), the same on the routed tensor-core kernel at 64 and 512 tokens."""
    if w.ndim in (2, 3) and ((w.qtype == T.Q8_0 and w.shape[-1] % 128 == 0)
                             or (w.qtype == T.IQ2_XXS and w.shape[-1] % 1024 == 0)):
        return w.split()
    return w


def _fields(qtype: GGMLQuantizationType) -> tuple[int, int, int, int, int]:
    """The kernel fields of a block type or of a dense 16-bit type (`_TYPES`, `_DENSE_TYPES`)."""
    return _TYPES.get(qtype) or _DENSE_TYPES[qtype]


def _code(w: GGMLTensor) -> int:
    """The kernels' QTYPE for ``w`` (9: split-layout Q8_0, 17: split-layout IQ2_XXS)."""
    if w.layout == "split":
        return 9 if w.qtype == T.Q8_0 else 17
    return _fields(w.qtype)[0]


@lru_cache(maxsize=8)
def _grid_bytes(device: torch.device) -> torch.Tensor:
    """IQ2_XXS grid as int64 [256]: entry g's 8 magnitudes (8 / 25 / 43) as little-endian bytes (the
    skinny kernel reads the same bytes as int32 pairs)."""
    mags = _iq2xxs_grid_cpu().to(torch.uint8).contiguous()  # (256, 8)
    return mags.view(torch.int64).reshape(-1).to(device)


@lru_cache(maxsize=8)
def _iq2_xxs_tables(device: torch.device) -> torch.Tensor:
    """The IQ2_XXS matvec's tables as int32 [391]:

    - [0, 256): grid entry g's 8 magnitudes as level indices (8, 25, 43 -> 0, 1, 2), weight j in nibble j;
    - [256, 384): for each 7-bit sign index, bit 2 of nibble j set where weight j is negative (the 8th weight's
      sign is the parity of the 7 bits), so that OR-ing it into a grid entry selects the negated levels;
    - 384: the float magic 0x4B000000;
    - 385, 386: the levels as signed bytes (8, 25, 43) and (-8, -25, -43);
    - 387, 388: the same as 64 + level: (72, 89, 107) and (56, 39, 21);
    - 389, 390: 385 and 386 again (the matvec reads one pair or the other by unit parity, see _iq2_xxs_words)."""
    mags = _iq2xxs_grid_cpu()  # (256, 8)
    levels = (mags > 8).to(torch.int64) + (mags > 25).to(torch.int64)
    grid = (levels << (4 * torch.arange(8))).sum(dim=1)
    s7 = torch.arange(128)
    bits = (s7[:, None] >> torch.arange(7)) & 1
    negative = torch.cat([bits, bits.sum(dim=1, keepdim=True) & 1], dim=1)  # (128, 8)
    signs = (negative << (4 * torch.arange(8) + 2)).sum(dim=1)

    def word(b: list[int]) -> int:
        return int.from_bytes(bytes(v & 255 for v in b), "little", signed=True)

    consts = [0x4B000000, word([8, 25, 43, 0]), word([-8, -25, -43, 0]), word([72, 89, 107, 0]),
              word([56, 39, 21, 0]), word([8, 25, 43, 0]), word([-8, -25, -43, 0])]
    return torch.cat([grid, signs, torch.tensor(consts)]).to(torch.int32).to(device)


@lru_cache(maxsize=64)
def _group_ids(groups: int, t: int, device: torch.device) -> torch.Tensor:
    """0 .. groups-1 repeated for t rows, int32 (never written: cached instead of built per call)."""
    return torch.arange(groups, device=device, dtype=torch.int32).repeat(t)


@lru_cache(maxsize=8)
def _dummy(device: torch.device) -> torch.Tensor:
    """A placeholder for pointer arguments a kernel variant never reads; one per device (a fresh one per call
    was two launches per matmul)."""
    return torch.zeros(1, dtype=torch.int64, device=device)


def _fit_units(units: int, u: int) -> int:
    """The largest power of two <= u that divides ``units`` (the matvec never masks a K step)."""
    while u > 1 and units % u:
        u //= 2
    return u


def weights_preloaded(w: GGMLTensor, units: int, ids: bool = False) -> bool:
    """Whether a matvec of ``w`` (kernel layout) at ``units`` units a K step, with or without expert ids, loads its
    weights before it waits for the kernels upstream (``PRELOAD_WEIGHTS``: split Q8_0 rows, no ids, all of K in one
    step)."""
    n_units = w.shape[-1] // _fields(w.qtype)[4]
    return PRELOAD_WEIGHTS and _code(w) == 9 and not ids and _fit_units(n_units, units) == n_units


def int8_activation_types() -> list[str]:
    """The types whose matvec quantizes activations to int8 as things stand (for benchmark records)."""
    return [t.name for t in (T.Q8_0, T.Q2_K, T.IQ2_XXS) if int8_activations(t)]


def int8_activations(qtype: GGMLQuantizationType, requested: bool | None = None) -> bool:
    """Whether the matvec for ``qtype`` quantizes activations to int8: ``requested`` if given, else the
    type's default (``INT8_ACTIVATIONS``), unless DS4X_QUANT_ACT is ``float`` (never) or ``int8`` (wherever the
    type has the path)."""
    has_path = qtype in (T.Q8_0, T.Q2_K, T.IQ2_XXS)
    if requested is not None:
        return requested and has_path
    choice = os.environ.get("DS4X_QUANT_ACT", "").lower()
    return has_path and (choice == "int8" or (choice != "float" and qtype in INT8_ACTIVATIONS))


# (R weight rows, most units per K step, most warps) of the matvec for the routed experts' types (a warp per 32
# units at most; Q2_K: many rows per thread amortize the activation decode); scripts/routed_matvec_sweep.py
MATVEC_TILES = {T.IQ2_XXS: (16, 64, 2), T.Q2_K: (8, 128, 4)}
# the same where the launch reads activations quantized beforehand (`quantize_activations`): with no quantization
# to amortize, fewer rows a program were faster (H200, routed gate / up + SwiGLU, us at 1 / 8 / 32 tokens, ledger
# rows of 7d24f11: 8 rows 19.6 / 116.7 / 449.2, 16 rows 20.9 / 128.6 / 495.8; quantizing in every program at 16
# rows 23.1 / 143.0 / 548.5)
MATVEC_TILES_PREPARED = {T.IQ2_XXS: (8, 64, 2)}


def matvec_config(qtype: GGMLQuantizationType, n: int, k: int, slots: int = 1,
                  prepared: bool = False) -> tuple[int, int, int]:
    """(R weight rows, U units per K step, num_warps) for the matvec kernel. ``slots``: products per activation
    row (groups, routed experts per token), never the number of rows, so that a row's result does not depend
    on how many rows share the call; ``prepared``: the activations come quantized (MATVEC_TILES_PREPARED).
    Measured on the H200 (int8 activations, us per call, 2026-12-04 sweep):

    - IQ2_XXS: 16 rows over 2 warps (routed gate / up, 12 slots, split rows: 22.8 against 25.3 at 8 rows over
      4 warps; one warp per program was twice as slow);
    - Q2_K: 8 rows, a warp of units (routed down 11.9);
    - others: 4 rows per thread where that still makes ~1,024 programs, else 2 (Q8_0 split rows: wq_b
      1024 -> 32768 12.7 against 16.5 at 8 rows, the output head 4096 -> 129280 135.8 against 155.3, the
      grouped wo_a 12.8 against 15.0, wo_b and the shared expert unchanged; wq_a 4096 -> 1024 at 2 rows
      5.1; Q4_K, off the q2 mix, not re-measured under this rule), each thread holding about 8 (unit, row) pairs
      per step so that many loads are in flight. Not kept: wq_a + wkv (4096 -> 1536) at 4 rows with all of K in
      one step, the weights still preloaded: 3.60 against 3.80 us alone (H100, 3b3356a, scripts/quant_matmul_bench.py)
      but no faster in the step (`ds4x bench frontier --weights q2 --experts 128`, 303a787, two rounds alternating:
      at 1M 6.895, 6.867 / 6.854, 6.839 ms against 6.860, 6.843 / 6.841, 6.831 at 2 rows; at 4K 6.004, 5.999
      against 6.002, 5.996)."""
    unit = _fields(qtype)[4]
    units = k // unit
    tiles = {**MATVEC_TILES, **MATVEC_TILES_PREPARED} if prepared else MATVEC_TILES
    if qtype in tiles:
        r, u, warps = tiles[qtype]
        u = _fit_units(units, u)
        return r, u, max(1, min(warps, u // 32))
    r = 4 if -(-n // 4) * slots >= 1024 else 2
    u = _fit_units(units, 1024 // r)
    return r, u, max(1, min(4, u // 32))


def token_tile_config(n: int, groups: int, tok: int, units: int) -> tuple[int, int, int]:
    """(R weight rows, U units per K step, num_warps) of `_token_tile_kernel` for ``groups`` products of n outputs
    and ``units`` units (Q8_0: 16 weights, dense: 4), ``tok`` tokens a program: 4 rows a thread, and wider K steps
    where the rows make fewer programs (H200 sweep of devrun/q8_tokens.py on Q8_0 at 2 - 8 tokens: 32 units from
    ~2,048 programs, as wq_b and the grouped wo_a; 64 from ~1,024, as wo_b; 128 below, as wq_a)."""
    programs = -(-n // 4) * groups
    u = _fit_units(units, 32 if programs >= 2048 else 64 if programs >= 1024 else 128)
    return 4, u, max(1, min(4, u // 32))


def _token_tile_tokens(w: GGMLTensor, rows: int, int8: bool | None) -> int:
    """Tokens a program of `_token_tile_kernel` takes for ``rows`` rows times ``w``, 0 where the kernel does not
    serve: split Q8_0 rows with int8 activations, 2 .. TOKEN_TILE_MAX_ROWS rows where mirrors are on."""
    if (_mirrors["on"] and w.qtype == T.Q8_0 and w.layout == "split" and w.ndim == 2
            and MIRROR_MIN_ROWS <= rows <= TOKEN_TILE_MAX_ROWS and int8_activations(w.qtype, int8)
            and (w.is_cuda or interpret_mode())):
        return min(TILE_TOKENS["q8_0"], triton.next_power_of_2(rows))
    return 0


def _token_tile(x2: torch.Tensor, w: GGMLTensor | torch.Tensor, groups: int, tok: int) -> torch.Tensor:
    """y [T, groups * n]: row t = x2[t * groups + g] @ W_g.T for each group g, W [groups * n, K] in split Q8_0 rows
    (x2 quantized per 16 values here) or a dense 16-bit tensor (x2 16-bit), by `_token_tile_kernel` with ``tok``
    tokens a program."""
    t = x2.shape[0] // groups
    n, k = w.shape[0] // groups, w.shape[1]
    dev = x2.device
    y = torch.empty((t, groups * n), dtype=x2.dtype, device=dev)
    if isinstance(w, GGMLTensor):
        xq = quantize_activations(x2)
        code, wr, row_bytes, units = 9, w.raw, w.row_bytes, k // 16
        x2, codes, scales = _dummy(dev), xq.codes, xq.scales
    else:
        code, wr, row_bytes, units = 0, w, 0, k // 4
        x2, codes, scales = x2.contiguous(), _dummy(dev), _dummy(dev)
        if x2.data_ptr() % 8:  # x is read 4 values (8 bytes) at a time
            x2 = x2.clone()
    r, u, nw = token_tile_config(n, groups, tok, units)
    _kernels()._token_tile_kernel[(triton.cdiv(n, r), triton.cdiv(t, tok), groups)](
        x2, codes, scales, wr, y, n, units, row_bytes, t, groups, y.stride(0), QTYPE=code, R=r, U=u, TOK=tok,
        INTERPRET=interpret_mode(), num_warps=nw, **launch_options(dev, "matvec"))
    return y


def matmul_config(qtype: GGMLQuantizationType, m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, num_warps) for the tl.dot kernel (sizes without register spills on sm_90)."""
    if m <= 16:
        return 16, 64, 128, 4
    return (32 if m <= 32 else 64), 64, 128, 8


def _launch(x2: torch.Tensor, w: GGMLTensor, ids: torch.Tensor | None, x_div: int, n_pairs: int,
            rows_per_weight: int, slots: int, config: tuple[int, ...] | None = None, force: str | None = None,
            int8: bool | None = None, mv_max_rows: int = MATVEC_MAX_ROWS,
            swiglu: float | None = None, xq: Int8Activations | None = None) -> torch.Tensor:
    """y [n_pairs, N]: row p = x2[p // x_div] @ W[ids[p] if ids is not None else 0].T; ``rows_per_weight``
    (rows a weight matrix meets, on average) picks the kernel (the matvec up to ``mv_max_rows``) unless ``force``
    is "mv" or "mm"; ``slots``: products per activation row (see matvec_config). ``swiglu`` (the limit; the
    matvec only): W stacks E gate experts then E up experts [2E, N, K], ids are gate experts, and row p is
    swiglu(gate, up) of expert ids[p]. ``xq``: x2 quantized by `quantize_activations` (IQ2_XXS, int8 activations,
    the matvec), read instead of quantizing x2 in every program."""
    mod = _kernels()
    _, s, _block_bytes, _, unit = _fields(w.qtype)
    code = _code(w)
    wr = w.raw
    n, k = w.shape[-2], w.shape[-1]
    expert_bytes = n * w.row_bytes if w.ndim == 3 else 0
    dev = x2.device
    y = torch.empty((n_pairs, n), dtype=x2.dtype, device=dev)
    if n_pairs == 0 or n == 0:
        return y
    iq2 = w.qtype == T.IQ2_XXS
    grid_t = _grid_bytes(dev) if iq2 else _dummy(dev)
    has_ids = ids is not None
    ids_t = ids.reshape(-1).to(torch.int32).contiguous() if has_ids else _dummy(dev)
    x2 = x2.contiguous()
    if x2.data_ptr() % 8:  # the matvec reads 16-bit x 4 values (8 bytes) at a time
        x2 = x2.clone()
    use_mv = force == "mv" or (force is None and rows_per_weight <= mv_max_rows)
    if swiglu is not None and not (use_mv and has_ids and w.ndim == 3 and w.shape[0] % 2 == 0):
        raise ValueError("_launch: the fused SwiGLU needs the routed matvec over stacked gate / up experts")
    if (xq is None and use_mv and w.qtype == T.Q2_K and Q2_K_PREPARED_ACTIVATIONS
            and n_pairs >= Q2_K_PREPARED_MIN_PAIRS and int8_activations(w.qtype, int8)):
        xq = quantize_activations(x2, sums=True)
    if xq is not None and not (use_mv and (iq2 or (w.qtype == T.Q2_K and xq.sums is not None))
                               and int8_activations(w.qtype, int8) and xq.codes.shape == (x2.shape[0], k // 4)):
        raise ValueError("_launch: prepared int8 activations serve the IQ2_XXS matvec (and with their groups' sums "
                         "the Q2_K one) on int8 activations of x")
    if use_mv:
        r, u, nw = config if config is not None else matvec_config(w.qtype, n, k, slots, xq is not None)
        if swiglu is not None and r % 2:
            raise ValueError(f"_launch: the fused SwiGLU splits a program's rows in two halves, got {r} rows")
        n_units = k // unit
        up_bytes = (w.shape[0] // 2) * expert_bytes
        if (swiglu is not None and xq is not None and code == 17 and EXPERT_PAIRS
                and max(EXPERT_PAIRS_MIN, x_div + 1) <= n_pairs <= EXPERT_PAIRS_MAX):
            mod._qmv_expert_pairs_kernel[(triton.cdiv(n, r // 2), n_pairs)](
                xq.codes, xq.scales, wr, _iq2_xxs_tables(dev), ids_t, y, n, n_units, n_pairs, w.row_bytes,
                expert_bytes, up_bytes, float(swiglu), y.stride(0), X_DIV=x_div, R=r, U=_fit_units(n_units, u),
                PB=triton.next_power_of_2(n_pairs), INTERPRET=interpret_mode(), num_warps=nw,
                **launch_options(dev, "matvec"))
            return y
        u = _fit_units(n_units, u)
        mod._qmv_kernel[(triton.cdiv(n, r // 2 if swiglu is not None else r), n_pairs)](
            x2, xq.codes if xq is not None else _dummy(dev), xq.scales if xq is not None else _dummy(dev),
            xq.sums if xq is not None and xq.sums is not None else _dummy(dev), wr,
            _iq2_xxs_tables(dev) if iq2 else _dummy(dev), ids_t, y, n, n_units, w.row_bytes, expert_bytes,
            up_bytes, float(swiglu or 0.0), x2.stride(0), y.stride(0), X_DIV=x_div, HAS_IDS=has_ids, QTYPE=code,
            ACT8=int8_activations(w.qtype, int8), R=r, U=u, SWIGLU=swiglu is not None,
            XQ=xq is not None, INTERPRET=interpret_mode(), num_warps=nw,
            PRELOAD=weights_preloaded(w, u, has_ids), **launch_options(dev, "matvec"))
        return y
    bm, bn, bk, nw = config if config is not None else matmul_config(w.qtype, n_pairs, n, k)
    wv = 8 if iq2 else {8: 16, 9: 8, 10: 4, 12: 8}[code]
    dot_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x2.dtype]
    if interpret_mode():  # the interpreter's tl.dot mishandles bfloat16; it computes exactly anyway
        dot_dtype = tl.float32
    prec = "tf32" if x2.dtype == torch.float32 and not interpret_mode() else "ieee"
    if has_ids:
        n_exp = w.shape[0] if w.ndim == 3 else 1
        order, c_exp, c_start, c_len, max_chunks = routed_wgmma.chunk_tables(ids_t, n_exp, bm)
        grid = (triton.cdiv(n, bn), max_chunks)
    else:
        order = c_exp = c_start = c_len = _dummy(dev)
        grid = (triton.cdiv(n, bn), triton.cdiv(n_pairs, bm))
    mod._qmm_kernel[grid](x2, wr, grid_t, c_exp, c_start, c_len, order, y, n_pairs, n, k, w.row_bytes,
                          expert_bytes, x2.stride(0), y.stride(0), X_DIV=x_div, HAS_IDS=has_ids, QTYPE=code, S=s,
                          W=wv, BM=bm, BN=bn, BK=bk, DOT_DTYPE=dot_dtype, PREC=prec,
                          INTERPRET=interpret_mode(), num_warps=nw)
    return y


def dequantize_gpu(w: GGMLTensor, dtype: torch.dtype = torch.bfloat16, experts: slice | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense ``w`` (or ``w[experts]`` of a 3-D weight) in ``dtype``, decoded by one Triton launch: the same values
    as ``w.dequantize(dtype)`` bit for bit (the decode is exact in float32, then one rounding). ``out``: a buffer
    of at least that many elements to decode into (a scratch reused across calls)."""
    if w.qtype not in _TYPES:
        raise ValueError(f"dequantize_gpu: no kernel for {w.qtype.name}")
    _, s, *_ = _TYPES[w.qtype]
    code = _code(w)
    n, k = w.shape[-2], w.shape[-1]
    raw = w.raw if w.ndim == 2 else w.raw.view(w.shape[0], n, w.row_bytes)
    if experts is not None:
        raw = raw[experts]
    n_exp = raw.shape[0] if w.ndim == 3 else 1
    shape = (n_exp, n, k) if w.ndim == 3 else (n, k)
    y = torch.empty(shape, dtype=dtype, device=raw.device) if out is None else out.view(-1)[: n_exp * n * k].view(shape)
    if y.numel():
        bn, bk = 32, 256
        iq2 = w.qtype == T.IQ2_XXS
        _kernels()._dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk), n_exp)](
            raw, _grid_bytes(raw.device) if iq2 else _dummy(raw.device), y, n, k, w.row_bytes, n * w.row_bytes,
            QTYPE=code, S=s, BN=bn, BK=bk, num_warps=4)
    return y


def _routed_grouped(x2: torch.Tensor, w: GGMLTensor, ids: torch.Tensor, x_div: int) -> torch.Tensor:
    """y [P, N], row p = x2[p // x_div] @ W[ids[p]].T through bf16 experts and torch._grouped_mm (see
    GROUPED_SCRATCH_BYTES). Reads the per-expert row counts on the host once."""
    n_exp, n, k = w.shape
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    ends = torch.cumsum(torch.zeros(n_exp, dtype=torch.long, device=x2.device).scatter_add_(
        0, flat, torch.ones_like(flat)), 0)
    xs = x2[order // x_div]
    ys = torch.empty((flat.numel(), n), dtype=x2.dtype, device=x2.device)
    per = max(1, min(n_exp, GROUPED_SCRATCH_BYTES // (n * k * x2.element_size())))
    scratch = torch.empty(per * n * k, dtype=x2.dtype, device=x2.device)
    bounds = [0, *ends.tolist()]
    for e0 in range(0, n_exp, per):
        e1 = min(n_exp, e0 + per)
        lo, hi = bounds[e0], bounds[e1]
        if hi > lo:
            wd = dequantize_gpu(w, x2.dtype, slice(e0, e1), out=scratch)
            ys[lo:hi] = torch._grouped_mm(xs[lo:hi], wd.transpose(1, 2), offs=(ends[e0:e1] - lo).to(torch.int32))
    return torch.empty_like(ys).index_copy_(0, order, ys)


def _grouped_path(x: torch.Tensor) -> bool:
    """Whether a routed product with these activations may take the grouped path."""
    return (x.dtype == torch.bfloat16 and (x.is_cuda or interpret_mode()) and hasattr(torch, "_grouped_mm")
            and not (x.is_cuda and torch.cuda.is_current_stream_capturing()))


def use_dense_mirrors(on: bool = True) -> None:
    """Turn dense mirrors of Q8_0 matrices on or off for batched products (see MIRROR_MIN_ROWS). Mirrors
    already built stay with their weights."""
    _mirrors["on"], _mirrors["refused"] = on, False


def _dense_mirror(w: GGMLTensor, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``w`` decoded to ``dtype`` and kept, when mirrors are on and ``rows`` rows make it pay; else None.
    Built outside a CUDA-graph capture only (a captured step uses what its eager first run built)."""
    if not (_mirrors["on"] and rows >= MIRROR_MIN_ROWS and w.qtype in MIRROR_TYPES and w.is_cuda):
        return None
    m = w.dense_mirror
    if m is not None and m.dtype == dtype:
        return m
    if torch.cuda.is_current_stream_capturing() or _mirrors["refused"]:
        return None
    need = w.numel() * torch.finfo(dtype).bits // 8
    free = free_memory(w.device)  # with the allocator's unused blocks, which the driver's count leaves out
    if free < need + MIRROR_RESERVE_BYTES:
        _mirrors["refused"] = True
        log.warning("dense mirrors of Q8_0 matrices stop here: %.1f GiB free on %s; batched products read the "
                    "blocks instead", free / 2**30, w.device)
        return None
    w.dense_mirror = dequantize_gpu(w, dtype)
    return w.dense_mirror


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
                 force: str | None = None, int8: bool | None = None) -> torch.Tensor:
    """``x [..., K] @ w[N, K].T -> [..., N]`` in x's dtype. Above ``DOT_MAX_ROWS`` rows: dequantize
    once (torch, on the device) and use the dense GEMM. ``int8``: see :func:`int8_activations`."""
    _check(x, w, "quant_linear")
    if w.ndim != 2:
        raise ValueError(f"quant_linear: weight must be 2-D, got {list(w.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if force is None and (tok := _token_tile_tokens(w, x2.shape[0], int8)):
        return _token_tile(x2, w, 1, tok).reshape(*lead, w.shape[0])
    if force is None and (dense := _dense_mirror(w, x2.shape[0], x.dtype)) is not None:
        return torch.nn.functional.linear(x, dense)
    if x2.shape[0] > DOT_MAX_ROWS and force is None:
        return torch.nn.functional.linear(x, dequantize_gpu(w, x.dtype))
    return _launch(x2, w, None, 1, x2.shape[0], x2.shape[0], 1, config, force, int8).reshape(*lead, w.shape[0])


def dense_serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `dense_linear` can take this product: a 16-bit weight [N, K] on CUDA (or in the interpreter), K a
    multiple of 8, rows 8-byte aligned (any number of rows of x; the matvec reads W once per row, so callers send
    it a few)."""
    return (HAVE_TRITON and w.dtype in _DENSE_QTYPE and w.dim() == 2 and w.is_contiguous()
            and (w.is_cuda or interpret_mode()) and x.device == w.device and w.shape[1] % 8 == 0
            and w.data_ptr() % 8 == 0 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.shape[-1] == w.shape[1])


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ w[N, K].T -> [..., N]`` in x's dtype for a dense 16-bit weight, by the matvec kernel: float32
    sums, each row of x alone (the same bits whatever the number of rows), see `dense_serves`."""
    if not dense_serves(x, w):
        raise ValueError(f"dense_linear: cannot take x {x.dtype} {list(x.shape)} @ w {w.dtype} {list(w.shape)} on "
                         f"{w.device}")
    g = GGMLTensor(w.view(torch.uint8), _DENSE_QTYPE[w.dtype], tuple(w.shape))
    x2 = x.reshape(-1, x.shape[-1])
    return _launch(x2, g, None, 1, x2.shape[0], 1, 1, force="mv").reshape(*x.shape[:-1], w.shape[0])


def dense_token_tile_serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `dense_token_tile` takes this product: what `dense_serves` says, 16-bit x and 2 ..
    DENSE_TOKEN_TILE_MAX_ROWS rows."""
    rows = x.numel() // max(1, x.shape[-1])
    return (MIRROR_MIN_ROWS <= rows <= DENSE_TOKEN_TILE_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and dense_serves(x, w))


def dense_token_tile(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ w[N, K].T -> [..., N]`` for a dense 16-bit weight and 2 .. DENSE_TOKEN_TILE_MAX_ROWS rows of
    16-bit x by `_token_tile_kernel`: each weight read once for all rows, float32 sums (a row's bits depend on the
    rows beside it; `dense_linear` computes each alone). See `dense_token_tile_serves`."""
    if not dense_token_tile_serves(x, w):
        raise ValueError(f"dense_token_tile: cannot take x {x.dtype} {list(x.shape)} @ w {w.dtype} "
                         f"{list(w.shape)} on {w.device}")
    x2 = x.reshape(-1, x.shape[-1])
    tok = min(TILE_TOKENS["dense"], triton.next_power_of_2(x2.shape[0]))
    return _token_tile(x2, w, 1, tok).reshape(*x.shape[:-1], w.shape[0])


def quant_matmul_routed(x: torch.Tensor, w: GGMLTensor, ids: torch.Tensor, *,
                        config: tuple[int, ...] | None = None, force: str | None = None,
                        int8: bool | None = None) -> torch.Tensor:
    """Routed experts: ``x [T, K]``, ``w [E, N, K]``, ``ids [T, k]`` -> ``y [T, k, N]`` with
    ``y[t, j] = x[t] @ w[ids[t, j]].T``."""
    _check(x, w, "quant_matmul_routed")
    if w.ndim != 3 or x.ndim != 2 or ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"quant_matmul_routed: want x [T, K], w [E, N, K], ids [T, k]; got {list(x.shape)}, "
                         f"{list(w.shape)}, {list(ids.shape)}")
    t, kk = ids.shape
    path = _routed_path(x, w, t * kk, config, force)
    if path == "wgmma":
        return routed_wgmma.routed_wgmma(x, w, ids, kk).reshape(t, kk, w.shape[1])
    if path == "grouped":
        return _routed_grouped(x.contiguous(), w, ids, kk).reshape(t, kk, w.shape[1])
    y = _launch(x, w, ids, kk, t * kk, _pairs_per_expert(w, t * kk), kk, config, force, int8,
                ROUTED_MATVEC_MAX_ROWS.get(w.qtype, MATVEC_MAX_ROWS))
    return y.reshape(t, kk, w.shape[1])


def _pairs_per_expert(w: GGMLTensor, pairs: int) -> int:
    """Rows an expert meets if the pairs spread over the experts (no host sync to count them): 1 for a decode
    step, also for the down projection's [T * k, 1] form."""
    return -(-pairs // min(w.shape[0], pairs)) if pairs else 0


def _routed_path(x: torch.Tensor, w: GGMLTensor, pairs: int, config: tuple[int, ...] | None,
                 force: str | None) -> str:
    """The kernel of a routed product of ``pairs`` (row, expert) pairs: "wgmma", "grouped" or "launch" (the
    matvec or the skinny kernel). A program per (token, expert) pair decodes its expert's blocks for that token
    alone. Sharing each decoded weight across up to 2 / 4 tokens of one expert was slower on the H200 (IQ2_XXS
    gate at 32 tokens: 471 / 741 / 1,278 us for 1 / 2 / 4 tokens a program; 2026-12-02, reverted), as was
    sorting the pairs by expert."""
    if force == "wgmma" or (force is None and config is None
                            and pairs >= WGMMA_MIN_PAIRS_PER_EXPERT.get(w.qtype, 1 << 30) * w.shape[0]
                            and os.environ.get("DS4X_ROUTED_WGMMA", "").lower() != "off"
                            and routed_wgmma.available(x, w)):
        return "wgmma"
    mv_max = ROUTED_MATVEC_MAX_ROWS.get(w.qtype, MATVEC_MAX_ROWS)
    if force is None and config is None and _pairs_per_expert(w, pairs) > mv_max and _grouped_path(x):
        return "grouped"
    return "launch"


class Int8Activations(NamedTuple):
    """Activations x [T, K] quantized per 16 values as the int8-activation matvec does it in each program:
    ``codes`` [T, K // 4] int32 (4 little-endian int8 codes a word), ``scales`` [T, K // 16] (x ~ scale * code),
    ``sums`` [T, K // 16] the groups' float sums (Q2_K's min term) or None."""

    codes: torch.Tensor
    scales: torch.Tensor
    sums: torch.Tensor | None = None


def quantize_activations(x: torch.Tensor, sums: bool = False) -> Int8Activations:
    """x [T, K] (K a multiple of 16, float32 / bf16 / fp16, CUDA or the interpreter) -> `Int8Activations`, one
    launch; a matvec given them reads them instead of quantizing x in every program (the same bits). ``sums``:
    also each group's float sum (what the Q2_K matvec needs)."""
    t, k = x.shape
    if k % 16:
        raise ValueError(f"quantize_activations: K = {k} is not a multiple of 16")
    x = x.contiguous()
    codes = torch.empty(t, k // 4, dtype=torch.int32, device=x.device)
    scales = torch.empty(t, k // 16, dtype=torch.float32, device=x.device)
    group_sums = torch.empty_like(scales) if sums else None
    if t and k:
        groups = _fit_units(k // 16, 128)
        _kernels()._xq16_kernel[(k // 16 // groups, t)](
            x, codes, scales, group_sums if sums else _dummy(x.device), k // 16, x.stride(0), G=groups, SUMS=sums,
            INTERPRET=interpret_mode(), num_warps=4, **launch_options(x.device, "matvec"))
    return Int8Activations(codes, scales, group_sums)


def routed_swiglu_input(x: torch.Tensor, w13: GGMLTensor, k: int) -> Int8Activations | None:
    """x [T, K] quantized for `quant_routed_swiglu` over k experts a row where that launch reads prepared int8
    activations (IQ2_XXS experts with int8 activations, at decode sizes), else None: quantized once, x's 16-value
    groups are not re-quantized by each of the launch's programs."""
    if (not PREPARED_ACTIVATIONS or w13.qtype != T.IQ2_XXS or not int8_activations(w13.qtype) or x.ndim != 2
            or not _swiglu_serves(x, w13, x.shape[0] * k, None)):
        return None
    return quantize_activations(x)


PREPARED_ACTIVATIONS = True  # False: each program of the routed gate / up launch quantizes x (an A/B switch)
# The matvec of split Q8_0 rows without expert ids whose whole K is one step of the tile (in the q2 mix wq_a, wq_b,
# the indexer's wq_b and the shared expert; not the grouped wo_a, wo_b or the output head) loads its weights before
# it waits for the kernels upstream (PDL): they write x, never the weights, so the first wave's weight bytes arrive
# while the previous kernel finishes. wq_a (4096 -> 1024, 4.5 MB) took 3.95 us, 27% of copy bandwidth (f663748),
# about one DRAM round trip more than its bytes. An L2 prefetch of each program's rows before the wait (see
# ds4x.formats.pdl) sped wq_a up and slowed the shared expert, wo_b and the step: those bytes crossed twice. Loaded
# into registers instead (the same bits either way), H100: wq_a 4.39 -> 3.04 us (int8 activations), wq_b at its
# int8 tile 15.65 -> 16.60 (slower alone); the replayed step (`scripts/batched_decode.py -m flash:q2:128`, two
# alternating rounds) 6.13 -> 6.06 ms at one session, 13.97 / 13.98 at eight
PRELOAD_WEIGHTS = True
# The Q2_K matvec (the routed down projection) from Q2_K_PREPARED_MIN_PAIRS (row, expert) pairs reads x quantized
# once per row with its groups' sums (one more launch) instead of quantizing it in each of a pair's N / R programs
# (512 at Flash's 4096 rows); the same bits. H200 (9fa0861, flash:q2 seed 0): routed down at 8 tokens 46.3 against
# 56.4 us (66.9% of copy bandwidth against 55.0%), one token 12.26 / 12.29; the replayed step at 8 sessions 13.91
# against 14.36 ms, at 32 sessions 36.78 against 38.72 (`scripts/batched_decode.py --variant`, one process). One
# session's 6 pairs keep the per-program path: the extra launch would sit on the step's path
Q2_K_PREPARED_ACTIVATIONS = True
Q2_K_PREPARED_MIN_PAIRS = 8
# The routed gate / up + SwiGLU launch over many tokens' pairs (a batched decode step) decodes each expert's rows
# once for two of its pairs (_qmv_expert_pairs_kernel; the same bits per pair) from EXPERT_PAIRS_MIN to
# EXPERT_PAIRS_MAX pairs (each program reads the launch's expert ids to find its expert's pairs); False: once per
# pair. H200, 6 random experts a token, us per launch (devrun of 1373968): 8 tokens 125.9 against 115.5 one program
# per pair, 16 tokens 238.2 against 225.7, 32 tokens 433.8 against 446.5 (a 32-session step 38.85 against 39.90 ms):
# the kernel's 148 registers (96 for one pair) cost more than the repeats it saves until experts repeat often.
EXPERT_PAIRS = True
EXPERT_PAIRS_MIN = 192
EXPERT_PAIRS_MAX = 1024


def _swiglu_serves(x: torch.Tensor, w13: GGMLTensor, pairs: int, config: tuple[int, ...] | None) -> bool:
    """Whether `quant_routed_swiglu` runs for ``pairs`` (row, expert) pairs: where the stacked product of twice as
    many would take the matvec."""
    return (_routed_path(x, w13, 2 * pairs, config, None) == "launch"
            and _pairs_per_expert(w13, 2 * pairs) <= ROUTED_MATVEC_MAX_ROWS.get(w13.qtype, MATVEC_MAX_ROWS))


def quant_routed_swiglu(x: torch.Tensor, w13: GGMLTensor, ids: torch.Tensor, limit: float, *,
                        config: tuple[int, ...] | None = None, int8: bool | None = None,
                        xq: Int8Activations | None = None) -> torch.Tensor | None:
    """``swiglu(x[t] @ w13[ids[t, j]].T, x[t] @ w13[E + ids[t, j]].T) -> [T, k, N]`` for gate and up experts
    stacked by expert (``w13 [2E, N, K]``, model/projections.py), in one matvec launch (the products' and
    `ds4x.kernels.moe.swiglu_fused`'s bits); None where the stacked product would not take the matvec (prompts,
    prefill chunks: the caller runs the product and SwiGLU apart). ``xq``: x from `routed_swiglu_input`."""
    _check(x, w13, "quant_routed_swiglu")
    if w13.ndim != 3 or w13.shape[0] % 2 or x.ndim != 2 or ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"quant_routed_swiglu: want x [T, K], w13 [2E, N, K], ids [T, k]; got {list(x.shape)}, "
                         f"{list(w13.shape)}, {list(ids.shape)}")
    t, kk = ids.shape
    if not _swiglu_serves(x, w13, t * kk, config):
        return None
    y = _launch(x, w13, ids, kk, t * kk, _pairs_per_expert(w13, 2 * t * kk), 2 * kk, config, "mv", int8,
                swiglu=limit, xq=xq)
    return y.reshape(t, kk, w13.shape[1])


def quant_grouped_linear(x: torch.Tensor, w: GGMLTensor, groups: int, *, config: tuple[int, ...] | None = None,
                         force: str | None = None, int8: bool | None = None) -> torch.Tensor:
    """Block-diagonal product of kernels/linear.grouped_linear: x [T, G, in_g], w [G*out_g, in_g]."""
    _check(x, w, "quant_grouped_linear")
    t, g, kin = x.shape
    if g != groups or w.ndim != 2 or w.shape[0] % groups:
        raise ValueError(f"quant_grouped_linear: x {list(x.shape)} and weight {list(w.shape)} do not fit "
                         f"{groups} groups")
    out_g = w.shape[0] // groups
    if force is None and (tok := _token_tile_tokens(w, t, int8)):
        return _token_tile(x.reshape(t * g, kin), w, g, tok).reshape(t, g, out_g)
    if force is None and (dense := _dense_mirror(w, t, x.dtype)) is not None:
        return torch.einsum("tgi,goi->tgo", x, dense.view(groups, out_g, kin))
    wg = GGMLTensor(w.raw.view(groups, out_g, w.row_bytes), w.qtype, (groups, out_g, kin), w.layout)
    if t > DOT_MAX_ROWS and force is None:
        return torch.einsum("tgi,goi->tgo", x, dequantize_gpu(wg, x.dtype))
    ids = _group_ids(groups, t, x.device)
    y = _launch(x.reshape(t * g, kin), wg, ids, 1, t * g, t, g, config, force, int8)
    return y.reshape(t, g, out_g)
