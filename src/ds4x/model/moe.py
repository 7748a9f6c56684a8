"""Mixture of experts: hash or score routing, clamped SwiGLU routed experts, shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds4x.config import ModelConfig
from ds4x.kernels.linear import linear


def _score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if func == "softmax":
        return logits.softmax(dim=-1)
    return torch.sigmoid(logits)


def route(
    x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, tokens: torch.Tensor, cfg: ModelConfig, hashed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] and their weights [T, k] for block inputs x [T, H]."""
    scores = _score(linear(x, w[prefix + "gate.weight"]), cfg.scoring_func)
    if hashed:
        ids = w[prefix + "gate.tid2eid"][tokens].long()
    else:
        biased = scores + w[prefix + "gate.bias"].to(scores.dtype)
        ids = torch.topk(biased, cfg.n_experts_per_tok, dim=-1).indices
    # the selected scores are always renormalised (the official model and transformers ignore
    # norm_topk_prob for V4), then scaled
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def moe(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, tokens: torch.Tensor, cfg: ModelConfig,
        hashed: bool) -> torch.Tensor:
    """x [T, H] -> routed experts (weighted) + shared expert."""
    ids, weights = route(x, w, prefix, tokens, cfg, hashed)
    w1, w3, w2 = w[prefix + "experts.w1"], w[prefix + "experts.w3"], w[prefix + "experts.w2"]
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        h = swiglu(linear(x[tok], w1[e]), linear(x[tok], w3[e]), cfg.swiglu_limit)
        out.index_add_(0, tok, (linear(h, w2[e]) * weights[tok, slot, None]).to(out.dtype))
    s = prefix + "shared_experts."
    h = swiglu(linear(x, w[s + "w1.weight"]), linear(x, w[s + "w3.weight"]), cfg.swiglu_limit)
    return out + linear(h, w[s + "w2.weight"])
