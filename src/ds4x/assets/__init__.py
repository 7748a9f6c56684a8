"""Files shipped inside the package: the embedded default model (`tiny_v4`, trained by scripts/train_tiny.py)."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def default_model_path() -> Path:
    """The checkpoint directory of the embedded default model (config.json, safetensors, tokenizer.json)."""
    return _HERE / "tiny_v4"
