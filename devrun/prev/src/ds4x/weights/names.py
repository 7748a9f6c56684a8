"""The canonical tensor names and shapes of a DeepSeek-V4 model.

Canonical names follow the official checkpoint (``layers.N.attn.wq_a.weight``), with one
change: routed experts are stacked per layer (``layers.N.ffn.experts.w1`` is ``[E, I, H]``)
because every consumer wants them that way. Loaders map their source names onto these;
the model reads only these.
"""

from __future__ import annotations

from ds4x.config import CSA, SLIDING, ModelConfig


def layer_prefix(layer: int) -> str:
    return f"layers.{layer}."


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its shape (dims as torch ``[out, in]``)."""
    H, V, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    hd, nh = cfg.head_dim, cfg.num_heads
    mix = (2 + hc) * hc
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (V, H),
        "head.weight": (V, H),
        "norm.weight": (H,),
        "hc_head_fn": (hc, hc * H),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    for i in range(cfg.num_layers):
        p = layer_prefix(i)
        for site in ("attn", "ffn"):
            shapes[f"{p}hc_{site}_fn"] = (mix, hc * H)
            shapes[f"{p}hc_{site}_base"] = (mix,)
            shapes[f"{p}hc_{site}_scale"] = (3,)
        shapes[f"{p}attn_norm.weight"] = (H,)
        shapes[f"{p}ffn_norm.weight"] = (H,)
        shapes[f"{p}attn.wq_a.weight"] = (cfg.q_lora_rank, H)
        shapes[f"{p}attn.q_norm.weight"] = (cfg.q_lora_rank,)
        shapes[f"{p}attn.wq_b.weight"] = (nh * hd, cfg.q_lora_rank)
        shapes[f"{p}attn.wkv.weight"] = (hd, H)
        shapes[f"{p}attn.kv_norm.weight"] = (hd,)
        shapes[f"{p}attn.wo_a.weight"] = (cfg.o_groups * cfg.o_lora_rank, nh * hd // cfg.o_groups)
        shapes[f"{p}attn.wo_b.weight"] = (H, cfg.o_groups * cfg.o_lora_rank)
        shapes[f"{p}attn.attn_sink"] = (nh,)
        kind, ratio = cfg.attn_kinds[i], cfg.compress_ratios[i]
        if kind != SLIDING:
            lanes = 2 if kind == CSA else 1  # CSA's overlapping windows carry two lanes per token
            c = f"{p}attn.compressor."
            shapes[c + "wkv.weight"] = (lanes * hd, H)
            shapes[c + "wgate.weight"] = (lanes * hd, H)
            shapes[c + "ape"] = (ratio, lanes * hd)
            shapes[c + "norm.weight"] = (hd,)
        if kind == CSA:
            ih, ni = cfg.index_head_dim, cfg.index_n_heads
            x = f"{p}attn.indexer."
            shapes[x + "wq_b.weight"] = (ni * ih, cfg.q_lora_rank)
            shapes[x + "weights_proj.weight"] = (ni, H)
            shapes[x + "compressor.wkv.weight"] = (2 * ih, H)
            shapes[x + "compressor.wgate.weight"] = (2 * ih, H)
            shapes[x + "compressor.ape"] = (ratio, 2 * ih)
            shapes[x + "compressor.norm.weight"] = (ih,)
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        shapes[f"{p}ffn.gate.weight"] = (E, H)
        if cfg.is_hash_layer(i):
            shapes[f"{p}ffn.gate.tid2eid"] = (V, cfg.n_experts_per_tok)
        else:
            shapes[f"{p}ffn.gate.bias"] = (E,)
        shapes[f"{p}ffn.experts.w1"] = (E, I, H)
        shapes[f"{p}ffn.experts.w3"] = (E, I, H)
        shapes[f"{p}ffn.experts.w2"] = (E, H, I)
        shapes[f"{p}ffn.shared_experts.w1.weight"] = (I, H)
        shapes[f"{p}ffn.shared_experts.w3.weight"] = (I, H)
        shapes[f"{p}ffn.shared_experts.w2.weight"] = (H, I)
    return shapes


# Tensors kept in float32 whatever the working dtype: they feed fp32 math (mHC, norms, sinks,
# position biases, routing bias), as in the official model and transformers.
FP32_SUFFIXES = (
    "_fn", "_base", "_scale", "norm.weight", "attn_sink", ".ape", "gate.bias",
)


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES) or name.startswith("hc_head")


def is_integer_tensor(name: str) -> bool:
    return name.endswith("tid2eid")
