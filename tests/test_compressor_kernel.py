"""The fused compressor emit kernel (Triton; the interpreter on CPU) against the torch reference path."""

import pytest
import torch

from ds4x.model import norms, rope
from ds4x.model.attention import _emit_windows
from ds4x.model.cache import FloatCodec, RowStore

pytest.importorskip("triton")
from ds4x.kernels import compressor  # noqa: E402


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def interp(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("ratio, overlap, width, capacity", [(4, True, 128, 24), (4, True, 512, 16),
                                                             (16, False, 128, 40), (128, False, 512, 256)])
def test_emit_matches_reference(interp, monkeypatch, ratio, overlap, width, capacity):
    dev = _device()
    g = torch.Generator().manual_seed(ratio + width)
    kv = width * (2 if overlap else 1)
    store = RowStore(capacity, FloatCodec(2 * kv), torch.device(dev))
    store.data.copy_((torch.randn(capacity, 2 * kv, generator=g) * 2).to(dev))
    ape = torch.randn(ratio, kv, generator=g).to(dev)
    norm = (1 + 0.1 * torch.randn(width, generator=g)).to(dev)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)).to(dev)
    # window 0 (no previous window), a closed window and the open one (its last slots not written yet)
    last = torch.tensor(capacity + 2 * ratio + ratio // 2, device=dev)
    windows = torch.tensor([0, int(last) // ratio - 1, int(last) // ratio], device=dev)
    got = compressor.emit_windows_fused(store.data, windows, last, ape, norm, inv, 1.25, ratio, overlap, width, 1e-6)
    monkeypatch.setattr(norms, "use_triton", lambda device: False)
    monkeypatch.setattr(rope, "use_triton", lambda device: False)
    pooled = _emit_windows(store, ape, windows, last, ratio, overlap, width)
    cos, sin = rope.cos_sin((inv, 1.25), windows * ratio)
    want = rope.apply_rope(norms.rms_norm(pooled, norm, 1e-6), cos, sin)
    assert got.shape == want.shape == (3, width)
    assert float((got - want).abs().max()) <= 2e-5 * float(want.abs().max())


def test_emit_from_a_batch_of_rings_is_each_ring_alone(interp):
    """A batched decode step: window i from ring i up to its own last position, the bits of one call per ring."""
    dev = _device()
    g = torch.Generator().manual_seed(11)
    ratio, width, capacity = 4, 128, 24
    rings = (torch.randn(3, capacity, 4 * width, generator=g) * 2).to(dev)
    ape = torch.randn(ratio, 2 * width, generator=g).to(dev)
    norm = (1 + 0.1 * torch.randn(width, generator=g)).to(dev)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)).to(dev)
    last = torch.tensor([2, 29, 45], device=dev)
    windows = last // ratio
    got = compressor.emit_windows_fused(rings, windows, last, ape, norm, inv, 1.25, ratio, True, width, 1e-6)
    for i in range(3):
        alone = compressor.emit_windows_fused(rings[i], windows[i : i + 1], last[i], ape, norm, inv, 1.25, ratio, True,
                                              width, 1e-6)
        assert torch.equal(got[i : i + 1], alone)
    # the arrival counters are kept between calls: each call leaves them at zero, and a repeat gives the same bits
    assert torch.equal(compressor.emit_windows_fused(rings, windows, last, ape, norm, inv, 1.25, ratio, True, width,
                                                     1e-6), got)
    assert not bool(compressor._arrival_counters(rings.device, 3).any())
    with pytest.raises(ValueError, match="one window and one last position per ring"):
        compressor.emit_windows_fused(rings, windows[:2], last[:2], ape, norm, inv, 1.25, ratio, True, width, 1e-6)


@pytest.mark.gpu
def test_emit_from_a_batch_of_rings_on_gpu():
    test_emit_from_a_batch_of_rings_is_each_ring_alone(None)
