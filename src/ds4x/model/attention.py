"""Attention of one layer: shared-KV MQA over a sliding window plus (CSA/HCA) compressed rows.

Per query at position t the keys are (K = V, one head shared by all query heads):
- the raw rows of positions t-W+1 .. t (sliding window W, the current token included);
- HCA: every compressed row whose window has closed (row w covers tokens [w*r, w*r+r-1] and
  becomes visible at t = w*r + r - 1);
- CSA: the top-k of the visible compressed rows by the Lightning indexer's score
  (exact selection: ties go to the lower row index), gathered per query.
A per-head sink logit joins the softmax. The output's RoPE dims get the inverse rotation, then the
grouped output projection (G groups -> o_lora each -> hidden).

Rows are read from the cache's stores (float, native or packed); the arithmetic after the read is the
same for every storage, which is what makes packed and native-unpacked logits bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4x.config import CSA, HCA, ModelConfig
from ds4x.kernels.attention import attention_decode_triton
from ds4x.kernels.dispatch import use_triton
from ds4x.kernels.indexer import indexer_scores, indexer_scores_triton
from ds4x.kernels.linear import grouped_linear, linear
from ds4x.kernels.select import select_topk, select_topk_blocked
from ds4x.model.cache import LayerState, ModelCache, RowStore
from ds4x.model.norms import rms_norm
from ds4x.model.rope import apply_rope, cos_sin


def _emit_windows(proj: RowStore, ape: torch.Tensor, first: int, last: int, ratio: int, overlap: bool,
                  width: int) -> torch.Tensor:
    """Compressed (un-normalised) rows for windows first..last-1 from per-position projections.

    ``proj`` rows are [kv | gate]. Each window softmax-pools its positions per channel (gate + learned
    position bias). With ``overlap`` (CSA) a row pools 2*ratio slots: the previous window's "a" lane
    (channels [:width]) and its own window's "b" lane (channels [width:]); window 0 has no previous one.
    """
    n = last - first
    rows = proj.read(first * ratio, last * ratio).view(n, ratio, -1)
    k, g = rows.chunk(2, dim=-1)
    g = g + ape.float()
    if overlap:
        prev_k = torch.zeros(n, ratio, width, dtype=k.dtype, device=k.device)
        prev_g = torch.full((n, ratio, width), float("-inf"), dtype=g.dtype, device=g.device)
        start = max(first, 1)
        if last > start:
            prev = proj.read((start - 1) * ratio, (last - 1) * ratio).view(-1, ratio, rows.shape[-1])
            pk, pg = prev.chunk(2, dim=-1)
            prev_k[start - first :] = pk[..., :width]
            prev_g[start - first :] = pg[..., :width] + ape[:, :width].float()
        k = torch.cat([prev_k, k[..., width:]], dim=1)
        g = torch.cat([prev_g, g[..., width:]], dim=1)
    return (k * g.softmax(dim=1)).sum(dim=1)


def _compress(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, proj: RowStore, rows: RowStore,
              p0: int, ratio: int, overlap: bool, width: int, cfg: ModelConfig,
              rope: tuple[torch.Tensor, float]) -> int:
    """Store this chunk's compressor projections, emit rows for windows that closed; return the row count."""
    T = x.shape[0]
    kv = linear(x, w[prefix + "wkv.weight"]).float()
    gate = linear(x, w[prefix + "wgate.weight"]).float()
    proj.write(p0, torch.cat([kv, gate], dim=-1))
    first, last = p0 // ratio, (p0 + T) // ratio
    if last > first:
        pooled = _emit_windows(proj, w[prefix + "ape"], first, last, ratio, overlap, width)
        normed = rms_norm(pooled, w[prefix + "norm.weight"], cfg.rms_norm_eps)
        positions = torch.arange(first, last, device=x.device) * ratio  # RoPE at each window's first token
        cos, sin = cos_sin(rope, positions)
        rows.write(first, apply_rope(normed, cos, sin))
    return last


@dataclass
class _Step:
    """What the attention of one layer knows after writing this step's rows (shared by both key paths)."""

    layer: int
    x: torch.Tensor  # block input [T, hidden]
    q_res: torch.Tensor  # q_lora residual [T, q_lora]
    positions: torch.Tensor  # [T]
    p0: int  # first of the T positions
    lo: int  # oldest raw position any of the T queries sees
    n_rows: int  # compressed rows emitted so far
    cos: torch.Tensor
    sin: torch.Tensor
    w: dict[str, torch.Tensor]
    cfg: ModelConfig
    cache: ModelCache

    @property
    def st(self) -> LayerState:
        return self.cache.layers[self.layer]

    @property
    def kind(self) -> str:
        return self.cfg.attn_kinds[self.layer]

    @property
    def sinks(self) -> torch.Tensor:
        return self.w[f"layers.{self.layer}.attn.attn_sink"]

    def indexer_query(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries [T, H, D] as the cache scores them, and head weights [T, H] (x H^-1/2)."""
        cfg, p = self.cfg, f"layers.{self.layer}.attn.indexer."
        q = linear(self.q_res, self.w[p + "wq_b.weight"]).view(-1, cfg.index_n_heads, cfg.index_head_dim)
        q = self.cache.indexer_query(apply_rope(q, self.cos, self.sin))
        return q, linear(self.x, self.w[p + "weights_proj.weight"]).float() * cfg.index_n_heads**-0.5


def attention(x: torch.Tensor, w: dict[str, torch.Tensor], layer: int, positions: torch.Tensor, cfg: ModelConfig,
              cache: ModelCache, rope: tuple[torch.Tensor, float]) -> torch.Tensor:
    """One attention block for the T tokens at ``positions`` (consecutive, starting at cache.length)."""
    p = f"layers.{layer}.attn."
    st: LayerState = cache.layers[layer]
    kind, ratio = cfg.attn_kinds[layer], cfg.compress_ratios[layer]
    T, nh, hd = x.shape[0], cfg.num_heads, cfg.head_dim
    p0 = cache.length  # the first position, as a host int (reading positions[0] would sync the GPU)
    cos, sin = cos_sin(rope, positions)

    q_res = rms_norm(linear(x, w[p + "wq_a.weight"]), w[p + "q_norm.weight"], cfg.rms_norm_eps)
    q = linear(q_res, w[p + "wq_b.weight"]).view(T, nh, hd)
    q = apply_rope(rms_norm(q, None, cfg.rms_norm_eps), cos, sin).float()
    kv = rms_norm(linear(x, w[p + "wkv.weight"]), w[p + "kv_norm.weight"], cfg.rms_norm_eps)
    st.raw.write(p0, apply_rope(kv, cos, sin))

    n_rows = 0
    if kind in (CSA, HCA):
        assert st.comp_proj is not None and st.comp_rows is not None
        n_rows = _compress(x, w, p + "compressor.", st.comp_proj, st.comp_rows, p0, ratio, kind == CSA, hd, cfg,
                           rope)
        if kind == CSA:
            assert st.idx_proj is not None and st.idx_rows is not None
            _compress(x, w, p + "indexer.compressor.", st.idx_proj, st.idx_rows, p0, ratio, True,
                      cfg.index_head_dim, cfg, rope)
    step = _Step(layer, x, q_res, positions, p0, max(0, p0 - cfg.sliding_window + 1), n_rows, cos, sin, w, cfg,
                 cache)
    if T == 1 and cache.mode != "float" and use_triton(x.device):
        out = _decode_triton(step, q[0])[None]
    else:
        out = _attend_reference(step, q)
    out = apply_rope(out, cos, sin, inverse=True).to(x.dtype)
    grouped = grouped_linear(out.reshape(T, cfg.o_groups, -1), w[p + "wo_a.weight"], cfg.o_groups)
    return linear(grouped.reshape(T, -1), w[p + "wo_b.weight"])


def _decode_triton(step: _Step, q: torch.Tensor) -> torch.Tensor:
    """One query [H, D] from stored rows with the Triton kernels: [H, D] float32 before the inverse RoPE."""
    cfg, st, n_rows = step.cfg, step.st, step.n_rows
    packed = step.cache.mode == "packed"
    dev = q.device
    window = torch.arange(step.lo, step.p0 + 1, device=dev) % st.raw.capacity
    sources = [(st.raw.data, window)]
    if step.kind == HCA:
        sources.append((st.comp_rows.data, torch.arange(n_rows, device=dev)))
    elif step.kind == CSA and n_rows:
        qi, wi = step.indexer_query()
        scores = indexer_scores_triton(qi[0], wi[0], st.idx_rows.data, n_rows, packed)
        index, valid = select_topk_blocked(scores, n_rows, cfg.index_topk)
        sources.append((st.comp_rows.data, torch.where(valid, index, -1)))
    return attention_decode_triton(q.float(), sources, step.sinks, cfg.head_dim**-0.5, cfg.nope_head_dim, packed)


def _attend_reference(step: _Step, q: torch.Tensor) -> torch.Tensor:
    """The torch reference for T queries [T, H, D]: [T, H, D] float32 before the inverse RoPE."""
    T, nh, hd = q.shape
    cfg, st, n_rows, dev = step.cfg, step.st, step.n_rows, q.device
    p0 = step.p0
    # keys shared by all T queries (window rows; HCA rows), with per-query visibility
    shared = [st.raw.read(step.lo, p0 + T)]
    key_pos = torch.arange(step.lo, p0 + T, device=dev)
    t = step.positions[:, None]
    visible = [(key_pos[None, :] <= t) & (key_pos[None, :] > t - cfg.sliding_window)]
    picked = picked_ok = None  # CSA: rows gathered per query [T, k, hd] and their validity [T, k]
    if step.kind in (CSA, HCA):
        row_visible = torch.arange(n_rows, device=dev)[None, :] < (t + 1) // cfg.compress_ratios[step.layer]
        if step.kind == HCA:
            shared.append(st.comp_rows.read(0, n_rows))
            visible.append(row_visible)
        else:
            qi, wi = step.indexer_query()
            scores = indexer_scores(qi, wi, st.idx_rows.read, n_rows)
            index, picked_ok = select_topk(scores, row_visible, cfg.index_topk)
            picked = st.comp_rows.gather(index)
            if step.cache.selections is not None:
                step.cache.selections.append((step.layer, step.positions, index, picked_ok))

    keys = torch.cat(shared, dim=0)  # [K, hd]
    scale = hd**-0.5
    logits = torch.einsum("thd,kd->thk", q, keys) * scale
    parts = [logits.masked_fill(~torch.cat(visible, dim=1)[:, None, :], float("-inf"))]
    if picked is not None:
        extra = torch.einsum("thd,tkd->thk", q, picked) * scale
        parts.append(extra.masked_fill(~picked_ok[:, None, :], float("-inf")))
    parts.append(step.sinks.float().view(1, nh, 1).expand(T, nh, 1))
    probs = torch.cat(parts, dim=-1).softmax(dim=-1)
    out = torch.einsum("thk,kd->thd", probs[..., : keys.shape[0]], keys)
    if picked is not None:
        out = out + torch.einsum("thk,tkd->thd", probs[..., keys.shape[0] : -1], picked)
    return out
