"""Manifold-constrained hyper-connections (mHC): n residual streams mixed around every block.

Before a block, a one-layer perceptron over the normalised streams gives three things: ``pre``
(collapse weights, n), ``post`` (expand weights, n) and ``comb`` (n x n stream mixing, projected
onto doubly-stochastic matrices by Sinkhorn-Knopp). All of it runs in float32.
"""

from __future__ import annotations

import torch

from ds4x.config import ModelConfig
from ds4x.kernels import hyper as fused
from ds4x.kernels.dispatch import use_triton
from ds4x.kernels.linear import linear, rowwise_enabled
from ds4x.model.activations import sigmoid
from ds4x.model.moe import MoEParts
from ds4x.model.norms import rms_norm


def use_fused(streams: torch.Tensor) -> bool:
    """The fused Triton kernels serve mHC on CUDA (one launch instead of ~100 small ops per call); not for
    batch-invariant (rowwise) steps, whose guarantee is defined on the reference ops."""
    return use_triton(streams.device) and fused.supported(streams, streams.shape[1]) and not rowwise_enabled()


def hc_pre(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig,
    partials: fused.MixPartials | None = None, norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, H] -> (block input [T, H], post [T, n], comb [T, n, n]). ``partials``: the mixing partials of
    these streams with ``fn`` that the previous ``hc_post`` computed on the fused path (None: computed here).
    ``norm``: the block input comes RMS-normalised with these weights (on the fused path in the same launch)."""
    if use_fused(streams):
        in_launch = norm is not None and fused.NORM_IN_PRE
        x, post, comb = fused.hc_pre_fused(streams, fn, base, scale, cfg.rms_norm_eps, cfg.hc_eps,
                                           cfg.hc_sinkhorn_iters, partials, norm if in_launch else None)
        return (x if in_launch or norm is None else rms_norm(x, norm, cfg.rms_norm_eps)), post, comb
    n = cfg.hc_mult
    flat = rms_norm(streams.flatten(1).float(), None, cfg.rms_norm_eps)
    mixes = linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = sigmoid(pre_w * scale[0] + pre_b) + cfg.hc_eps
    post = 2 * sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + cfg.hc_eps
    eps = cfg.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return (collapsed if norm is None else rms_norm(collapsed, norm, cfg.rms_norm_eps)), post, comb


def hc_post(streams: torch.Tensor, block_out: torch.Tensor | MoEParts, post: torch.Tensor, comb: torch.Tensor,
            next_fn: torch.Tensor | None = None) -> tuple[torch.Tensor, fused.MixPartials | None]:
    """New streams: out[k] = post[k] * block_out + sum_j comb[j, k] * streams[j]; and on the fused path, given the
    next block's ``fn``, that block's mixing partials for its ``hc_pre`` (one launch fewer per block), else None.
    ``block_out`` may be a MoE block's `MoEParts`, combined here (inside the fused launch on that path)."""
    if use_fused(streams):
        routed = None
        if isinstance(block_out, MoEParts):
            routed, block_out = (block_out.routed, block_out.weights), block_out.shared
        return fused.hc_post_fused(streams, block_out, post, comb, next_fn if fused.MIX_AHEAD else None, routed)
    if isinstance(block_out, MoEParts):
        block_out = block_out.combined()
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * block_out.unsqueeze(-2) + comb.to(dt).transpose(-1, -2) @ streams, None


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            cfg: ModelConfig) -> torch.Tensor:
    """Final collapse of the n streams [T, n, H] -> [T, H]."""
    flat = rms_norm(streams.flatten(1).float(), None, cfg.rms_norm_eps)
    pre = sigmoid(linear(flat, fn.float()) * scale.float() + base.float()) + cfg.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
