"""Programmatic dependent launch (CUDA capability 9.x and up): a kernel launched with it may be set up while the kernel
before it in the stream is still finishing, so its launch overlaps that kernel's tail (also inside a captured CUDA
graph). Such a kernel calls `wait_upstream` before it touches memory: that waits until the previous kernel has
completed and its writes are visible. The module sits with the formats because the packed-row kernels
(`ds4x.formats.rows_triton`) launch with it too.

The short kernels of a decode step (matvecs and their activation quantization, norms, RoPE, mHC, routing, SwiGLU,
combine, compressor emit, the one-program top-k, the packed-row writes) also release their dependents right after their
own wait (`wait_upstream(PDL, RELEASE=True)`: griddepcontrol.launch_dependents), so the next kernel's programs are
placed and set up while this one runs. H200, synthetic flash:q2, 4K, replayed step (`scripts/batched_decode.py`, same
process): one session 5.93 ms against 6.37 without PDL anywhere (6.20 with only the matvecs releasing); 8 sessions 15.50
against 15.55; 32 sessions 39.1 against 39.0. The mHC pre kernel takes PDL for one token only: with it at 8 sessions the
step took 15.91 ms (15.48 without it on that kernel, or 15.52 without it on mHC post). `OFF` names families to launch
without PDL for such A/Bs. Prefill (eager launches of 4,096-token chunks) measured 5,603 / 5,652 tok/s at 4K / 16K
against 5,697 / 5,719 with `ENABLED=False` in the process before (one A/B, order not swapped), and 5,580 / 5,623 with
the launch attribute kept out of eager launches: not settled whether PDL costs prefill 1-2%. The long passes of the
compressed layers (attention, indexer scoring, the multi-program top-k, the attention merge) release theirs only as
their programs exit: a trigger at their start measured slower (HCA layer at 1M: 35.3 us without it, 39.0 with it; the
frontier benchmark's 41 compressed layers 1.865 ms against 1.977; the merge releasing after its wait changed nothing).
Prefetching a matvec's weight rows into L2 before its wait made the small wq_a faster alone (4.07 -> 3.08 us) but the
large matrices slower (wo_b 13.6 -> 17.2 us) and the step slower (6.43 ms): not used. Nor a trigger between the two
(8f064ed's EARLY_RELEASE, removed): the attention's partial pass releasing before its state stores, the indexer after
its last tile, the fused top-k after its last grid barrier. All three (H100, `ds4x bench frontier --weights q2
--experts 128 --contexts 1048576`, two rounds): CSA attention 10.4-10.5 -> 10.9-11.0 us, HCA 22.5-22.6 -> 25.3, the
41 compressed layers as one graph 1.271-1.279 -> 1.339-1.351 ms. The indexer and the top-k alone: the top-k's share
of a scoring + top-k pair 10.7-10.9 -> 10.3 us, but the 41 layers' graph level (1.262, 1.267 -> 1.261, 1.266 ms) and
the decode step too (6.74-6.75 -> 6.72-6.75 ms).
"""

from __future__ import annotations

from functools import cache

import torch

from .triton_mode import HAVE_TRITON, interpret_mode, tl, triton

ENABLED = True
OFF: frozenset[str] = frozenset()  # kernel families launched without PDL (an A/B switch for benchmarks)


@cache
def _supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(device: torch.device, family: str = "") -> dict:
    """Keyword arguments for launching, on ``device``, a kernel that takes ``PDL: tl.constexpr`` and calls
    `wait_upstream(PDL)` first: ``PDL`` and, where it applies, the launch attribute (``family``: the kernel's, for
    `OFF`)."""
    if ENABLED and family not in OFF and not interpret_mode() and _supported(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


if HAVE_TRITON:  # the kernels' side (their modules import it only with triton)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def wait_upstream(PDL: tl.constexpr, RELEASE: tl.constexpr = False):
        """The first statement of a kernel launched with `launch_options`: nothing before it may read or write memory
        that earlier kernels touch. RELEASE (the step's short kernels): then let the kernel after this one start its
        programs at once (griddepcontrol.launch_dependents); they run up to their own `wait_upstream`, which still
        waits for this whole kernel. Without it the next kernel starts as this one's programs exit."""
        if PDL:
            gdc_wait()
            if RELEASE:
                gdc_launch_dependents()
