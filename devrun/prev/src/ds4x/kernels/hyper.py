"""Fused mHC (manifold-constrained hyper-connections) for CUDA: one Triton kernel where the reference
(:mod:`ds4x.model.hyper`) launches about a hundred small ops per call (twenty Sinkhorn iterations on 4x4
matrices, sigmoids, a softmax, the collapse), which dominates the launch count of a decode step.

- ``hc_pre_fused``: split-K mixing dots ``streams @ fn.T`` and sums of squares (one program per 256 values of
  a token's flattened streams), then one program per (token, block of the hidden size) sums the partials in
  a fixed order, computes ``r``, ``pre``, ``post``, ``comb`` (softmax + Sinkhorn in registers) and collapses
  its block. The RMS factor is applied after the dots (``r * (x @ fn.T)`` instead of ``(r * x) @ fn.T``: the
  same value up to rounding). A decode step has one token: a single program per token was latency bound.
- ``hc_post_fused``: ``out[k] = post[k] * block_out + sum_j comb[j, k] * streams[j]`` in float32, one
  rounding to the streams' dtype. Given the next block's ``fn`` it also computes that block's mixing dots and
  sums of squares over its part of the new streams (as stored, after the rounding) and returns them as
  :class:`MixPartials`, so the next ``hc_pre_fused`` skips its mixing launch.

Both agree with the reference to float32 rounding (the order of the sums differs), not bit for bit; the
decode step uses them only on CUDA (``DS4X_KERNELS=reference`` keeps the reference). The interpreter
(``TRITON_INTERPRET=1``) runs them on CPU tensors for the parity tests.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ds4x.formats.triton_mode import HAVE_TRITON, interpret_mode, module_for_current_mode, tl, triton

_DEFINED_INTERPRETED = interpret_mode()
# the hidden size is a compile-time constant (one model, one value): static loops, also in the interpreter

if HAVE_TRITON:

    @triton.jit
    def _hc_mix_kernel(streams, fn, mix_part, sq_part, K: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                       CH: tl.constexpr, S: tl.constexpr):
        # program (token, chunk of the flattened streams): partial mixing dots and partial sum of squares; the
        # chunks are summed in a fixed order by _hc_pre_kernel (no atomics: replays give the same bits)
        t = tl.program_id(0)
        s = tl.program_id(1)
        k = s * CH + tl.arange(0, CH)
        km = k < K
        x = tl.load(streams + t * K + k, mask=km, other=0.0).to(tl.float32)
        m = tl.arange(0, MP)
        f = tl.load(fn + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & km[None, :], other=0.0).to(tl.float32)
        tl.store(mix_part + (t * S + s) * MP + m, tl.sum(f * x[None, :], axis=1))
        tl.store(sq_part + t * S + s, tl.sum(x * x, axis=0))

    @triton.jit
    def _hc_pre_kernel(streams, mix_part, sq_part, base, scale, out, post_out, comb_out, H: tl.constexpr, rms_eps,
                       hc_eps, ITERS: tl.constexpr, N: tl.constexpr, MP: tl.constexpr, S: tl.constexpr,
                       SP: tl.constexpr, BLOCK_H: tl.constexpr):
        # program (token, block of the hidden size): every program of a token derives the same pre / post /
        # comb from the partials (4x4 work, cheaper than another launch), then collapses its block
        t = tl.program_id(0)
        hb = tl.program_id(1)
        j = tl.arange(0, N)
        sp = tl.arange(0, SP)
        s_ok = sp < S
        r = 1.0 / tl.sqrt(tl.sum(tl.load(sq_part + t * S + sp, mask=s_ok, other=0.0), axis=0) / (N * H) + rms_eps)
        part = mix_part + t * S * MP + sp * MP  # [SP] pointers to each chunk's mixing dots
        s0 = tl.load(scale).to(tl.float32)
        s1 = tl.load(scale + 1).to(tl.float32)
        s2 = tl.load(scale + 2).to(tl.float32)
        pre_dot = tl.sum(tl.load(part[:, None] + j[None, :], mask=s_ok[:, None], other=0.0), axis=0)
        post_dot = tl.sum(tl.load(part[:, None] + N + j[None, :], mask=s_ok[:, None], other=0.0), axis=0)
        nn = j[:, None] * N + j[None, :]  # [row i, column k]
        comb_dot = tl.sum(tl.load(part[:, None, None] + 2 * N + nn[None, :, :], mask=s_ok[:, None, None], other=0.0),
                          axis=0)
        pre = tl.sigmoid(pre_dot * r * s0 + tl.load(base + j).to(tl.float32)) + hc_eps
        post = 2.0 * tl.sigmoid(post_dot * r * s1 + tl.load(base + N + j).to(tl.float32))
        logits = comb_dot * r * s2 + tl.load(base + 2 * N + nn).to(tl.float32)
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        first = hb == 0
        tl.store(post_out + t * N + j, post, mask=first & (j < N))
        tl.store(comb_out + t * N * N + nn, comb, mask=first & (nn < N * N))
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        m = h < H
        x = tl.load(streams + t * N * H + j[:, None] * H + h[None, :], mask=m[None, :], other=0.0).to(tl.float32)
        tl.store(out + t * H + h, tl.sum(pre[:, None] * x, axis=0).to(out.dtype.element_ty), mask=m)

    @triton.jit
    def _hc_post_kernel(streams, block_out, routed, routed_w, post, comb, out, fn, mix_part, sq_part,
                        H: tl.constexpr, N: tl.constexpr, BLOCK_H: tl.constexpr, MIX: tl.constexpr, M: tl.constexpr,
                        MP: tl.constexpr, K: tl.constexpr):
        # program (token, block of the hidden size); with MIX also the next block's partial mixing dots and sum of
        # squares over this block of the new streams (chunk s = the block: _hc_pre_kernel sums them in order).
        # K > 0: block_out is the shared expert's output and the block's output is first summed with the K routed
        # outputs [T, K, H] by their weights [T, K], rounded to block_out's dtype (the MoE combine's arithmetic)
        t = tl.program_id(0)
        hb = tl.program_id(1)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        m = h < H
        j = tl.arange(0, N)
        x = tl.load(streams + t * N * H + j[:, None] * H + h[None, :], mask=m[None, :], other=0.0).to(tl.float32)
        b = tl.load(block_out + t * H + h, mask=m, other=0.0).to(tl.float32)
        if K > 0:
            for i in tl.static_range(K):
                wi = tl.load(routed_w + t * K + i).to(tl.float32)
                b += wi * tl.load(routed + (t * K + i) * H + h, mask=m, other=0.0).to(tl.float32)
            b = b.to(block_out.dtype.element_ty).to(tl.float32)
        c = tl.load(comb + t * N * N + j[:, None] * N + j[None, :])  # [j, k]
        p = tl.load(post + t * N + j)  # [k]
        mixed = tl.sum(c[:, :, None] * x[:, None, :], axis=0)  # [k, h] = sum_j comb[j, k] * x[j, h]
        y = (p[:, None] * b[None, :] + mixed).to(out.dtype.element_ty)
        tl.store(out + t * N * H + j[:, None] * H + h[None, :], y, mask=m[None, :])
        if MIX:
            yf = tl.where(m[None, :], y.to(tl.float32), 0.0)  # the stored values, as the next block reads them
            r = tl.arange(0, MP)
            f = tl.load(fn + r[:, None, None] * (N * H) + j[None, :, None] * H + h[None, None, :],
                        mask=(r[:, None, None] < M) & m[None, None, :], other=0.0).to(tl.float32)
            s = tl.num_programs(1)
            tl.store(mix_part + (t * s + hb) * MP + r, tl.sum(tl.sum(f * yf[None, :, :], axis=2), axis=1))
            tl.store(sq_part + t * s + hb, tl.sum(tl.sum(yf * yf, axis=1), axis=0))


# launch shapes: values of the flattened streams per mixing program, hidden values per collapse program, warps.
# The collapse programs run the 4x4 Sinkhorn chain (20 iterations of small reductions) before collapsing: one
# warp keeps its reductions in shuffles. H200, Flash (4 x 4096 streams), us per hc_pre_fused call with collapse
# warps 4 / 2 / 1: 10.5 / 11.0 / 6.95 at 1 token, 23.2 / 19.8 / 13.9 at 32 tokens (mixing 256 values, 4 warps).
MIX_CHUNK, MIX_WARPS = 256, 4
PRE_BLOCK, PRE_WARPS = 256, 1
# hidden values per hc_post program: 256 alone; 64 when it also computes the next block's mixing dots (its fn tile
# is [mixes, n, block] in registers)
POST_BLOCK, POST_MIX_BLOCK = 256, 64
MIX_AHEAD = True  # the model's hc_post computes the next block's mixing partials (False: each hc_pre mixes itself)


class MixPartials(NamedTuple):
    """A block's mixing dots and sums of squares over chunks of its input streams, computed ahead (by the
    previous block's ``hc_post_fused``): mix [T, S, MP], sq [T, S], summed in chunk order by ``hc_pre_fused``."""

    mix: torch.Tensor
    sq: torch.Tensor


def _kernels() -> Any:
    if not HAVE_TRITON:
        raise RuntimeError("ds4x.kernels.hyper needs the 'triton' package")
    return module_for_current_mode(__name__, __file__, _DEFINED_INTERPRETED)


def supported(streams: torch.Tensor, n: int) -> bool:
    """Whether the fused kernels serve this call: Triton present, CUDA tensors (or the interpreter) and a
    power-of-two stream count (Triton tiles are powers of two)."""
    return HAVE_TRITON and (streams.is_cuda or interpret_mode()) and n > 0 and n & (n - 1) == 0


def hc_pre_fused(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, rms_eps: float,
                 hc_eps: float, iters: int, partials: MixPartials | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, H] -> (block input [T, H] in streams' dtype, post [T, n], comb [T, n, n]) float32.

    Two launches, both spread over the GPU: split-K mixing dots straight from the streams and ``fn`` in their
    stored dtypes, then the per-token mHC math and the collapse by blocks of the hidden size. ``partials``: the
    mixing dots already computed for these streams and this ``fn`` (by ``hc_post_fused``): one launch."""
    t, n, hd = streams.shape
    m = fn.shape[0]
    streams = streams.contiguous()
    mp = triton.next_power_of_2(m)
    kern = _kernels()
    if partials is None:
        k = n * hd
        s = triton.cdiv(k, MIX_CHUNK)
        partials = MixPartials(torch.empty(t, s, mp, dtype=torch.float32, device=streams.device),
                               torch.empty(t, s, dtype=torch.float32, device=streams.device))
        kern._hc_mix_kernel[(t, s)](streams, fn.contiguous(), partials.mix, partials.sq, K=k, M=m, MP=mp,
                                    CH=MIX_CHUNK, S=s, num_warps=MIX_WARPS)
    mix_part, sq_part = partials
    s = sq_part.shape[1]
    if mix_part.shape != (t, s, mp) or sq_part.shape != (t, s):
        raise ValueError(f"hc_pre_fused: partials {list(mix_part.shape)} / {list(sq_part.shape)} do not fit {t} "
                         f"tokens and {m} mixes")
    dev = streams.device
    out = torch.empty(t, hd, dtype=streams.dtype, device=dev)
    post = torch.empty(t, n, dtype=torch.float32, device=dev)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=dev)
    kern._hc_pre_kernel[(t, triton.cdiv(hd, PRE_BLOCK))](
        streams, mix_part, sq_part, base.contiguous(), scale.contiguous(), out, post, comb, hd, rms_eps, hc_eps,
        ITERS=iters, N=n, MP=mp, S=s, SP=triton.next_power_of_2(s), BLOCK_H=PRE_BLOCK, num_warps=PRE_WARPS)
    return out, post, comb


def hc_post_fused(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                  next_fn: torch.Tensor | None = None, routed: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, MixPartials | None]:
    """New streams [T, n, H]: out[k] = post[k] * block_out + sum_j comb[j, k] * streams[j], and with ``next_fn``
    (the next block's mixing weights [M, n H]) that block's :class:`MixPartials` over the new streams. ``routed``:
    the routed experts' outputs [T, k, H] and weights [T, k], summed into ``block_out`` (the shared expert's
    output) first with the bits of `ds4x.kernels.moe.combine_fused` (one launch fewer per MoE block)."""
    t, n, hd = streams.shape
    out = torch.empty_like(streams, memory_format=torch.contiguous_format)
    block = POST_BLOCK if next_fn is None else POST_MIX_BLOCK
    s = triton.cdiv(hd, block)
    m = next_fn.shape[0] if next_fn is not None else 1
    mp = triton.next_power_of_2(m)
    partials = None
    if next_fn is not None:
        partials = MixPartials(torch.empty(t, s, mp, dtype=torch.float32, device=streams.device),
                               torch.empty(t, s, dtype=torch.float32, device=streams.device))
    y, y_w = routed if routed is not None else (out, out)  # unread without routed outputs
    _kernels()._hc_post_kernel[(t, s)](
        streams.contiguous(), block_out.contiguous(), y.contiguous(), y_w.contiguous(), post.float().contiguous(),
        comb.float().contiguous(), out, next_fn.contiguous() if next_fn is not None else out,
        *(partials if partials is not None else (out, out)), hd, N=n, BLOCK_H=block, MIX=next_fn is not None, M=m,
        MP=mp, K=y.shape[1] if routed is not None else 0)
    return out, partials
