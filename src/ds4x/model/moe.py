"""Mixture of experts: hash or score routing, clamped SwiGLU routed experts, shared expert."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import torch

from ds4x.config import ModelConfig
from ds4x.kernels import moe as fused
from ds4x.kernels.branches import Branch, fork_point
from ds4x.kernels.dispatch import use_triton
from ds4x.kernels.linear import (
    Weight,
    has_routed_kernel,
    linear,
    routed_linear,
    routed_swiglu,
    routed_swiglu_input,
    routes_without_sync,
    rowwise_enabled,
)
from ds4x.model.activations import sigmoid, silu, softplus
from ds4x.model.projections import project, stacked_name


def _score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return softplus(logits).sqrt()
    if func == "softmax":
        return logits.softmax(dim=-1)
    return sigmoid(logits)


def route(
    x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, tokens: torch.Tensor, cfg: ModelConfig, hashed: bool,
    stacked: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] and their weights [T, k] for block inputs x [T, H]. ``stacked`` > 0: ids [T, 2k], the
    ids and then the ids + ``stacked`` (the gate and up slots of stacked experts, see experts_by_slot)."""
    if use_triton(x.device) and not rowwise_enabled():  # one launch for the glue after the router product
        return fused.route_fused(linear(x, w[prefix + "gate.weight"]), None if hashed else w[prefix + "gate.bias"],
                                 tokens, w[prefix + "gate.tid2eid"] if hashed else None, cfg.n_experts_per_tok,
                                 cfg.scoring_func, cfg.routed_scaling_factor, stacked)
    ids, weights = _route_reference(x, w, prefix, tokens, cfg, hashed)
    return (stacked_slots(ids, stacked) if stacked else ids), weights


def _route_reference(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, tokens: torch.Tensor,
                     cfg: ModelConfig, hashed: bool) -> tuple[torch.Tensor, torch.Tensor]:
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
    if use_triton(gate.device) and not rowwise_enabled():
        return fused.swiglu_fused(gate, up, limit)
    return silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def experts_by_expert(x: torch.Tensor, w1: Weight, w3: Weight, w2: Weight, ids: torch.Tensor,
                      weights: torch.Tensor, limit: float) -> torch.Tensor:
    """Routed experts, one expert at a time over the rows that chose it (the reference; reads each chosen
    expert once, but syncs with the host to find them)."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        h = swiglu(linear(x[tok], w1[e]), linear(x[tok], w3[e]), limit)
        out.index_add_(0, tok, (linear(h, w2[e]) * weights[tok, slot, None]).to(out.dtype))
    return out


@lru_cache(maxsize=8)
def _gate_up_offsets(n_experts: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[1, 2, 1]: the expert offsets of the gate and up halves of w13 (cached: never rebuilt inside a CUDA graph)."""
    return torch.tensor([0, n_experts], device=device, dtype=dtype).view(1, 2, 1)


def stacked_slots(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Expert ids [T, k] -> the slots [T, 2k] of stacked gate / up experts (w13 = [w1; w3]): the ids, then the ids
    + ``n_experts``, by one broadcast add (the fused router writes the same itself)."""
    t, k = ids.shape
    return (ids.unsqueeze(1) + _gate_up_offsets(n_experts, ids.device, ids.dtype)).view(t, 2 * k)


def experts_by_slot(x: torch.Tensor, w1: Weight, w3: Weight, w2: Weight, ids: torch.Tensor,
                    limit: float, w13: Weight | None = None, stacked_ids: torch.Tensor | None = None,
                    prepared: Any = None) -> torch.Tensor:
    """Routed experts' outputs [T, k, out] (unweighted), every (row, slot) pair in one routed product per
    projection: no host sync and three launches, but an expert chosen by several rows is read once per row on
    dense weights (the quantized kernel groups the pairs by expert). ``w13``: w1 and w3 stacked by expert
    ([2E, I, H], model/projections.py): gate and up of the k experts in one product of 2k slots, or, where the
    routed matvec serves it (decode steps), one launch that also applies SwiGLU; ``stacked_ids``: its slots
    [T, 2k] if the router wrote them (else `stacked_slots` here); ``prepared``: `routed_swiglu_input` of x."""
    t, k = ids.shape
    h = routed_swiglu(x, w13, ids, limit, prepared) if w13 is not None else None  # [T, k, I], one launch (decode)
    if h is None:
        if w13 is not None:  # slots j < k pick w1[ids], slots k + j pick w3[ids] = w13[ids + E]
            both = stacked_ids if stacked_ids is not None else stacked_slots(ids, w1.shape[0])
            gu = routed_linear(x, w13, both)  # [T, 2k, I]
            gate, up = gu[:, :k], gu[:, k:]
        else:
            gate, up = routed_linear(x, w1, ids), routed_linear(x, w3, ids)
        h = swiglu(gate, up, limit)  # [T, k, I]
    return routed_linear(h.reshape(t * k, -1), w2, ids.reshape(t * k, 1)).view(t, k, -1)


class MoEParts(NamedTuple):
    """A MoE block's output before its sum: routed outputs [T, k, out] (unweighted), their weights [T, k] and the
    shared expert's output [T, out]; the next op may sum them in its own launch (`ds4x.model.hyper.hc_post`)."""

    routed: torch.Tensor
    weights: torch.Tensor
    shared: torch.Tensor

    def combined(self) -> torch.Tensor:
        return combine(self.routed, self.weights, self.shared)


def combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """The routed outputs y [T, k, out] weighted and summed, plus the shared expert's output [T, out]."""
    if use_triton(y.device) and not rowwise_enabled():
        return fused.combine_fused(y, weights, shared)
    return (y * weights[..., None].to(y.dtype)).sum(dim=1).to(shared.dtype) + shared


# capture the router and the routing before the MoE block's other pieces (`fork_point`); False: the order before
ROUTER_FIRST = True

# dense weights: above this many (row, slot) pairs the by-expert loop reads less weight than gathering a copy of
# the expert per pair (the quantized routed kernel groups the pairs by expert itself, so it serves any count)
BY_SLOT_MAX_PAIRS = 64


def moe(x: torch.Tensor, w: dict[str, Weight], prefix: str, tokens: torch.Tensor, cfg: ModelConfig,
        hashed: bool, parts: bool = False) -> torch.Tensor | MoEParts:
    """x [T, H] -> routed experts (weighted) + shared expert; with ``parts``, where the routed experts run by slot,
    the unsummed `MoEParts` instead (summed by the caller's next launch)."""
    w1, w3, w2 = w[prefix + "experts.w1"], w[prefix + "experts.w3"], w[prefix + "experts.w2"]
    w13 = w.get(stacked_name((prefix + "experts.w1", prefix + "experts.w3")))
    w13 = w13 if w13 is not None and has_routed_kernel(w13) else None
    s = prefix + "shared_experts."

    def shared_expert() -> torch.Tensor:
        return linear(swiglu(*project(x, w, (s + "w1.weight", s + "w3.weight")), cfg.swiglu_limit),
                      w[s + "w2.weight"])

    # the quantized routed kernel at any size: no host sync, and the by-expert loop measured 147 ms against 16 ms
    # for a 512-token chunk of Flash (H200); row-wise products (batch invariance) stay on one path too
    if has_routed_kernel(w1) or (routes_without_sync(w1) and x.shape[0] * cfg.n_experts_per_tok <= BY_SLOT_MAX_PAIRS):
        # in a captured step the shared expert and x's preparation for the routed gate / up (int8 activations) are
        # branches beside the router and the routed experts; they fork from the block's input but are captured
        # after the routing (the step's critical path), so their grids do not hold the SMs the router needs
        def side_pieces(after: torch.cuda.Event | None) -> tuple[Branch | None, Branch]:
            prepared = (Branch(x.device, lambda: routed_swiglu_input(x, w13, cfg.n_experts_per_tok), after=after)
                        if w13 is not None else None)
            return prepared, Branch(x.device, shared_expert, after=after)

        start = fork_point(x.device)
        if not ROUTER_FIRST:
            prepared, shared_b = side_pieces(None)
        # with stacked gate / up experts the router also writes their 2k slots
        ids, weights = route(x, w, prefix, tokens, cfg, hashed, w1.shape[0] if w13 is not None else 0)
        if ROUTER_FIRST:
            prepared, shared_b = side_pieces(start)
        stacked_ids = None
        if w13 is not None:
            stacked_ids, ids = ids, ids[:, : cfg.n_experts_per_tok]
        routed = experts_by_slot(x, w1, w3, w2, ids, cfg.swiglu_limit, w13, stacked_ids,
                                 prepared.join() if prepared is not None else None)
        out = MoEParts(routed, weights, shared_b.join())
        return out if parts else out.combined()
    ids, weights = route(x, w, prefix, tokens, cfg, hashed)
    return experts_by_expert(x, w1, w3, w2, ids, weights, cfg.swiglu_limit) + shared_expert()
