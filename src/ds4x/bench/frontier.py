"""Frontier decode benchmark (DESIGN §7): allocate the context, seed a deterministic cache at the frontier
(no prefill), 3 warm-ups, then the median of N timed decode steps; plus each compressed-attention kernel
per layer (a CUDA graph of the kernel for every layer of its kind, each on its own rows, after clearing L2:
`_per_layer_ms`), and the attention + indexer scoring + top-k of all compressed layers (each reading its own
rows) timed as one sequence, both launched eagerly and replayed from a CUDA graph (the GPU time without Python
launch gaps). The top-k is timed paired with its scoring, as the model runs them (the radix select's first digit
level counted by the indexer kernel: `ds4x.kernels.select.scored_topk_radix`), and reported as that pair less
the scoring alone.

The model is DeepSeek-V4-Flash at full attention shapes (43 layers, 64 heads x 512, indexer 64 x 128,
top-512, window 128, ratios 4/128, vocab 129280) with its MoE shrunk to fit next to the cache in bf16:
``experts`` routed experts (default 8 instead of 256, top-6 kept), weights random (seeded, generated on
the GPU). Attention, indexer and cache sizes are the real ones. With ``weights="q2"`` it is the whole model
instead: GGML blocks in the ds4 q2 mix (``ds4x.weights.synthetic_gguf``) with all 256 experts (about 81 GiB), or
``experts`` of them (128: 44 GiB, so it fits an 80 GB GPU; a token still takes 6).
On CUDA the decode steps replay the captured step (``ds4x.runtime.decode_graph``), as a session decodes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from ds4x.bench.variants import parse_variant, variant_applied
from ds4x.config import CSA, HCA, PRESETS, SLIDING, ModelConfig
from ds4x.formats import INDEXER_ROW_BYTES, kv_row_bytes
from ds4x.kernels.attention import Slots, attention_decode_triton
from ds4x.kernels.indexer import indexer_scores_triton
from ds4x.kernels.quant_matmul import int8_activation_types
from ds4x.kernels.select import (
    scored_topk_radix,
    select_topk_blocked,
    select_topk_keys,
    select_topk_radix,
    select_topk_threshold,
)
from ds4x.model.cache import ModelCache, RowStore
from ds4x.model.transformer import Transformer
from ds4x.runtime.decode_graph import make_decoder
from ds4x.weights.synthetic import synthetic_weights

COPY_BANDWIDTH = 4.26e12  # bytes/s, measured device-to-device copy on the H200 (read + write)
TOPK_VARIANTS = {"radix": select_topk_radix, "blocked": select_topk_blocked, "keys": select_topk_keys,
                 "threshold": select_topk_threshold}


@dataclass
class FrontierConfig:
    contexts: tuple[int, ...] = (131072, 262144, 524288, 1048576)
    steps: int = 50
    warmup: int = 3
    seed: int = 0
    experts: int | None = None  # routed experts: None = 8 for "bf16", all of the preset's for "q2"
    weights: str = "bf16"  # "bf16": the shrunk MoE above; "q2": the model in the ds4 q2 mix
    profile: bool = False  # also break one decode step down by kernel group (ds4x.bench.profile), CUDA only
    topk: str = "radix"
    ab: tuple[str, ...] = ()  # other top-k variants to alternate with, e.g. ("keys",)
    # module-switch variants ('NAME: pkg.module.attr=EXPR; ...', `ds4x.bench.variants`): each context measured with
    # the defaults and with each variant, in two alternating rounds; their rows marked "status": "variant"
    variants: tuple[str, ...] = ()
    preset: str = "flash"  # "tiny" runs the same code small (tests, CPU dry runs under the Triton interpreter)
    device: str = "cuda"


def _fill(store: RowStore, start: int, stop: int, dim: int, g: torch.Generator, scale: float = 1.0) -> None:
    chunk = 65536
    for a in range(start, stop, chunk):
        b = min(stop, a + chunk)
        store.write(a, torch.randn(b - a, dim, generator=g, device=g.device) * scale)


def seed_frontier(cache: ModelCache, length: int, seed: int) -> None:
    """Deterministic non-zero rows for every position a step at ``length`` reads; sets cache.length."""
    cfg = cache.cfg
    g = torch.Generator(device=cache.device).manual_seed(seed)
    for st, kind, ratio in zip(cache.layers, cfg.attn_kinds, cfg.compress_ratios, strict=True):
        _fill(st.raw, max(0, length - st.raw.capacity), length, cfg.head_dim, g)
        if kind == SLIDING:
            continue
        _fill(st.comp_rows, 0, length // ratio, cfg.head_dim, g)
        lanes = 2 if kind == CSA else 1
        _fill(st.comp_proj, max(0, length - st.comp_proj.capacity), length, 2 * lanes * cfg.head_dim, g, 0.5)
        if kind == CSA:
            _fill(st.idx_rows, 0, length // ratio, cfg.index_head_dim, g)
            _fill(st.idx_proj, max(0, length - st.idx_proj.capacity), length, 4 * cfg.index_head_dim, g, 0.5)
    cache.length = length


def _median_ms(fn, reps: int = 50) -> float:
    if not torch.cuda.is_available():  # CPU dry run: wall clock
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=reps, return_mode="median"))


def _attention_query_dtype(dev: torch.device) -> torch.dtype:
    """The dtype the model's decode step gives the attention its query in: its working dtype (bf16 on the GPU)."""
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def _attention_query(cfg: ModelConfig, g: torch.Generator, dev: torch.device) -> torch.Tensor:
    """A decode query [heads, head_dim] as the model's step gives it, so the kernels time the query path the step
    runs."""
    return torch.randn(cfg.num_heads, cfg.head_dim, generator=g, device=dev).to(_attention_query_dtype(dev))


def _layer_kernels(cache: ModelCache, layer: int, topk: str, g: torch.Generator) -> dict[str, Any]:
    """Closures running one layer's compressed-attention kernels at the cache's frontier."""
    cfg, st = cache.cfg, cache.layers[layer]
    dev, L = cache.device, cache.length
    q = _attention_query(cfg, g, dev)
    sinks = torch.randn(cfg.num_heads, generator=g, device=dev)
    position = torch.tensor([L], device=dev)  # the decoded token's position; slots as the model offers them
    window = Slots(cfg.sliding_window, position=position, ring=st.raw.capacity)
    scale, nope = cfg.head_dim**-0.5, cfg.nope_head_dim
    n_rows = L // cfg.compress_ratios[layer] if cfg.compress_ratios[layer] else 0
    out: dict[str, Any] = {"n_rows": n_rows}
    kind = cfg.attn_kinds[layer]
    if kind == CSA:
        from ds4x.formats import hadamard128, mxfp4_roundtrip

        qi = mxfp4_roundtrip(hadamard128(torch.randn(cfg.index_n_heads, cfg.index_head_dim, generator=g,
                                                     device=dev)), 32)
        wi = torch.randn(cfg.index_n_heads, generator=g, device=dev)
        scores = indexer_scores_triton(qi, wi, st.idx_rows.data, n_rows, True)
        index, valid = TOPK_VARIANTS[topk](scores, n_rows, cfg.index_topk)
        picked = torch.where(valid, index, -1)
        out["indexer"] = lambda: indexer_scores_triton(qi, wi, st.idx_rows.data, n_rows, True)
        out["indexer_plain"] = lambda: indexer_scores_triton(qi, wi, st.idx_rows.data, n_rows, True, ptx=False)
        # scoring then selection, as the model pairs them (the radix select's first level counted by the indexer)
        out["indexer_topk"] = {name: _scored_selection(qi, wi, st.idx_rows.data, n_rows, f, cfg.index_topk)
                               for name, f in TOPK_VARIANTS.items()}
        out["attention"] = lambda: attention_decode_triton(q, [(st.raw.data, window), (st.comp_rows.data, picked)],
                                                           sinks, scale, nope, True)
    elif kind == HCA:
        rows = Slots(st.comp_rows.capacity, position=position, ratio=cfg.compress_ratios[layer])
        out["attention"] = lambda: attention_decode_triton(q, [(st.raw.data, window), (st.comp_rows.data, rows)],
                                                           sinks, scale, nope, True)
    else:
        out["attention"] = lambda: attention_decode_triton(q, [(st.raw.data, window)], sinks, scale, nope, True)
    return out


def _scored_selection(qi: torch.Tensor, wi: torch.Tensor, rows: torch.Tensor, n_rows: int, select, k: int):
    """A closure scoring ``n_rows`` indexer rows and selecting the top ``k`` of them as the model does (the radix
    select by `scored_topk_radix`) -> the selected rows (-1: none)."""

    def run() -> torch.Tensor:
        if select is select_topk_radix:
            return scored_topk_radix(qi, wi, rows, n_rows, True, k)
        index, valid = select(indexer_scores_triton(qi, wi, rows, n_rows, True), n_rows, k)
        return torch.where(valid, index, -1)

    return run


def _compressed_sequence(cache: ModelCache, topk: str, g: torch.Generator):
    """One decode step's attention + indexer scoring + top-k of every compressed layer, each on its own rows."""
    cfg, dev, L = cache.cfg, cache.device, cache.length
    from ds4x.formats import hadamard128, mxfp4_roundtrip

    q = _attention_query(cfg, g, dev)
    sinks = torch.randn(cfg.num_heads, generator=g, device=dev)
    qi = mxfp4_roundtrip(hadamard128(torch.randn(cfg.index_n_heads, cfg.index_head_dim, generator=g, device=dev)), 32)
    wi = torch.randn(cfg.index_n_heads, generator=g, device=dev)
    scale, nope, select = cfg.head_dim**-0.5, cfg.nope_head_dim, TOPK_VARIANTS[topk]
    layers = []
    position = torch.tensor([L], device=dev)  # the decoded token's position, as the model passes it
    for st, kind, ratio in zip(cache.layers, cfg.attn_kinds, cfg.compress_ratios, strict=True):
        if kind in (CSA, HCA):
            window = Slots(cfg.sliding_window, position=position, ring=st.raw.capacity)
            rows = (_scored_selection(qi, wi, st.idx_rows.data, L // ratio, select, cfg.index_topk) if kind == CSA
                    else Slots(st.comp_rows.capacity, position=position, ratio=ratio))
            layers.append((st, window, rows))

    def run() -> None:
        # the model's decode calls (`ds4x.model.attention`): HCA offers all compressed slots, CSA its top-k
        for st, window, rows in layers:
            picked = rows() if callable(rows) else rows
            attention_decode_triton(q, [(st.raw.data, window), (st.comp_rows.data, picked)], sinks, scale, nope, True)

    return run


def _per_layer_ms(calls: list) -> float:
    """Median ms of one layer's kernel: a CUDA graph that clears L2 (zeroing 256 MiB) and then makes the call once
    for every layer of its kind, each on its own rows, so every layer reads its bytes from memory as in a decode
    step and no host launch time counts; the graph of the clearing alone is subtracted and the rest divided by the
    layer count. Without a GPU, the wall clock of the first call."""
    if not torch.cuda.is_available():
        return _median_ms(calls[0])
    scratch = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    clear_ms = _graph_ms(scratch.zero_)
    total_ms = _graph_ms(lambda: (scratch.zero_(), [call() for call in calls]))
    assert clear_ms is not None and total_ms is not None
    return (total_ms - clear_ms) / len(calls)


def _graph_ms(fn) -> float | None:
    """Median ms of ``fn`` captured once in a CUDA graph and replayed (None without a GPU)."""
    if not torch.cuda.is_available():
        return None
    fn()  # compiled and warm before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _median_ms(graph.replay)


def run_frontier(fc: FrontierConfig, log=print) -> list[dict[str, Any]]:
    """Measure every context; returns one ledger row per (context, top-k variant)."""
    dev = torch.device(fc.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the frontier benchmark needs a CUDA GPU")
    base = PRESETS[fc.preset]()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if fc.weights == "q2":
        from ds4x.runtime.engine import synthetic_quantized_spec
        from ds4x.weights.synthetic_gguf import synthetic_quantized_weights

        cfg, _ = synthetic_quantized_spec(f"{fc.preset}:q2" + ("" if fc.experts is None else f":{fc.experts}"))
        experts = cfg.n_routed_experts
        whole = "full model" if experts == base.n_routed_experts else f"{experts} routed experts"
        log(f"synthesizing {fc.preset} in the q2 mix, {whole} ({dtype} activations, seed {fc.seed}) ...")
        weights = synthetic_quantized_weights(cfg, "q2", seed=fc.seed, dtype=dtype, device=dev)
        label = f"synthetic {fc.preset}:q2 ({whole}), seed {fc.seed}"
    elif fc.weights == "bf16":
        experts = 8 if fc.experts is None else fc.experts
        cfg = base.replace(n_routed_experts=experts, n_experts_per_tok=min(base.n_experts_per_tok, experts))
        log(f"synthesizing {fc.preset} attention shapes with {experts} routed experts ({dtype}, seed {fc.seed}) "
            "...")
        weights = synthetic_weights(cfg, fc.seed, dtype, dev, generate_on=dev)
        label = f"synthetic {fc.preset} attention shapes, seed {fc.seed}, {experts} routed experts"
    else:
        raise ValueError(f"weights must be 'bf16' or 'q2', got {fc.weights!r}")
    model = Transformer(cfg, weights, dtype)
    layers_of = {kind: [i for i, k in enumerate(cfg.attn_kinds) if k == kind] for kind in (CSA, HCA, SLIDING)}
    # (the setting as given, or None for the defaults; the attributes it sets)
    variants = [(None, [])] + [(spec.strip(), parse_variant(spec)[1]) for spec in fc.variants]
    rounds = 2 if len(variants) > 1 else 1
    rows = []
    for L in fc.contexts:
        cache = model.new_cache(L + fc.warmup + fc.steps + 8, "packed", chunk=32)  # + the profiled steps
        seed_frontier(cache, L, fc.seed)
        for _ in range(rounds):
            for spec, sets in variants:
                with variant_applied(sets):
                    measured = _measure_context(model, cache, L, fc, label, layers_of, log)
                for row in measured:
                    if spec is not None:
                        row.update(status="variant", variant=spec)
                    rows.append(row)
                    log(format_table([row]).splitlines()[-1])
        del cache
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _measure_context(model: Transformer, cache: ModelCache, L: int, fc: FrontierConfig, label: str,
                     layers_of: dict[str, list[int]], log) -> list[dict[str, Any]]:
    """One context's decode steps from its seeded frontier, its per-layer kernels and its compressed layers'
    sequence, as the module switches stand now: a row per top-k variant."""
    cfg, dev = model.cfg, cache.device
    n_csa, n_hca, n_sld = (len(layers_of[x]) for x in (CSA, HCA, SLIDING))
    cache.length = L
    g = torch.Generator(device=dev).manual_seed(fc.seed + 1)
    decode = make_decoder(model, cache)  # the captured step on CUDA (the first call captures it)
    tok = 1
    step_ms = []
    for i in range(fc.warmup + fc.steps):
        t0 = time.perf_counter()
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        logits = decode(tok)
        if dev.type == "cuda":
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = 1000 * (time.perf_counter() - t0)
        tok = int(logits.argmax())
        if i >= fc.warmup:
            step_ms.append(ms)
    if fc.profile and dev.type == "cuda":
        from ds4x.bench.profile import format_profile, profile_step

        groups, wall_us = profile_step(lambda d=decode, t=tok: d(t))  # 7 more steps
        log(f"one decode step at context {L}, by kernel group:\n{format_profile(groups, wall_us)}")
    del decode  # the graph holds buffers of this cache
    cache.length = L  # the kernels below read the same frontier the steps started from
    k_csa, k_hca, k_sld = ([_layer_kernels(cache, i, fc.topk, g) for i in layers_of[kind]]
                           for kind in (CSA, HCA, SLIDING))
    variants = [fc.topk, *[v for v in fc.ab if v != fc.topk]]
    topk_ms: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(3):  # A/B variants alternate in one process
        for v in variants:
            topk_ms[v].append(_per_layer_ms([k["indexer_topk"][v] for k in k_csa]))
    t_index = _per_layer_ms([k["indexer"] for k in k_csa])
    t_index_plain = _per_layer_ms([k["indexer_plain"] for k in k_csa])
    t_csa, t_hca, t_sld = (_per_layer_ms([k["attention"] for k in ks]) for ks in (k_csa, k_hca, k_sld))
    index_bytes = k_csa[0]["n_rows"] * INDEXER_ROW_BYTES
    kv_bytes = kv_row_bytes(cfg.head_dim, cfg.rope_head_dim)
    hca_bytes = (k_hca[0]["n_rows"] + cfg.sliding_window) * kv_bytes
    step_bytes = n_csa * (index_bytes + (cfg.index_topk + cfg.sliding_window) * kv_bytes) + n_hca * hca_bytes
    rows = []
    for v in variants:
        # the top-k's share of scoring + selection (the indexer's first-level counts included)
        t_topk = statistics.median(topk_ms[v]) - t_index
        compressed = n_csa * (t_index + t_topk + t_csa) + n_hca * t_hca
        seq = _compressed_sequence(cache, v, g)
        t_eager = _median_ms(seq)
        t_graph = _graph_ms(seq)
        rows.append({
            "bench": "frontier", "context": L,
            "flags": {"cache": "packed", "topk": v, "experts": cfg.n_routed_experts, "weights": fc.weights,
                      "dtype": "bfloat16", "steps": fc.steps, "decode": "cuda graph" if dev.type == "cuda"
                      else "eager", "int8_activations": int8_activation_types(),
                      "attention_query": str(_attention_query_dtype(dev)).removeprefix("torch.")},
            "model": label,
            "decode_ms": statistics.median(step_ms), "decode_tok_s": 1000 / statistics.median(step_ms),
            "csa_indexer_us": 1000 * t_index, "csa_indexer_plain_us": 1000 * t_index_plain,
            "csa_topk_us": 1000 * t_topk, "csa_attention_us": 1000 * t_csa,
            "hca_attention_us": 1000 * t_hca, "sliding_attention_us": 1000 * t_sld,
            "compressed_layers_ms": compressed, "all_attention_ms": compressed + n_sld * t_sld,
            "compressed_eager_ms": t_eager, "compressed_graph_ms": t_graph,
            "indexer_gb_s": index_bytes / t_index / 1e6,
            "indexer_floor_fraction": index_bytes / (t_index / 1000) / COPY_BANDWIDTH,
            "hca_attention_gb_s": hca_bytes / t_hca / 1e6,
            "kv_bytes_read": step_bytes,
            "compressed_floor_fraction": step_bytes / ((t_graph or t_eager) / 1000) / COPY_BANDWIDTH,
        })
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The frontier rows as a short text table: per-kernel us (per layer, from graph replays), GB/s and fraction of the
    copy bandwidth, and the compressed layers of one step (sum of the per-kernel medians, eager sequence, CUDA
    graph replay)."""
    head = (f"{'context':>9} {'top-k':>6} {'step ms':>8} {'idx us':>7} {'GB/s':>5} {'of bw':>6} {'plain':>6} "
            f"{'topk us':>7} {'CSA us':>7} {'HCA us':>7} {'GB/s':>5} | {'41 layers ms: sum':>17} {'eager':>7} "
            f"{'graph':>7} {'of bw':>6}")
    lines = [head]
    for r in rows:
        graph = r.get("compressed_graph_ms")
        lines.append(
            f"{r['context']:>9} {r['flags']['topk']:>6} {r['decode_ms']:8.2f} {r['csa_indexer_us']:7.1f} "
            f"{r['indexer_gb_s']:5.0f} {100 * r['indexer_floor_fraction']:5.1f}% {r['csa_indexer_plain_us']:6.1f} "
            f"{r['csa_topk_us']:7.1f} {r['csa_attention_us']:7.1f} {r['hca_attention_us']:7.1f} "
            f"{r['hca_attention_gb_s']:5.0f} | {r['compressed_layers_ms']:17.3f} {r['compressed_eager_ms']:7.3f} "
            f"{'-' if graph is None else f'{graph:7.3f}':>7} {100 * r['compressed_floor_fraction']:5.1f}%")
    return "\n".join(lines)
