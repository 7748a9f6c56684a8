"""Working dtypes and devices: the reference path runs in bf16/fp16 and on CUDA."""

import pytest
import torch

from ds4x.runtime.engine import Engine


def _logits(device, dtype, cache="float"):
    engine = Engine.load("tiny", device=device, dtype=dtype)
    s = engine.new_session(ctx=128, cache=cache)
    ids = torch.randint(3, 259, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    return s.prefill(ids, chunk=16).float().cpu()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(dtype):
    ref = _logits("cpu", "float32")
    half = _logits("cpu", dtype)
    assert torch.isfinite(half).all()
    rel = float((half - ref).abs().max() / ref.abs().max())
    assert rel < 0.15, rel


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["float", "native"])
def test_cuda_matches_cpu(cache):
    cpu = _logits("cpu", "float32", cache)
    gpu = _logits("cuda", "float32", cache)
    rel = float((gpu - cpu).abs().max() / cpu.abs().max())
    assert rel < (1e-4 if cache == "float" else 2e-2), rel
