"""What a server says about itself: the ``ds4x`` object of its ``/v1/models`` entry.

A load harness measures over HTTP and cannot see the server's machine; this object is what it records in
its ledger rows (DESIGN §7: commit, model, GPU, driver, torch and triton versions).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import ds4x
from ds4x.bench.ledger import driver_version, git_commit, triton_version
from ds4x.runtime.engine import Engine
from ds4x.runtime.session_file import model_description, model_fingerprint


def server_info(engine: Engine, cache: str) -> dict[str, Any]:
    """Build, machine and model of a server serving ``engine`` with ``cache`` sessions. Every field that cannot
    be found out is None (never an error: a server starts without git or nvidia-smi)."""
    device = engine.model.device
    return {
        "version": ds4x.__version__,
        # DS4X_COMMIT first: a copy without git metadata (e.g. the GPU machine) is named by whoever started it;
        # else the work tree the package was imported from (an installed wheel has none)
        "commit": os.environ.get("DS4X_COMMIT") or git_commit(Path(ds4x.__file__).parent),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "driver": driver_version(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "cache": cache,
        "model": model_description(engine),
        # the identity session files are checked against: equal fingerprints, same weights and working dtype
        "model_fingerprint": model_fingerprint(engine),
    }
