"""Fused MoE routing and SwiGLU kernels (Triton; the interpreter on CPU) against the torch references."""

from types import SimpleNamespace

import pytest
import torch

from ds4x.model import moe

pytest.importorskip("triton")
from ds4x.kernels import moe as fused  # noqa: E402


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def interp(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("experts, k, func, hashed", [(256, 6, "sqrtsoftplus", False), (8, 2, "sqrtsoftplus", True),
                                                      (64, 4, "softmax", False), (16, 3, "sigmoid", False)])
def test_route_matches_reference(interp, monkeypatch, experts, k, func, hashed):
    dev = _device()
    g = torch.Generator().manual_seed(experts + k)
    t, hidden = 5, 32
    cfg = SimpleNamespace(n_experts_per_tok=k, scoring_func=func, routed_scaling_factor=1.5)
    w = {"gate.weight": torch.randn(experts, hidden, generator=g).to(dev),
         "gate.bias": (0.1 * torch.randn(experts, generator=g)).to(dev),
         "gate.tid2eid": torch.randint(0, experts, (50, k), generator=g, dtype=torch.int32).to(dev)}
    x = torch.randn(t, hidden, generator=g).to(dev) * 3
    x[0] = 0.0  # every score equal: ties go to the lower expert id (bias still separates them)
    tokens = torch.randint(0, 50, (t,), generator=g).to(dev)
    ids, weights = fused.route_fused(x @ w["gate.weight"].t(), None if hashed else w["gate.bias"], tokens,
                                     w["gate.tid2eid"] if hashed else None, k, func, 1.5)
    monkeypatch.setattr(moe, "use_triton", lambda device: False)
    want_ids, want_w = moe.route(x, w, "", tokens, cfg, hashed)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    assert torch.allclose(weights, want_w, rtol=1e-5, atol=1e-6)
    # stacked gate / up experts: the same launch also writes the up slots (ids + experts)
    both, weights2 = fused.route_fused(x @ w["gate.weight"].t(), None if hashed else w["gate.bias"], tokens,
                                       w["gate.tid2eid"] if hashed else None, k, func, 1.5, stacked=experts)
    assert both.shape == (t, 2 * k) and torch.equal(both[:, :k], ids) and torch.equal(both[:, k:], ids + experts)
    assert torch.equal(weights2, weights)
    want_both, _ = moe.route(x, w, "", tokens, cfg, hashed, stacked=experts)
    assert torch.equal(both.long(), want_both)


def test_swiglu_matches_reference(interp, monkeypatch):
    g = torch.Generator().manual_seed(7)
    gate, up = (torch.randn(2, 6, 700, generator=g) * 8).to(_device()), (torch.randn(2, 6, 700, generator=g) * 8).to(
        _device())
    got = fused.swiglu_fused(gate, up, 10.0)
    monkeypatch.setattr(moe, "use_triton", lambda device: False)
    want = moe.swiglu(gate, up, 10.0)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    both = torch.cat((gate, up), dim=-1).view(12, 1400)  # the halves of one stacked product: strided rows
    assert torch.equal(fused.swiglu_fused(both[:, :700], both[:, 700:], 10.0), got.view(12, 700))


def test_combine_matches_reference(interp, monkeypatch):
    dev = _device()
    g = torch.Generator().manual_seed(3)
    y, weights = torch.randn(3, 6, 300, generator=g), torch.rand(3, 6, generator=g)
    shared = torch.randn(3, 300, generator=g)
    fast = fused.combine_fused(y.to(dev), weights.to(dev), shared.to(dev)).cpu()
    monkeypatch.setattr(moe, "use_triton", lambda device: False)
    torch.testing.assert_close(fast, moe.combine(y, weights, shared), rtol=1e-5, atol=1e-5)
