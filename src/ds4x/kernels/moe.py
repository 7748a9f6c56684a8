"""MoE glue in one Triton launch each, for CUDA: routing (score, bias, top-k, renormalise, scale) and the clamped
SwiGLU between the expert projections.

The torch references (:func:`ds4x.model.moe.route`, :func:`ds4x.model.moe.swiglu`) take about a dozen small
kernels per call each, twice per layer in a decode step; the combine of the routed outputs with their weights
and the shared expert (:func:`ds4x.model.moe.combine`) three. The kernels compute in float32 and round to the
activations' dtype where the reference holds a value in it (the scores and the biased scores, so low-precision
ties break the same way, lower expert id first); values agree to that dtype's rounding, not bit for bit. The
interpreter (``TRITON_INTERPRET=1``) runs them on CPU tensors for the parity tests.
"""

from __future__ import annotations

from typing import Any

import torch

from ds4x.formats.pdl import launch_options
from ds4x.formats.triton_mode import HAVE_TRITON, interpret_mode, module_for_current_mode, tl, triton

_DEFINED_INTERPRETED = interpret_mode()

SCORE_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
# Warps of a routing program: one keeps the top-k's argmax rounds (k in a row, each a reduction over the experts)
# in shuffles; with four each round crossed two barriers (sm_90 SASS of Flash's router: 22 barriers at 4 warps, none
# at 1). H200, flash:q2, replayed step (4258750): 1 / 8 sessions 5.70-5.72 / 14.44-14.47 ms against 5.72 / 14.48-14.49
# with 4 warps, within noise
ROUTE_WARPS = 1

if HAVE_TRITON:
    from ds4x.formats.pdl import wait_upstream

    @triton.jit
    def _route_kernel(logits, bias, tokens, tid2eid, ids_out, weights_out, scaling, stacked, E: tl.constexpr,
                      K: tl.constexpr, FUNC: tl.constexpr, HASHED: tl.constexpr, STACKED: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        wait_upstream(PDL, RELEASE=True)
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        em = e < E
        x = tl.load(logits + t * E + e, mask=em, other=0.0).to(tl.float32)
        if FUNC == 0:  # sqrt(softplus), softplus = x above 20; log1p(y) = log(u) * y / (u - 1), u = 1 + y rounded
            y = tl.exp(tl.minimum(x, 20.0))
            u = 1.0 + y
            log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
            s = tl.sqrt(tl.where(x > 20.0, x, log1p))
        elif FUNC == 1:
            z = tl.exp(tl.where(em, x, float("-inf")) - tl.max(tl.where(em, x, float("-inf")), axis=0))
            s = z / tl.sum(z, axis=0)
        else:
            s = 1.0 / (1.0 + tl.exp(-x))
        s = s.to(logits.dtype.element_ty).to(tl.float32)
        k = tl.arange(0, BLOCK_K)
        km = k < K
        if HASHED:
            tok = tl.load(tokens + t)
            ids = tl.load(tid2eid + tok * K + k, mask=km, other=0).to(tl.int64)
        else:
            b = tl.load(bias + e, mask=em, other=0.0).to(logits.dtype.element_ty).to(tl.float32)
            biased = (s + b).to(logits.dtype.element_ty).to(tl.float32)
            biased = tl.where(em, biased, float("-inf"))
            ids = tl.zeros([BLOCK_K], tl.int64)
            for j in tl.static_range(K):
                best = tl.argmax(biased, axis=0, tie_break_left=True)
                ids = tl.where(k == j, best.to(tl.int64), ids)
                biased = tl.where(e == best, float("-inf"), biased)
        hit = (e[None, :] == ids[:, None]) & km[:, None]
        picked = tl.sum(tl.where(hit, s[None, :], 0.0), axis=1)  # [BLOCK_K]
        w = picked / (tl.sum(picked, axis=0) + 1e-20) * scaling
        if STACKED:  # ids [T, 2K]: the ids, then the ids + stacked (the up halves of stacked gate / up experts)
            tl.store(ids_out + t * 2 * K + k, ids, mask=km)
            tl.store(ids_out + t * 2 * K + K + k, ids + stacked, mask=km)
        else:
            tl.store(ids_out + t * K + k, ids, mask=km)
        tl.store(weights_out + t * K + k, w.to(weights_out.dtype.element_ty), mask=km)

    @triton.jit
    def _swiglu_kernel(gate, up, out, width, stride_g, stride_u, limit, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        # program (row, column block); gate and up rows may be strided (the halves of one stacked product)
        wait_upstream(PDL, RELEASE=True)
        r = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < width
        g = tl.minimum(tl.load(gate + r * stride_g + i, mask=m, other=0.0).to(tl.float32), limit)
        u = tl.minimum(tl.maximum(tl.load(up + r * stride_u + i, mask=m, other=0.0).to(tl.float32), -limit), limit)
        tl.store(out + r * width + i, (g / (1.0 + tl.exp(-g)) * u).to(out.dtype.element_ty), mask=m)


    @triton.jit
    def _moe_combine_kernel(y, weights, shared, out, N: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr,
                            PDL: tl.constexpr = False):
        wait_upstream(PDL, RELEASE=True)
        t = tl.program_id(0)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = n < N
        acc = tl.load(shared + t * N + n, mask=m, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            w = tl.load(weights + t * K + j).to(tl.float32)
            acc += w * tl.load(y + (t * K + j) * N + n, mask=m, other=0.0).to(tl.float32)
        tl.store(out + t * N + n, acc.to(out.dtype.element_ty), mask=m)


def _kernels() -> Any:
    return module_for_current_mode(__name__, __file__, _DEFINED_INTERPRETED)


def supported(x: torch.Tensor) -> bool:
    """Triton present and a CUDA tensor (or the interpreter)."""
    return HAVE_TRITON and (x.is_cuda or interpret_mode())


def route_fused(logits: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor | None,
                tid2eid: torch.Tensor | None, k: int, func: str, scaling: float,
                stacked: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids [T, k] int32, weights [T, k] in the logits' dtype): top-k of
    score + bias (or the ids ``tid2eid[tokens]`` of a hash layer), their scores renormalised and scaled.
    ``stacked`` > 0: ids [T, 2k], the k ids and then the same plus ``stacked`` (the slots of gate and up experts
    stacked in one weight, see model/moe.py), written by the same launch."""
    t, n_exp = logits.shape
    hashed = tid2eid is not None
    # int32: what the routed kernels index with
    ids = torch.empty(t, 2 * k if stacked else k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(t, k, dtype=logits.dtype, device=logits.device)
    if t:
        lg = logits.contiguous()
        _kernels()._route_kernel[(t,)](
            lg, bias if bias is not None else lg, tokens.contiguous() if hashed else lg,
            tid2eid.contiguous() if hashed else lg, ids, weights, float(scaling), stacked, E=n_exp, K=k,
            FUNC=SCORE_FUNCS.index(func) if func in SCORE_FUNCS else 2, HASHED=hashed, STACKED=stacked > 0,
            BLOCK_E=triton.next_power_of_2(n_exp), BLOCK_K=triton.next_power_of_2(k), num_warps=ROUTE_WARPS,
            **launch_options(logits.device, "moe"))
    return ids, weights


def swiglu_fused(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in one launch (gate's dtype). Rows of gate and up may
    be strided views (the two halves of one stacked product) without a copy."""
    width = gate.shape[-1]
    g, u = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate, up))
    g, u = g.reshape(-1, width), u.reshape(-1, width)  # views unless the leading dims are not uniform
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        block = min(1024, triton.next_power_of_2(width))
        _kernels()._swiglu_kernel[(g.shape[0], triton.cdiv(width, block))](
            g, u, out, width, g.stride(0), u.stride(0), float(limit), BLOCK=block, **launch_options(out.device, "moe"))
    return out


def combine_fused(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * y[t, j] + shared[t] in float32, one rounding to shared's dtype: y [T, k, N],
    weights [T, k], shared [T, N]."""
    t, k, n = y.shape
    out = torch.empty_like(shared, memory_format=torch.contiguous_format)
    if t:
        block = 1024
        _kernels()._moe_combine_kernel[(t, triton.cdiv(n, block))](y.contiguous(), weights.contiguous(),
                                                               shared.contiguous(), out, N=n, K=k, BLOCK=block,
                                                               **launch_options(out.device, "moe"))
    return out
