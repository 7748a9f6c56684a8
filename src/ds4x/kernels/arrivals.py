"""Arrival counters for kernels whose last program to finish a row does the row's final pass (the compressor
emit's normalisation, the mHC collapse's RMSNorm): each program adds one with acq_rel semantics, the one that
sees the count complete finishes the row and sets the counter back to zero. The counters are kept between calls
(zero on entry, zero on exit), so a step needs no fill launch; one set per (device, length, stream), so kernels
on parallel branches of a captured step (`ds4x.kernels.branches`) never share one."""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters [n] on ``device`` for the current stream."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, n, stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _COUNTERS[key]
