"""Decode attention (one query, H heads sharing one K = V row set) straight from stored rows.

The rows come from the cache's stores: packed KV rows (E4M3 non-RoPE values with a UE8M0 scale per 64,
FP16 RoPE values) are decoded tile by tile in registers, unpacked native rows are read as float32; no
float copy of the history is made. Work is split over (row range, head group) programs, each keeping
an online softmax; `combine_partials` merges the splits with the per-head sink logit.
The torch reference is the model's attention path (`ds4x.model.attention`).
"""

from __future__ import annotations

import torch

_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def partial_kernel(q_ptr, rows_ptr, idx_ptr, n, row_stride, m_ptr, l_ptr, acc_ptr, scale, split_offset,
                       ROWS: tl.constexpr, H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr,
                       BLOCK: tl.constexpr, PACKED: tl.constexpr, IEEE: tl.constexpr):
        split = tl.program_id(0)
        hg = tl.program_id(1)
        offs_h = hg * HB + tl.arange(0, HB)
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + offs_h[:, None] * D + offs_d[None, :])
        m_i = tl.full([HB], float("-inf"), tl.float32)
        l_i = tl.zeros([HB], tl.float32)
        acc = tl.zeros([HB, D], tl.float32)
        lo = split * ROWS
        hi = tl.minimum(lo + ROWS, n)
        for it in range(0, ROWS, BLOCK):
            offs_r = lo + it + tl.arange(0, BLOCK)
            idx = tl.load(idx_ptr + offs_r, mask=offs_r < hi, other=-1)
            ok = idx >= 0
            base = rows_ptr + tl.where(ok, idx, 0).to(tl.int64)[:, None] * row_stride
            if PACKED:
                is_nope = offs_d[None, :] < NOPE
                b = tl.load(base + offs_d[None, :], mask=ok[:, None] & is_nope, other=0).to(tl.int32)
                e = (b >> 3) & 15
                mant = (b & 7).to(tl.float32)
                mag = tl.where(e == 0, mant * 0.001953125, (8.0 + mant) * tl.exp2((e - 10).to(tl.float32)))
                mag = tl.where((e == 15) & ((b & 7) == 7), float("nan"), mag)
                nope_val = tl.where(b >= 128, -mag, mag)
                sb = tl.load(base + NOPE + 2 * (D - NOPE) + offs_d[None, :] // 64, mask=ok[:, None] & is_nope,
                             other=127).to(tl.int32)
                sc = (sb << 23).to(tl.float32, bitcast=True)
                sc = tl.where(sb == 0, 5.877471754111438e-39, tl.where(sb == 255, float("nan"), sc))
                j = tl.where(is_nope, 0, offs_d[None, :] - NOPE)
                lo_b = tl.load(base + NOPE + 2 * j, mask=ok[:, None] & ~is_nope, other=0).to(tl.int32)
                hi_b = tl.load(base + NOPE + 2 * j + 1, mask=ok[:, None] & ~is_nope, other=0).to(tl.int32)
                h16 = (lo_b | (hi_b << 8)).to(tl.int16)
                rope_val = h16.to(tl.float16, bitcast=True).to(tl.float32)
                k = tl.where(is_nope, nope_val * sc, rope_val)
            else:
                k = tl.load(base + offs_d[None, :], mask=ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k), input_precision="tf32x3") * scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, k, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p, k, input_precision="tf32x3")
            m_i = m_new
        out = split + split_offset
        tl.store(m_ptr + out * H + offs_h, m_i)
        tl.store(l_ptr + out * H + offs_h, l_i)
        tl.store(acc_ptr + (out * H + offs_h)[:, None] * D + offs_d[None, :], acc)

    return partial_kernel


def attention_decode_triton(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor,
                            scale: float, nope: int, packed: bool, rows_per_split: int = 512,
                            ) -> torch.Tensor:
    """q [H, D] float32; sources: (store data, slot indices [n] with -1 = skip) -> out [H, D] float32."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    H, D = q.shape
    hb = 16 if H % 16 == 0 else H
    splits = [max(1, -(-idx.numel() // rows_per_split)) for _, idx in sources]
    total = sum(splits)
    m = torch.empty(total, H, device=q.device)
    l = torch.empty(total, H, device=q.device)
    acc = torch.empty(total, H, D, device=q.device)
    offset = 0
    for (data, idx), n_split in zip(sources, splits, strict=True):
        _kernel[(n_split, H // hb)](q.contiguous(), data, idx.contiguous(), idx.numel(), data.stride(0), m, l, acc,
                                    scale, offset, ROWS=rows_per_split, H=H, HB=hb, D=D, NOPE=nope, BLOCK=16,
                                    PACKED=packed, IEEE=not q.is_cuda, num_warps=8)
        offset += n_split
    return combine_partials(m, l, acc, sinks)


def combine_partials(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Merge split softmax states (m, l, acc) [S, H(, D)] with the sink logit per head."""
    top = torch.maximum(m.max(dim=0).values, sinks.float())
    w = torch.exp(m - top)  # splits that saw no row have m = -inf -> weight 0
    denom = (l * w).sum(dim=0) + torch.exp(sinks.float() - top)
    return (acc * w.unsqueeze(-1)).sum(dim=0) / denom.unsqueeze(-1)
