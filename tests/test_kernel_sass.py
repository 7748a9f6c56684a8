"""The Hopper kernels compiled offline for sm_90 by scripts/kernel_sass.py (no GPU needed): no spills, and no wgmma
that ptxas serialized. A product issued to run beside the next tile's decode is only worth its code if ptxas keeps
it asynchronous; an accumulator register read inside another product's stage makes it wait after every step
(ptxas note C7514), which Triton's own compile does not show. The script runs in its own process: the tests' Triton
runs in the interpreter (conftest), whose kernels cannot be compiled."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists(),
                    reason="Triton's bundled ptxas is not here")
@pytest.mark.skipif(importlib.util.find_spec("triton.experimental.gluon") is None, reason="needs Triton's Gluon")
@pytest.mark.parametrize("args, kernels",
                         [(["indexer", "--pipelined"], 4),
                          (["attention", "--query", "bf16", "--two-phase", "5", "--overlap", "--q-async"], 4)],
                         ids=["indexer", "attention"])
def test_overlapped_products_stay_asynchronous(args: list[str], kernels: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), *args], env=env,
                         capture_output=True, text=True, timeout=600)
    # each kernel's report: its tag's line, then indented lines ("!!": a spill or serialized wgmma)
    reports = [block for block in re.split(r"\n(?=\S)", run.stdout) if re.match(r"\S+: registers", block)]
    # E4M3 indexer products are added into float32 a K step at a time (max_num_imprecise_acc), so ptxas waits for
    # each step before its adds (C7517): synchronous by design, measured faster than the fp16 pipeline anyway
    for block in reports:
        tag, notes = block.split(":")[0], [line for line in block.splitlines() if "!!" in line]
        assert all(tag.endswith("_fp8") and "C7517" in note for note in notes), run.stdout
    # the default and the overlapped variant (the indexer's each with E4M3 and fp16 operands; the attention's each
    # with its query through registers and by cp.async)
    assert len(reports) == kernels, run.stdout + run.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton.experimental.gluon") is None, reason="needs Triton's Gluon")
def test_attention_phases_stamps_find_their_markers() -> None:
    """scripts/attention_phases.py stamps a copy of the attention kernel at marker lines; a kernel edit that moves
    one made the script stop on the device (found there twice), so the copy is made and imported here for every
    set of stamps. Every line of the kernel is in the stamped copy, in order and at its indentation (a marker that
    began inside a line once moved the RoPE atomics out of their branch in the copy)."""
    code = ("import tempfile, pathlib, attention_phases as a\n"
            "from ds4x.kernels import attention_wgmma\n"
            "d = pathlib.Path(tempfile.mkdtemp())\n"
            "kernel = pathlib.Path(attention_wgmma.__file__).read_text().splitlines()\n"
            "for two_phase, no_scores in ((False, False), (True, False), (True, True)):\n"
            "    a.stamped_module(d, two_phase, no_scores)\n"
            "    if no_scores:\n"
            "        continue\n"
            "    copy = iter((d / 'attention_wgmma_stamped.py').read_text()\n"
            "                .replace('stamps_ptr, srow, ', '').replace(' stamps_ptr,', '').splitlines())\n"
            "    lost = [line for line in kernel if not any(line == c for c in copy)]\n"
            "    assert not lost, (two_phase, lost[:3])\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "scripts")])
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
