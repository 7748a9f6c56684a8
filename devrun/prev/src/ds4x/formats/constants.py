"""Float32 constants on a device, made once per (value, device)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=64)
def device_constant(values: float | tuple[float, ...], device: torch.device) -> torch.Tensor:
    """``values`` as a float32 tensor on ``device`` (0-d for a scalar). Made per call it would be a host-to-device
    copy every time: a sync point, and an operation a CUDA graph cannot capture. Treat the result as read-only."""
    return torch.tensor(values, dtype=torch.float32, device=device)
