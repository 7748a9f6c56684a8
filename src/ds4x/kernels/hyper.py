"""Fused mHC (manifold-constrained hyper-connections) for CUDA: one Triton kernel where the reference
(:mod:`ds4x.model.hyper`) launches about a hundred small ops per call (twenty Sinkhorn iterations on 4x4
matrices, sigmoids, a softmax, the collapse), which dominates the launch count of a decode step.

- ``hc_pre_fused``: the mixing partials over blocks of the hidden size (dots ``streams @ fn.T`` and the streams'
  Gram matrix, whose trace is their sum of squares), then one program per (token, block of the hidden size) sums
  the partials in a fixed order, computes ``r``, ``pre``, ``post``, ``comb`` (softmax + Sinkhorn in registers) and
  collapses its block, optionally RMS-normalised for the block (its mean square is ``pre^T G pre / H``, so no
  program needs another's block and the norm needs no launch). The RMS factor is applied after the dots
  (``r * (x @ fn.T)`` instead of ``(r * x) @ fn.T``: the same value up to rounding). A decode step has one token:
  a single program per token was latency bound.
- ``hc_post_fused``: ``out[k] = post[k] * block_out + sum_j comb[j, k] * streams[j]`` in float32, one
  rounding to the streams' dtype. Given the next block's ``fn`` it also computes that block's mixing partials
  over its part of the new streams (as stored, after the rounding) and returns them as :class:`MixPartials`, so
  the next ``hc_pre_fused`` skips its mixing launch.
- From ``MATMUL_PARTIALS_TOKENS`` tokens (prefill chunks) the partials are float32 GEMMs over whole rows instead.

Both agree with the reference to float32 rounding (the order of the sums differs), not bit for bit; the
decode step uses them only on CUDA (``DS4X_KERNELS=reference`` keeps the reference). The interpreter
(``TRITON_INTERPRET=1``) runs them on CPU tensors for the parity tests.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ds4x.formats.pdl import launch_options
from ds4x.formats.triton_mode import HAVE_TRITON, interpret_mode, module_for_current_mode, tl, triton

_DEFINED_INTERPRETED = interpret_mode()
# the hidden size is a compile-time constant (one model, one value): static loops, also in the interpreter

if HAVE_TRITON:
    from ds4x.formats.pdl import wait_upstream

    @triton.jit
    def _fn_block(fn, h, m, H: tl.constexpr, N: tl.constexpr, M: tl.constexpr, MP: tl.constexpr):
        # fn [M, N H] at block h of each stream: [MP, N, BLOCK_H] float32, zero past M and H
        j = tl.arange(0, N)
        r = tl.arange(0, MP)
        return tl.load(fn + r[:, None, None] * (N * H) + j[None, :, None] * H + h[None, None, :],
                       mask=(r[:, None, None] < M) & m[None, None, :], other=0.0).to(tl.float32)

    @triton.jit
    def _mix_partials(y, f, mix_part, gram_part, t, hb, s, N: tl.constexpr, MP: tl.constexpr):
        # one block of the streams y [N, BLOCK_H] (float32, zero past H): its partial mixing dots with f (the block
        # of fn [M, N H], _fn_block) and Gram matrix y y^T (whose trace is the sum of squares), stored as chunk hb of
        # s (summed in chunk order by _hc_pre_kernel)
        j = tl.arange(0, N)
        r = tl.arange(0, MP)
        chunk = t * s + hb
        tl.store(mix_part + chunk * MP + r, tl.sum(tl.sum(f * y[None, :, :], axis=2), axis=1))
        nn = j[:, None] * N + j[None, :]
        tl.store(gram_part + chunk * N * N + nn, tl.sum(y[:, None, :] * y[None, :, :], axis=2))

    @triton.jit
    def _hc_mix_kernel(streams, fn, mix_part, gram_part, H: tl.constexpr, N: tl.constexpr,
                       M: tl.constexpr, MP: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
        # program (token, block of the hidden size): the block's mixing partials over all N streams (no atomics:
        # replays give the same bits)
        wait_upstream(PDL, RELEASE=True)
        t = tl.program_id(0)
        hb = tl.program_id(1)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        m = h < H
        j = tl.arange(0, N)
        y = tl.load(streams + t * N * H + j[:, None] * H + h[None, :], mask=m[None, :], other=0.0).to(tl.float32)
        _mix_partials(y, _fn_block(fn, h, m, H, N, M, MP), mix_part, gram_part, t, hb, tl.num_programs(1), N, MP)

    @triton.jit
    def _hc_pre_kernel(streams, mix_part, gram_part, base, scale, norm_w, out, post_out, comb_out,
                       H: tl.constexpr, rms_eps, hc_eps, ITERS: tl.constexpr, N: tl.constexpr, MP: tl.constexpr,
                       S: tl.constexpr, SP: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr,
                       PDL: tl.constexpr = False):
        # program (token, block of the hidden size): every program of a token derives the same pre / post /
        # comb from the partials (4x4 work, cheaper than another launch), then collapses its block. NORM: the
        # block input's RMSNorm too (weights norm_w): its mean square is pre^T G pre / H for the streams' Gram
        # matrix G (summed from the partials), so no program needs the others' blocks
        wait_upstream(PDL, RELEASE=True)
        t = tl.program_id(0)
        hb = tl.program_id(1)
        j = tl.arange(0, N)
        sp = tl.arange(0, SP)
        s_ok = sp < S
        nn = j[:, None] * N + j[None, :]  # [row i, column k]
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        m = h < H
        # every load first, in one wave (the reductions between them cross barriers, which kept each later load
        # waiting for the one before: six round trips to L2 where one does)
        gram_p = tl.load(gram_part + (t * S + sp)[:, None, None] * (N * N) + nn[None, :, :], mask=s_ok[:, None, None],
                         other=0.0)
        part = mix_part + t * S * MP + sp * MP  # [SP] pointers to each chunk's mixing dots
        pre_p = tl.load(part[:, None] + j[None, :], mask=s_ok[:, None], other=0.0)
        post_p = tl.load(part[:, None] + N + j[None, :], mask=s_ok[:, None], other=0.0)
        comb_p = tl.load(part[:, None, None] + 2 * N + nn[None, :, :], mask=s_ok[:, None, None], other=0.0)
        s0 = tl.load(scale).to(tl.float32)
        s1 = tl.load(scale + 1).to(tl.float32)
        s2 = tl.load(scale + 2).to(tl.float32)
        base_pre = tl.load(base + j).to(tl.float32)
        base_post = tl.load(base + N + j).to(tl.float32)
        base_comb = tl.load(base + 2 * N + nn).to(tl.float32)
        x = tl.load(streams + t * N * H + j[:, None] * H + h[None, :], mask=m[None, :], other=0.0).to(tl.float32)
        if NORM:
            nw = tl.load(norm_w + h, mask=m, other=0.0).to(tl.float32)
        gram = tl.sum(gram_p, axis=0)
        sq = tl.sum(tl.sum(tl.where(j[:, None] == j[None, :], gram, 0.0), axis=1), axis=0)  # trace: sum of squares
        r = 1.0 / tl.sqrt(sq / (N * H) + rms_eps)
        pre = tl.sigmoid(tl.sum(pre_p, axis=0) * r * s0 + base_pre) + hc_eps
        post = 2.0 * tl.sigmoid(tl.sum(post_p, axis=0) * r * s1 + base_post)
        logits = tl.sum(comb_p, axis=0) * r * s2 + base_comb
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        first = hb == 0
        tl.store(post_out + t * N + j, post, mask=first & (j < N))
        tl.store(comb_out + t * N * N + nn, comb, mask=first & (nn < N * N))
        y = tl.sum(pre[:, None] * x, axis=0).to(out.dtype.element_ty)
        if NORM:  # the RMSNorm kernel's arithmetic on the rounded collapse, with the Gram matrix's mean square
            ms = tl.sum(tl.sum(pre[:, None] * gram * pre[None, :], axis=1), axis=0) / H
            v = y.to(tl.float32) * (1.0 / tl.sqrt(ms + rms_eps))
            y = (nw * v).to(out.dtype.element_ty)
        tl.store(out + t * H + h, y, mask=m)

    @triton.jit
    def _hc_post_kernel(streams, block_out, routed, routed_w, post, comb, out, fn, mix_part, gram_part,
                        H: tl.constexpr, N: tl.constexpr, BLOCK_H: tl.constexpr, MIX: tl.constexpr, M: tl.constexpr,
                        MP: tl.constexpr, K: tl.constexpr, PDL: tl.constexpr = False):
        # program (token, block of the hidden size); with MIX also the next block's mixing partials over this block
        # of the new streams (chunk s = the block: _hc_pre_kernel sums them in order).
        # K > 0: block_out is the shared expert's output and the block's output is first summed with the K routed
        # outputs [T, K, H] by their weights [T, K], rounded to block_out's dtype (the MoE combine's arithmetic)
        wait_upstream(PDL, RELEASE=True)
        t = tl.program_id(0)
        hb = tl.program_id(1)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        m = h < H
        j = tl.arange(0, N)
        # every load before any arithmetic, so they wait on memory together (the streams' block last: its layout
        # change goes through shared memory behind a barrier, which held back the loads issued after it)
        if MIX:  # not after the block's output is stored (a second round trip)
            f = _fn_block(fn, h, m, H, N, M, MP)
        c = tl.load(comb + t * N * N + j[:, None] * N + j[None, :])  # [j, k]
        p = tl.load(post + t * N + j)  # [k]
        b = tl.load(block_out + t * H + h, mask=m, other=0.0).to(tl.float32)
        if K > 0:
            for i in tl.static_range(K):
                wi = tl.load(routed_w + t * K + i).to(tl.float32)
                b += wi * tl.load(routed + (t * K + i) * H + h, mask=m, other=0.0).to(tl.float32)
            b = b.to(block_out.dtype.element_ty).to(tl.float32)
        x = tl.load(streams + t * N * H + j[:, None] * H + h[None, :], mask=m[None, :], other=0.0).to(tl.float32)
        mixed = tl.sum(c[:, :, None] * x[:, None, :], axis=0)  # [k, h] = sum_j comb[j, k] * x[j, h]
        y = (p[:, None] * b[None, :] + mixed).to(out.dtype.element_ty)
        tl.store(out + t * N * H + j[:, None] * H + h[None, :], y, mask=m[None, :])
        if MIX:
            yf = tl.where(m[None, :], y.to(tl.float32), 0.0)  # the stored values, as the next block reads them
            _mix_partials(yf, f, mix_part, gram_part, t, hb, tl.num_programs(1), N, MP)


# launch shapes: hidden values per collapse program, on one warp. The collapse programs run the 4x4 Sinkhorn chain
# (20 iterations of small reductions) before collapsing: one warp keeps its reductions in shuffles. H200, Flash
# (4 x 4096 streams), us per hc_pre_fused call with collapse warps 4 / 2 / 1: 10.5 / 11.0 / 6.95 at 1 token, 23.2 /
# 19.8 / 13.9 at 32 tokens. Two warps once measured faster for up to 8 tokens in the whole step (d2f1476); since the
# kernel issues its loads in one wave (522588e) one warp is faster there too: the launch alone (graph of 64, with
# partials; devrun of 57903e1) 4.03 against 4.71 us at 1 token and 4.81 against 5.37 at 8 (the chain's 19 Sinkhorn
# iterations after the first cost 1.1 / 2.0 us of that), the replayed step (dd4d2ee, one process) 5.65 / 5.62
# against 5.70 / 5.68 ms for one session and 14.39 / 14.37 against 14.45 / 14.44 for 8.
PRE_BLOCK = 256
# hidden values per hc_post program: 256 alone; 64 when it also computes the next block's mixing partials (its fn
# tile is [mixes, n, block] in registers), and so per mixing program (the same chunks either way)
POST_BLOCK, POST_MIX_BLOCK = 256, 64
# From this many tokens (a prefill chunk) the mixing partials are two float32 GEMMs over whole rows, one chunk (the
# dots streams [T, n H] x fn^T, the Gram matrices as a batched [n, H] x [H, n]), instead of the kernels' reductions
# per (token, block of the hidden size), which are instruction-bound there: H200, 4,096 tokens, hc_post with the
# partials 1.6 ms a call. Fewer tokens (decode steps and their batches) keep the kernels.
MATMUL_PARTIALS_TOKENS = 512
MIX_AHEAD = True  # the model's hc_post computes the next block's mixing partials (False: each hc_pre mixes itself)
NORM_IN_PRE = True  # the model's hc_pre applies the block's RMSNorm in its launch (False: the norm kernel after it)


class MixPartials(NamedTuple):
    """A block's mixing partials over chunks (blocks of the hidden size) of its input streams: the mixing dots
    mix [T, S, MP] and the Gram matrices gram [T, S, n n] of the n streams (their traces: the sums of squares),
    summed in chunk order by ``hc_pre_fused``; computed by the previous block's ``hc_post_fused`` (or by
    ``hc_pre_fused``)."""

    mix: torch.Tensor
    gram: torch.Tensor


def _new_partials(t: int, s: int, mp: int, n: int, device: torch.device) -> MixPartials:
    def new(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.float32, device=device)

    return MixPartials(new(t, s, mp), new(t, s, n * n))


def _partials_by_matmul(streams: torch.Tensor, fn: torch.Tensor, mp: int) -> MixPartials:
    """The mixing partials of streams [T, n, H] (as stored) and fn [M, n H] in one chunk: float32 GEMMs."""
    t, n, hd = streams.shape
    y = streams.float()
    mix = torch.zeros(t, 1, mp, dtype=torch.float32, device=streams.device)
    mix[:, 0, : fn.shape[0]] = y.view(t, n * hd) @ fn.float().t()
    return MixPartials(mix, torch.bmm(y, y.transpose(1, 2)).view(t, 1, n * n))


def _kernels() -> Any:
    if not HAVE_TRITON:
        raise RuntimeError("ds4x.kernels.hyper needs the 'triton' package")
    return module_for_current_mode(__name__, __file__, _DEFINED_INTERPRETED)


def supported(streams: torch.Tensor, n: int) -> bool:
    """Whether the fused kernels serve this call: Triton present, CUDA tensors (or the interpreter) and a
    power-of-two stream count (Triton tiles are powers of two)."""
    return HAVE_TRITON and (streams.is_cuda or interpret_mode()) and n > 0 and n & (n - 1) == 0


def hc_pre_fused(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, rms_eps: float,
                 hc_eps: float, iters: int, partials: MixPartials | None = None,
                 norm_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, H] -> (block input [T, H] in streams' dtype, post [T, n], comb [T, n, n]) float32.

    Two launches, both spread over the GPU: the mixing partials (dots and Gram matrices) straight
    from the streams and ``fn`` in their stored dtypes, then the per-token mHC math and the collapse by blocks of
    the hidden size. ``partials``: those of these streams and this ``fn`` computed already (by ``hc_post_fused``):
    one launch. ``norm_weight``: the block input comes RMS-normalised with these weights (eps ``rms_eps``), the
    mean square taken from the Gram matrices (pre^T G pre / H: the unrounded collapse's, where the norm kernel
    reads the rounded one; the same to float32 rounding), so the norm needs no launch of its own."""
    t, n, hd = streams.shape
    m = fn.shape[0]
    streams = streams.contiguous()
    mp = triton.next_power_of_2(m)
    kern = _kernels()
    if partials is None and t >= MATMUL_PARTIALS_TOKENS:
        partials = _partials_by_matmul(streams, fn, mp)
    elif partials is None:
        partials = _new_partials(t, triton.cdiv(hd, POST_MIX_BLOCK), mp, n, streams.device)
        kern._hc_mix_kernel[(t, partials.gram.shape[1])](streams, fn.contiguous(), *partials, hd, N=n, M=m, MP=mp,
                                                       BLOCK_H=POST_MIX_BLOCK,
                                                       **launch_options(streams.device, "hc_mix"))
    s = partials.gram.shape[1]
    if partials.mix.shape != (t, s, mp) or partials.gram.shape != (t, s, n * n):
        raise ValueError(f"hc_pre_fused: partials {[list(p.shape) for p in partials]} do not fit {t} tokens, {n} "
                         f"streams and {m} mixes")
    dev = streams.device
    out = torch.empty(t, hd, dtype=streams.dtype, device=dev)
    post = torch.empty(t, n, dtype=torch.float32, device=dev)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=dev)
    # PDL for one token only: with 8 or 32 the step was slower with it (see ds4x.formats.pdl)
    kern._hc_pre_kernel[(t, triton.cdiv(hd, PRE_BLOCK))](
        streams, *partials, base.contiguous(), scale.contiguous(),
        norm_weight.contiguous() if norm_weight is not None else out, out, post, comb, hd, rms_eps, hc_eps,
        ITERS=iters, N=n, MP=mp, S=s, SP=triton.next_power_of_2(s), BLOCK_H=PRE_BLOCK,
        NORM=norm_weight is not None, num_warps=1,
        **(launch_options(dev, "hc_pre") if t == 1 else {"PDL": False}))
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
    by_matmul = next_fn is not None and t >= MATMUL_PARTIALS_TOKENS
    mix_fn = None if by_matmul else next_fn  # the kernel's mixing weights
    block = POST_BLOCK if mix_fn is None else POST_MIX_BLOCK
    s = triton.cdiv(hd, block)
    m = mix_fn.shape[0] if mix_fn is not None else 1
    mp = triton.next_power_of_2(m)
    partials = _new_partials(t, s, mp, n, streams.device) if mix_fn is not None else None
    y, y_w = routed if routed is not None else (out, out)  # unread without routed outputs
    _kernels()._hc_post_kernel[(t, s)](
        streams.contiguous(), block_out.contiguous(), y.contiguous(), y_w.contiguous(), post.float().contiguous(),
        comb.float().contiguous(), out, mix_fn.contiguous() if mix_fn is not None else out,
        *(partials if partials is not None else (out, out)), hd, N=n, BLOCK_H=block, MIX=mix_fn is not None,
        M=m, MP=mp, K=y.shape[1] if routed is not None else 0, **launch_options(streams.device, "hc_post"))
    if by_matmul:
        assert next_fn is not None
        partials = _partials_by_matmul(out, next_fn, triton.next_power_of_2(next_fn.shape[0]))
    return out, partials
