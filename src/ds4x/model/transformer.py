"""The whole model as a function of (weights, cache, tokens): embedding -> layers -> HC head -> logits."""

from __future__ import annotations

import torch

from ds4x.config import ModelConfig
from ds4x.kernels.linear import embedding, linear
from ds4x.model.attention import attention
from ds4x.model.cache import ModelCache
from ds4x.model.hyper import hc_head, hc_post, hc_pre
from ds4x.model.moe import moe
from ds4x.model.norms import rms_norm
from ds4x.model.rope import rope_kind, rope_tables


class Transformer:
    """Holds the weights (canonical names, working dtype) and runs the reference forward pass."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        self.cfg, self.w, self.dtype = cfg, weights, dtype
        self.device = device = weights["embed.weight"].device
        self.rope = {k: (inv.to(device), mag) for k, (inv, mag) in rope_tables(cfg).items()}

    def new_cache(self, ctx: int, mode: str = "float", chunk: int = 512) -> ModelCache:
        return ModelCache(self.cfg, ctx, self.device, mode, chunk)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: ModelCache, all_logits: bool = False) -> torch.Tensor:
        """Evaluate ``tokens`` [T] at positions cache.length.. and advance the cache.

        Returns float32 logits of the last token [V] (or of every token [T, V] with ``all_logits``).
        """
        cfg, w = self.cfg, self.w
        T = tokens.shape[0]
        if T == 0:
            raise ValueError("forward needs at least one token")
        cache.check_room(T)
        tokens = tokens.to(self.device)
        positions = torch.arange(cache.length, cache.length + T, device=self.device)
        x = embedding(w["embed.weight"], tokens, self.dtype)
        streams = x.unsqueeze(1).expand(T, cfg.hc_mult, cfg.hidden_size).contiguous()
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            block_in, post, comb = hc_pre(streams, w[p + "hc_attn_fn"], w[p + "hc_attn_base"],
                                          w[p + "hc_attn_scale"], cfg)
            h = rms_norm(block_in, w[p + "attn_norm.weight"], cfg.rms_norm_eps)
            out = attention(h, w, i, positions, cfg, cache, self.rope[rope_kind(cfg, i)])
            streams = hc_post(streams, out, post, comb)
            block_in, post, comb = hc_pre(streams, w[p + "hc_ffn_fn"], w[p + "hc_ffn_base"],
                                          w[p + "hc_ffn_scale"], cfg)
            h = rms_norm(block_in, w[p + "ffn_norm.weight"], cfg.rms_norm_eps)
            out = moe(h, w, p + "ffn.", tokens, cfg, cfg.is_hash_layer(i))
            streams = hc_post(streams, out, post, comb)
        cache.length += T
        if not all_logits:
            streams = streams[-1:]
        h = hc_head(streams, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"], cfg)
        logits = linear(rms_norm(h, w["norm.weight"], cfg.rms_norm_eps), w["head.weight"]).float()
        return logits if all_logits else logits[0]
