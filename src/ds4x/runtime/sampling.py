"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.temperature == self.temperature) or self.temperature > 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from float logits [V].

    Order: temperature, then top-k, top-p (smallest set whose mass reaches p) and min-p (drop tokens
    below min_p x the top probability), renormalise, draw. Greedy takes the lowest index among ties.
    """
    logits = logits.float()
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True, stable=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass strictly above each token
        drop = before >= params.top_p
        probs = probs.clone()
        probs[order[drop]] = 0
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0)
    probs = probs / probs.sum()
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
