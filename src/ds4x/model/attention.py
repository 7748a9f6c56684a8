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

Batching: one call serves the tokens of several caches (``Segment``s of the batch). The projections, norms,
RoPE and output projection are token-local and run over the whole batch; writing rows, the compressors,
indexer selection and attention over stored rows run per cache, except in a decode step on the Triton path:
there the caches' stores are read as batches of rings (`ds4x.model.cache.batch_layer`: the caches of a
`CachePool`, or a single cache), and each of those kernels runs once per layer for all of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache

import torch

from ds4x.config import CSA, HCA, ModelConfig
from ds4x.kernels import compressor
from ds4x.kernels.attention import Slots, attention_decode_triton, attention_prefill_triton
from ds4x.kernels.branches import Branch, fork_point
from ds4x.kernels.dispatch import use_triton
from ds4x.kernels.indexer import indexer_scores, indexer_scores_triton
from ds4x.kernels.linear import grouped_linear, linear, rowwise_enabled
from ds4x.kernels.select import scored_topk_radix, select_topk
from ds4x.model.cache import LayerState, ModelCache, RowStore, batch_layer
from ds4x.model.norms import rms_norm
from ds4x.model.projections import project, stacked_name
from ds4x.model.rope import apply_rope, cos_sin, rms_norm_rope

# capture a step's critical work before the large pieces beside it (`fork_point`); False: the order before (A/B)
LAUNCH_CRITICAL_FIRST = True
_SPAN: ContextVar[int | None] = ContextVar("ds4x_position_span", default=None)


@contextmanager
def position_span(span: int | None) -> Iterator[None]:
    """Within the block, decode steps (the Triton path) may assume every query's position is below ``span`` (a
    multiple of every compression ratio; None: any position the caches hold): HCA is offered only the compressed
    rows closed before it and CSA scores and selects over only that prefix of its indexer store, so a step
    captured for a long cache at a short position launches the kernels of a short one. The caller keeps the
    promise (`ds4x.runtime.decode_graph.CapturedStep` replays the step of the smallest span above its positions)."""
    token = _SPAN.set(span)
    try:
        yield
    finally:
        _SPAN.reset(token)


def _span_rows(capacity: int, ratio: int) -> int:
    """The compressed rows a decode step offers from a store of ``capacity``: those closed below the span."""
    span = _SPAN.get()
    return capacity if span is None else min(capacity, span // ratio)


def _emit_windows(proj: RowStore, ape: torch.Tensor, windows: torch.Tensor, last: torch.Tensor, ratio: int,
                  overlap: bool, width: int) -> torch.Tensor:
    """Compressed (un-normalised) rows for ``windows`` [n] from the per-position projections up to position ``last``.

    ``proj`` rows are [kv | gate]. Each window softmax-pools its positions per channel (gate + learned
    position bias). With ``overlap`` (CSA) a row pools 2*ratio slots: the previous window's "a" lane
    (channels [:width]) and its own window's "b" lane (channels [width:]); window 0 has no previous one.
    Positions past ``last`` (a window still open) or before 0 take no part, so a closed window gives the same
    bits whether it is emitted once or recomputed every step while it fills. Indices stay on the device.
    """
    pos = windows[:, None] * ratio + torch.arange(ratio, device=windows.device)  # [n, ratio]
    k, g = proj.gather(pos).chunk(2, dim=-1)
    live = (pos <= last)[..., None]
    k = torch.where(live, k, 0.0)
    g = torch.where(live, g + ape.float(), float("-inf"))
    if overlap:
        prev = pos - ratio
        pk, pg = proj.gather(prev).chunk(2, dim=-1)
        prev_live = (prev >= 0)[..., None]
        k = torch.cat([torch.where(prev_live, pk[..., :width], 0.0), k[..., width:]], dim=1)
        g = torch.cat([torch.where(prev_live, pg[..., :width] + ape[:, :width].float(), float("-inf")),
                       g[..., width:]], dim=1)
    return (k * g.softmax(dim=1)).sum(dim=1)


def _compress(projected: torch.Tensor, proj: RowStore, rows: RowStore, ape: torch.Tensor, norm: torch.Tensor,
              positions: torch.Tensor, windows: torch.Tensor | None, ratio: int, overlap: bool, width: int,
              cfg: ModelConfig, rope: tuple[torch.Tensor, float]) -> None:
    """Store one cache's compressor projections [T, kv | gate] at ``positions`` and (re)write the compressed rows
    of ``windows`` from the projections up to the last of them. With batches of rings (a decode step over B
    caches, `batch_layer`) row b, its position and window b belong to cache b."""
    proj.write_at(positions, projected)
    if windows is None:
        return
    batched = proj.data.dim() == 3
    last = positions if batched else positions[-1:]
    inv_freq, magnitude = rope
    if use_triton(projected.device) and compressor.supported(proj.data, inv_freq.shape[0]):
        rows.write_at(windows, compressor.emit_windows_fused(proj.data, windows, last, ape, norm, inv_freq,
                                                             magnitude, ratio, overlap, width, cfg.rms_norm_eps))
        return
    rings = ([RowStore(proj.capacity, proj.codec, proj.data.device, d) for d in proj.data] if batched else [proj])
    pooled = torch.cat([_emit_windows(ring, ape, windows[i : i + 1] if batched else windows, last[i if batched else 0],
                                      ratio, overlap, width) for i, ring in enumerate(rings)])
    normed = rms_norm(pooled, norm, cfg.rms_norm_eps)
    cos, sin = cos_sin(rope, windows * ratio)  # RoPE at each window's first token
    rows.write_at(windows, apply_rope(normed, cos, sin))


def _compressor_projection(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The compressor's per-token [kv | gate] projections in the working dtype (token-local: runs over the whole
    batch; the float32 ring write converts them)."""
    names = (prefix + "wkv.weight", prefix + "wgate.weight")
    if stacked_name(names) in w:  # already [kv | gate] side by side
        return linear(x, w[stacked_name(names)])
    return torch.cat(project(x, w, names), dim=-1)


class PassPositions:
    """The positions [N] of one pass and the window indices every layer of a compression ratio derives from them,
    each computed on first use and kept for the pass (a decode step would otherwise launch them per layer)."""

    def __init__(self, positions: torch.Tensor):
        self.positions = positions
        self._derived: dict[tuple[str, int], torch.Tensor] = {}

    def windows(self, ratio: int) -> torch.Tensor:
        """The window holding each position: ``positions // ratio``."""
        if ("window", ratio) not in self._derived:
            self._derived["window", ratio] = self.positions // ratio
        return self._derived["window", ratio]

    def closed(self, ratio: int) -> torch.Tensor:
        """The windows closed by each position: ``(positions + 1) // ratio``."""
        if ("closed", ratio) not in self._derived:
            self._derived["closed", ratio] = (self.positions + 1) // ratio
        return self._derived["closed", ratio]


@lru_cache(maxsize=16)
def _float32_scalar(value: float, device: torch.device) -> torch.Tensor:
    """``value`` as a float32 tensor of one element on ``device`` (cached: never built inside a CUDA graph)."""
    return torch.tensor([value], dtype=torch.float32, device=device)


@dataclass
class Segment:
    """One cache's share of a batched pass: rows [start, start + length) of the batch, at positions
    cache.length .. cache.length + length - 1."""

    cache: ModelCache
    start: int
    length: int
    # its positions as a tensor of their own (16-byte aligned: Triton compiles a kernel again for a pointer that
    # is not, as a slice of the batch's positions at an odd row would be); None: the batch's positions[rows]
    positions: torch.Tensor | None = None

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


@dataclass
class _Step:
    """What the attention of one layer knows about one cache after writing this step's rows (shared by both
    key paths)."""

    layer: int
    positions: torch.Tensor  # [T]
    p0: int  # first of the T positions
    lo: int  # oldest raw position any of the T queries sees
    n_rows: int  # compressed rows emitted so far
    index_q: torch.Tensor | None  # CSA: indexer queries [T, H, D] as the cache scores them
    index_w: torch.Tensor | None  # CSA: indexer head weights [T, H] (x H^-1/2)
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


def attention(x: torch.Tensor, w: dict[str, torch.Tensor], layer: int, positions: torch.Tensor, cfg: ModelConfig,
              segments: list[Segment], rope: tuple[torch.Tensor, float],
              rope_at_positions: tuple[torch.Tensor, torch.Tensor] | None = None,
              reference: bool = False, derived: PassPositions | None = None) -> torch.Tensor:
    """One attention block for a batch of N tokens x [N, hidden] at ``positions`` [N].

    ``segments`` split the batch by cache (each segment's positions are consecutive from its cache.length).
    Token-local work (projections, norms, RoPE, the output projection) runs over all N rows at once; the
    cache writes, compressors, indexer selection and attention over stored rows run per segment.
    ``rope_at_positions`` is ``cos_sin(rope, positions)`` when the caller already has it (it is the same for
    every layer of a rope kind). Multi-token segments of a packed cache on CUDA attend with the Triton prefill
    kernel (TF32 products; on Hopper the decode kernel in one pass) unless ``reference`` asks for the torch path.
    ``derived``: the pass's `PassPositions` of ``positions`` (shared by the layers; a new one otherwise).
    """
    p = f"layers.{layer}.attn."
    kind, ratio = cfg.attn_kinds[layer], cfg.compress_ratios[layer]
    N, nh, hd = x.shape[0], cfg.num_heads, cfg.head_dim
    cos, sin = rope_at_positions if rope_at_positions is not None else cos_sin(rope, positions)

    ip = p + "indexer."
    dev = x.device

    def compressor_input() -> torch.Tensor | None:
        return _compressor_projection(x, w, p + "compressor.") if kind in (CSA, HCA) else None

    def indexer_input() -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if kind != CSA:
            return None, None
        # times a float32 [1] tensor: the product is promoted to float32 in one launch (.float() then * was two)
        return (_compressor_projection(x, w, ip + "compressor."),
                linear(x, w[ip + "weights_proj.weight"]) * _float32_scalar(cfg.index_n_heads**-0.5, dev))

    # in a captured step these are graph branches (`Branch`), joined where the decode path needs them: the
    # compressor and indexer projections, the attention query's second projection and the KV row's norm + RoPE
    # beside the indexer query (on the capturing stream, which goes on to the selection)
    comp_b, idx_b = Branch(dev, compressor_input), Branch(dev, indexer_input)
    q_low, kv_low = project(x, w, (p + "wq_a.weight", p + "wkv.weight"))
    kv_b = Branch(dev, lambda: rms_norm_rope(kv_low, w[p + "kv_norm.weight"], cfg.rms_norm_eps, cos, sin))
    q_res = rms_norm(q_low, w[p + "q_norm.weight"], cfg.rms_norm_eps)

    def attention_q() -> torch.Tensor:  # working dtype: the kernels read it as is
        return rms_norm_rope(linear(q_res, w[p + "wq_b.weight"]).view(N, nh, hd), None, cfg.rms_norm_eps, cos, sin)

    # the attention query's wq_b (a 35 MB matrix: its grid fills the GPU) is read only by the attention, after the
    # selection: it forks from q_res but is captured after the indexer query, which the selection waits for
    q_ready = fork_point(dev)
    q_b = None if LAUNCH_CRITICAL_FIRST else Branch(dev, attention_q)
    index_q = None
    if kind == CSA:
        index_q = apply_rope(linear(q_res, w[ip + "wq_b.weight"]).view(N, cfg.index_n_heads, cfg.index_head_dim),
                             cos, sin)
    q_b = q_b or Branch(dev, attention_q, after=q_ready)
    inputs = _LayerInputs(q_b, kv_b, comp_b, idx_b, index_q)

    pieces: list[tuple[int, torch.Tensor]] = []  # (first segment number, the outputs of its rows), in any order
    done: set[int] = set()
    decode = [i for i, seg in enumerate(segments)
              if seg.length == 1 and seg.cache.mode != "float" and use_triton(dev)]
    derived = derived if derived is not None else PassPositions(positions)
    for group in _decode_groups([segments[i] for i in decode], decode, layer):
        rows = group.rows
        out = _decode_triton(group.st, group.cache, positions[rows], derived.windows(ratio)[rows] if ratio else None,
                             derived.closed(ratio)[rows] if kind == CSA else None, inputs, rows, w, layer, cfg, rope,
                             (cos[rows], sin[rows], x.dtype))
        n = group.numbers
        if isinstance(rows, slice) and n == list(range(n[0], n[0] + len(n))):
            pieces.append((n[0], out))  # consecutive segments and rows: one piece
        else:
            pieces.extend(zip(n, out.split(1), strict=True))
        done.update(n)
    # every branch joins the capturing stream (a capture cannot end otherwise); the other segments read them here
    q, kv, comp, (idx, index_w) = q_b.join(), kv_b.join(), comp_b.join(), idx_b.join()
    for i, seg in enumerate(segments):
        if i in done:
            continue
        cache, r = seg.cache, seg.rows
        st: LayerState = cache.layers[layer]
        pos = seg.positions if seg.positions is not None else positions[r]
        st.raw.write_at(pos, kv[r])
        p0 = cache.length  # host int (reading positions[0] would sync the GPU)
        windows = None  # the windows that close in this pass, known from the host's position
        if ratio and (p0 + seg.length) // ratio > p0 // ratio:
            windows = torch.arange(p0 // ratio, (p0 + seg.length) // ratio, device=x.device)
        if comp is not None:
            assert st.comp_proj is not None and st.comp_rows is not None
            _compress(comp[r], st.comp_proj, st.comp_rows, w[p + "compressor.ape"], w[p + "compressor.norm.weight"],
                      pos, windows, ratio, kind == CSA, hd, cfg, rope)
        if idx is not None:
            assert st.idx_proj is not None and st.idx_rows is not None
            _compress(idx[r], st.idx_proj, st.idx_rows, w[p + "indexer.compressor.ape"],
                      w[p + "indexer.compressor.norm.weight"], pos, windows, ratio, True, cfg.index_head_dim, cfg,
                      rope)
        step = _Step(layer, pos, p0, max(0, p0 - cfg.sliding_window + 1), (p0 + seg.length) // ratio if ratio else 0,
                     None if index_q is None else cache.indexer_query(index_q[r]),
                     None if index_w is None else index_w[r], w, cfg, cache)
        if not reference and cache.mode == "packed" and use_triton(x.device):
            pieces.append((i, apply_rope(_prefill_triton(step, q[r]), cos[r], sin[r], inverse=True, dtype=x.dtype)))
        else:
            pieces.append((i, apply_rope(_attend_reference(step, q[r]), cos[r], sin[r], inverse=True,
                                         dtype=x.dtype)))
    out = pieces[0][1] if len(pieces) == 1 else torch.cat([t for _, t in sorted(pieces, key=lambda piece: piece[0])])
    grouped = grouped_linear(out.reshape(N, cfg.o_groups, -1), w[p + "wo_a.weight"], cfg.o_groups)
    return linear(grouped.reshape(N, -1), w[p + "wo_b.weight"])


@dataclass
class _DecodeGroup:
    """Decode segments (one token each) whose caches' stores batch into one view (`batch_layer`)."""

    numbers: list[int]  # their segment numbers
    rows: slice | torch.Tensor  # their rows of the batch
    st: LayerState  # the layer's stores as batches of rings
    cache: ModelCache  # the first (all share the mode)


def _decode_groups(segs: list[Segment], numbers: list[int], layer: int) -> list[_DecodeGroup]:
    """All decode segments in one group when their caches are slots 0..B-1 of one pool (the server's decode
    step), else one group per segment."""
    st = batch_layer([s.cache for s in segs], layer) if segs else None
    parts = [list(range(len(segs)))] if st is not None else [[j] for j in range(len(segs))]
    groups = []
    for part in parts:
        starts = [segs[j].start for j in part]
        rows: slice | torch.Tensor = slice(starts[0], starts[0] + len(part))
        if starts != list(range(starts[0], starts[0] + len(part))):
            rows = torch.tensor(starts, device=segs[0].cache.device)
        group_st = st if st is not None else batch_layer([segs[part[0]].cache], layer)
        assert group_st is not None
        groups.append(_DecodeGroup([numbers[j] for j in part], rows, group_st, segs[part[0]].cache))
    return groups


@dataclass
class _LayerInputs:
    """A layer's per-token inputs to its cache work and attention, as `Branch`es where a captured step computes
    them beside the capturing stream (joined where they are read)."""

    q: Branch[torch.Tensor]  # queries [T, H, D] after norm + RoPE
    kv: Branch[torch.Tensor]  # the KV rows [T, D] after norm + RoPE
    comp: Branch[torch.Tensor | None]  # compressor projections [T, kv | gate] (CSA / HCA)
    idx: Branch[tuple[torch.Tensor | None, torch.Tensor | None]]  # CSA: indexer compressor projections, head weights
    index_q: torch.Tensor | None  # CSA: indexer queries [T, H, D] after RoPE, before the cache's rounding


def _decode_triton(st: LayerState, cache: ModelCache, pos: torch.Tensor, windows: torch.Tensor | None,
                   n_rows: torch.Tensor | None, inputs: _LayerInputs, rows: slice | torch.Tensor,
                   w: dict[str, torch.Tensor], layer: int, cfg: ModelConfig, rope: tuple[torch.Tensor, float],
                   inverse_rope: tuple[torch.Tensor, torch.Tensor, torch.dtype]) -> torch.Tensor:
    """One token for each of B caches (their stores batched: ``st``, rings [B, ...]; ``cache`` the first of them)
    with the Triton kernels, each kernel launched once for all B: the row writes and compressors, then the queries
    (``inputs`` at ``rows``) [B, H, D] -> [B, H, D] after the inverse RoPE (``inverse_rope``: the queries' cos /
    sin and the output dtype; applied by the attention's merge launch). Each cache's rows are
    bit-identical to a step of that cache alone. ``windows`` / ``n_rows``: the window of each position and (CSA)
    the windows closed by it (`PassPositions`).

    Only device values describe the step (positions, row counts), and every shape is fixed by the caches'
    capacities, so a captured step replays at any positions: the window holding the new position is re-emitted
    each step (its row is read only once closed), the attention window is its W slots (-1 before position 0), HCA
    offers all compressed slots with the unwritten ones at -1, CSA scores the whole indexer store with the row
    count read on the device; within `position_span` only the compressed rows below the span."""
    p = f"layers.{layer}.attn."
    kind, ratio = cfg.attn_kinds[layer], cfg.compress_ratios[layer]
    packed = cache.mode == "packed"

    def write_compressed() -> None:
        comp = inputs.comp.join()
        if comp is not None:
            assert st.comp_proj is not None and st.comp_rows is not None
            _compress(comp[rows], st.comp_proj, st.comp_rows, w[p + "compressor.ape"], w[p + "compressor.norm.weight"],
                      pos, windows, ratio, kind == CSA, cfg.head_dim, cfg, rope)

    def write_raw() -> None:
        st.raw.write_at(pos, inputs.kv.join()[rows])

    # in a captured step the rows' writes are branches beside the indexer and the selection (which stays on the
    # capturing stream: its programs meet at grid barriers); the compressor's chain (ring write, emit, row pack)
    # is the longer and waits for nothing the raw row needs, so it is a branch of its own, captured first
    writes = ([Branch(pos.device, write_compressed), Branch(pos.device, write_raw)] if LAUNCH_CRITICAL_FIRST
              else [Branch(pos.device, lambda: (write_raw(), write_compressed()))])
    index = None
    if kind == CSA:
        idx, index_w = inputs.idx.join()
        assert idx is not None and index_w is not None and inputs.index_q is not None
        assert st.idx_rows is not None and st.idx_proj is not None and n_rows is not None  # [B]: closed windows
        _compress(idx[rows], st.idx_proj, st.idx_rows, w[p + "indexer.compressor.ape"],
                  w[p + "indexer.compressor.norm.weight"], pos, windows, ratio, True, cfg.index_head_dim, cfg, rope)
        keys = st.idx_rows.data
        keys = keys.narrow(-2, 0, _span_rows(keys.shape[-2], ratio))  # compressed rows never wrap: a prefix
        index = scored_topk_radix(cache.indexer_query(inputs.index_q[rows]), index_w[rows], keys, n_rows, packed,
                                  cfg.index_topk)  # unfilled slots: -1, no row
    for b in writes:
        b.join()
    sources: list[tuple[torch.Tensor, Slots | torch.Tensor]] = [
        (st.raw.data, Slots(cfg.sliding_window, position=pos, ring=st.raw.capacity))]
    if kind == HCA:
        assert st.comp_rows is not None
        sources.append((st.comp_rows.data, Slots(_span_rows(st.comp_rows.capacity, ratio), position=pos,
                                                 ratio=ratio)))
    elif kind == CSA:
        assert st.comp_rows is not None and index is not None
        sources.append((st.comp_rows.data, index))
    # a batch of sessions may split each one's rows by the batch size unless the caller asked for batch invariance
    return attention_decode_triton(inputs.q.join()[rows], sources, w[p + "attn_sink"], cfg.head_dim**-0.5,
                                   cfg.nope_head_dim, packed, inverse_rope=inverse_rope,
                                   batch_splits=not rowwise_enabled())


def _csa_selection(step: _Step, packed_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The T queries' top-k compressed rows (index [T, k], valid [T, k]) by the torch indexer, or with
    ``packed_scores`` by the Triton one on the packed rows (per row the decode step's bits); recorded when the
    cache collects selections."""
    assert step.index_q is not None and step.index_w is not None
    ratio = step.cfg.compress_ratios[step.layer]
    closed = (step.positions + 1) // ratio
    row_visible = torch.arange(step.n_rows, device=step.positions.device)[None, :] < closed[:, None]
    if packed_scores:
        scores = indexer_scores_triton(step.index_q, step.index_w, step.st.idx_rows.data[: step.n_rows], closed,
                                       True)
    else:
        scores = indexer_scores(step.index_q, step.index_w, step.st.idx_rows.read, step.n_rows)
    index, valid = select_topk(scores, row_visible, step.cfg.index_topk)
    if step.cache.selections is not None:
        step.cache.selections.append((step.layer, step.positions, index, valid))
    return index, valid


def _prefill_triton(step: _Step, q: torch.Tensor) -> torch.Tensor:
    """T queries [T, H, D] over the packed rows with the Triton prefill kernel: [T, H, D] float32 before the
    inverse RoPE."""
    cfg, st = step.cfg, step.st
    window = (st.raw.data, st.raw.capacity, cfg.sliding_window)
    args: dict = {}
    if step.kind == HCA:
        args = {"ratio": cfg.compress_ratios[step.layer], "n_rows": step.n_rows}
    elif step.kind == CSA:
        index, valid = _csa_selection(step, packed_scores=True)
        args = {"index": torch.where(valid, index, -1)}  # compressed rows never wrap (as in _decode_triton)
    return attention_prefill_triton(q, step.positions, window, st.comp_rows.data if args else None, step.sinks,
                                    cfg.head_dim**-0.5, cfg.nope_head_dim, **args)


def _attend_reference(step: _Step, q: torch.Tensor) -> torch.Tensor:
    """The torch reference for T queries [T, H, D]: [T, H, D] float32 before the inverse RoPE."""
    q = q.float()
    T, nh, hd = q.shape
    cfg, st, n_rows, dev = step.cfg, step.st, step.n_rows, q.device
    p0 = step.p0
    # keys shared by all T queries (window rows; HCA rows), with per-query visibility
    shared = [st.raw.read(step.lo, p0 + T)]
    key_pos = torch.arange(step.lo, p0 + T, device=dev)
    t = step.positions[:, None]
    visible = [(key_pos[None, :] <= t) & (key_pos[None, :] > t - cfg.sliding_window)]
    picked = picked_ok = None  # CSA: rows gathered per query [T, k, hd] and their validity [T, k]
    if step.kind == HCA:
        shared.append(st.comp_rows.read(0, n_rows))
        visible.append(torch.arange(n_rows, device=dev)[None, :] < (t + 1) // cfg.compress_ratios[step.layer])
    elif step.kind == CSA:
        index, picked_ok = _csa_selection(step)
        picked = st.comp_rows.gather(index)

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
