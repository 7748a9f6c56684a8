"""Attention of one layer: shared-KV MQA over a sliding window plus (CSA/HCA) compressed rows.

Per query at position t the keys are (K = V, one head shared by all query heads):
- the raw rows of positions t-W+1 .. t (sliding window W, the current token included);
- HCA: every compressed row whose window has closed (row w covers tokens [w*r, w*r+r-1] and
  becomes visible at t = w*r + r - 1);
- CSA: the top-k of the visible compressed rows by the Lightning indexer's score
  (exact selection: ties go to the lower row index).
A per-head sink logit joins the softmax. The output's RoPE dims get the inverse rotation, then the
grouped output projection (G groups -> o_lora each -> hidden).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds4x.config import CSA, HCA, ModelConfig
from ds4x.kernels.linear import grouped_linear, linear
from ds4x.model.cache import LayerState, ModelCache
from ds4x.model.norms import rms_norm
from ds4x.model.rope import apply_rope, cos_sin


def select_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask [T, N] of the k highest visible scores per row; ties go to the lower index.

    A stable descending sort keeps equal scores in index order, so the first k are exactly the
    set the tie rule defines; invisible entries are never selected even when fewer than k are visible.
    """
    n = scores.shape[-1]
    chosen = torch.zeros_like(visible)
    if n == 0 or k <= 0:
        return chosen
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., : min(k, n)]
    chosen.scatter_(-1, order, True)
    return chosen & visible


def _emit_windows(
    kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, first: int, last: int, ratio: int, overlap: bool,
    width: int,
) -> torch.Tensor:
    """Compressed (un-normalised) rows for windows first..last-1 from per-position projections.

    Each window softmax-pools its positions per channel (gate + learned position bias). With
    ``overlap`` (CSA) a row pools 2*ratio slots: the previous window's "a" lane (channels [:width])
    and its own window's "b" lane (channels [width:]); window 0 has no previous window.
    """
    n = last - first
    k = kv[first * ratio : last * ratio].view(n, ratio, -1)
    g = gate[first * ratio : last * ratio].view(n, ratio, -1) + ape.float()
    if overlap:
        prev_k = torch.zeros(n, ratio, width, dtype=k.dtype, device=k.device)
        prev_g = torch.full((n, ratio, width), float("-inf"), dtype=g.dtype, device=g.device)
        start = max(first, 1)
        if last > start:
            lo, hi = (start - 1) * ratio, (last - 1) * ratio
            prev_k[start - first :] = kv[lo:hi, :width].view(-1, ratio, width)
            prev_g[start - first :] = (gate[lo:hi, :width].view(-1, ratio, width) + ape[:, :width].float())
        k = torch.cat([prev_k, k[..., width:]], dim=1)
        g = torch.cat([prev_g, g[..., width:]], dim=1)
    return (k * g.softmax(dim=1)).sum(dim=1)


def _compress(
    x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, kv_store: torch.Tensor, gate_store: torch.Tensor,
    rows: torch.Tensor, p0: int, ratio: int, overlap: bool, width: int, cfg: ModelConfig,
    rope: tuple[torch.Tensor, float], finish: Callable[[torch.Tensor], torch.Tensor],
) -> int:
    """Store this chunk's compressor projections, emit rows for windows that closed; return row count."""
    T = x.shape[0]
    kv_store[p0 : p0 + T] = linear(x, w[prefix + "wkv.weight"]).float()
    gate_store[p0 : p0 + T] = linear(x, w[prefix + "wgate.weight"]).float()
    first, last = p0 // ratio, (p0 + T) // ratio
    if last > first:
        pooled = _emit_windows(kv_store, gate_store, w[prefix + "ape"], first, last, ratio, overlap, width)
        normed = rms_norm(pooled, w[prefix + "norm.weight"], cfg.rms_norm_eps)
        positions = torch.arange(first, last, device=x.device) * ratio  # RoPE at each window's first token
        cos, sin = cos_sin(rope, positions)
        rows[first:last] = finish(apply_rope(normed, cos, sin))
    return last


def indexer_scores(
    q_res: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, w: dict[str, torch.Tensor], prefix: str,
    cos: torch.Tensor, sin: torch.Tensor, cfg: ModelConfig, cache: ModelCache,
) -> torch.Tensor:
    """Lightning indexer score [T, N] = sum_h w_h * relu(q_h . k) for the T queries and N keys."""
    T = x.shape[0]
    q = linear(q_res, w[prefix + "wq_b.weight"]).view(T, cfg.index_n_heads, cfg.index_head_dim)
    q = cache.indexer_row(apply_rope(q, cos, sin))
    dots = torch.einsum("thd,nd->thn", q, keys)
    weights = linear(x, w[prefix + "weights_proj.weight"]).float() * cfg.index_n_heads**-0.5
    return (dots.relu() * cfg.index_head_dim**-0.5 * weights.unsqueeze(-1)).sum(dim=1)


def attention(
    x: torch.Tensor, w: dict[str, torch.Tensor], layer: int, positions: torch.Tensor, cfg: ModelConfig,
    cache: ModelCache, rope: tuple[torch.Tensor, float],
) -> torch.Tensor:
    """One attention block for the T tokens at ``positions`` (consecutive, starting at cache.length)."""
    p = f"layers.{layer}.attn."
    st: LayerState = cache.layers[layer]
    kind, ratio = cfg.attn_kinds[layer], cfg.compress_ratios[layer]
    T, nh, hd = x.shape[0], cfg.num_heads, cfg.head_dim
    p0 = int(positions[0])
    cos, sin = cos_sin(rope, positions)

    q_res = rms_norm(linear(x, w[p + "wq_a.weight"]), w[p + "q_norm.weight"], cfg.rms_norm_eps)
    q = linear(q_res, w[p + "wq_b.weight"]).view(T, nh, hd)
    q = apply_rope(rms_norm(q, None, cfg.rms_norm_eps), cos, sin)
    kv = rms_norm(linear(x, w[p + "wkv.weight"]), w[p + "kv_norm.weight"], cfg.rms_norm_eps)
    st.raw[p0 : p0 + T] = cache.kv_row(apply_rope(kv, cos, sin))

    # raw window keys and their visibility
    lo = max(0, p0 - cfg.sliding_window + 1)
    keys = [st.raw[lo : p0 + T]]
    key_pos = torch.arange(lo, p0 + T, device=x.device)
    t = positions[:, None]
    visible = [(key_pos[None, :] <= t) & (key_pos[None, :] > t - cfg.sliding_window)]

    if kind in (CSA, HCA):
        n_rows = _compress(x, w, p + "compressor.", st.comp_kv, st.comp_gate, st.comp_rows, p0, ratio,
                           kind == CSA, hd, cfg, rope, cache.kv_row)
        row_visible = torch.arange(n_rows, device=x.device)[None, :] < (t + 1) // ratio
        if kind == CSA:
            ih = cfg.index_head_dim
            _compress(x, w, p + "indexer.compressor.", st.idx_kv, st.idx_gate, st.idx_rows, p0, ratio, True,
                      ih, cfg, rope, cache.indexer_row)
            scores = indexer_scores(q_res, x, st.idx_rows[:n_rows], w, p + "indexer.", cos, sin, cfg, cache)
            row_visible = select_topk(scores, row_visible, cfg.index_topk)
        keys.append(st.comp_rows[:n_rows])
        visible.append(row_visible)

    k = torch.cat(keys, dim=0)  # [K, hd]
    mask = torch.cat(visible, dim=1)  # [T, K]
    logits = torch.einsum("thd,kd->thk", q.float(), k) * hd**-0.5
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sinks = w[p + "attn_sink"].float().view(1, nh, 1).expand(T, nh, 1)
    probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.einsum("thk,kd->thd", probs, k)
    out = apply_rope(out, cos, sin, inverse=True).to(x.dtype)

    grouped = grouped_linear(out.reshape(T, cfg.o_groups, -1), w[p + "wo_a.weight"], cfg.o_groups)
    return linear(grouped.reshape(T, -1), w[p + "wo_b.weight"])
