"""How much memory an allocation can still get on a device."""

from __future__ import annotations

import os

import torch


def free_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on ``device``: on CUDA the driver's free memory plus the blocks torch's
    caching allocator holds unused (freed tensors, e.g. the temporaries of weights generated on the device, which
    the allocator hands out again or releases on demand); on the host MemAvailable."""
    if device.type == "cuda":
        spare = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + spare
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
