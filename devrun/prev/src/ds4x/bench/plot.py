"""``ds4x bench plot``: throughput and latency per load level from a ``bench serve`` ledger.

One panel per metric, one line per run (rows sharing a ``run_id``), zero-based y axes, PNG and SVG.
Closed-loop rows go to ``PREFIX.png/.svg`` (x: concurrency), open-loop rows to ``PREFIX_open.png/.svg``
(x: offered request rate).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

# (ledger key, panel title) per figure
_CLOSED_PANELS = (
    ("aggregate_tok_s", "aggregate output tok/s"),
    ("per_stream_tok_s_median", "per-stream decode tok/s (median)"),
    ("ttft_p50_s", "TTFT p50 (s)"),
    ("itl_p99_ms", "burst-normalized ITL p99 (ms)"),
)
_OPEN_PANELS = (("goodput_rps", "goodput (requests/s within limits)"), *_CLOSED_PANELS)


def _label(row: dict[str, Any]) -> str:
    flags = row.get("flags", {})
    extra = " shared-prefix" if flags.get("shared_prefix") else ""
    return f"{row.get('model', '?')} {row.get('commit', '?')} {row.get('date', '')[:16]}{extra}"


def _figure(rows: list[dict[str, Any]], x_key: str, x_label: str, panels: tuple[tuple[str, str], ...],
            out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        runs.setdefault(r.get("run_id", "?"), []).append(r)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    xs_all = sorted({r[x_key] for r in rows})
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        for run_rows in runs.values():
            pts = sorted((r[x_key], r[key]) for r in run_rows if r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=_label(run_rows[0]))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(x_label)
        if len(xs_all) > 1 and xs_all[-1] / xs_all[0] >= 4:  # levels like 1, 8, 32: spread them evenly
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all, [f"{x:g}" for x in xs_all])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    handles, labels = axes[0][0].get_legend_handles_labels()
    # below the panels, so that no run's line is hidden however many runs the ledger holds
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(labels), 3),
               fontsize=8, frameon=False)
    paths = [out.with_name(out.name + ".png"), out.with_name(out.name + ".svg")]
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in paths:
        fig.savefig(p, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths


def plot(rows: list[dict[str, Any]], prefix: Path) -> list[Path]:
    """Draw the ``bench serve`` rows of a ledger; returns the files written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError("ds4x bench plot needs matplotlib (pip install 'ds4x[bench]')") from None
    serve = [r for r in rows if r.get("bench") == "serve"]
    closed = [r for r in serve if r.get("mode") == "closed"]
    open_ = [r for r in serve if r.get("mode") == "open"]
    if not serve:
        raise ValueError("the ledger has no `bench serve` rows")
    paths = []
    if closed:
        paths += _figure(closed, "concurrency", "concurrent streams", _CLOSED_PANELS, prefix)
    if open_:
        paths += _figure(open_, "rate", "offered requests/s", _OPEN_PANELS, prefix.with_name(prefix.name + "_open"))
    return paths


def add_parser(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = kinds.add_parser("plot", help="plot a `bench serve` ledger: throughput and latency per level (PNG, SVG)")
    p.add_argument("ledger", help="JSONL ledger written by `ds4x bench serve`")
    p.add_argument("--out", default=None, help="output path prefix (default: the ledger path without suffix)")
    return p


def run(args: argparse.Namespace) -> int:
    from ds4x.bench.report import load

    ledger = Path(args.ledger)
    prefix = Path(args.out) if args.out else ledger.with_suffix("")
    for path in plot(load(ledger), prefix):
        print(f"wrote {path}")
    return 0
