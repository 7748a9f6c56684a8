"""``ds4x bench soak``: a long greedy decode that watches memory (issue: 10,000 steps without growth).

One session decodes ``steps`` tokens after a short prompt. Every ``every`` steps it samples the device memory
torch has allocated and reserved (CUDA), the process's resident set size, and the median step time of the last
interval. The first interval is warm-up (graph capture, kernel compiles, allocator pools); growth is measured
from the end of it to the end of the run. A decode step allocates nothing that outlives it, so on CUDA the
allocated bytes must come back to the same value; host RSS is reported beside it (it moves by allocator pages).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds4x.runtime.engine import Engine


@dataclass(frozen=True)
class SoakConfig:
    steps: int = 10_000
    every: int = 500
    cache: str = "packed"
    prompt: int = 16  # prompt tokens before the decode


def host_rss_bytes() -> int:
    """The process's resident set size now (Linux /proc; 0 where it is not available)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    import resource

    return pages * resource.getpagesize()


def _sample(dev: torch.device, step: int, times: list[float]) -> dict[str, Any]:
    s: dict[str, Any] = {"step": step, "host_rss_bytes": host_rss_bytes(),
                         "step_ms_median": 1000 * statistics.median(times) if times else None}
    if dev.type == "cuda":
        s["device_allocated_bytes"] = torch.cuda.memory_allocated(dev)
        s["device_reserved_bytes"] = torch.cuda.memory_reserved(dev)
    return s


def run_soak(engine: Engine, sc: SoakConfig, model_label: str,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """Decode ``sc.steps`` greedy tokens in one session; a ledger row with the memory samples and growth."""
    if sc.steps < 2 * sc.every or sc.every < 1:
        raise ValueError(f"--steps ({sc.steps}) must cover at least two sampling intervals of --every ({sc.every})")
    dev = engine.model.device
    ctx = sc.prompt + sc.steps + 1
    if ctx > engine.cfg.max_position_embeddings:
        raise ValueError(f"{sc.steps} steps need a context of {ctx}, over the model's maximum "
                         f"{engine.cfg.max_position_embeddings}")
    session = engine.new_session(ctx, sc.cache, announce=False)
    vocab = engine.cfg.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(sc.prompt)]  # deterministic, not all one token
    token = int(session.prefill(prompt).argmax())
    samples, times = [], []
    t_last = time.perf_counter()
    for i in range(1, sc.steps + 1):
        token = int(session.step(token).argmax())  # the argmax syncs, so the clock sees the whole step
        now = time.perf_counter()
        times.append(now - t_last)
        t_last = now
        if i % sc.every == 0:
            samples.append(_sample(dev, i, times))
            times = []
            s = samples[-1]
            mem = (f"device {s['device_allocated_bytes'] / 2**20:.1f} MiB allocated, "
                   f"{s['device_reserved_bytes'] / 2**20:.1f} MiB reserved, " if dev.type == "cuda" else "")
            log(f"step {i:>6}: {s['step_ms_median']:.2f} ms/step, {mem}host RSS {s['host_rss_bytes'] / 2**20:.1f} MiB")
    first, last = samples[0], samples[-1]  # growth from the end of the warm-up interval
    row: dict[str, Any] = {
        "bench": "soak", "model": model_label, "context": ctx,
        "flags": {"cache": sc.cache, "steps": sc.steps, "every": sc.every, "prompt": sc.prompt,
                  "dtype": str(engine.model.dtype).removeprefix("torch.")},
        "samples": samples,
        "host_rss_growth_bytes": last["host_rss_bytes"] - first["host_rss_bytes"],
        "decode_ms": last["step_ms_median"], "decode_tok_s": 1000 / last["step_ms_median"],
        "first_interval_decode_ms": first["step_ms_median"],
    }
    if dev.type == "cuda":
        row["device_allocated_growth_bytes"] = last["device_allocated_bytes"] - first["device_allocated_bytes"]
        row["device_reserved_growth_bytes"] = last["device_reserved_bytes"] - first["device_reserved_bytes"]
    return row
