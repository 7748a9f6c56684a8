"""Logit parity with transformers' DeepseekV4ForCausalLM (float cache, float32)."""

from __future__ import annotations

import pytest
import torch

from ds4x.runtime.engine import Engine
from ds4x.runtime.sampling import SamplingParams
from tests.hf_reference import PARITY_CONFIGS, random_hf_model

pytest.importorskip("transformers")

STEPS = 64


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_prompt_and_greedy_decode_match_transformers(name, tmp_path):
    hf = random_hf_model(seed=1, **PARITY_CONFIGS[name])
    hf.save_pretrained(tmp_path)
    engine = Engine.load(str(tmp_path), device="cpu", dtype="float32")
    vocab = engine.cfg.vocab_size
    prompt = torch.randint(0, vocab, (21,), generator=torch.Generator().manual_seed(7)).tolist()

    session = engine.new_session(ctx=256, cache="float", prefill_chunk=8)
    ours = list(session.generate(prompt, STEPS, SamplingParams(), stop_ids=()))

    # transformers: same prompt, then its own greedy tokens one at a time through its cache
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        pkv, ref_logits, ref_tokens = out.past_key_values, [out.logits[0, -1]], []
        for _ in range(STEPS - 1):
            ref_tokens.append(int(ref_logits[-1].argmax()))
            out = hf(torch.tensor([[ref_tokens[-1]]]), past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            ref_logits.append(out.logits[0, -1])
        ref_tokens.append(int(ref_logits[-1].argmax()))

    assert [t for t, _ in ours] == ref_tokens
    worst = max(float((l - r).abs().max() / r.abs().max()) for (_, l), r in zip(ours, ref_logits, strict=True))
    assert worst < 1e-4, f"{name}: worst logit difference {worst:.2e} of the largest logit"
    # the run crosses several compression boundaries of every compressed layer, and CSA layers end
    # with more compressed rows than the indexer keeps
    total = len(prompt) + STEPS
    cfg = engine.cfg
    assert all(total // r >= 3 for r in cfg.compress_ratios if r)
    csa_ratios = [r for k, r in zip(cfg.attn_kinds, cfg.compress_ratios, strict=True) if k == "csa"]
    assert all(total // r > cfg.index_topk for r in csa_ratios)
