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


def provenance() -> dict[str, Any]:
    """Commit and date for a ledger row (a row measured against another machine, e.g. a server over HTTP, adds
    that machine's description itself)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    if not commit:  # a copy without git metadata (e.g. the GPU machine): the caller names the commit
        commit, dirty = os.environ.get("DS4X_COMMIT", "unknown"), False
    return {"commit": commit + ("-dirty" if dirty else ""),
            "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}


def environment() -> dict[str, Any]:
    """Commit, date, GPU, driver, torch and triton versions for a ledger row."""
    env: dict[str, Any] = {
        **provenance(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        env["driver"] = out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    return env


def append(rows: list[dict[str, Any]], path: Path = DEFAULT_LEDGER) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
