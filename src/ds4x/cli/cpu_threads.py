"""How many threads torch's CPU kernels get for a command that runs a model (``--threads``).

A small model's ops are too short to share: on a 2-core machine the default model (44 MB of float32 weights)
ran at most ~6% faster on 2 threads than on 1, and 3-4x slower whenever another process kept a core busy,
because each op's threads wait for the one that is not running. So below
``SMALL_MODEL_BYTES`` of weights a CPU run uses one thread unless ``--threads`` or ``OMP_NUM_THREADS`` says
otherwise; larger models keep torch's default (one thread per core).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line starts without importing torch
    from ds4x.runtime.engine import Engine

SMALL_MODEL_BYTES = 256 << 20

log = logging.getLogger(__name__)


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 for models under 256 MiB of weights on the CPU, "
                             "else torch's default; OMP_NUM_THREADS also sets it)")


def apply_cpu_threads(engine: Engine, requested: int | None) -> int:
    """Set torch's intra-op thread count for this process and return it (see the module docstring)."""
    import torch

    from ds4x.weights.synthetic_gguf import weight_bytes

    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be >= 1, got {requested}")
        # torch starts that many OpenMP threads at once: far past the CPU count (--threads 100000) the process
        # died in a Rust panic and a segfault, and starved other processes of threads meanwhile
        cpus = os.cpu_count() or 1
        if requested > cpus:
            raise ValueError(f"--threads must be at most this machine's {cpus} CPUs, got {requested}")
        torch.set_num_threads(requested)
    elif "OMP_NUM_THREADS" not in os.environ and engine.model.device.type == "cpu" \
            and weight_bytes(engine.model.w) < SMALL_MODEL_BYTES:
        torch.set_num_threads(1)
    log.info("torch CPU threads: %d", torch.get_num_threads())
    return torch.get_num_threads()
