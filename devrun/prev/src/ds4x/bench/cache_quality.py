"""How much the cache semantics move the model: float vs native vs packed (issue: packed cache quality).

For one prompt: max and RMS logit differences over every prompt position, greedy agreement over the
generated tokens (each mode generating on its own), and the overlap of the CSA top-k selections.
"""

from __future__ import annotations

from typing import Any

import torch

from ds4x.runtime.engine import Engine
from ds4x.runtime.sampling import SamplingParams


def _run(engine: Engine, prompt: list[int], mode: str, gen: int, chunk: int):
    s = engine.new_session(ctx=len(prompt) + gen + 1, cache=mode, prefill_chunk=chunk)
    s.cache.selections = []
    logits = []
    for start in range(0, len(prompt), chunk):
        part = torch.tensor(prompt[start : start + chunk])
        logits.append(engine.model.forward(part, s.cache, all_logits=True))
        s.tokens.extend(prompt[start : start + chunk])
    selections = s.cache.selections
    s.cache.selections = None
    s.logits = logits[-1][-1]
    tokens = [t for t, _ in s.generate([], gen, SamplingParams(), stop_ids=())]
    return torch.cat(logits), tokens, selections


def _overlap(a, b, topk: int) -> float:
    """Mean fraction of selected rows shared, over CSA layers and queries that select a full top-k."""
    fractions = []
    for (la, _, ia, va), (lb, _, ib, vb) in zip(a, b, strict=True):
        assert la == lb
        n = int(max(ia.max(), ib.max())) + 1
        ma = torch.zeros(ia.shape[0], n, dtype=torch.bool).scatter_(1, ia, va)
        mb = torch.zeros(ib.shape[0], n, dtype=torch.bool).scatter_(1, ib, vb)
        full = va.sum(1) == topk
        if full.any():
            fractions.append(((ma & mb).sum(1)[full].float() / topk).mean())
    return float(torch.stack(fractions).mean()) if fractions else float("nan")


def compare_caches(engine: Engine, prompt: list[int], gen: int = 256, chunk: int = 64) -> dict[str, Any]:
    runs = {mode: _run(engine, prompt, mode, gen, chunk) for mode in ("float", "native", "packed")}
    report: dict[str, Any] = {}
    for a, b in (("float", "native"), ("native", "packed"), ("float", "packed")):
        la, ta, sa = runs[a]
        lb, tb, sb = runs[b]
        d = (la - lb).float()
        same = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        report[f"{a}_vs_{b}"] = {
            "max_abs_over_max_logit": float(d.abs().max() / la.abs().max()),
            "rms_over_rms_logit": float(d.pow(2).mean().sqrt() / la.pow(2).mean().sqrt()),
            "prompt_argmax_agreement": float((la.argmax(-1) == lb.argmax(-1)).float().mean()),
            "greedy_tokens_identical_prefix": same,
            "greedy_tokens_equal_fraction": sum(x == y for x, y in zip(ta, tb, strict=True)) / len(ta),
            "topk_overlap": _overlap(sa, sb, engine.cfg.index_topk),
        }
    return report
