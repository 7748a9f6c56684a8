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
from triton.language.extra.cuda import gdc_wait

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
