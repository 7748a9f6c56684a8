"""What ``ds4x inspect`` reports: config, parameter counts, weight bytes by tensor type."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path
from typing import Any

from ds4x.config import PRESETS, ModelConfig, load_config
from ds4x.model.cache import plan_cache
from ds4x.runtime.engine import preset_config
from ds4x.weights.checkpoint import CheckpointError
from ds4x.weights.gguf import is_gguf_file
from ds4x.weights.names import expected_shapes, is_integer_tensor

_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                   "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


def _safetensors_headers(root: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from the headers only (no tensor data is read)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {root}")
    for f in files:
        with f.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{f} is truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise CheckpointError(f"{f} has an implausible header size {n}: not a safetensors file")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise CheckpointError(f"{f} has a corrupt safetensors header") from None
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (info["dtype"], tuple(info["shape"]))
    return out


def _count(cfg: ModelConfig, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[dict, int, int]:
    """(bytes by dtype, total parameters, active parameters per token) from safetensors-style headers."""
    by_dtype: dict[str, dict[str, int]] = {}
    total = routed = 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape)
        if name.endswith(".scale") or "scale_inv" in name:
            kind = f"{dtype} (scales)"
        else:
            kind = dtype
            if (".experts." in name and ".shared_experts." not in name) or name.endswith(
                    ("experts.gate_up_proj", "experts.down_proj")):
                routed += n
            total += n
        row = by_dtype.setdefault(kind, {"tensors": 0, "params": 0, "bytes": 0})
        row["tensors"] += 1
        row["params"] += n
        # FP4 experts hold two values per byte: their "params" here count bytes' worth of storage
        row["bytes"] += n * _ST_DTYPE_BYTES.get(dtype, 1)
    return by_dtype, total, total - routed + routed * cfg.n_experts_per_tok // cfg.n_routed_experts


def describe_model(model: str, ctx: int | None = None, chunk: int = 32) -> dict[str, Any]:
    """Config, parameter counts and weight bytes by type; with ``ctx``, the packed cache plan too."""
    extra: dict[str, Any] = {}
    if model == "default":
        from ds4x.assets import default_model_path

        model = str(default_model_path())
    if model in PRESETS:
        cfg = preset_config(model)  # as `-m PRESET` runs it (tiny with the byte tokenizer's vocabulary)
        tensors = {n: ("I32" if is_integer_tensor(n) else "F32", s) for n, s in expected_shapes(cfg).items()}
        by_dtype, total, active = _count(cfg, tensors)
    elif is_gguf_file(model):
        from ds4x.weights.gguf import describe_gguf

        if not Path(model).is_file():
            raise FileNotFoundError(f"no GGUF file at {model}")
        info = describe_gguf(model)
        cfg = info["config"]
        # parameters from the architecture's shapes; bytes as stored, by GGML type
        _, total, active = _count(cfg, {n: ("F32", s) for n, s in expected_shapes(cfg).items()})
        by_dtype = {k: {"tensors": 0, "params": 0, "bytes": v} for k, v in info["bytes_by_type"].items()}
        extra = {"synthetic": info["synthetic"], "file_bytes": info["file_bytes"]}
    else:
        root = Path(model)
        if not root.is_dir():
            raise FileNotFoundError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}), a .gguf file "
                                    f"nor a directory")
        cfg = load_config(root)
        by_dtype, total, active = _count(cfg, _safetensors_headers(root))
    report: dict[str, Any] = {
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "extra"},
        "schedule": cfg.layer_summary(),
        "params_total": total,
        "params_active": active,
        "bytes_by_dtype": by_dtype,
        "bytes_total": sum(r["bytes"] for r in by_dtype.values()),
        **extra,
    }
    if ctx is not None:
        if ctx <= 0 or chunk <= 0:
            raise ValueError(f"--ctx and --prefill-chunk must be positive, got {ctx} and {chunk}")
        report["cache_plan"] = plan_cache(cfg, ctx, chunk, "packed")
    return report
