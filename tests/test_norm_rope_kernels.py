"""Fused RMSNorm and RoPE kernels (Triton; the interpreter on CPU) against the torch references."""

import pytest
import torch

from ds4x.model import norms, rope

pytest.importorskip("triton")
from ds4x.kernels import norm_rope  # noqa: E402


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _reference(monkeypatch):
    """The model functions with the fused kernels switched off."""
    monkeypatch.setattr(norms, "use_triton", lambda device: False)
    monkeypatch.setattr(rope, "use_triton", lambda device: False)


@pytest.mark.parametrize("shape, weighted, dtype", [((3, 512), True, torch.float32),
                                                    ((2, 4, 128), False, torch.float32),
                                                    ((5, 1000), True, torch.bfloat16)])
def test_rms_norm_matches_reference(monkeypatch, shape, weighted, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(_device())
    w = torch.randn(shape[-1], generator=g).to(_device()) if weighted else None
    got = norm_rope.rms_norm_fused(x, w, 1e-6)
    _reference(monkeypatch)
    want = norms.rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert float((got.float() - want.float()).abs().max()) <= tol * float(want.float().abs().max())


@pytest.mark.parametrize("shape, inverse, dtype", [((3, 8, 512), False, torch.float32), ((4, 128), True, torch.float32),
                                                   ((2, 16, 128), False, torch.bfloat16)])
def test_rope_matches_reference(monkeypatch, shape, inverse, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(dtype).to(_device())
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    cos, sin = rope.cos_sin((inv.to(_device()), 1.0), torch.tensor([0, 7, 4095, 1 << 20][: shape[0]]).to(_device()))
    assert norm_rope.rope_supported(x, cos)
    got = norm_rope.rope_fused(x, cos, sin, inverse)
    _reference(monkeypatch)
    want = rope.apply_rope(x, cos, sin, inverse)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got[..., :-64], want[..., :-64])  # the non-rotated dims are copied
    if dtype == torch.float32 and not x.is_cuda:
        assert torch.equal(got, want)  # the same two products and one sum per value (compiled: may fuse to FMA)
    else:
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert float((got.float() - want.float()).abs().max()) <= tol * float(want.float().abs().max())


@pytest.mark.parametrize("shape, weighted, dtype", [((3, 8, 512), False, torch.bfloat16),
                                                    ((4, 512), True, torch.bfloat16), ((2, 128), True, torch.float32)])
def test_rms_norm_rope_is_the_two_kernels(shape, weighted, dtype):
    """The fused norm + RoPE launch gives the bits of the norm kernel followed by the RoPE kernel."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(_device())
    w = torch.randn(shape[-1], generator=g).to(_device()) if weighted else None
    cos, sin = rope.cos_sin((torch.rand(32, generator=g).to(_device()), 1.0), torch.arange(shape[0], device=_device()))
    fused = norm_rope.rms_norm_fused(x, w, 1e-6, (cos, sin))
    two = norm_rope.rope_fused(norm_rope.rms_norm_fused(x, w, 1e-6), cos, sin)
    assert fused.dtype == two.dtype and torch.equal(fused, two)
    model = rope.rms_norm_rope(x, w, 1e-6, cos, sin)  # the kernel on CUDA, the torch ops on the CPU
    close = torch.allclose(model.float(), fused.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(model, fused) if x.is_cuda else close


def test_rope_into_another_dtype_is_a_cast_after():
    """The attention output's inverse RoPE writes the working dtype directly: the bits of rotating, then casting."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 8, 512, generator=g) * 2).to(_device())
    cos, sin = rope.cos_sin((torch.rand(32, generator=g).to(_device()), 1.0), torch.arange(3, device=_device()))
    got = norm_rope.rope_fused(x, cos, sin, inverse=True, dtype=torch.bfloat16)
    after = norm_rope.rope_fused(x, cos, sin, inverse=True).to(torch.bfloat16)
    model = rope.apply_rope(x, cos, sin, inverse=True, dtype=torch.bfloat16)
    assert got.dtype == model.dtype == torch.bfloat16
    if x.is_cuda:
        assert torch.equal(got, after) and torch.equal(model, got)
    else:  # the interpreter rounds float32 -> bfloat16 toward zero, torch to nearest: one bf16 step apart at most
        assert torch.allclose(got.float(), after.float(), rtol=2**-7, atol=0)


@pytest.mark.gpu
def test_fused_norm_rope_and_rope_into_bf16_bit_for_bit_on_gpu():
    """The compiled kernels: the fused launches give the bits of the separate ones (the interpreter rounds to
    bf16 differently, so only the GPU checks this exactly)."""
    for shape, weighted, dtype in [((3, 8, 512), False, torch.bfloat16), ((4, 512), True, torch.bfloat16),
                                   ((64, 512), True, torch.bfloat16)]:
        test_rms_norm_rope_is_the_two_kernels(shape, weighted, dtype)
    test_rope_into_another_dtype_is_a_cast_after()
