"""Interpreter vs compiled Triton kernels in one process.

``triton.jit`` reads TRITON_INTERPRET when it decorates, i.e. when a kernel module is imported. A module
records the mode it was defined in; a call made in the other mode gets a private copy of that module,
loaded in the current mode, so interpreter and compiled kernels can coexist (tests switch modes).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

try:  # the kernel modules take triton from here (None without it: their torch paths still import)
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAVE_TRITON = False

_COPIES: dict[tuple[str, bool], ModuleType] = {}


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def module_for_current_mode(name: str, path: str, defined_interpreted: bool) -> ModuleType:
    """Module ``name`` (file ``path``) itself if it was defined in the current mode, else a private copy."""
    mode = interpret_mode()
    if mode == defined_interpreted:
        return sys.modules[name]
    mod = _COPIES.get((name, mode))
    if mod is None:
        copy_name = f"{name}_{'interp' if mode else 'jit'}"
        spec = importlib.util.spec_from_file_location(copy_name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[copy_name] = mod  # inspect (used by Triton to read kernel source) looks modules up here
        spec.loader.exec_module(mod)
        _COPIES[(name, mode)] = mod
    return mod
