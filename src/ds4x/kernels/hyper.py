"""Fused mHC (manifold-constrained hyper-connections) for CUDA: one Triton kernel where the reference
(:mod:`ds4x.model.hyper`) launches about a hundred small ops per call (twenty Sinkhorn iterations on 4x4
matrices, sigmoids, a softmax, the collapse), which dominates the launch count of a decode step.

- ``hc_pre_fused``: the mixing logits come from one dense product ``streams @ fn.T`` (torch); the RMS factor
  is applied after it (``r * (x @ fn.T)`` instead of ``(r * x) @ fn.T``: the same value up to rounding), then
  one program per token computes ``r``, ``pre``, ``post``, ``comb`` (softmax + Sinkhorn in registers) and the
  collapsed block input.
- ``hc_post_fused``: ``out[k] = post[k] * block_out + sum_j comb[j, k] * streams[j]`` in float32, one
  rounding to the streams' dtype.

Both agree with the reference to float32 rounding (the order of the sums differs), not bit for bit; the
decode step uses them only on CUDA (``DS4X_KERNELS=reference`` keeps the reference). The interpreter
(``TRITON_INTERPRET=1``) runs them on CPU tensors for the parity tests.
"""

from __future__ import annotations

from typing import Any

import torch

from ds4x.formats.triton_mode import HAVE_TRITON, interpret_mode, module_for_current_mode, tl, triton

_DEFINED_INTERPRETED = interpret_mode()
# the hidden size is a compile-time constant (one model, one value): static loops, also in the interpreter

if HAVE_TRITON:

    @triton.jit
    def _hc_pre_kernel(streams, mixes, base, scale, out, post_out, comb_out, H: tl.constexpr, rms_eps, hc_eps,
                       ITERS: tl.constexpr, N: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0)
        j = tl.arange(0, N)
        h = tl.arange(0, BLOCK_H)
        row = streams + t * N * H
        sq = tl.zeros([N, BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            m = (h0 + h) < H
            x = tl.load(row + j[:, None] * H + h0 + h[None, :], mask=m[None, :], other=0.0).to(tl.float32)
            sq += x * x
        r = 1.0 / tl.sqrt(tl.sum(tl.sum(sq, axis=1), axis=0) / (N * H) + rms_eps)
        mix = mixes + t * (2 * N + N * N)
        s0 = tl.load(scale)
        s1 = tl.load(scale + 1)
        s2 = tl.load(scale + 2)
        pre = tl.sigmoid(tl.load(mix + j) * r * s0 + tl.load(base + j)) + hc_eps
        post = 2.0 * tl.sigmoid(tl.load(mix + N + j) * r * s1 + tl.load(base + N + j))
        nn = j[:, None] * N + j[None, :]  # [row i, column k]
        logits = tl.load(mix + 2 * N + nn) * r * s2 + tl.load(base + 2 * N + nn)
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(post_out + t * N + j, post)
        tl.store(comb_out + t * N * N + nn, comb)
        for h0 in range(0, H, BLOCK_H):
            m = (h0 + h) < H
            x = tl.load(row + j[:, None] * H + h0 + h[None, :], mask=m[None, :], other=0.0).to(tl.float32)
            y = tl.sum(pre[:, None] * x, axis=0)
            tl.store(out + t * H + h0 + h, y.to(out.dtype.element_ty), mask=m)

    @triton.jit
    def _hc_post_kernel(streams, block_out, post, comb, out, H: tl.constexpr, N: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = h < H
        j = tl.arange(0, N)
        x = tl.load(streams + t * N * H + j[:, None] * H + h[None, :], mask=m[None, :], other=0.0).to(tl.float32)
        b = tl.load(block_out + t * H + h, mask=m, other=0.0).to(tl.float32)
        c = tl.load(comb + t * N * N + j[:, None] * N + j[None, :])  # [j, k]
        p = tl.load(post + t * N + j)  # [k]
        mixed = tl.sum(c[:, :, None] * x[:, None, :], axis=0)  # [k, h] = sum_j comb[j, k] * x[j, h]
        y = p[:, None] * b[None, :] + mixed
        tl.store(out + t * N * H + j[:, None] * H + h[None, :], y.to(out.dtype.element_ty), mask=m[None, :])


def _kernels() -> Any:
    if not HAVE_TRITON:
        raise RuntimeError("ds4x.kernels.hyper needs the 'triton' package")
    return module_for_current_mode(__name__, __file__, _DEFINED_INTERPRETED)


def supported(streams: torch.Tensor, n: int) -> bool:
    """Whether the fused kernels serve this call: Triton present, CUDA tensors (or the interpreter) and a
    power-of-two stream count (Triton tiles are powers of two)."""
    return HAVE_TRITON and (streams.is_cuda or interpret_mode()) and n > 0 and n & (n - 1) == 0


def hc_pre_fused(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, rms_eps: float,
                 hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, H] -> (block input [T, H] in streams' dtype, post [T, n], comb [T, n, n]) float32."""
    t, n, hd = streams.shape
    streams = streams.contiguous()
    mixes = (streams.reshape(t, n * hd).float() @ fn.float().t()).contiguous()
    out = torch.empty(t, hd, dtype=streams.dtype, device=streams.device)
    post = torch.empty(t, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=streams.device)
    _kernels()._hc_pre_kernel[(t,)](streams, mixes, base.float().contiguous(), scale.float().contiguous(), out,
                                    post, comb, hd, rms_eps, hc_eps, ITERS=iters, N=n, BLOCK_H=256)
    return out, post, comb


def hc_post_fused(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, n, H]: out[k] = post[k] * block_out + sum_j comb[j, k] * streams[j]."""
    t, n, hd = streams.shape
    out = torch.empty_like(streams, memory_format=torch.contiguous_format)
    block = 256
    _kernels()._hc_post_kernel[(t, triton.cdiv(hd, block))](
        streams.contiguous(), block_out.contiguous(), post.float().contiguous(), comb.float().contiguous(), out, hd,
        N=n, BLOCK_H=block)
    return out
