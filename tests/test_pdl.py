"""Programmatic dependent launch: where it applies, and that every kernel launched with it waits first.

A kernel launched with the PDL attribute may start while the kernel before it is still running; reading or writing
memory before its `wait_upstream` would race with that kernel. The check below reads the kernels' source: in every
Triton / Gluon kernel that takes ``PDL``, `wait_upstream(PDL)` comes before any load, store or atomic the kernel makes
itself (the helpers it calls are not followed); releasing its dependents is part of that call (`RELEASE=True`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import ds4x
from ds4x.formats import pdl

SRC = Path(ds4x.__file__).parent
MEMORY_CALLS = {"load", "store", "atomic_add", "atomic_xchg", "atomic_cas", "atomic_max", "atomic_min"}


def _kernels_taking_pdl() -> list[tuple[str, ast.FunctionDef]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                if node.name not in ("wait_upstream", "release_dependents"):
                    out.append((f"{path.relative_to(SRC)}:{node.name}", node))
    return out


def _calls_in_order(fn: ast.FunctionDef) -> list[str]:
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    names = []
    for c in calls:
        f = c.func
        names.append(f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
    return names


KERNELS = _kernels_taking_pdl()


def test_the_step_kernels_take_pdl() -> None:
    names = {name.split(":")[1] for name, _ in KERNELS}
    for kernel in ("_qmv_kernel", "_hc_post_kernel", "_rms_norm_kernel", "_route_kernel", "_emit_kernel",
                   "pack_kv_kernel", "score_kernel", "radix_kernel", "combine_kernel"):
        assert kernel in names


@pytest.mark.parametrize("name,fn", KERNELS, ids=[n for n, _ in KERNELS])
def test_a_pdl_kernel_waits_before_touching_memory(name: str, fn: ast.FunctionDef) -> None:
    calls = _calls_in_order(fn)
    assert "wait_upstream" in calls, f"{name} takes PDL but never calls wait_upstream"
    first_wait = calls.index("wait_upstream")
    touching = [c for c in calls[:first_wait] if c in MEMORY_CALLS]
    assert not touching, f"{name} calls {touching} before wait_upstream"
    if "release_dependents" in calls:
        assert calls.index("release_dependents") > first_wait, f"{name} releases its dependents before it waits"


def test_no_pdl_off_cuda_or_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "_supported", lambda device: True)
    monkeypatch.setattr(pdl, "interpret_mode", lambda: False)
    assert pdl.launch_options(torch.device("cpu"), "matvec") == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "OFF", frozenset({"matvec"}))
    assert pdl.launch_options(torch.device("cpu"), "matvec") == {"PDL": False}
    assert pdl.launch_options(torch.device("cpu"), "rows")["PDL"]
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_options(torch.device("cpu"), "rows") == {"PDL": False}
