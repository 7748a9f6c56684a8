"""The benchmark ledger: one JSON object per measured point, appended, never edited (DESIGN §7)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

DEFAULT_LEDGER = Path("benchmarks/ledger.jsonl")


def git_commit(directory: Path | None = None) -> str | None:
    """The short HEAD commit of the git work tree holding ``directory`` (default: the current one), with
    ``-dirty`` if tracked files differ from it; None outside a work tree or without git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                                timeout=10, cwd=directory).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, timeout=10, cwd=directory).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("-dirty" if dirty else "")) if commit else None


def provenance() -> dict[str, Any]:
    """Commit and date for a ledger row (a row measured against another machine, e.g. a server over HTTP, adds
    that machine's description itself)."""
    # DS4X_COMMIT names the measured tree where git cannot: a copy without git metadata, or one whose git
    # metadata belongs to another checkout (a tree exported into a work directory, as on the GPU machine)
    commit = os.environ.get("DS4X_COMMIT") or git_commit() or "unknown"
    return {"commit": commit, "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def driver_version() -> str | None:
    """The NVIDIA driver version nvidia-smi reports, or None (no driver, no nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


def environment() -> dict[str, Any]:
    """Commit, date, GPU, driver, torch and triton versions for a ledger row."""
    return {
        **provenance(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "triton": triton_version(),
        "driver": driver_version(),
    }


def append(rows: list[dict[str, Any]], path: Path = DEFAULT_LEDGER) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
