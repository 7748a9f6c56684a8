"""Programmatic dependent launch (CUDA capability 9.x and up): a kernel launched with it may be set up while the
kernel before it in the stream is still finishing, so its launch overlaps that kernel's tail (also inside a
captured CUDA graph). Such a kernel calls `wait_upstream` before it touches memory: that waits until the previous
kernel has completed and its writes are visible.

No kernel triggers its dependents early (griddepcontrol.launch_dependents): they are released as its programs
exit. A trigger at each kernel's start measured slower on the long attention passes (H200, HCA layer at 1M:
35.3 us without it, 39.0 with it; the frontier benchmark's 41 compressed layers 1.865 ms against 1.977).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ds4x.formats.triton_mode import interpret_mode

ENABLED = True


@cache
def _supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for launching, on ``device``, a kernel that takes ``PDL: tl.constexpr`` and calls
    `wait_upstream(PDL)` first: ``PDL`` and, where it applies, the launch attribute."""
    if ENABLED and not interpret_mode() and _supported(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_upstream(PDL: tl.constexpr):
    """The first statement of a kernel launched with `launch_options`: nothing before it may read or write memory
    that earlier kernels touch."""
    if PDL:
        gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """Lets the kernel after this one (launched with `launch_options`) start its programs now: they run up to
    their own `wait_upstream`, which still waits for this whole kernel."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptr, nbytes):
    """One thread of the program asks for ``nbytes`` (a multiple of 16) at ``ptr`` (16-byte aligned) to be read
    into L2 (Hopper's bulk prefetch; the program does not wait for it)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr + tl.zeros([1], tl.int64), nbytes + tl.zeros([1], tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1)
