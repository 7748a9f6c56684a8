"""Deterministic random DeepSeek-V4 weights of any config (for tests and benchmarks).

Same seed, config and dtype give the same tensors on any machine when generated on the CPU (one seeded
generator, canonical name order). Full-size models are generated on the GPU instead (``generate_on``):
then the same seed gives the same tensors on the same kind of device. Scales are chosen so activations stay O(1)
through every layer and the logits are far from flat: projections get std 1/sqrt(fan_in), norms
sit near 1, mHC starts near an even mix, routing biases and sinks are small.
"""

from __future__ import annotations

import math

import torch

from ds4x.config import ModelConfig
from ds4x.weights.names import expected_shapes, is_integer_tensor, keeps_fp32


def _init(name: str, shape: tuple[int, ...], cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32, device=g.device) * std

    if name.endswith("tid2eid"):
        # each token gets k distinct experts
        ranks = torch.rand((shape[0], cfg.n_routed_experts), generator=g, device=g.device).argsort(dim=-1)
        return ranks[:, : shape[1]].to(torch.int32)
    if name == "embed.weight":
        return normal(1.0)
    if name == "head.weight":
        return normal(3.0 / math.sqrt(shape[-1]))
    if name.endswith("norm.weight"):
        return 1.0 + normal(0.1)
    if name.endswith("_fn"):
        return normal(0.5 / math.sqrt(shape[-1]))
    if name.endswith("_base"):
        return normal(0.1)
    if name.endswith("_scale"):
        return 1.0 + normal(0.1)
    if name.endswith("attn_sink"):
        return normal(0.5)
    if name.endswith(".ape"):
        return normal(0.5)
    if name.endswith("gate.bias"):
        return normal(0.05)
    if name.endswith("experts.w2") or name.endswith("shared_experts.w2.weight"):
        return normal(0.5 / math.sqrt(shape[-1]))
    if name.endswith("wo_b.weight"):
        return normal(0.5 / math.sqrt(shape[-1]))
    return normal(1.0 / math.sqrt(shape[-1]))


def synthetic_weights(
    cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    generate_on: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """All canonical tensors for ``cfg``; float32-by-contract tensors stay float32."""
    g = torch.Generator(device=generate_on).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        t = _init(name, shape, cfg, g)
        if not is_integer_tensor(name):
            t = t.to(torch.float32 if keeps_fp32(name) else dtype)
        out[name] = t.to(device)
    return out
