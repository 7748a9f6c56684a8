"""The kernel-compile watch: Triton's JIT hooks counted, timed and passed on (ds4x.kernels.jit_watch)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from ds4x.kernels.jit_watch import CompileWatch, KernelCompile, watch


def test_a_compile_is_counted_timed_and_told_with_its_constants() -> None:
    """The hooks as Triton calls them (keyword arguments; constants and attributes keyed by argument position): the
    kernel's own name, its constants by argument name and the arguments not specialized as multiples of 16 (those
    under ``do_not_specialize`` left out), the time between the two hooks; hooks set before still run."""
    w = CompileWatch()
    earlier = []
    w._before = lambda **kw: earlier.append(("before", kw["key"]))
    w._after = lambda **kw: earlier.append(("after", kw["key"]))
    told: list[KernelCompile] = []
    w.listeners.append(told.append)
    params = [SimpleNamespace(name=n, do_not_specialize=n == "m") for n in ("x_ptr", "n", "y_ptr", "m", "BLOCK")]
    fn = SimpleNamespace(name="make.<locals>._probe_kernel",
                         jit_function=SimpleNamespace(arg_names=[p.name for p in params], params=params))
    info = {"constants": {(4,): SimpleNamespace(value=128), (1,): 1},
            "configs": [{(0,): [["tt.divisibility", 16]], (2,): [], (3,): []}]}
    for _ in range(2):
        assert w.cache_missed(key="k1", repr="_probe_kernel[num_warps=4](...)", fn=fn, compile=info) is None
        w.compiled(key="k1", repr="_probe_kernel[num_warps=4](...)", fn=fn, compile=info)
    assert w.totals()[0][:2] == ("_probe_kernel", 2) and w.totals()[0][2] >= 0
    assert [t.constants for t in told] == ["BLOCK=128, n=1, not multiples of 16: y_ptr"] * 2
    assert all(t.seconds >= 0 for t in told)
    assert earlier == [("before", "k1"), ("after", "k1")] * 2


def test_the_process_has_one_watch() -> None:
    assert watch() is watch()


@pytest.mark.gpu
def test_a_new_specialization_on_the_gpu_is_recorded() -> None:
    """A kernel launched with a constexpr this process has not met is compiled, and the watch sees it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import triton
    import triton.language as tl

    @triton.jit
    def _scale_probe(x_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * FACTOR, mask=offs < n)

    w = watch()
    told: list[KernelCompile] = []
    w.listeners.append(told.append)
    try:
        factor = random.randrange(2, 1 << 20)  # a specialization no earlier run of this process compiled
        x = torch.ones(8, device="cuda")
        _scale_probe[(1,)](x, 8, FACTOR=factor, BLOCK=16)
        torch.cuda.synchronize()
    finally:
        w.listeners.remove(told.append)
    assert x[0].item() == factor
    assert [t.kernel for t in told] == ["_scale_probe"] and f"FACTOR={factor}" in told[0].constants
    assert told[0].constants.endswith("not multiples of 16: n")  # x is a fresh (aligned) tensor, n = 8

