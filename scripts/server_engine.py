"""The engine and scheduler of `ds4x serve` for the device scripts that measure its pieces without HTTP
(`scheduler_ab.py`, `prefill_calls.py`): the same arguments, model, dtype and decode slots."""

from __future__ import annotations

import argparse

from ds4x.runtime.engine import Engine
from ds4x.serve.scheduler import Scheduler, default_kv_budget


def add_server_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("-m", "--model", default="flash:q2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="as ds4x serve: auto is bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=256)


def server_scheduler(args: argparse.Namespace, max_batch: int, prefill_budget: int | None = None) -> Scheduler:
    """A packed-cache scheduler over decode slots, as `ds4x serve` makes it, on the model ``args`` names."""
    engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
    return Scheduler(engine, args.ctx, "packed", prefill_chunk=args.prefill_chunk, max_batch=max_batch,
                     kv_budget=default_kv_budget(engine.model.device), slots=True, prefill_budget=prefill_budget)
