"""Lightning indexer scoring: score[t, n] = sum_h w[t, h] * relu(q[t, h] . k[n]) / sqrt(d).

`indexer_scores` is the torch reference (keys decoded a tile at a time, so no full-history float
copy). `indexer_scores_triton` scores one query (decode) or a chunk of queries (prefill) straight from the packed
68-byte MXFP4 rows.

How the fast kernel stays exact and cheap: a row is read as 17 int32 words (16 words of E2M1 codes,
one word of four UE8M0 scales). A code nibble becomes an fp16 by moving bits (E2M1 value x 2^-14,
the 0.5 code an fp16 subnormal), times 2^(s_block - s_rowmax + 15) in fp16: exact while a row's block
scales lie within 2^24 of each other (a block smaller than that adds less than 2^-24 of the row).
Queries (MXFP4 values) are scaled per head by a power of two into fp16, also exact. The tensor
cores then form the dot products with fp32 accumulation; the powers of two come back per row (after
the head sum) and per head (folded into the head weights). Only the accumulation order differs from
the float32 reference. On the GPU an inline-PTX version of the code -> fp16 step (byte permutes,
paired fp16 multiply) replaces the arithmetic one; both give the same fp16 values. The Hopper kernel takes E4M3
operands instead (`ds4x.kernels.indexer_wgmma.FP8_KEYS`): every E2M1 value is an E4M3 value, so they are exact
too while a row's block scales lie within 2^14 of each other (a head's within 2^12), each 32-value block's
products are exact, and the blocks are summed in float32.
Unpacked native rows (float32) are packed first: packing them is lossless, so both storages score
bit-identically (the native mode is the oracle, not the fast path).
"""

from __future__ import annotations

import functools

import torch

TILE_ROWS = 8192
ROW_WORDS = 17  # 68-byte row as int32 words: 16 of codes, 1 of scales
# On Hopper the Gluon kernel (`ds4x.kernels.indexer_wgmma`) scores; WGMMA=False keeps the Triton kernel
WGMMA = True
# Persistent programs per SM (all of them on one decode query): each keeps one row tile's loads in flight. H200,
# Gluon kernel, 262,144 rows (17.8 MB): 1 23.3 us, 2 18.6, 3 17.7, 4 18.7, 6 19.5 (devrun, 2026-12-03)
PROGRAMS_PER_SM = 3


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


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def indexer_scores_triton(q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, n_rows: int | torch.Tensor,
                          packed: bool, block_n: int = 128, ptx: bool | None = None,
                          first_level: torch.Tensor | None = None) -> torch.Tensor:
    """One query q [H, 128] float32 (rotated, MXFP4 values), weights [H] -> scores [n_rows]; or T queries
    q [T, H, 128], weights [T, H] -> scores [T, n_rows] (a prefill chunk: the same per-row bits as T decode calls).

    ``rows`` is the store's data: uint8 [cap, 68] when ``packed`` else float32 [cap, 128] (packed here
    first), or one store per query [T, cap, width] (a batched decode step: query t scores store t; packed, it may
    be a view of the first ``cap`` rows of larger stores); rows
    0..n_rows-1 are scored (compressed rows are never wrapped: their store holds the whole
    context). ``n_rows`` may be an integer tensor on the device, one count or one per query (a CUDA graph
    replays with whatever count it then holds; a prefill query sees only the rows closed by its position):
    scores then have ``cap`` columns and those from a query's count on are not written.
    ``ptx`` picks the Triton kernel with (True) or without (False) the inline-PTX code decode; by default the Gluon
    kernel on Hopper GPUs (`ds4x.kernels.indexer_wgmma`), else the Triton kernel with PTX on the GPU.
    ``first_level`` (int32 [T, 2^bits], from `ds4x.kernels.select.radix_first_level`): each query's scored rows
    counted by the first radix digit of their scores into its row, the top-k's first level done here.
    """
    single = q.dim() == 2
    qs, ws = (q[None], weights[None]) if single else (q, weights)
    T, H, D = qs.shape
    if D != 128:
        raise ValueError(f"indexer rows hold 128 values; got queries of {D}")
    count = n_rows if isinstance(n_rows, torch.Tensor) else None
    if count is not None and count.numel() not in (1, T):
        raise ValueError(f"row counts: one or one per query ({T}), got {count.numel()}")
    per_query = rows.dim() == 3
    if per_query and rows.shape[0] != T:
        raise ValueError(f"one row store per query: {T} queries, {rows.shape[0]} stores")
    n_rows = rows.shape[-2] if count is not None else n_rows
    out = torch.empty(T, n_rows, device=q.device, dtype=torch.float32)
    if n_rows and T:
        from ds4x.kernels.triton_indexer import score_kernel

        if not packed:
            from ds4x.formats import pack_indexer_rows

            rows = pack_indexer_rows(rows[..., :n_rows, :], validate=False)
        # one store's rows back to back; a batch of stores may be a prefix view of larger ones (a decode step
        # within a position span scores only the rows below it)
        if (rows.dtype != torch.uint8 or rows.shape[-1] != 68 or rows.stride(-1) != 1 or rows.stride(-2) != 68
                or (per_query and rows.stride(0) % 4)):
            raise ValueError(f"packed indexer rows must be uint8 [(T,) cap, 68], each store's rows contiguous; got "
                             f"{rows.dtype} {tuple(rows.shape)} strides {rows.stride()}")
        words = rows.view(torch.int32)
        from ds4x.kernels import indexer_wgmma

        wide = WGMMA and ptx is None and indexer_wgmma.available(q, H)
        n_tiles = -(-n_rows // (indexer_wgmma.block_rows() if wide else block_n))
        persistent = q.is_cuda
        # persistent programs walk a query's row tiles with its query tiles prepared once (PROGRAMS_PER_SM)
        n_prog = min(n_tiles, max(1, PROGRAMS_PER_SM * num_sms(q.device) // T)) if persistent else n_tiles
        hist_bits = 0
        if first_level is not None:
            hist_bits = first_level.shape[-1].bit_length() - 1
            if first_level.shape != (T, 1 << hist_bits) or first_level.dtype != torch.int32:
                raise ValueError(f"first_level: int32 [{T}, 2^bits] bins, got {first_level.dtype} "
                                 f"{tuple(first_level.shape)}")
        args = (qs.contiguous().float(), ws.contiguous().float(), words, words.stride(0) if per_query else 0, out,
                n_rows, out if count is None else count, 0 if count is None or count.numel() == 1 else 1,
                -(-n_tiles // n_prog), n_prog, D**-0.5, out if first_level is None else first_level,
                0 if first_level is None else first_level.stride(0))
        if wide:
            from ds4x.formats.pdl import launch_options

            pdl = launch_options(q.device)
            indexer_wgmma.score_kernel[(n_prog, T)](*args, H=H, DEVICE_COUNT=count is not None, **pdl,
                                                    num_warps=indexer_wgmma.WARPS, BN=indexer_wgmma.block_rows(),
                                                    PIPELINED=indexer_wgmma.PIPELINED, HIST_BITS=hist_bits,
                                                    FP8=indexer_wgmma.FP8_KEYS)
        else:
            score_kernel[(n_prog, T)](*args, H=H, HP=max(16, 1 << (H - 1).bit_length()), BLOCK_N=block_n,
                                      PTX=q.is_cuda if ptx is None else ptx, PERSISTENT=persistent,
                                      DEVICE_COUNT=count is not None, HIST_BITS=hist_bits, num_warps=4)
    return out[0] if single else out
