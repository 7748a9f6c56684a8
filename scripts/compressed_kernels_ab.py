#!/usr/bin/env python3
"""A/B of the compressed-attention decode kernels at Flash shapes (CUDA): the Triton kernels against the Hopper
(Gluon) ones for attention and indexer scoring (the Gluon indexer also as its PIPELINED variant at 3 / 4 programs an
SM and with FP8_KEYS, each with its rows in L2 and from DRAM), and the exact top-512 select at several sizes;
microseconds per call from `triton.testing.do_bench_cudagraph`, with each pair's relative difference; the Hopper
attention also on the model's bf16 query (and on it with the rows from DRAM), the top-k as dispatched against one
program a row forced, at 8 / 16 / 32 warps, up to 32,768 scores, and scoring + top-k as a CSA layer at 1M pairs
them with FIRST_LEVEL_IN_INDEXER flipped (the better of two alternating runs each).
``--ledger PATH`` appends each figure as a ``kernel`` row. The figures behind
``ds4x.kernels.attention.WGMMA_CONFIG`` and the kernel rows of the ledger of 2026-12-03.

    PYTHONPATH=src python scripts/compressed_kernels_ab.py [--ledger benchmarks/ledger.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch


def attention_cases(g: torch.Generator, dev: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, list]]:
    """One decode query's attention sources at Flash shapes, drawn from ``g``: a ring of 768 packed rows, a store of
    262,146 compressed rows, and the cases (window 128; CSA window + top-512 at 1M; HCA at 4K and 1M) as
    `attention_decode_triton` sources."""
    from ds4x.formats import rows_triton
    from ds4x.kernels.attention import Slots

    dim = 512
    ring = rows_triton.pack_kv_rows_triton(torch.randn(768, dim, generator=g, device=dev) * 2, validate=False)
    rows = rows_triton.pack_kv_rows_triton(torch.randn(262_146, dim, generator=g, device=dev) * 2, validate=False)
    at_4k, at_1m = torch.tensor([4095], device=dev), torch.tensor([1_048_575], device=dev)
    top = torch.randperm(262_144, generator=g, device=dev)[:512].sort().values
    cases = {
        "window 128": [(ring, Slots(128, position=at_4k, ring=768))],
        "CSA top-512 @1M": [(ring, Slots(128, position=at_1m, ring=768)), (rows, top)],
        "HCA 34 rows @4K": [(ring, Slots(128, position=at_4k, ring=768)), (rows, Slots(34, position=at_4k, ratio=128))],
        "HCA 8194 rows @1M": [(ring, Slots(128, position=at_1m, ring=768)),
                              (rows, Slots(8194, position=at_1m, ratio=128))],
    }
    return ring, rows, cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ledger", type=Path, default=None, help="JSONL benchmark ledger to append kernel rows to")
    ap.add_argument("--parts", default="attention,indexer,select,merge,pair",
                    help="comma-separated parts to run: attention, indexer, select, merge, pair (scoring + top-k), "
                         "attention-variants (of attention, the part --variant adds to)")
    ap.add_argument("--variant", action="append", default=[],
                    help="'NAME: module.attr=EXPR; ...' (repeatable): one query's attention cases on the bf16 query "
                         "also with these attributes set, in L2 and from DRAM, alternating with the defaults")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not torch.cuda.is_available():
        print("compressed_kernels_ab needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton.testing as tt

    from ds4x.bench.ledger import append, environment
    from ds4x.bench.variants import parse_variant, variant_applied
    from ds4x.formats import hadamard128, mxfp4_roundtrip, pack_indexer_rows
    from ds4x.kernels import attention as A
    from ds4x.kernels import indexer as I
    from ds4x.kernels.attention import Slots, attention_decode_triton, attention_prefill_triton
    from ds4x.kernels.indexer import indexer_scores_triton
    from ds4x.kernels.select import select_topk_keys, select_topk_radix

    dev, heads, dim, nope = "cuda", 64, 512, 448
    g = torch.Generator(device=dev).manual_seed(0)

    def us(fn) -> float:
        fn()
        torch.cuda.synchronize()
        return 1000 * tt.do_bench_cudagraph(fn, rep=100)

    rows_out: list[dict[str, Any]] = []
    env = environment()

    def record(what: str, shape: str, variant: str, t_us: float, extra: dict[str, Any] | None = None) -> None:
        rows_out.append({**env, "bench": "kernel", "what": what, "shape": shape, "variant": variant, "ms": t_us / 1000,
                         "model": "random rows and queries at Flash shapes, seed 0",
                         "flags": {"command": "scripts/compressed_kernels_ab.py", "timing": "do_bench_cudagraph"},
                         **(extra or {})})

    q = torch.nn.functional.rms_norm(torch.randn(heads, dim, generator=g, device=dev), (dim,))
    sinks = torch.randn(heads, generator=g, device=dev)
    ring, rows, cases = attention_cases(g, dev)
    scale = dim**-0.5
    # each case as a call on a float32 query (q, or a batch of it): one query's decode cases; a batch of sessions
    # (the pooled decode step's batch splits: more blocks a program); a prefill chunk's queries in one pass
    calls = {name: (q, lambda query, sources=sources: attention_decode_triton(query, sources, sinks, scale, nope,
                                                                               True))
             for name, sources in cases.items()}
    for batch, name, n, pos, ratio in ((32, "32 x CSA @4K", 1024, 4095, 0), (8, "8 x HCA @1M", 8194, 1_048_575, 128)):
        at = torch.full((batch,), pos, device=dev)
        ring_b = ring[None].expand(batch, *ring.shape)
        comp_b = rows[None, :n].expand(batch, n, rows.shape[1])
        comp_slots = (Slots(n, position=at, ratio=ratio) if ratio else
                      torch.stack([torch.randperm(n, generator=g, device=dev)[:512].sort().values
                                   for _ in range(batch)]))
        sources = [(ring_b, Slots(128, position=at, ring=768)), (comp_b, comp_slots)]
        calls[name] = (q[None].expand(batch, heads, dim).contiguous(),
                       lambda query, sources=sources: attention_decode_triton(query, sources, sinks, scale, nope, True,
                                                                              batch_splits=True))
    chunk = 1024  # a prefill chunk's queries at positions 3,072 .. 4,095: CSA's 1,024 rows, top-512 each
    positions = torch.arange(4096 - chunk, 4096, device=dev)
    picks = torch.stack([torch.randperm(1024, generator=g, device=dev)[:512] for _ in range(chunk)])
    qp = torch.nn.functional.rms_norm(torch.randn(chunk, heads, dim, generator=g, device=dev), (dim,))
    calls[f"prefill {chunk} x CSA"] = (qp, lambda query: attention_prefill_triton(
        query, positions, (ring, 768, 128), rows[:1024], sinks, scale, nope, index=picks))
    # the Triton kernel and the Gluon one on a float32 query, and the Gluon one on the model's bf16 query: the
    # online loop and (the default) its blocks in two phases where a program takes at most that many
    # (A.TWO_PHASE_BLOCKS; the batches and the prefill chunk take more: the online loop either way)
    two_phase_values = (5,)  # TWO_PHASE_BLOCKS values timed beside the online loop
    two_phase_default, overlap_default = A.TWO_PHASE_BLOCKS, A.TWO_PHASE_OVERLAP
    flipped = f"overlap {int(not overlap_default)}"  # the default with TWO_PHASE_OVERLAP flipped
    print(f"{'attention':<20} {'Triton us':>9} {'Gluon us':>9} {'rel diff':>9} {'bf16 q us':>9} "
          + " ".join(f"{f'2-ph {k}':>9}" for k in two_phase_values) + f" {'rel diff':>9} {flipped:>9} {'same':>5}")
    for name, (query, call) in calls.items() if "attention" in parts else ():
        qb = query.bfloat16()
        A.WGMMA = A.PREFILL_WGMMA = False
        ref, t_ref = call(query), us(partial(call, query))
        A.WGMMA = A.PREFILL_WGMMA = True
        A.TWO_PHASE_BLOCKS = 0
        out, t, t_bf16, online = call(query), us(partial(call, query)), us(partial(call, qb)), call(qb)
        t_two, diff_two = {}, 0.0
        for k in two_phase_values:
            A.TWO_PHASE_BLOCKS = k
            two = call(qb)
            t_two[k] = us(partial(call, qb))
            diff_two = max(diff_two, float((two - online).abs().max() / online.abs().max()))
        # the default's two phases with TWO_PHASE_OVERLAP (the next block decoded beside each score product) flipped
        A.TWO_PHASE_BLOCKS = two_phase_default
        plain = call(qb)
        A.TWO_PHASE_OVERLAP = not overlap_default
        same_overlap = torch.equal(call(qb), plain)
        t_overlap = us(partial(call, qb))
        A.TWO_PHASE_OVERLAP = overlap_default
        diff = float((out - ref).abs().max() / ref.abs().max())
        print(f"{name:<20} {t_ref:9.1f} {t:9.1f} {diff:9.1e} {t_bf16:9.1f} "
              + " ".join(f"{t_two[k]:9.1f}" for k in two_phase_values) + f" {diff_two:9.1e} {t_overlap:9.1f} "
              f"{str(same_overlap):>5}")
        record("decode attention", name, "Triton kernel, float32 query", t_ref)
        record("decode attention", name, "Gluon kernel, float32 query", t, {"rel_diff": diff})
        record("decode attention", name, "Gluon kernel, bf16 query, online loop (TWO_PHASE_BLOCKS=0)", t_bf16,
               {"status": "variant"})
        for k in two_phase_values:
            record("decode attention", name, f"Gluon kernel, bf16 query, blocks in two phases (TWO_PHASE_BLOCKS={k})",
                   t_two[k], {"rel_diff": diff_two, **({} if k == two_phase_default else {"status": "variant"})})
        record("decode attention", name,
               f"Gluon kernel, bf16 query, default with TWO_PHASE_OVERLAP={not overlap_default}", t_overlap,
               {"same_bits": same_overlap, "status": "variant"})
    qb = q.bfloat16()

    # one query's cases on the bf16 query with their rows from DRAM as in the model (a graph of one call on each of 24
    # copies of the case's stores, so L2 holds none at its turn; a replayed call on one store reads L2 instead), and
    # with each --variant both ways, alternating twice, its output compared bit for bit with the defaults' (this part
    # alone: --parts attention-variants)
    if parts & {"attention", "attention-variants"}:
        from ds4x.bench.timing import graph_replay_us

        variants = {"defaults": []} | dict(parse_variant(spec) for spec in args.variant)
        print(f"\n{'attention (bf16 query)':<22} " + " ".join(f"{v[:20]:>20}" for v in variants)
              + "  (us in L2 / from DRAM; same bits)")
        for name, sources in cases.items():
            copies = [sources] + [[(data.clone(), slots) for data, slots in sources] for _ in range(23)]
            t_l2: dict[str, list[float]] = {v: [] for v in variants}
            t_dram: dict[str, list[float]] = {v: [] for v in variants}
            same: dict[str, bool] = {}
            base = attention_decode_triton(qb, sources, sinks, scale, nope, True)
            for _ in range(2):
                for v, sets in variants.items():
                    with variant_applied(sets):
                        same[v] = torch.equal(attention_decode_triton(qb, sources, sinks, scale, nope, True), base)
                        t_l2[v].append(us(lambda s=sources: attention_decode_triton(qb, s, sinks, scale, nope, True)))
                        t_dram[v].append(graph_replay_us([lambda c=c: attention_decode_triton(qb, c, sinks, scale,
                                                                                              nope, True)
                                                          for c in copies], rep_ms=100))
            del copies
            print(f"{name:<22} " + " ".join(f"{f'{min(t_l2[v]):.1f} / {min(t_dram[v]):.1f} {str(same[v])[0]}':>20}"
                                            for v in variants))
            for v in variants:
                extra = {} if v == "defaults" else {"status": "variant", "same_bits": same[v]}
                label = "Gluon kernel, bf16 query" + ("" if v == "defaults" else f", {v}")
                record("decode attention", name, label, min(t_l2[v]), extra)
                record("decode attention", f"{name} from DRAM", label, min(t_dram[v]), {"rows": "DRAM", **extra})

    # the merge of the splits by (splits per iteration, 64-value chunks per program), each configuration forced as
    # COMBINE_CHUNKS (COMBINE_ROWS_WAVES = 0): one query's cases above on the model's bf16 query, and a batch of 8
    # / 32 sessions' at 4K (batch splits, as a pooled decode step), alternating twice
    merge_configs = {f"({sb}, {cb})": (sb, cb) for sb, cb in ((64, 1), (32, 2), (16, 4), (16, 8))}
    merge_cases = {name: (qb, sources) for name, sources in cases.items()}
    for batch in (8, 32):
        at = torch.full((batch,), 4095, device=dev)
        ring_b = ring[None].expand(batch, *ring.shape).contiguous()
        comp_b = rows[None, :1024].expand(batch, 1024, rows.shape[1]).contiguous()
        picks = torch.stack([torch.randperm(1024, generator=g, device=dev)[:512].sort().values for _ in range(batch)])
        qs = q[None].expand(batch, heads, dim).bfloat16().contiguous()
        merge_cases[f"{batch} x CSA @4K"] = (qs, [(ring_b, Slots(128, position=at, ring=768)), (comp_b, picks)])
        merge_cases[f"{batch} x HCA @4K"] = (qs, [(ring_b, Slots(128, position=at, ring=768)),
                                                  (comp_b, Slots(34, position=at, ratio=128))])
    default_merge = A.COMBINE_CHUNKS, A.COMBINE_ROWS_WAVES
    A.COMBINE_ROWS_WAVES = 0
    print(f"\n{'merge (splits, chunks)':<22} " + " ".join(f"{v:>9}" for v in merge_configs) + "  (us, max rel diff)")
    for name, (query, sources) in merge_cases.items() if "merge" in parts else ():
        times_m: dict[str, list[float]] = {v: [] for v in merge_configs}
        outs: dict[str, torch.Tensor] = {}
        for _ in range(2):
            for v, config in merge_configs.items():
                A.COMBINE_CHUNKS = config

                def call(query=query, sources=sources):
                    return attention_decode_triton(query, sources, sinks, dim**-0.5, nope, True, batch_splits=True)
                outs[v] = call()
                times_m[v].append(us(call))
        first = outs[next(iter(merge_configs))]
        diff = max(float((o - first).abs().max() / first.abs().max()) for o in outs.values())
        print(f"{name:<22} " + " ".join(f"{min(times_m[v]):9.1f}" for v in merge_configs) + f"  {diff:.1e}")
        for v in merge_configs:
            record("decode attention merge", name, v, min(times_m[v]), {"rel_diff": diff})
    A.COMBINE_CHUNKS, A.COMBINE_ROWS_WAVES = default_merge

    if parts & {"indexer", "select", "pair"}:  # (the select times the indexer's scores: it runs the indexer too)
        n = 262_144
        keys = mxfp4_roundtrip(hadamard128(torch.randn(n, 128, generator=g, device=dev)), 32)
        packed = pack_indexer_rows(keys)
        qi = mxfp4_roundtrip(hadamard128(torch.randn(heads, 128, generator=g, device=dev)), 32)
        wi = torch.randn(heads, generator=g, device=dev)
        times, scores = [], []
        for flag in (False, True):
            I.WGMMA = flag
            scores.append(indexer_scores_triton(qi, wi, packed, n, True))
            times.append(us(lambda: indexer_scores_triton(qi, wi, packed, n, True)))
        diff = float((scores[1] - scores[0]).abs().max() / scores[0].abs().max())
        print(f"{'indexer 262,144 rows':<20} {times[0]:9.1f} {times[1]:9.1f} {diff:9.1e}  "
              f"({packed.numel() / times[1] / 1e3:.0f} GB/s)")
        record("indexer scoring", "262,144 rows", "Triton kernel", times[0])
        record("indexer scoring", "262,144 rows", "Gluon kernel", times[1], {"rel_diff": diff})
        if parts & {"indexer", "select"}:
            # the Gluon kernel at 3 programs an SM (PROGRAMS_PER_SM), its PIPELINED variant (tiles of 64 rows at 3 / 4
            # an SM, of 128 at 2), each with E4M3 or fp16 operands (FP8_KEYS), alternating twice: the same scores as
            # the Triton kernel's bit for bit where the operands are exact (as on these rows). Each twice: the rows in
            # L2 (one store, replayed: 17.8 MB fit an H100's 50 MB) and from DRAM as in the model (a graph of one call
            # on each of 24 copies of the store, so L2 holds none at its turn)
            from ds4x.bench.timing import graph_replay_us
            from ds4x.kernels import indexer_wgmma as IW

            copies = [packed] + [packed.clone() for _ in range(23)]
            idx_variants = {f"{name}, {'e4m3' if fp8 else 'fp16'}": [(I, "PROGRAMS_PER_SM", per_sm),
                                                                      (IW, "PIPELINED", pipelined),
                                                                      (IW, "PIPELINED_BLOCK_N", block),
                                                                      (IW, "FP8_KEYS", fp8)]
                            for fp8 in (True, False)
                            for name, per_sm, pipelined, block in (("one tile, 3 a SM", 3, False, 64),
                                                                   ("pipelined, 64 rows, 3 a SM", 3, True, 64),
                                                                   ("pipelined, 64 rows, 4 a SM", 4, True, 64),
                                                                   ("pipelined, 128 rows, 2 a SM", 2, True, 128))}
            times_i: dict[str, list[float]] = {v: [] for v in idx_variants}
            times_d: dict[str, list[float]] = {v: [] for v in idx_variants}
            same: dict[str, bool] = {}
            err: dict[str, float] = {}
            for _ in range(2):
                for v, sets in idx_variants.items():
                    with variant_applied(sets):
                        got = indexer_scores_triton(qi, wi, packed, n, True)
                        same[v] = torch.equal(got, scores[1])
                        err[v] = float((got - scores[0]).abs().max() / scores[0].abs().max())
                        times_i[v].append(us(lambda: indexer_scores_triton(qi, wi, packed, n, True)))
                        times_d[v].append(graph_replay_us([lambda c=c: indexer_scores_triton(qi, wi, c, n, True)
                                                           for c in copies], rep_ms=100))
            del copies
            print(f"  {'(us; GB/s of rows)':<40} {'rows in L2':>16} {'rows from DRAM':>18}")
            for v in idx_variants:
                t_i, t_d = min(times_i[v]), min(times_d[v])
                gb_i, gb_d = packed.numel() / t_i / 1e3, packed.numel() / t_d / 1e3
                print(f"  {v:<40} {t_i:7.1f} ({gb_i:5.0f}) {t_d:9.1f} ({gb_d:5.0f})  same bits {same[v]}, "
                      f"from the Triton kernel's {err[v]:.1e}")
                for rows, t in (("L2", t_i), ("DRAM", t_d)):
                    record("indexer scoring", "262,144 rows" + (" from DRAM" if rows == "DRAM" else ""), v, t,
                           {"same_bits": same[v], "rel_diff": err[v], "rows": rows})

        # the select as dispatched (one program a row up to SMALL_ROWS scores, SMALL_ROWS_BATCHED from 8 rows on, else
        # the multi-program select) against one program a row forced (the histogram select, SMALL_WARPS warps) up to
        # 32,768 scores, alternating twice; exact: the same set as the composite-key topk for every row
        from ds4x.kernels import select as S

        default_warps = S.SMALL_WARPS
        variants = {"as dispatched": (None, None), "one program, 8 warps": (True, 8),
                    "one program, 16 warps": (True, 16), "one program, 32 warps": (True, 32)}
        print(f"\n{'top-512 select':<20} " + " ".join(f"{v:>28}" for v in variants) + "  (us, exact)")
        sizes = ((262_144, 1), (32_768, 1), (16_384, 1), (8_192, 1), (4_160, 1), (2_048, 1), (1_024, 1), (1_024, 32),
                 (8_192, 8), (16_384, 8), (32_768, 8))
        for rows_n, batch in sizes if "select" in parts else ():
            s = scores[1][None].repeat(batch, 1)[:, :rows_n]
            count = torch.full((batch,), rows_n, dtype=torch.int32, device=dev)
            times_v: dict[str, list[float]] = {v: [] for v in variants}
            exact: dict[str, bool] = {}
            for _ in range(2):
                for name, (small, warps) in variants.items():
                    if small and rows_n > 32_768:
                        continue
                    S.SMALL_WARPS = warps
                    try:
                        index, valid = select_topk_radix(s, count, 512, small=small)
                        exact[name] = all(set(index[b][valid[b]].tolist())
                                          == set(select_topk_keys(s[b], rows_n, 512)[0].tolist())
                                          for b in range(batch))
                        times_v[name].append(us(lambda s=s, c=count, m=small: select_topk_radix(s, c, 512, small=m)))
                    except Exception as exc:  # (a configuration the GPU cannot launch is reported, not fatal)
                        print(f"  {name} at {batch} x {rows_n:,}: {type(exc).__name__}: {str(exc)[:80]}")
                        times_v[name].append(float("nan"))
            S.SMALL_WARPS = default_warps
            print(f"{f'{batch} x {rows_n:,}':<20} "
                  + " ".join(f"{min(times_v[v], default=float('nan')):21.1f} {str(exact.get(v, '-')):>6}"
                             for v in variants))
            for v in variants:
                if times_v[v] and v in exact:
                    record("top-512 select", f"{batch} x {rows_n:,} scores", v, min(times_v[v]), {"exact": exact[v]})
        # scoring then the top-512 of 262,144 rows as a CSA layer at 1M pairs them, from DRAM (one pair on each of 24
        # copies of the store per graph), with the select's first level counted by the indexer or by itself
        # (FIRST_LEVEL_IN_INDEXER), alternating twice; exact against the composite-key topk
        if "pair" in parts:
            from ds4x.bench.timing import graph_replay_us
            from ds4x.kernels import select as S

            copies = [packed] + [packed.clone() for _ in range(23)]
            count = torch.full((1,), n, dtype=torch.int32, device=dev)
            want = set(select_topk_keys(scores[1], n, 512)[0].tolist())
            saved = S.FIRST_LEVEL_IN_INDEXER
            pairs = {f"first level in indexer {int(fl)}": fl for fl in (saved, not saved)}

            def pair(rows):
                return S.scored_topk_radix(qi, wi, rows, count, True, 512)

            times_p: dict[str, list[float]] = {v: [] for v in pairs}
            exact_p: dict[str, bool] = {}
            for _ in range(2):
                for v, S.FIRST_LEVEL_IN_INDEXER in pairs.items():
                    index = pair(packed)
                    exact_p[v] = set(index.tolist()) == want
                    times_p[v].append(graph_replay_us([lambda c=c: pair(c) for c in copies], rep_ms=100))
            S.FIRST_LEVEL_IN_INDEXER = saved
            del copies
            print(f"\n{'scoring + top-512, 262,144 rows from DRAM':<44} {'us':>7}  exact")
            for v in pairs:
                print(f"  {v:<42} {min(times_p[v]):7.1f}  {exact_p[v]}")
                record("indexer scoring + top-512 select", "262,144 rows from DRAM", v, min(times_p[v]),
                       {"exact": exact_p[v], "rows": "DRAM",
                        **({} if pairs[v] == saved else {"status": "variant"})})
    if args.ledger is not None:
        append(rows_out, args.ledger)
        print(f"{len(rows_out)} rows appended to {args.ledger}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
