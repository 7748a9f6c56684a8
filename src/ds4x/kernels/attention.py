"""Attention over stored rows (H heads sharing one K = V row set): decode (one query) and prefill (a chunk of queries).

The rows come from the cache's stores: packed KV rows (E4M3 non-RoPE values with a UE8M0 scale per 64,
FP16 RoPE values) are decoded tile by tile in registers, unpacked native rows are read as float32; no
float copy of the history is made. Flash-decoding: one launch over the (one or two) row sources, a program per
split of consecutive row blocks and group of heads (`ds4x.kernels.triton_attention`), then one merge of the
splits' softmax states with the per-head sink. A source names its rows by `Slots`: an explicit index tensor,
or (so that a decode step needs no index arithmetic of its own) the sliding window of a ring or the closed
compressed rows, both derived inside the kernel from the query's position on the device.
The torch reference is the model's attention path (`ds4x.model.attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slots:
    """The stored rows one source offers a query, as ``n`` slots (-1 = no row):

    - ``index`` given: slot j is row ``index[j]``;
    - ``ring`` given: the sliding window of ``n`` positions ending at ``position`` in a ring of ``ring`` rows
      (slot j is position ``position - n + 1 + j``, none before 0);
    - ``ratio`` given: compressed rows 0 .. n-1, those whose window has closed by ``position``
      (``(position + 1) // ratio`` of them).

    ``position`` is a device tensor [1], read by the kernel: a captured step replays at any position. For a batch
    of B queries (`attention_decode_triton` with q [B, H, D]) ``position`` is [B] and ``index`` [B, n], one row per
    query."""

    n: int
    index: torch.Tensor | None = None
    position: torch.Tensor | None = None
    ring: int = 0
    ratio: int = 0

    @property
    def mode(self) -> int:
        return 0 if self.index is not None else 1 if self.ring else 2

    def explicit(self) -> torch.Tensor:
        """The slots as an index tensor [n] (-1 = none); [B, n] for B positions."""
        if self.index is not None:
            return self.index
        assert self.position is not None
        j = torch.arange(self.n, device=self.position.device)
        pos = self.position[:, None] if self.position.numel() > 1 else self.position
        if self.ring:
            p = pos - (self.n - 1) + j
            return torch.where(p >= 0, p % self.ring, -1)
        return torch.where(j < (pos + 1) // self.ratio, j, -1)


# Decode blocking: (rows per block, heads per program, warps, most splits per source). A program runs its split's
# blocks one after another with the next block's loads in flight; long sources (HCA at 1M: 8,194 rows) are cut
# into at most that many splits, so the merge reads few partial states. Measured (H200, 2026-12-02,
# scripts/attention_sweep.py, us for window 128 / CSA top-512 / HCA 8,194 rows at 1M, each with its window):
# (16, 16, 8, 64) 11.6 / 16.0 / 85.7, (16, 16, 8, 32) 12.3 / 16.0 / 84.6, (16, 32, 8, 64) 18.7 / 19.9 / 98.8; before
# the hardware E4M3 conversion, 4 warps (which spill) 16.1 / 18.9 / 113.2, 16 warps 13.9 / 20.8 / 137.7, 32 rows
# per block 25.3 / 27.0 / 166.3. 64 heads per program gave NaN or an illegal memory access with Triton 3.6 (the
# earlier kernel, 2026-12-01), so a program takes at most 32 heads.
DECODE_CONFIG = (16, 16, 8, 64)
MAX_HEADS_PER_PROGRAM = 32
# The Hopper kernel (`ds4x.kernels.attention_wgmma`, all heads and all 512 output columns per program) for queries
# of up to 64 heads at the model's row shape (512 values, 448 non-RoPE): (rows per block, most splits per source);
# WGMMA=False keeps the Triton kernel. Measured (H200, devrun sweep like scripts/compressed_kernels_ab.py, us;
# window 128 / CSA window + top-512 at 1M / HCA 34 rows at 4K / HCA 8,194 rows at 1M, each with the window):
# (16, 128) 13.8 / 15.0 / 13.9 / 37.2, (16, 64) 13.8 / 15.1 / 14.0 / 46.8, (32, 128) 16.6 / 16.9 / 16.3 / 37.8
# (32 rows spill); the Triton kernel at DECODE_CONFIG 12.1 / 15.9 / 12.4 / 84.7. The earlier Gluon kernel (two
# programs per split, each half of the columns, 1efc93d) 11.1 / 12.3 / 11.2 / 49.4.
# Since (16, 128) with the warp-local softmax, asynchronous products and PDL (c53a198): 12.3 / 13.5 / 13.0 / 32.3;
# (32, 128) with blocks decoded in 16-row parts 15.7 / 16.8 / 16.5 / 37.5. Splits fitted to one program a
# multiprocessor instead (an HCA layer at 1M: the window 2 x 4 blocks and the compressed rows 129 x 4, 131 programs
# against 8 x 1 and 103 x 5) were slower: 29.5 against 26.9 us with the rows from DRAM (H100, cd6ca52,
# scripts/compressed_kernels_ab.py; more partial states to store, each ~4,000-8,000 cycles a program). At most 96 /
# 160 splits instead (an HCA layer at 1M: 86 splits of 6 blocks / 129 of 4, against 103 of 5): HCA at 1M 29.5, 29.2 /
# 35.4, 34.8 us against 24.6, 24.4 (H100, d30fe1e, `ds4x bench frontier --weights q2 --experts 128 --contexts
# 1048576 --variant "s96: ds4x.kernels.attention.WGMMA_CONFIG=(16, 96)"`, two rounds alternating).
WGMMA = True
WGMMA_CONFIG = (16, 128)
# Not kept: longer programs for the calls of 64 splits or more (LONG_CONFIG, 3a0909d, removed), so that an HCA layer
# at 1M runs 4 + 86 splits of three 32-row blocks (its score product m64n16 a warpgroup instead of m64n8) or 8 + 86
# of six 16-row blocks, instead of 8 + 103 of five, in two phases (225,280 B of shared memory, no spills). The bf16
# states' accuracy (GPU test), but HCA at 1M 22.6 -> 24.7 / 24.3 us and the 41 layers 1.234-1.238 -> 1.276-1.277 /
# 1.266-1.267 ms (H100, 8f064ed, the frontier at 1M, two rounds alternating): fewer programs doing more each
# Splits of at least 2 or 3 blocks for the short sources (the window's 8 blocks and CSA's 32, one a split now) were
# slower: us in L2 / from DRAM at 1 / 2 / 3, window 10.9 / 13.1 / 15.1 and 11.3 / 13.6 / 15.8, CSA top-512 at 1M
# 11.6 / 13.0 / 15.4 and 12.3 / 14.1 / 16.4 (H100, 16317e5 with the row loads' groups loaded a block ahead, not kept).
# A bf16 query whose programs take at most TWO_PHASE_BLOCKS blocks each runs them in two phases (all scores first,
# then the products against the final maximum: `attention_wgmma._two_phase_blocks`), not the online loop; 0: off.
# Shared memory bounds it (5 blocks of 16 rows: 195 KB). H100, scripts/compressed_kernels_ab.py --parts attention,
# us online / two phases, two runs (be06734; ungrouped kernel at 964ce28): window 128 10.7 / 10.7, 10.6 / 10.8; CSA
# top-512 at 1M 11.6 / 11.6, 11.5 / 11.4; HCA at 4K 10.7 / 10.6, 10.8 / 10.5; HCA at 1M 30.0 / 27.0, 27.4 / 25.9.
# Longer programs in groups of 4 or 5 blocks (an accumulator held across a group's decodes: 255 registers and
# spills; c49a7b8) were slower everywhere: 32 x CSA at 4K 60.4 online against 68.3 / 69.3, 8 x HCA at 1M 201 against
# 219 / 225, a 1,024-query CSA prefill chunk 1,038 against 1,168 / 1,181, the one-group cases 0.3-0.9 slower.
TWO_PHASE_BLOCKS = 5
# In the two phases, block j + 1's rows decoded while block j's score product runs (`_two_phase_blocks` OVERLAP); the
# same bits. H100, scripts/compressed_kernels_ab.py --parts attention (9fded58), us without / with: window 128
# 10.9 / 10.7, CSA top-512 at 1M 11.7 / 11.5, HCA at 4K 10.6 / 10.7, HCA at 1M 26.2 / 25.8; the batches and the
# prefill chunk (the online loop) level.
TWO_PHASE_OVERLAP = True
# Not kept: phase 2 with one barrier (4cb9a49, reverted): every block's probabilities stored first, then one fence
# and barrier and all the output products back to back, instead of a fence, a barrier and the block's products
# after each block's probabilities. The same bits (GPU test), fewer registers (171 against 184), phase 2's issue
# ~776 -> ~608 cycles a block by the stamps, yet no faster: HCA at 1M 21.9 -> 22.2 us from DRAM
# (`compressed_kernels_ab.py --parts attention`), the frontier's HCA 22.4, 22.5 -> 22.8, 22.7 us and its 41 layers
# at 1M 1.228, 1.232 -> 1.238, 1.237 ms (H100, 4cb9a49, two rounds alternating); one-block programs level
# In the two phases, the query copied to shared memory by cp.async (`attention_wgmma._copy_query`) instead of loaded
# into registers and stored: the first block's rows are decoded while it arrives (a program waited ~1.4 us for the
# query before its first decode, 389dd87's stamps). The same bits (GPU test). H100, `ds4x bench frontier --weights q2
# --experts 128 --contexts 4096,1048576 --steps 50 --variant "q async: ds4x.kernels.attention.QUERY_ASYNC=True"`
# (d8246bd, two rounds alternating), without / with: at 4K CSA attention 12.5 / 11.9-12.0 us, HCA 11.3 / 10.9, the 41
# compressed layers 0.623, 0.624 / 0.605, 0.603 ms (sum); at 1M CSA 12.3 / 11.9, HCA 24.8-24.9 / 24.5, 41 layers
# 1.348, 1.352 / 1.334, 1.336 ms
QUERY_ASYNC = True
# The Hopper kernel's partial states (64 x 512 float32 a split) written by the TMA unit from a swizzled shared tile,
# the RoPE columns' low-part products added there (`attention_wgmma._store_state_tma`), instead of global 8-byte
# stores over 8 rows a warp instruction and a global atomic add per RoPE element: TMA_STATE True / False in every
# launch / none; None (the default) in launches of one query with at least TMA_STATE_SPLITS splits (batched steps
# and prefill chunks were not timed with it). The same bits (GPU test). It pays only where many programs store at
# once: H100, 4adf64c, `compressed_kernels_ab.py --parts attention-variants`, us in L2 / from DRAM, global stores /
# TMA: window 128 (8 programs) 10.5 / 10.4, 11.1 / 11.9; CSA top-512 at 1M (40) 11.4 / 12.1, 12.5 / 13.1; HCA at 4K
# (11) 10.4 / 10.9, 11.5 / 12.1; HCA at 1M (111) 24.3 / 24.9, 23.9 / 24.2. The frontier at 1M with it in every
# launch: CSA attention 12.4 -> 13.4 us, HCA 25.4 -> 24.8, 41 layers 1.366 -> 1.375 ms (sum). At 64 splits, of a
# decode step's layers only HCA at long contexts takes it (111 splits at 1M). That default against global stores
# everywhere (H100, 6e57e4f, `ds4x bench frontier --weights q2 --experts 128 --contexts 4096,1048576 --variant
# "global state: ds4x.kernels.attention.TMA_STATE=False"`, two rounds): HCA at 1M 24.8, 24.9 / 25.5, 25.5 us, 41
# layers 1.355, 1.359 / 1.371, 1.368 ms (sum); at 4K level (0.625 / 0.624-0.625). Since STATE_BF16 (below), the
# launches that would take it by default store bf16 states instead: it serves float32 states (STATE_BF16=False).
TMA_STATE: bool | None = None
TMA_STATE_SPLITS = 64
# The Hopper kernel's partial accumulators stored as bf16 (`attention_wgmma._store_state_bf16`: rounded once, after
# the RoPE columns' low parts are added; m and l stay float32, as split-KV decoders commonly keep them), halving the
# bytes the partial pass stores and the merge reads back (an HCA layer at 1M: 111 splits, 14.5 MB as float32). Not
# the float32 state's bits: each split's output carries one more bf16 rounding (at most 2^-9 of an element, ~1e-3
# of the output's norm after the merge, as the GPU test measures) before the merge's float32 sum, and the merged
# output is rounded to the model's bf16 anyway. True / False in every launch; None (the default) in launches with
# at least STATE_BF16_SPLITS splits, whatever the batch (so a query's bits do not depend on its batch). H100,
# e0da670, `compressed_kernels_ab.py --parts attention-variants`, us in L2 / from DRAM, float32 / bf16 in every
# launch: window 128 (8 programs) 10.2 / 11.0, 10.2 / 11.6; CSA top-512 at 1M (40) 11.2 / 11.6, 11.7 / 12.2; HCA at
# 4K (11) 10.3 / 11.0, 10.7 / 11.6; HCA at 1M (111) 23.3 / 21.4, 24.0 / 22.3. The frontier (`--weights q2 --experts
# 128 --contexts 4096,1048576 --variant "bf16 state: ds4x.kernels.attention.STATE_BF16=True"`, two rounds): at 1M
# HCA 24.6 / 22.7-22.8 us, CSA 11.9 / 12.3-12.4, 41 layers 1.301, 1.300 / 1.273, 1.270 ms (sum); at 4K 0.609 /
# 0.634-0.636. So only the many-split launches take it; the default against float32 states (H100, 678cb91, the same
# frontier with "f32 state: ...STATE_BF16=False", two rounds): at 1M HCA 22.9, 22.8 / 24.6, 24.5 us, CSA 11.8-11.9
# both, 41 layers 1.267, 1.269 / 1.302, 1.298 ms (sum); at 4K 0.610 both. In that run splits fitted to one wave
# again (an HCA layer at 1M as 2 x 4 + 129 x 4 blocks, 131 programs, against 8 x 1 + 103 x 5; dropped with float32
# states at 41242c6) were still slower with bf16 states: HCA at 1M 26.6, 26.7 us, 41 layers 1.341, 1.345 ms.
STATE_BF16: bool | None = None
STATE_BF16_SPLITS = 64
# A bf16 state rounded in the two phases' registers and stored by the TMA unit (`attention_wgmma.
# _store_state_bf16_tma`): the RoPE columns from a second accumulator of their output products (each element the same
# products in the same order as the big accumulator's) plus the low parts', all 512 columns rounded to bf16 into a
# 64 KB swizzled tile and written out in 64-column boxes, instead of the 128 KB float32 stage read back 64 columns at
# a time and stored by the threads (~6,060 cycles of an HCA call at 1M by the stamps, 4cb9a49). The same bits
# meant (GPU test). Not yet timed: off.
STATE_BF16_TMA = False
# Not kept: the bf16 state stored straight from the two phases' accumulator registers (STATE_BF16_DIRECT,
# e21ad32..a2ac8c5, removed: a second accumulator of the RoPE columns' products in the low parts' layout, each thread
# storing its column pairs as bf16), instead of the float32 stage in shared memory read back as 16-byte row pieces.
# The same bits (GPU test, H100), but an HCA call at 1M 22.5-22.6 -> 27.0-27.1 us and the 41 compressed layers
# 1.234-1.236 -> 1.322-1.323 ms (H100, 8f064ed, `ds4x bench frontier --weights q2 --experts 128 --contexts 1048576
# --steps 50`, two rounds alternating): a warp's 4-byte stores in the accumulator's layout cover 16 bytes of each of
# 8 rows, half of each 32-byte sector, 76 store instructions a thread against 16 of 16 bytes
# A split's output columns spread over programs (`attention_wgmma.partial_kernel` PARTS): in a two-phase launch
# storing float32 states by global stores, each split runs as up to COLUMN_PARTS programs (a power of two, as many
# as keep the launch within one program a multiprocessor), each of which decodes and scores all the split's rows
# but runs the output product and stores the partial state for 512 / PARTS columns only. A launch of few splits
# (the window's 8, CSA's 40) waits on each program's 128 KB of state stores (~4,300 cycles by the phases' stamps,
# as long as its one block's decode and scores); this spreads them over idle multiprocessors. The same bits (each
# output element's k16 steps in the same order; `test_hopper_attention_column_parts_give_the_same_bits`).
# sm_90 offline (scripts/kernel_sass.py attention --query bf16 --two-phase 5 --overlap --q-async --skip-empty
# --parts 1 2 4): 188 / 120 / 89 registers, 68 / 36 / 20 global stores, 2,056 / 1,992 / 1,992 instructions, no
# spills. H100 (8ab700f, `bash scripts/device_ab.sh frontier` with 2 and 4 as variants; the same bits in every
# case), us from DRAM 1 / 2 / 4: window 10.8 / 9.4 / 9.0, CSA 11.8 / 10.7 / 10.7, HCA at 4K 10.9 / 9.4 / 9.4, HCA at
# 1M 21.9 (one part); the frontier's 41 compressed layers at 4K 0.607 / 0.550 / 0.552 ms, at 1M 1.260 / 1.232 /
# 1.233 (sum, two rounds alternating). 1: off.
COLUMN_PARTS = 4
# A captured step sizes a source's splits by its store's capacity, not the query's position: a session opened for
# 1M tokens runs HCA's 111 splits at every position, and at a 4K position all but one of them read no row yet
# each wrote a 128 KB zero state that the merge read back (H100, 03d142b, `scripts/batched_decode.py --batches 1
# --context 4096 --capacity 1048576 --profile`: partial passes 573 us a step against 353 at a 4,142-token capacity,
# merges 178 against 138; the step 6.53 against 6.04 ms). SKIP_EMPTY_SPLITS: a split past its source's closed
# compressed rows (`triton_attention.empty_split`) stores only m = -inf and l = 0, and the merge leaves its
# accumulator unread; the same bits. On: a 1M-capacity session at position 200,000 (inside its 1M span, spans on)
# 6.70 -> 6.58 ms a step, at 4K without spans 6.53 -> 6.39; at 1M (every split live) the frontier's 41 compressed
# layers 1.341 / 1.341 ms against 1.346 / 1.338 without it (H100, 754f523, two rounds alternating)
SKIP_EMPTY_SPLITS = True
# Not kept: the two phases warp-specialized (Gluon warp_specialize, 6e57e4f..f4e8630, removed): the same bits, never
# faster (H100, scripts/compressed_kernels_ab.py --parts attention-variants, us in L2 / from DRAM, without / with).
# One decode warpgroup for whole blocks beside two product warpgroups: window 128 10.5 / 10.3, 11.2 / 11.9; HCA at 1M
# 23.8 / 24.2, 26.8 / 28.7 (four warps decode at half the rate of eight). Sixteen warps, a second partition of two
# warpgroups decoding half of every block's rows (its half announced by an mbarrier; the state by global stores, the
# TMA stage not fitting beside the tiles): window 10.4 / 11.1, 10.8 / 11.4; CSA top-512 at 1M 11.4 / 12.1, 11.7 /
# 12.6; HCA at 4K 10.5 / 11.0, 10.6 / 11.2; HCA at 1M 23.5 / 24.3, 23.6 / 24.3; the frontier (f4e8630) 41 layers at
# 1M 1.353, 1.353 / 1.361, 1.363 ms (sum), at 4K 0.625, 0.626 / 0.642, 0.641. Halving each warp's decode did not
# shorten the blocks (HCA at 1M level even after giving up the TMA state's ~0.6 us)
# Not kept: the score product's query operand half in registers (its first 128 or 256 columns; each m64n8 step
# re-reads its 2 KB A operand from shared memory, ~128 KB a block). Stamps had said the score products slow a phase-1
# block's decode from 2,166 to 3,041 cycles (scripts/attention_phases.py --two-phase [--no-score-products], H100,
# 749c900), but the same bits in registers measured level (H100, 726c635, `compressed_kernels_ab.py --parts
# attention-variants`, us in L2 / from DRAM, none / 128 / 256 columns: window 10.3 / 10.3, 10.4 / 11.0, 10.6 / 11.0;
# CSA top-512 at 1M 11.4 / 12.0, 11.4 / 12.0, 11.2 / 11.9; HCA at 1M 24.1 / 24.8, 23.9 / 24.6, 24.2 / 25.1): the
# A operand's shared-memory reads are not what the products cost
# Splits of a batch of queries. Every split writes a partial state (64 heads x 512 float32: 128 KB) that the merge
# reads back, and a Hopper program holds a multiprocessor's shared memory, so a batch at one query's splits (CSA at
# 4K: 40 splits of one 16-row block each) ran B x 40 programs and moved 168 MB of partial states per layer at B = 32.
# With ``batch_splits`` each source of a batch of B > 1 queries gets at most BATCH_SPLIT_WAVES x SMs / (B x sources)
# splits (at least one); 0 keeps one query's splits.
BATCH_SPLIT_WAVES = 1
# The merge of the splits, as (splits per iteration, 64-value chunks per program): one chunk a program over 64
# splits at once, or whole rows over 16 at a time, which reads each split's m and l once instead of once per chunk
# but runs D / 64 times fewer programs. H100, cd222a2, us for partial pass + merge (scripts/compressed_kernels_ab.py
# --parts merge, bf16 query), chunks / rows: one query's window 128 12.1 / 12.1, CSA top-512 at 1M 12.1 / 14.8, HCA
# at 1M 31.5 / 37.6; 8 queries at 4K (batch splits) CSA 31.9 / 23.9, HCA 22.8 / 15.7; 32 queries CSA 99.0 / 67.3,
# HCA 58.1 / 26.4. So whole rows where a batch's H x B programs fill COMBINE_ROWS_WAVES waves of the SMs, and only
# with ``batch_splits`` (a query's bits already depend on its batch there); 0 waves: chunks always. A query of up
# to twice the chunks' splits per iteration takes them all in one iteration (each iteration waits on its loads).
COMBINE_CHUNKS = (64, 1)
COMBINE_ROWS = (16, 8)
COMBINE_ROWS_WAVES = 2


def column_parts(programs: int, sms: int) -> int:
    """How many programs each split takes under COLUMN_PARTS in a launch of ``programs`` splits (all its queries'):
    the largest power of two up to COLUMN_PARTS that keeps the launch within one program a multiprocessor (``sms``),
    at least 1."""
    if COLUMN_PARTS not in (1, 2, 4):
        raise ValueError(f"COLUMN_PARTS is 1, 2 or 4 (64-value chunks a part), got {COLUMN_PARTS}")
    parts = COLUMN_PARTS
    while parts > 1 and parts * programs > sms:
        parts //= 2
    return parts


def attention_decode_triton(q: torch.Tensor, sources: list[tuple[torch.Tensor, Slots | torch.Tensor]],
                            sinks: torch.Tensor, scale: float, nope: int, packed: bool,
                            config: tuple[int, int, int, int] | None = None,
                            inverse_rope: tuple[torch.Tensor, torch.Tensor, torch.dtype] | None = None,
                            one_pass: bool = False, batch_splits: bool = False) -> torch.Tensor:
    """q [H, D] (float32, or a half type read as float32); sources (one or two): (store data, its `Slots` or an
    explicit index tensor [n] with -1 = skip) -> out [H, D] float32. ``inverse_rope`` (cos, sin [B, 32] float32
    of each query's position, dtype): the output comes back with the inverse RoPE of its 64 RoPE dims applied by
    the merge launch, in that dtype (the bits of `ds4x.model.rope.apply_rope(out, cos, sin, inverse=True,
    dtype=dtype)`). A batched decode step passes B queries
    q [B, H, D] with each source's data a batch of stores [B, capacity, width] (query b reads store b), its
    positions [B] and explicit indices [B, n] -> [B, H, D], in the same two launches; each query's output has the
    bits of that query alone, unless ``batch_splits`` (B > 1) lets the batch size cut each query's rows into fewer
    splits (``BATCH_SPLIT_WAVES``): the same attention to float rounding, fewer partial states.

    On the GPU the query and the probabilities enter the tensor cores as high + low bf16/fp16 parts (the
    module doc of `ds4x.kernels.triton_attention`): relative error about 1e-5, and packed and unpacked rows
    give bit-identical outputs. The query must stay below 2^15 in magnitude (RMS-normed queries do).
    Without ``config``, Hopper GPUs run `ds4x.kernels.attention_wgmma` where it applies (see ``WGMMA_CONFIG``).
    ``config`` (the Triton kernel): (rows per block, heads per program, warps, most splits per source) instead of
    ``DECODE_CONFIG`` (heads per program 16 to ``MAX_HEADS_PER_PROGRAM``; 16 is the smallest tensor-core tile).
    ``one_pass`` (the Hopper kernel, no ``inverse_rope``): one program per query runs all its rows and applies the
    sink, no merge launch: for a prefill chunk, which has programs enough with one per query (and whose partial
    states, 128 KB per program, would not fit at decode's splits).
    Packed and native rows run the same kernel with the same blocks, so they agree bit for bit at any setting.
    """
    from ds4x.kernels.triton_attention import combine_kernel, partial_kernel

    batched = q.dim() == 3
    B, H, D = q.shape if batched else (1, *q.shape)
    if D % 64 or D > 512 or D - nope != 64:
        raise ValueError(f"the decode kernel handles rows of <= 512 values in 64-value chunks with 64 RoPE dims; "
                         f"got {D} values, {nope} non-RoPE")
    if len(sources) not in (1, 2):
        raise ValueError(f"the decode kernel takes one or two row sources per call, got {len(sources)}")
    rows_of = [rows for rows, _ in sources]
    slots = [s if isinstance(s, Slots) else Slots(int(s.shape[-1]), index=s) for _, s in sources]
    if not packed:
        # Native rows: pack the rows this query reads (lossless for native values), so both storages run one
        # kernel. Decoding float and packed rows in two kernel variants gave the same operand values but not
        # the same bits on the H200 (measured: 2e-7 apart on the first step).
        from ds4x.formats import pack_kv_rows, rows_triton

        pack = rows_triton.pack_kv_rows_triton if q.is_cuda else pack_kv_rows
        for i, s in enumerate(slots):
            idx = s.explicit().reshape(B, -1) if batched else s.explicit()
            src = rows_of[i]
            picked = (src[torch.arange(B, device=idx.device)[:, None], idx.clamp(min=0)] if batched
                      else src[idx.clamp(min=0)])
            rows_of[i] = pack(picked, validate=False, rope_dim=D - nope)
            slots[i] = Slots(s.n, index=torch.where(idx >= 0, torch.arange(s.n, device=idx.device), -1))
    from ds4x.kernels import attention_wgmma

    wide = config is None and WGMMA and attention_wgmma.available(q, H, D, nope)
    hp = attention_wgmma.HEADS if wide else max(16, 1 << (H - 1).bit_length())
    if wide:
        (block, max_splits), hb, warps = WGMMA_CONFIG, hp, attention_wgmma.WARPS
    else:
        block, hb, warps, max_splits = config if config is not None else DECODE_CONFIG
        hb = min(hp, MAX_HEADS_PER_PROGRAM, max(16, hb))
    if one_pass:
        if not wide or inverse_rope is not None:
            raise ValueError("one_pass runs the Hopper kernel (config None, WGMMA on, a query it serves) and "
                             "leaves the inverse RoPE to the caller")
        max_splits = 1
    elif batch_splits and B > 1 and BATCH_SPLIT_WAVES > 0:
        from ds4x.kernels.indexer import num_sms

        max_splits = min(max_splits, max(1, BATCH_SPLIT_WAVES * num_sms(q.device) // (B * len(slots))))
    per_split, n_splits = [], []
    for s in slots:
        n_blocks = max(1, -(-s.n // block))
        per_split.append(-(-n_blocks // max_splits))
        n_splits.append(-(-n_blocks // per_split[-1]))
    if len(slots) == 1:  # source B repeats A with no splits and no blocks (a one-pass program runs B's blocks too)
        rows_of, slots, per_split, n_splits = rows_of * 2, slots * 2, [per_split[0], 0], [n_splits[0], 0]
    n_split = sum(n_splits)
    skip_empty = SKIP_EMPTY_SPLITS and not one_pass and n_split > 1 and 2 in (slots[0].mode, slots[1].mode)
    qc = q.contiguous()
    state_bf16 = wide and not one_pass and (STATE_BF16 if STATE_BF16 is not None else n_split >= STATE_BF16_SPLITS)
    if one_pass:
        out = torch.empty(B, H, D, device=q.device)
        m = l = acc = out  # unwritten
    else:
        m = torch.empty(B, n_split, hp, device=q.device)
        l = torch.empty(B, n_split, hp, device=q.device)
        acc = torch.empty(B, n_split, hp, D, device=q.device, dtype=torch.bfloat16 if state_bf16 else torch.float32)
        out = m  # unwritten by the partial pass
    args = []
    for rows, s in zip(rows_of, slots, strict=True):
        pos = s.position if s.position is not None else qc  # an unread pointer in mode 0
        if batched and (rows.dim() != 3 or rows.shape[0] != B or (s.position is not None and s.position.numel() != B)
                        or (s.index is not None and s.index.shape != (B, s.n))):
            raise ValueError(f"a batch of {B} queries reads a batch of {B} stores with {B} positions or [{B}, n] "
                             f"indices per source; got stores {tuple(rows.shape)}")
        index = s.index.contiguous() if s.index is not None else pos
        args.append((rows, index, pos, s.n, s.ring or s.ratio or 1, rows.stride(-2),
                     rows.stride(0) if batched else 0, s.n if batched and s.index is not None else 0))
    (ra, ia, pa, na, ga, sa, store_a, index_a), (rb, ib, pb, nb, gb, sb, store_b, index_b) = args
    from ds4x.formats.pdl import launch_options

    pdl = launch_options(q.device)  # the Gluon partial pass and the merge overlap their launches with what precedes
    if wide:
        two_phase = (TWO_PHASE_BLOCKS if not one_pass and qc.dtype == torch.bfloat16 and block == 16
                     and max(per_split) <= TWO_PHASE_BLOCKS else 0)
        if state_bf16:  # (the TMA unit stores a bf16 state from registers the two phases round)
            tma_state = STATE_BF16_TMA and two_phase > 0
        else:
            tma_state = not one_pass and (TMA_STATE if TMA_STATE is not None
                                          else B == 1 and n_split >= TMA_STATE_SPLITS)
        parts = 1
        if two_phase and not (tma_state or state_bf16):
            from ds4x.kernels.indexer import num_sms

            parts = column_parts(n_split * B, num_sms(q.device))
        attention_wgmma.partial_kernel[(1 if one_pass else n_split, parts, B)](
            qc, ra, ia, pa, na, ga, sa, n_splits[0], per_split[0], rb, ib, pb, nb, gb, sb, per_split[1], m, l, acc,
            scale, store_a, store_b, index_a, index_b, n_split, sinks, out,
            attention_wgmma.state_descriptor(acc) if tma_state else None, H=H, D=D, NOPE=nope,
            BLOCK=block,
            MODE_A=slots[0].mode, MODE_B=slots[1].mode, num_warps=warps, WHOLE=one_pass, TWO_PHASE=two_phase,
            OVERLAP=TWO_PHASE_OVERLAP and two_phase > 0, TMA_STATE=tma_state,
            Q_ASYNC=QUERY_ASYNC and two_phase > 0, SKIP_EMPTY=skip_empty, STATE_BF16=state_bf16, PARTS=parts,
            **pdl)
        if one_pass:
            return out if batched else out[0]
    else:
        partial_kernel[(n_split, hp // hb, B)](qc, ra, ia, pa, na, ga, sa, n_splits[0], per_split[0], rb, ib, pb, nb,
                                               gb, sb, per_split[1], m, l, acc, scale, store_a, store_b, index_a,
                                               index_b, n_split, H=H, HP=hp, HB=hb, D=D, NOPE=nope,
                                               NC=1 << (nope // 64 - 1).bit_length(), BLOCK=block, SPLIT=q.is_cuda,
                                               MODE_A=slots[0].mode, MODE_B=slots[1].mode, SKIP_EMPTY=skip_empty,
                                               num_warps=warps)
    rows_merge = False
    if batch_splits and COMBINE_ROWS_WAVES > 0:
        from ds4x.kernels.indexer import num_sms

        rows_merge = H * B >= COMBINE_ROWS_WAVES * num_sms(q.device)
    sb, cb = COMBINE_ROWS if rows_merge else COMBINE_CHUNKS
    if not rows_merge and sb < n_split <= 2 * sb:  # (an HCA layer at 1M: 111 splits) one iteration, one wait
        sb *= 2
    cb = math.gcd(cb, D // 64)  # chunks per program: a power of two dividing the row's
    n_iter = 1 << (-(-n_split // sb) - 1).bit_length()  # powers of two: few compiled variants
    if inverse_rope is not None:
        cos, sin, dtype = inverse_rope
        if cos.shape != (B, 32) or sin.shape != (B, 32):
            raise ValueError(f"inverse_rope takes cos / sin [{B}, 32] for 64 RoPE dims, got {tuple(cos.shape)}")
        out = torch.empty(B, H, D, device=q.device, dtype=dtype)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    else:
        out = torch.empty(B, H, D, device=q.device)
        cos = sin = out  # unread
    combine_kernel[(H, D // 64 // cb, B)](m, l, acc, sinks, out, cos, sin, n_split, HP=hp, D=D, SB=sb,
                                          N_ITER=n_iter, ROPE=inverse_rope is not None, CB=cb, SKIP_EMPTY=skip_empty,
                                          num_warps=4, **pdl)
    return out if batched else out[0]


# Prefill blocking (rows per step, heads per program, warps). H200, one layer of a 2,048-query chunk at Flash shapes
# (scripts/prefill_sweep.py), ms CSA (window + top-512) / HCA: (16, 16, 4) 11.1 / 3.2, (16, 16, 8) 18.4 / 8.0,
# (32, 16, 8) 13.6 / 4.6, (16, 32, 8) 38.8 / 14.6; the torch reference path 19.8 / 21.5.
PREFILL_CONFIG = (16, 16, 4)
# On Hopper a chunk's queries run the decode kernel of `ds4x.kernels.attention_wgmma` as a batch in one pass (all
# heads and all rows of a query per program, products on the tensor cores, decode's precision, the sink applied in
# the same launch). PREFILL_WGMMA=False keeps the Triton prefill kernel.
PREFILL_WGMMA = True


def attention_prefill_triton(q: torch.Tensor, positions: torch.Tensor, window: tuple[torch.Tensor, int, int],
                             compressed: torch.Tensor | None, sinks: torch.Tensor, scale: float, nope: int, *,
                             index: torch.Tensor | None = None, ratio: int = 0, n_rows: int = 0,
                             config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """T queries q [T, H, D] (float32, or a half type read as float32) at ``positions`` [T] over packed rows ->
    [T, H, D] float32.

    ``window``: (ring rows, ring size, W): each query sees the W ring slots ending at its position (none before
    0). ``compressed``: packed compressed rows, offered per query either by ``index`` [T, k] (-1 = none) or as
    the first ``n_rows`` rows of which a query sees (position + 1) // ``ratio``. The products run in TF32 (the
    stored values and bf16-valued queries exactly, probabilities to 10 bits): the ``default`` prefill mode's
    precision, not the decode kernel's bits. Without ``config``, Hopper GPUs run the decode kernel's Gluon pass over
    the chunk as a batch of queries instead, in one pass (``PREFILL_WGMMA``: a program per query takes all its rows
    and applies the sink): decode's precision (about 1e-5 relative), not its bits (a decode step cuts the rows into
    splits and merges them)."""
    from ds4x.kernels.triton_attention import prefill_kernel

    T, H, D = q.shape
    if D % 64 or D - nope != 64 or D & (D - 1):
        raise ValueError(f"the prefill kernel handles rows of a power-of-two width with 64 RoPE dims; got {D} "
                         f"values, {nope} non-RoPE")
    from ds4x.kernels import attention_wgmma

    if config is None and PREFILL_WGMMA and attention_wgmma.available(q, H, D, nope):
        return _prefill_wide(q, positions, window, compressed, sinks, scale, nope, index, ratio, n_rows)
    block, hb, warps = config if config is not None else PREFILL_CONFIG
    hb = min(max(16, 1 << (H - 1).bit_length()), max(16, hb))
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if T == 0:
        return out
    rows, ring, w = window
    src_mode = 0 if compressed is None else 1 if index is not None else 2
    src = compressed if compressed is not None else rows
    idx, k = positions, 1
    if index is not None:
        # the width is a compile-time constant: padded to a power of two (-1 = none), so a short context (fewer
        # rows than the top-k) compiles a few variants, not one per row count
        k = max(16, 1 << (index.shape[1] - 1).bit_length())
        idx = torch.nn.functional.pad(index.to(torch.int32), (0, k - index.shape[1]), value=-1).contiguous()
    prefill_kernel[(T, -(-H // hb))](q.contiguous(), positions.contiguous(), rows, ring, rows.stride(0), src, idx,
                                     n_rows, max(1, ratio), src.stride(0), sinks, out, scale, H=H, HB=hb, D=D,
                                     NOPE=nope, W=w, K=k, BLOCK=block, SRC=src_mode, num_warps=warps)
    return out


def _prefill_wide(q: torch.Tensor, positions: torch.Tensor, window: tuple[torch.Tensor, int, int],
                  compressed: torch.Tensor | None, sinks: torch.Tensor, scale: float, nope: int,
                  index: torch.Tensor | None, ratio: int, n_rows: int) -> torch.Tensor:
    """`attention_prefill_triton` through `attention_decode_triton`'s Hopper kernel in one pass: each query of the
    chunk is one query of a batch whose stores are all the same (stride-0 views), so no row is copied."""
    rows, ring, w = window
    T = q.shape[0]
    pos = positions.contiguous()
    sources: list[tuple[torch.Tensor, Slots | torch.Tensor]] = [
        (rows.expand(T, *rows.shape), Slots(w, position=pos, ring=ring))]
    if compressed is not None:
        slots = (Slots(index.shape[1], index=index.contiguous()) if index is not None
                 else Slots(n_rows, position=pos, ratio=max(1, ratio)))
        sources.append((compressed.expand(T, *compressed.shape), slots))
    return attention_decode_triton(q, sources, sinks, scale, nope, True, one_pass=True)
