"""Lightning indexer scoring: score[t, n] = sum_h w[t, h] * relu(q[t, h] . k[n]) / sqrt(d).

`indexer_scores` is the torch reference (keys decoded a tile at a time, so no full-history float
copy). `indexer_scores_triton` scores one query (decode) straight from the stored rows: packed
68-byte MXFP4 rows are decoded in registers; unpacked native rows are read as float32. Native
keys and queries are E2M1 x 2^e values, exact in bf16, so the dot products run on tensor cores
and are exact; only the final sum over heads may round in another order than the reference.
"""

from __future__ import annotations

import torch

TILE_ROWS = 8192


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, read_rows, n_rows: int) -> torch.Tensor:
    """q [T, H, D] (as the cache scores it), weights [T, H] (already x H^-1/2) -> scores [T, n_rows].

    ``read_rows(start, stop)`` returns float32 keys [stop - start, D].
    """
    T, _, D = q.shape
    scores = torch.empty(T, n_rows, device=q.device)
    for start in range(0, n_rows, TILE_ROWS):
        stop = min(start + TILE_ROWS, n_rows)
        dots = torch.einsum("thd,nd->thn", q, read_rows(start, stop))
        scores[:, start:stop] = (dots.relu() * D**-0.5 * weights.unsqueeze(-1)).sum(dim=1)
    return scores


_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def score_kernel(q_ptr, w_ptr, rows_ptr, out_ptr, n_rows, row_stride, scale,
                     H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PACKED: tl.constexpr,
                     BF16: tl.constexpr):
        # Elements are handled as an even and an odd half (the low and high nibbles of a packed byte), so
        # both storages run the very same two dot products and give bit-identical scores.
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_rows
        half = tl.arange(0, D // 2)
        base = rows_ptr + offs_n[:, None].to(tl.int64) * row_stride
        if PACKED:
            byte = tl.load(base + half[None, :], mask=mask_n[:, None], other=0).to(tl.int32)
            sbyte = tl.load(base + D // 2 + (2 * half[None, :]) // 32, mask=mask_n[:, None], other=127).to(tl.int32)
            # UE8M0 scale 2^(b-127) from its bits (byte 0 is the subnormal 2^-127)
            sc = tl.where(sbyte == 0, 5.877471754111438e-39, (sbyte << 23).to(tl.float32, bitcast=True))
            # E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 by arithmetic (no table, no exp2); sign in bit 3
            lo, hi = byte & 7, (byte >> 4) & 7
            v_lo = tl.where(lo < 4, lo * 0.5, tl.where(lo < 6, lo - 2.0, (lo - 5) * 2.0 + 2.0))
            v_hi = tl.where(hi < 4, hi * 0.5, tl.where(hi < 6, hi - 2.0, (hi - 5) * 2.0 + 2.0))
            k_even = tl.where((byte & 8) != 0, -v_lo, v_lo) * sc
            k_odd = tl.where((byte & 128) != 0, -v_hi, v_hi) * sc
        else:
            k_even = tl.load(base + 2 * half[None, :], mask=mask_n[:, None], other=0.0)
            k_odd = tl.load(base + 2 * half[None, :] + 1, mask=mask_n[:, None], other=0.0)
        offs_h = tl.arange(0, H)
        q_even = tl.load(q_ptr + offs_h[:, None] * D + 2 * half[None, :])
        q_odd = tl.load(q_ptr + offs_h[:, None] * D + 2 * half[None, :] + 1)
        if BF16:  # exact for E2M1 x 2^e operands; tensor cores, fp32 accumulate
            dots = tl.dot(k_even.to(tl.bfloat16), tl.trans(q_even.to(tl.bfloat16)))
            dots = tl.dot(k_odd.to(tl.bfloat16), tl.trans(q_odd.to(tl.bfloat16)), dots)
        else:  # the CPU interpreter has no bf16 matmul
            dots = tl.dot(k_even, tl.trans(q_even), input_precision="ieee")
            dots = tl.dot(k_odd, tl.trans(q_odd), dots, input_precision="ieee")
        w = tl.load(w_ptr + offs_h)
        terms = (tl.maximum(dots, 0.0) * scale) * w[None, :]
        tl.store(out_ptr + offs_n, tl.sum(terms, axis=1), mask=mask_n)

    return score_kernel


def indexer_scores_triton(q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, n_rows: int,
                          packed: bool, block_n: int = 128) -> torch.Tensor:
    """One query: q [H, D] float32 (rotated, MXFP4 values), weights [H] -> scores [n_rows].

    ``rows`` is the store's data: uint8 [cap, 68] when ``packed`` else float32 [cap, D]; rows
    0..n_rows-1 are scored (compressed rows are never wrapped: their store holds the whole context).
    """
    global _kernel
    if _kernel is None:
        _kernel = _build()
    H, D = q.shape
    out = torch.empty(n_rows, device=q.device, dtype=torch.float32)
    if n_rows == 0:
        return out
    grid = (-(-n_rows // block_n),)
    _kernel[grid](q.contiguous().float(), weights.contiguous().float(), rows, out, n_rows, rows.stride(0),
                  D**-0.5, H=H, D=D, BLOCK_N=block_n, PACKED=packed, BF16=q.is_cuda)
    return out
