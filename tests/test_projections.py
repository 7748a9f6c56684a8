"""Stacked projections of one input (model/projections.py) against the separate products."""

import torch

from ds4x.config import tiny_config
from ds4x.model.moe import experts_by_slot
from ds4x.model.projections import SHARED_INPUT_GROUPS, project, stack_shared_inputs, stacked_name
from ds4x.weights.synthetic_gguf import synthetic_quantized_weights


def test_stacked_projections_match_separate_products_and_share_memory():
    cfg = tiny_config().replace(hidden_size=256)
    w = synthetic_quantized_weights(cfg, "q8", seed=1, dtype=torch.float32, device="cpu")
    separate = {n: w[n] for n in w}
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    stacked = stack_shared_inputs(w, cfg)
    assert stacked, "no group was stacked"
    for i in range(cfg.num_layers):
        for group in SHARED_INPUT_GROUPS:
            names = [f"layers.{i}.{n}" for n in group]
            key = stacked_name(names)
            if key not in stacked:
                continue
            if stacked[key].ndim == 3:  # routed experts stacked by expert: gate and up in one routed product
                ids = torch.tensor([[0, 3], [2, 1], [3, 3]])
                e1, e3 = (separate[n] for n in names)
                e2 = separate[f"layers.{i}.ffn.experts.w2"]
                parts = experts_by_slot(x, e1, e3, e2, ids, 10.0, stacked[key])
                want = experts_by_slot(x, e1, e3, e2, ids, 10.0)
            else:
                parts = project(x, {**w, **stacked}, names)
                want = project(x, separate, names)  # no stacked entry: one product per weight
            for got, ref in zip(parts, want, strict=True):
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            raw = stacked[key].raw if hasattr(stacked[key], "raw") else stacked[key]
            for n in names:  # the separate entries are views into the stacked storage
                part = w[n].raw if hasattr(w[n], "raw") else w[n]
                assert part.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
