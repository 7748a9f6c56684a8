"""docs/BENCHMARKS.md generated from the ledger (never typed by hand)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _sequence_ms(r: dict[str, Any]) -> str:
    """The 41 compressed layers timed as one sequence (rows from before that measurement show '-')."""
    if "compressed_eager_ms" not in r:
        return "-"
    graph = r.get("compressed_graph_ms")
    return f"{r['compressed_eager_ms']:.3f} / " + ("-" if graph is None else f"{graph:.3f}")


def _frontier_model(r: dict[str, Any]) -> str:
    """Which model a frontier row measured and how its step ran (rows before these flags: shrunk MoE, eager)."""
    flags = r["flags"]
    weights = "full q2" if flags.get("weights") == "q2" else f"bf16, {flags.get('experts', '?')} experts"
    acts = flags.get("int8_activations")  # rows before this flag: not recorded
    int8 = "" if acts is None or flags.get("weights") != "q2" else f", int8 activations: {'/'.join(acts) or 'none'}"
    return f"{weights}, {flags.get('decode', 'eager')}{int8}"


def _frontier_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| date | commit | GPU | model, step | context | top-k | step ms | CSA indexer us (GB/s) | CSA top-k us "
        "| CSA attn us | HCA attn us | 41 compressed layers ms | 41 layers eager / graph ms | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['date'][:16]} | {r['commit']} | {r['gpu']} | {_frontier_model(r)} | {r['context']:,} "
            f"| {r['flags']['topk']} | {r['decode_ms']:.1f} | {r['csa_indexer_us']:.1f} ({r['indexer_gb_s']:.0f}) "
            f"| {r['csa_topk_us']:.1f} | {r['csa_attention_us']:.1f} | {r['hca_attention_us']:.1f} "
            f"| {r['compressed_layers_ms']:.3f} | {_sequence_ms(r)} | {r.get('status', 'ok')} |"
        )
    return out


def _serve_table(rows: list[dict[str, Any]]) -> list[str]:
    def num(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    out = ["| date | commit | server GPU | model | run | concurrency | requests | errors | tok/s | stream tok/s med "
           "| TTFT p50 s | ITL p99 ms | server step ms (device / host) | status | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sm = r.get("server_meta")
        gpu = sm.get("gpu", "?") if isinstance(sm, dict) else "?"
        level = r["concurrency"] if r.get("mode") == "closed" else f"rate {r.get('rate')}"
        c = r.get("server_counters") or {}
        step = f"{num(c.get('step_model_ms'), '.2f')} / {num(c.get('step_host_ms'), '.2f')}" if c else "-"
        out.append(f"| {r['date'][:16]} | {r['commit']} | {gpu} | {r['model']} | {r['run_id']} | {level} "
                   f"| {r['requests']} | {sum(r.get('errors', {}).values())} | {num(r['aggregate_tok_s'], '.1f')} "
                   f"| {num(r.get('per_stream_tok_s_median'), '.1f')} | {num(r.get('ttft_p50_s'), '.3f')} "
                   f"| {num(r.get('itl_p99_ms'), '.1f')} | {step} | {r.get('status', 'ok')} | {r.get('note', '')} |")
    return out


def render(rows: list[dict[str, Any]], ledger_name: str, serve: list[dict[str, Any]] | None = None,
           serve_name: str = "") -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Generated from `{ledger_name}` by `ds4x bench report`; every row is one measured point. Rows marked",
        "`superseded` or `invalid` are kept on purpose (DESIGN §7). Model and flags of each row are in the ledger.",
        "",
    ]
    frontier = [r for r in rows if r.get("bench") == "frontier"]
    if frontier:
        models = sorted({r["model"] for r in frontier})
        lines += ["## Frontier decode (packed cache seeded at the frontier, no prefill)", "",
                  "Model: " + "; ".join(models) + ".", "", *_frontier_table(frontier), ""]
    prefill = [r for r in rows if r.get("bench") == "prefill"]
    if prefill:
        lines += ["## Full model: fixture prefill, then greedy decode (`ds4x bench prefill`)", "",
                  "Decode rate: steps 2.. of the run (the first token excluded); floor: the weight bytes one token "
                  "reads at 4.26 TB/s.", "",
                  "| date | commit | GPU | model | context | prefill tok/s | decode ms | decode tok/s | of the floor "
                  "| peak GB | status | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in prefill:
            peak = r.get("peak_memory_bytes")
            lines.append(f"| {r['date'][:16]} | {r['commit']} | {r['gpu']} | {r['model']} | {r['context']:,} "
                         f"| {r['prefill_tok_s']:.0f} | {r['decode_ms']:.2f} | {r['decode_tok_s']:.1f} "
                         f"| {100 * r['floor_fraction']:.1f}% | {'-' if peak is None else f'{peak / 1e9:.1f}'} "
                         f"| {r.get('status', 'ok')} | {r.get('note', '')} |")
        lines.append("")
    batched = [r for r in rows if r.get("bench") == "batched_decode"]
    if batched:
        lines += ["## Batched decode: B sessions in one replayed step (`scripts/batched_decode.py`)", "",
                  "Each session seeded at the frontier (no prefill); the server's pool of cache slots, one CUDA graph "
                  "per batch size; median step including a host read of each session's greedy token (step ms), and "
                  "the captured step alone timed with CUDA events (replay ms); tok/s from step ms where measured, "
                  "else from replay ms.", "",
                  "| date | commit | GPU | model | context | batch | step ms | replay ms | tok/s | status | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]

        def ms(v: Any) -> str:
            return "-" if v is None else f"{v:.2f}"

        for r in batched:
            lines.append(f"| {r['date'][:16]} | {r['commit']} | {r['gpu']} | {r['model']} | {r['context']:,} "
                         f"| {r['batch']} | {ms(r['step_ms'])} | {ms(r.get('replay_ms'))} | {r['tok_s']:.1f} "
                         f"| {r.get('status', 'ok')} | {r.get('note', '')} |")
        lines.append("")
    loops = [r for r in rows if r.get("bench") == "scheduler"]
    if loops:
        lines += ["## The server's decode loop without HTTP (`scripts/scheduler_ab.py`)", "",
                  "N jobs submitted together (unique prompts, EOS ignored, temperature 0.2) to the server's scheduler "
                  "in one process; a step's tokens read after the next step is queued or before it, and the prompt "
                  "tokens a call may take (budget); wall "
                  "time from submitting to the last token; model / host ms: the scheduler's mean device time and host "
                  "time per decode step.", "",
                  "| date | commit | GPU | model | streams | budget | reads | tok/s | per stream | TTFT max s "
                  "| model ms | host ms | status |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in loops:
            per = r.get("per_stream_tok_s")
            lines.append(f"| {r['date'][:16]} | {r['commit']} | {r['gpu']} | {r['model']} | {r['concurrency']} "
                         f"| {r['flags']['prefill_budget']} "
                         f"| {'after' if r['flags']['overlapped_reads'] else 'before'} the next step | "
                         f"{r['tok_s']:.1f} | {'-' if per is None else f'{per:.1f}'} | {r['ttft_max_s']:.3f} "
                         f"| {r['step_model_ms']:.2f} | {r['step_host_ms']:.2f} | {r.get('status', 'ok')} |")
        lines.append("")
    long_runs = [r for r in rows if r.get("bench") == "long_decode"]
    if long_runs:
        lines += ["## Long decode runs: memory over N steps in one session (`scripts/long_decode.py`)", "",
                  "Growth from the first sample at a quarter of the run to the end: the process's resident memory and, "
                  "on CUDA, the caching allocator's allocated / reserved bytes.", "",
                  "| date | commit | GPU | model | device | steps | ms / step | growth MiB (rss / allocated / "
                  "reserved) | status |", "|---|---|---|---|---|---|---|---|---|"]
        for r in long_runs:
            g = r["growth_mib"]
            lines.append(f"| {r['date'][:16]} | {r['commit']} | {r['gpu']} | {r['model']} | {r['device']} "
                         f"| {r['flags']['steps']:,} | {r['decode_ms']:.2f} | {g['rss']:+.1f} / "
                         f"{g['cuda_allocated']:+.1f} / {g['cuda_reserved']:+.1f} | {r.get('status', 'ok')} |")
        lines.append("")
    kernels = [r for r in rows if r.get("bench") == "kernel"]
    if kernels:
        lines += ["## Kernel comparisons (one-off A/B runs, `do_bench` median; the command is in each row's flags)", "",
                  "| date | commit | GPU | what | shape | variant | us | note |", "|---|---|---|---|---|---|---|---|"]
        for r in kernels:
            lines.append(f"| {r['date'][:16]} | {r['commit']} | {r['gpu']} | {r['what']} | {r['shape']} "
                         f"| {r['variant']} | {1000 * r['ms']:.1f} | {r.get('note', '')} |")
        lines.append("")
    quant = [r for r in rows if r.get("bench") == "quant_matmul"]
    if quant:
        lines += ["## Quantized matmuls straight from GGML blocks (decode shapes)", "",
                  "| date | commit | type | shape | rows | kernel | us | GB/s | of copy bandwidth |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in quant:
            frac = 100 * r["floor_fraction"]
            lines.append(f"| {r['date'][:16]} | {r['commit']} | {r['qtype']} | {r['shape']} | {r['flags']['rows']} "
                         f"| {r['flags']['kernel']} | {r['us']:.1f} | {r['gb_s']:.0f} | {frac:.1f}% |")
        lines.append("")
    if serve:
        lines += [f"## Server under load (`ds4x bench serve`, from `{serve_name}`)", "",
                  "Closed loop: each stream sends its next request when the previous one ends; tok/s is every output "
                  "token over the wall time including the drain; ITL burst-normalized (DESIGN §7). Flags, prompt "
                  "and output lengths are in the ledger.", "", *_serve_table(serve), ""]
    return "\n".join(lines)


def write_report(ledger: Path, out: Path, serve_ledger: Path | None = None) -> None:
    """``out`` from ``ledger``, plus the server-load rows of ``serve_ledger`` if that file exists."""
    out.parent.mkdir(parents=True, exist_ok=True)
    serve = load(serve_ledger) if serve_ledger is not None and serve_ledger.is_file() else None
    out.write_text(render(load(ledger), ledger.as_posix(), serve, serve_ledger.as_posix() if serve_ledger else ""))
