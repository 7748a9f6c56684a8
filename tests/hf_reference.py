"""Random transformers DeepSeek-V4 models for parity tests (transformers is a test-only dependency)."""

from __future__ import annotations

import torch


def random_hf_model(seed: int = 0, **config):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**config)
    model = DeepseekV4ForCausalLM(cfg).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    n_experts = cfg.n_routed_experts
    with torch.no_grad():
        # transformers initialises sinks, position biases, mHC bases and routing tables to zeros:
        # randomise everything so every code path carries signal.
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if p.dim() == 1 else p.shape[-1] ** -0.5)
            if "norm" in name:
                p.add_(1.0)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.rand(b.shape[0], n_experts).argsort(dim=-1)[:, : b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


# Three small configs mixing sliding / CSA / HCA, hash layers, windows and ratios; the indexer top-k is
# smaller than the number of compressed rows the tests reach.
PARITY_CONFIGS = {
    "mixed": dict(
        vocab_size=300, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
        head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=6,
        num_experts_per_tok=2, num_hash_layers=2, sliding_window=8, index_n_heads=16, index_head_dim=32,
        index_topk=3, max_position_embeddings=4096,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                      "beta_fast": 32, "beta_slow": 1},
    ),
    "csa_heavy": dict(
        vocab_size=257, hidden_size=96, moe_intermediate_size=48, num_hidden_layers=4, num_attention_heads=6,
        head_dim=96, qk_rope_head_dim=32, q_lora_rank=48, o_groups=3, o_lora_rank=24, n_routed_experts=8,
        num_experts_per_tok=3, num_hash_layers=1, sliding_window=16, index_n_heads=16, index_head_dim=64,
        index_topk=5, max_position_embeddings=2048, hc_mult=2,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
                      "beta_fast": 16, "beta_slow": 2},
    ),
    "small_ratios": dict(
        vocab_size=200, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=6, num_attention_heads=4,
        head_dim=64, qk_rope_head_dim=8, q_lora_rank=32, o_groups=4, o_lora_rank=8, n_routed_experts=4,
        num_experts_per_tok=2, num_hash_layers=3, sliding_window=4, index_n_heads=16, index_head_dim=16,
        index_topk=4, max_position_embeddings=1024, hc_sinkhorn_iters=5, rope_theta=500.0,
        compress_rope_theta=5000.0, swiglu_limit=3.0, routed_scaling_factor=2.0,
        layer_types=["heavily_compressed_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention", "sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 6},
    ),
}
