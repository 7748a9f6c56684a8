"""Decode attention (one query, H heads sharing one K = V row set) straight from stored rows.

The rows come from the cache's stores: packed KV rows (E4M3 non-RoPE values with a UE8M0 scale per 64,
FP16 RoPE values) are decoded tile by tile in registers, unpacked native rows are read as float32; no
float copy of the history is made. Flash-decoding: one program per block of rows for all heads, one launch
per row source (`ds4x.kernels.triton_attention`), then one merge of the blocks' softmax states with the
per-head sink.
The torch reference is the model's attention path (`ds4x.model.attention`).
"""

from __future__ import annotations

import torch


def attention_decode_triton(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor,
                            scale: float, nope: int, packed: bool, rows_per_split: int = 64,
                            heads_per_program: int = 16) -> torch.Tensor:
    """q [H, D] float32; sources: (store data, slot indices [n] with -1 = skip) -> out [H, D] float32.

    On the GPU the query and the probabilities enter the tensor cores as high + low bf16/fp16 parts (the
    module doc of `ds4x.kernels.triton_attention`): relative error about 1e-5, and packed and unpacked rows
    give bit-identical outputs. The query must stay below 2^15 in magnitude (RMS-normed queries do).
    ``rows_per_split``: rows per program; ``heads_per_program``: heads per program (at least 16, the smallest
    tensor-core tile; a decode step has few rows, so splitting the heads is what fills the GPU). Packed and
    native rows run the same kernel with the same blocks, so they agree bit for bit at any setting.
    """
    from ds4x.kernels.triton_attention import combine_kernel, partial_kernel

    H, D = q.shape
    if D % 64 or D > 512 or D - nope != 64:
        raise ValueError(f"the decode kernel handles rows of <= 512 values in 64-value chunks with 64 RoPE dims; "
                         f"got {D} values, {nope} non-RoPE")
    if not packed:
        # Native rows: pack the rows this query reads (lossless for native values), so both storages run one
        # kernel. Decoding float and packed rows in two kernel variants gave the same operand values but not
        # the same bits on the H200 (measured: 2e-7 apart on the first step).
        from ds4x.formats import pack_kv_rows, rows_triton

        pack = rows_triton.pack_kv_rows_triton if q.is_cuda else pack_kv_rows
        sources = [(pack(rows[idx.clamp(min=0)], validate=False, rope_dim=D - nope),
                    torch.where(idx >= 0, torch.arange(idx.numel(), device=idx.device), -1)) for rows, idx in sources]
    block = rows_per_split
    splits = [max(1, -(-idx.numel() // block)) for _, idx in sources]
    n_split = sum(splits)
    hp = max(16, 1 << (H - 1).bit_length())
    hb = min(hp, max(16, heads_per_program))
    m = torch.empty(n_split, hp, device=q.device)
    l = torch.empty(n_split, hp, device=q.device)
    acc = torch.empty(n_split, hp, D, device=q.device)
    offset = 0
    for (rows, idx), n_blocks in zip(sources, splits, strict=True):
        partial_kernel[(n_blocks, hp // hb)](q.contiguous(), rows, idx.contiguous(), idx.numel(), rows.stride(0), m, l,
                                             acc, scale, offset, H=H, HP=hp, HB=hb, D=D, NOPE=nope, BLOCK=block,
                                             SPLIT=q.is_cuda, num_warps=8 if block * hb >= 4096 else 4)
        offset += n_blocks
    out = torch.empty(H, D, device=q.device)
    n_iter = 1 << (-(-n_split // 64) - 1).bit_length()  # powers of two: few compiled variants
    combine_kernel[(H, D // 64)](m, l, acc, sinks, out, n_split, HP=hp, D=D, SB=64, N_ITER=n_iter, num_warps=4)
    return out
