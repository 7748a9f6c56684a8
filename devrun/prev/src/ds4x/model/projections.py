"""Projections that read the same input, stored as one weight: one product (one launch) instead of several.

At load the weights of each group in ``SHARED_INPUT_GROUPS`` are stacked along their first dimension into one
tensor (dense weights of one dtype, or GGML blocks of one type and layout: output rows, or the routed experts of
a ``[E, out, in]`` weight, are independent, so stacking is a concatenation) and the separate entries become
views of it, so memory does not grow. The stacked weights live
beside the canonical dict (under ``stacked_name``), so accounting over the canonical names counts each byte
once. `project` multiplies once and splits the outputs; a group whose weights differ in storage stays
separate products.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds4x.config import ModelConfig
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.kernels.linear import Weight, linear

# per layer (relative to "layers.{i}."): weights multiplied with the same activation
SHARED_INPUT_GROUPS = (
    ("attn.wq_a.weight", "attn.wkv.weight"),
    ("attn.compressor.wkv.weight", "attn.compressor.wgate.weight"),
    ("attn.indexer.compressor.wkv.weight", "attn.indexer.compressor.wgate.weight"),
    ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"),
    ("ffn.experts.w1", "ffn.experts.w3"),  # [2E, I, H]: gate and up of the chosen experts in one routed product
)


def stacked_name(names: Sequence[str]) -> str:
    return "+".join(names)


def _stack_rows(weights: Sequence[Weight]) -> Weight | None:
    """The weights one after another along their first dimension (output rows, or experts) in one weight, or
    None when they cannot share storage."""
    first = weights[0]
    if any(w.ndim not in (2, 3) or w.shape[1:] != first.shape[1:] or w.device != first.device for w in weights):
        return None
    if all(isinstance(w, GGMLTensor) and (w.qtype, w.layout) == (first.qtype, first.layout) for w in weights):
        raw = torch.cat([w.raw for w in weights])  # type: ignore[union-attr]
        return GGMLTensor(raw, first.qtype, (raw.shape[0], *first.shape[1:]), first.layout)
    if all(isinstance(w, torch.Tensor) and w.dtype == first.dtype for w in weights):
        return torch.cat(list(weights))  # type: ignore[arg-type]
    return None


def stack_shared_inputs(w: dict[str, Weight], cfg: ModelConfig) -> dict[str, Weight]:
    """The stacked weight of every group of ``SHARED_INPUT_GROUPS`` present in ``w``, by ``stacked_name``; the
    separate entries of ``w`` are replaced by views of it."""
    out: dict[str, Weight] = {}
    for i in range(cfg.num_layers):
        for group in SHARED_INPUT_GROUPS:
            names = [f"layers.{i}.{n}" for n in group]
            if not all(n in w for n in names):
                continue
            stacked = _stack_rows([w[n] for n in names])
            if stacked is None:
                continue
            out[stacked_name(names)] = stacked
            start = 0
            for n in names:
                rows = w[n].shape[0]
                w[n] = stacked[start : start + rows]
                start += rows
    return out


def project(x: torch.Tensor, w: dict[str, Weight], names: Sequence[str]) -> list[torch.Tensor]:
    """``[linear(x, w[n]) for n in names]``, as one product when the group is stacked."""
    stacked = w.get(stacked_name(names))
    if stacked is None:
        return [linear(x, w[n]) for n in names]
    return list(linear(x, stacked).split([w[n].shape[0] for n in names], dim=-1))
