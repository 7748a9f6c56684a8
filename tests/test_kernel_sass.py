"""The Hopper kernels compiled offline for sm_90 by scripts/kernel_sass.py (no GPU needed): no spills, and no wgmma
that ptxas serialized. A product issued to run beside the next tile's decode is only worth its code if ptxas keeps
it asynchronous; an accumulator register read inside another product's stage makes it wait after every step
(ptxas note C7514), which Triton's own compile does not show. The script runs in its own process: the tests' Triton
runs in the interpreter (conftest), whose kernels cannot be compiled."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists(),
                    reason="Triton's bundled ptxas is not here")
@pytest.mark.skipif(importlib.util.find_spec("triton.experimental.gluon") is None, reason="needs Triton's Gluon")
@pytest.mark.parametrize("args", [["indexer", "--pipelined"], ["attention", "--query", "bf16", "--two-phase", "5",
                                                                "--overlap"]], ids=["indexer", "attention"])
def test_overlapped_products_stay_asynchronous(args: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr  # 1: a kernel spills or has its wgmma serialized
    assert "!!" not in run.stdout
    assert run.stdout.count("registers") == 2  # the default and the overlapped variant
