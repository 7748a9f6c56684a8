"""Decode attention (one query, H heads sharing one K = V row set) straight from stored rows.

The rows come from the cache's stores: packed KV rows (E4M3 non-RoPE values with a UE8M0 scale per 64,
FP16 RoPE values) are decoded tile by tile in registers, unpacked native rows are read as float32; no
float copy of the history is made. Work is split over (row range, head group) programs, each keeping
an online softmax; `combine_partials` merges the splits with the per-head sink logit.
The torch reference is the model's attention path (`ds4x.model.attention`).
"""

from __future__ import annotations

import torch


def attention_decode_triton(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor,
                            scale: float, nope: int, packed: bool, rows_per_split: int = 128,
                            precision: str = "ieee") -> torch.Tensor:
    """q [H, D] float32; sources: (store data, slot indices [n] with -1 = skip) -> out [H, D] float32.

    ``precision`` is the dot products' input precision. The default, "ieee" (fp32), is required for packed and
    unpacked rows to give bit-identical results: with "tf32"/"tf32x3" Triton rounds an operand differently
    depending on whether it was loaded or computed in registers (measured on the H200). It was also no slower
    at these sizes (HCA at 1M: 249 us ieee vs 236 us tf32x3, 128 rows per split).
    """
    from ds4x.kernels.triton_attention import partial_kernel

    H, D = q.shape
    if D % 64 or D > 512 or D - nope != 64:
        raise ValueError(f"the decode kernel handles rows of <= 512 values in 64-value chunks with 64 RoPE dims; "
                         f"got {D} values, {nope} non-RoPE")
    hb = 16 if H % 16 == 0 else H
    splits = [max(1, -(-idx.numel() // rows_per_split)) for _, idx in sources]
    total = sum(splits)
    m = torch.empty(total, H, device=q.device)
    l = torch.empty(total, H, device=q.device)
    acc = torch.empty(total, H, D, device=q.device)
    offset = 0
    for (data, idx), n_split in zip(sources, splits, strict=True):
        partial_kernel[(n_split, H // hb)](
            q.contiguous(), data, idx.contiguous(), idx.numel(), data.stride(0), m, l, acc, scale, offset,
            ROWS=rows_per_split, H=H, HB=hb, D=D, NOPE=nope, NCHUNK=D // 64, NOPE_CHUNKS=nope // 64, BLOCK=16,
            PACKED=packed, PREC=precision, num_warps=4)
        offset += n_split
    return combine_partials(m, l, acc, sinks)


def combine_partials(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Merge split softmax states (m, l, acc) [S, H(, D)] with the sink logit per head."""
    top = torch.maximum(m.max(dim=0).values, sinks.float())
    w = torch.exp(m - top)  # splits that saw no row have m = -inf -> weight 0
    denom = (l * w).sum(dim=0) + torch.exp(sinks.float() - top)
    return (acc * w.unsqueeze(-1)).sum(dim=0) / denom.unsqueeze(-1)
