"""Per-session attention state of the reference path.

The reference cache keeps, per layer, every position's raw KV row and every position's compressor
projections (kv and gate) in float32, plus the compressed rows emitted so far. Everything the model
needs at position p is a function of positions < p, so rewinding is just moving ``length`` back:
compressed rows beyond the new length are recomputed from the kept projections when their window
closes again. The packed persistent cache (DESIGN §5) replaces this layout; the semantics stay.

Two semantics, one switch (DESIGN §3.2): ``float`` stores rows as computed (matches transformers);
``native`` stores them as the official graph does: the non-RoPE dims of every attention row through
E4M3 with a power-of-two scale per 64 values, the RoPE dims as FP16, indexer keys (and queries)
Hadamard-rotated then MXFP4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4x.config import CSA, SLIDING, ModelConfig
from ds4x.formats import e4m3_block_roundtrip, hadamard128, mxfp4_roundtrip

CACHE_MODES = ("float", "native")


class ContextOverflowError(ValueError):
    """More tokens than the session's context was created for."""


@dataclass
class LayerState:
    raw: torch.Tensor  # [ctx, head_dim] KV rows after norm + RoPE (+ native round trip)
    comp_kv: torch.Tensor | None = None  # [ctx, lanes*head_dim] compressor kv projection per position
    comp_gate: torch.Tensor | None = None  # [ctx, lanes*head_dim] compressor gate (+ position bias)
    comp_rows: torch.Tensor | None = None  # [ctx//ratio, head_dim] emitted compressed rows
    idx_kv: torch.Tensor | None = None  # [ctx, 2*index_head_dim] indexer compressor projections
    idx_gate: torch.Tensor | None = None
    idx_rows: torch.Tensor | None = None  # [ctx//ratio, index_head_dim] compressed indexer keys


class ModelCache:
    def __init__(self, cfg: ModelConfig, ctx: int, device: torch.device | str = "cpu", mode: str = "float"):
        if mode not in CACHE_MODES:
            raise ValueError(f"cache mode must be one of {CACHE_MODES}, got {mode!r}")
        if mode == "native" and (why := cfg.native_cache_error()):
            raise ValueError(why)
        if ctx <= 0:
            raise ValueError(f"context size must be positive, got {ctx}")
        self.cfg, self.ctx, self.mode, self.device = cfg, ctx, mode, torch.device(device)
        self.length = 0
        f32 = dict(device=self.device, dtype=torch.float32)
        hd, ih = cfg.head_dim, cfg.index_head_dim
        self.layers: list[LayerState] = []
        for kind, ratio in zip(cfg.attn_kinds, cfg.compress_ratios, strict=True):
            st = LayerState(raw=torch.zeros(ctx, hd, **f32))
            if kind != SLIDING:
                lanes = 2 if kind == CSA else 1
                st.comp_kv = torch.zeros(ctx, lanes * hd, **f32)
                st.comp_gate = torch.zeros(ctx, lanes * hd, **f32)
                st.comp_rows = torch.zeros(ctx // ratio, hd, **f32)
            if kind == CSA:
                st.idx_kv = torch.zeros(ctx, 2 * ih, **f32)
                st.idx_gate = torch.zeros(ctx, 2 * ih, **f32)
                st.idx_rows = torch.zeros(ctx // ratio, ih, **f32)
            self.layers.append(st)

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.ctx:
            raise ContextOverflowError(
                f"context overflow: {self.length} tokens held + {n_new} new > context size {self.ctx}; "
                f"create the session with a larger --ctx"
            )

    def rewind(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind to {length}: the session holds {self.length} tokens")
        self.length = length

    def nbytes(self) -> int:
        total = 0
        for st in self.layers:
            for t in vars(st).values():
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    # ---- the native round trips (identity in float mode) --------------------------------------
    def kv_row(self, x: torch.Tensor) -> torch.Tensor:
        """A row as the attention history holds it."""
        x = x.float()
        if self.mode == "float":
            return x
        nope = self.cfg.nope_head_dim
        return torch.cat([e4m3_block_roundtrip(x[..., :nope], 64), x[..., nope:].half().float()], dim=-1)

    def indexer_row(self, x: torch.Tensor) -> torch.Tensor:
        """An indexer key or query as the native graph scores it (rotated, MXFP4)."""
        x = x.float()
        if self.mode == "float":
            return x
        return mxfp4_roundtrip(hadamard128(x), 32)
