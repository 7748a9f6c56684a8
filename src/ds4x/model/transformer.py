"""The whole model as a function of (weights, cache, tokens): embedding -> layers -> HC head -> logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds4x.config import ModelConfig
from ds4x.kernels.linear import embedding, kernel_form, linear, rowwise_products
from ds4x.model.attention import PassPositions, Segment, attention
from ds4x.model.cache import ModelCache
from ds4x.model.hyper import hc_head, hc_post, hc_pre
from ds4x.model.moe import moe
from ds4x.model.norms import rms_norm
from ds4x.model.projections import stack_shared_inputs
from ds4x.model.rope import cos_sin, rope_kind, rope_tables


class Transformer:
    """Holds the weights (canonical names, working dtype) and runs the reference forward pass."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        self.cfg, self.w, self.dtype = cfg, weights, dtype
        for name, w in weights.items():  # one weight at a time, so a re-laid copy never doubles the model
            weights[name] = kernel_form(w)
        # one product for projections of the same input (model/projections.py); the forward reads both dicts
        stacked = stack_shared_inputs(weights, cfg)  # replaces the separate entries by views first
        self.w_forward = {**weights, **stacked}
        self.device = device = weights["embed.weight"].device
        self.rope = {k: (inv.to(device), mag) for k, (inv, mag) in rope_tables(cfg).items()}

    def new_cache(self, ctx: int, mode: str = "float", chunk: int = 512) -> ModelCache:
        return ModelCache(self.cfg, ctx, self.device, mode, chunk)

    def forward(self, tokens: torch.Tensor, cache: ModelCache, all_logits: bool = False,
                reference: bool = False) -> torch.Tensor:
        """Evaluate ``tokens`` [T] at positions cache.length.. and advance the cache.

        Returns float32 logits of the last token [V] (or of every token [T, V] with ``all_logits``).
        ``reference``: multi-token attention takes the torch path, not the Triton prefill kernel.
        """
        logits = self.forward_batch([tokens], [cache], all_logits, reference=reference)
        return logits if all_logits else logits[0]

    @torch.inference_mode()
    def forward_batch(self, tokens: Sequence[torch.Tensor], caches: Sequence[ModelCache], all_logits: bool = False,
                      rowwise: bool = False, reference: bool = False) -> torch.Tensor:
        """Evaluate ``tokens[i]`` (1-D, at least one token) after ``caches[i]`` for every i in one pass.

        The caches may hold different lengths; each advances by its own tokens. Token-local work runs over
        all rows together, attention over each cache's rows (:func:`ds4x.model.attention.attention`).
        Returns float32 logits of each cache's last token [B, V] (of every token [sum T_i, V] with
        ``all_logits``, in batch order). With ``rowwise`` every product computes each row alone
        (:func:`ds4x.kernels.linear.rowwise_products`), so a session's rows do not depend on the others.
        """
        if len(tokens) != len(caches) or not caches:
            raise ValueError(f"forward_batch needs one token list per cache, got {len(tokens)} for {len(caches)}")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a cache appears twice in one batch")
        segments, start = [], 0
        for cache, t in zip(caches, tokens, strict=True):
            n = int(t.shape[0])
            if n == 0:
                raise ValueError("forward needs at least one token per cache")
            cache.check_room(n)
            segments.append(Segment(cache, start, n, torch.arange(cache.length, cache.length + n, device=self.device)))
            start += n
        ids = torch.cat([t.reshape(-1) for t in tokens]).to(self.device)
        positions = torch.cat([s.positions for s in segments]) if len(segments) > 1 else segments[0].positions
        with rowwise_products(rowwise):
            logits = self._forward(ids, positions, segments, all_logits, reference)
        for seg in segments:
            seg.cache.length += seg.length
        return logits

    @torch.inference_mode()
    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, caches: Sequence[ModelCache]) -> torch.Tensor:
        """One token per cache, given as device tensors ``tokens`` [B] and ``positions`` [B] (each cache's
        length): float32 logits [B, V]. The lengths are not advanced (the caller does, after the step), and on
        CUDA with a native or packed cache nothing in the step reads a host value that changes between steps,
        so it can be captured once as a CUDA graph and replayed at later positions."""
        segments = [Segment(cache, i, 1) for i, cache in enumerate(caches)]
        return self._forward(tokens, positions, segments, all_logits=False)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                 all_logits: bool, reference: bool = False) -> torch.Tensor:
        cfg, w = self.cfg, self.w_forward
        N = ids.shape[0]
        x = embedding(w["embed.weight"], ids, self.dtype)
        streams = x.unsqueeze(1).expand(N, cfg.hc_mult, cfg.hidden_size).contiguous()
        rope_at_positions = {kind: cos_sin(table, positions) for kind, table in self.rope.items()}  # once a pass
        derived = PassPositions(positions)
        mix = None  # the next block's mixing partials, from the fused hc_post before it
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            h, post, comb = hc_pre(streams, w[p + "hc_attn_fn"], w[p + "hc_attn_base"], w[p + "hc_attn_scale"], cfg,
                                   mix, w[p + "attn_norm.weight"])
            kind = rope_kind(cfg, i)
            out = attention(h, w, i, positions, cfg, segments, self.rope[kind], rope_at_positions[kind], reference,
                            derived)
            streams, mix = hc_post(streams, out, post, comb, w[p + "hc_ffn_fn"])
            h, post, comb = hc_pre(streams, w[p + "hc_ffn_fn"], w[p + "hc_ffn_base"], w[p + "hc_ffn_scale"], cfg,
                                   mix, w[p + "ffn_norm.weight"])
            out = moe(h, w, p + "ffn.", ids, cfg, cfg.is_hash_layer(i), parts=True)  # summed by hc_post
            last = i + 1 == cfg.num_layers
            streams, mix = hc_post(streams, out, post, comb, None if last else w[f"layers.{i + 1}.hc_attn_fn"])
        if not all_logits and N > len(segments):  # each cache's last token
            streams = streams[[s.start + s.length - 1 for s in segments]]
        h = hc_head(streams, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"], cfg)
        return linear(rms_norm(h, w["norm.weight"], cfg.rms_norm_eps), w["head.weight"]).float()
