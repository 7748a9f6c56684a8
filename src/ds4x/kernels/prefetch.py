"""Weights brought into the GPU's L2 cache ahead of the product that reads them.

Much of a decode step is a chain of latency-bound kernels that read little memory (the cache row writes, the
indexer's selection, the attention, the MoE router), while the products after them stream tens of MB of weights
from DRAM. A prefetch launched as a graph branch beside such a chain (`ds4x.kernels.branches.Branch`) moves the
next product's weights into L2 while DRAM is idle, so the product then reads them at L2 speed. The kernel only
issues Hopper's bulk L2 prefetches (``cp.async.bulk.prefetch.L2``, asynchronous, nothing written), so it finishes
at once and holds no SM while the bytes move; values are never changed, so results are bit-identical with or
without it. Where the instruction does not exist (before sm_90, the CPU, the Triton interpreter) it does nothing.
"""

from __future__ import annotations

from functools import cache

import torch

from ds4x.formats.triton_mode import HAVE_TRITON, interpret_mode

ENABLED = True  # False: no prefetches (an A/B switch for benchmarks)
CHUNK = 4096  # bytes per bulk prefetch (a thread's one instruction)
LANES = 32  # prefetches (threads) per program

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _prefetch_kernel(base, ids_ptr, span_bytes, stride_bytes, HAS_IDS: tl.constexpr, CHUNK: tl.constexpr,
                         LANES: tl.constexpr):
        # program (chunk block, span): span s covers span_bytes from base + ids[s] * stride_bytes (HAS_IDS) or from
        # base; each thread prefetches one CHUNK of it (sizes rounded down to the instruction's 16 bytes)
        span = tl.program_id(1)
        if HAS_IDS:
            first = base + tl.load(ids_ptr + span).to(tl.int64) * stride_bytes
        else:
            first = base + span.to(tl.int64) * stride_bytes
        off = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
        size = (tl.minimum(span_bytes - off, CHUNK) & -16).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [first + off, size], dtype=tl.int32, is_pure=False, pack=1)


@cache
def _supported(device: torch.device) -> bool:
    return HAVE_TRITON and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def active(device: torch.device) -> bool:
    """Whether prefetches do anything on ``device``."""
    return ENABLED and not interpret_mode() and _supported(device)


def prefetch_l2(data: torch.Tensor, span_bytes: int | None = None, ids: torch.Tensor | None = None) -> None:
    """Bring ``data``'s bytes into L2 (asynchronously, changing nothing). With ``ids`` (a device tensor of
    integers), only the spans ``[ids[i] * span_bytes, (ids[i] + 1) * span_bytes)`` of its bytes (the rows of
    stacked experts a step routes to), read on the device, so a CUDA graph replays it for any ids."""
    if not active(data.device) or data.numel() == 0:
        return
    total = data.numel() * data.element_size()
    span = total if span_bytes is None else span_bytes
    n_spans = 1 if ids is None else ids.numel()
    ids_t = ids.reshape(-1).contiguous() if ids is not None else data
    _prefetch_kernel[(triton.cdiv(span, CHUNK * LANES), n_spans)](
        data.data_ptr(), ids_t, span, span, HAS_IDS=ids is not None, CHUNK=CHUNK, LANES=LANES, num_warps=1)
