"""``ds4x convert`` streams: a lazy checkpoint gives the same GGUF bytes as loading it all, one tensor at a time;
synthetic files keep their bytes on the CPU and only switch the generator's device for CUDA."""

from __future__ import annotations

import argparse
import hashlib
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("gguf")

from ds4x.cli import convert  # noqa: E402
from ds4x.config import tiny_config  # noqa: E402
from ds4x.formats.ggml import GGMLQuantizationType as T  # noqa: E402
from ds4x.weights import checkpoint  # noqa: E402
from ds4x.weights.checkpoint import (  # noqa: E402
    CheckpointError,
    LazyCheckpoint,
    load_checkpoint,
    open_checkpoint,
    save_checkpoint,
    to_official_names,
)
from ds4x.weights.gguf_writer import encode_tensor, write_gguf, write_synthetic_gguf  # noqa: E402
from ds4x.weights.synthetic import synthetic_weights  # noqa: E402
from tests.test_official_quantized import FP4_NAMES, FP8_NAMES, quantize_fp4, quantize_fp8  # noqa: E402

CFG = tiny_config()


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    convert.add_parser(parser.add_subparsers(dest="command"))
    return convert.run(parser.parse_args(["convert", *argv]))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same model stored three ways: official (sharded), transformers, official with FP8 weights and
    the routed experts of a hash and a score-routed layer in FP4 (bf16 for the rest; quantizing every
    expert would only slow the test)."""
    root = tmp_path_factory.mktemp("ckpt")
    w = synthetic_weights(CFG, seed=1)
    save_checkpoint(CFG, w, root / "official", naming="official", shard_bytes=400_000)
    save_checkpoint(CFG, w, root / "hf", naming="hf")
    stored: dict[str, torch.Tensor] = {}
    for name, t in to_official_names(w).items():
        base = name[: -len(".weight")]
        if FP8_NAMES.search(name):
            stored[name], stored[base + ".scale"], _ = quantize_fp8(t)
        elif FP4_NAMES.search(name) and name.startswith(("layers.0.", "layers.4.")):
            stored[name], stored[base + ".scale"], _ = quantize_fp4(t)
        else:
            stored[name] = t.to(torch.bfloat16) if t.is_floating_point() and t.dim() == 2 else t
    save_checkpoint(CFG, {}, root / "fp8_fp4")  # config.json
    save_file(stored, str(root / "fp8_fp4" / "model.safetensors"))
    return root


# f32 writes the loaded values as they are, so equal files mean equal tensors; q8 adds the block encoder
@pytest.mark.parametrize("kind, mix", [("official", "f32"), ("hf", "f32"), ("fp8_fp4", "f32"), ("fp8_fp4", "q8")])
def test_streamed_convert_equals_loading_everything(checkpoints, tmp_path, kind, mix):
    src = checkpoints / kind
    assert _run(str(src), str(tmp_path / "lazy.gguf"), "--mix", mix, "-q") == 0
    cfg, weights = load_checkpoint(src)  # the former path: the whole model in RAM as float32
    write_gguf(tmp_path / "eager.gguf", cfg, weights, mix, name=f"ds4x convert of {src.name}")
    assert (tmp_path / "lazy.gguf").read_bytes() == (tmp_path / "eager.gguf").read_bytes()


class _LiveCounter:
    """Counts tensors alive at once (each dies when its Python object is collected)."""

    def __init__(self) -> None:
        self.live = self.peak = self.calls = 0
        self.live_bytes = self.peak_bytes = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.calls += 1
        self.live += 1
        self.live_bytes += n
        self.peak, self.peak_bytes = max(self.peak, self.live), max(self.peak_bytes, self.live_bytes)
        weakref.finalize(t, self._gone, n)
        return t

    def _gone(self, n: int) -> None:
        self.live -= 1
        self.live_bytes -= n


@pytest.mark.parametrize("kind", ["official", "hf", "fp8_fp4"])
def test_convert_holds_one_tensor_at_a_time(checkpoints, tmp_path, monkeypatch, kind):
    src = checkpoints / kind
    ckpt = open_checkpoint(src)
    largest = max(t.numel() * t.element_size() for t in (ckpt.load(n) for n in ckpt))
    read, loaded = _LiveCounter(), _LiveCounter()
    get, load = checkpoint._SafetensorsDir.get, LazyCheckpoint.load
    monkeypatch.setattr(checkpoint._SafetensorsDir, "get", lambda self, *a, **k: read.track(get(self, *a, **k)))
    monkeypatch.setattr(LazyCheckpoint, "load", lambda self, *a, **k: loaded.track(load(self, *a, **k)))
    assert _run(str(src), str(tmp_path / "c.gguf"), "--mix", "f16", "-q") == 0
    assert loaded.calls == len(ckpt)  # every canonical tensor read exactly once
    assert loaded.peak == 1 and loaded.peak_bytes <= largest
    # from disk: a weight and its scale at most (one expert's while a stacked tensor is assembled)
    assert read.peak <= 2 and read.calls >= len(ckpt)

    # the same counter catches the former path, which held every tensor before writing
    loaded_all = _LiveCounter()
    weights = {n: loaded_all.track(load(ckpt, n)) for n in ckpt}
    write_gguf(tmp_path / "e.gguf", ckpt.cfg, weights, "f16")
    assert loaded_all.peak == len(ckpt)


def test_open_checkpoint_checks_headers_before_reading(checkpoints, tmp_path, monkeypatch):
    official = load_file(checkpoints / "fp8_fp4" / "model.safetensors")
    name = "layers.4.ffn.experts.3.w2.weight"
    official[name] = official[name][:, :16].contiguous()  # packed FP4 of half the width
    save_checkpoint(CFG, {}, tmp_path)
    save_file(official, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(checkpoint._SafetensorsDir, "get", lambda *a, **k: pytest.fail("read tensor data"))
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight' has shape \[128, 32\], expected \[128, 64\]"):
        open_checkpoint(tmp_path)
    ckpt = open_checkpoint(checkpoints / "hf")
    assert "layers.0.ffn.experts.w1" in ckpt and "nope" not in ckpt and len(ckpt) == len(ckpt.shapes)


@pytest.mark.parametrize("qt", [T.Q8_0, T.Q4_K, T.Q2_K, T.IQ2_XXS, T.F16])
def test_encoding_in_chunks_gives_the_same_bytes(qt):
    x = torch.randn(3, 5, 512, generator=torch.Generator().manual_seed(0))
    x[0, 0, :32] = 0  # an all-zero block
    whole = encode_tensor(x, qt)
    for chunk in (512, 3 * 512, 10**9):  # a row, rows that do not divide the leading dims, everything
        assert torch.equal(encode_tensor(x, qt, chunk_values=chunk), whole)


# SHA-256 of the tensor data of write_synthetic_gguf(256-wide tiny, "q2", seed=3) as the CPU path wrote it before
# the device switch (torch CPU generator; the metadata is left out so unrelated key changes do not matter)
_SYNTHETIC_Q2_SEED3 = "1750a746c89b95e05ca85b70a1ad788686c40ef175d4a1df422f813a9e491b58"


def test_synthetic_cpu_bytes_unchanged(tmp_path, capsys):
    from gguf import GGUFReader

    # rows of 256 values, so the q2 mix's K-quant and IQ2_XXS blocks fit
    write_synthetic_gguf(tmp_path / "a.gguf", CFG.replace(hidden_size=256, moe_intermediate_size=256), "q2", seed=3)
    data = (tmp_path / "a.gguf").read_bytes()
    assert hashlib.sha256(data[GGUFReader(tmp_path / "a.gguf").data_offset :]).hexdigest() == _SYNTHETIC_Q2_SEED3
    assert _run("--synthetic", "tiny", "--mix", "q8", "--out", str(tmp_path / "b.gguf"), "--seed", "2") == 0
    err = capsys.readouterr().err
    assert "GiB/s" in err and "[178/178]" in err and "wrote" in err  # progress: tensor i/n, GiB, rate; size
    assert _run("--synthetic", "tiny", "--mix", "q8", "--out", str(tmp_path / "c.gguf"), "--seed", "2",
                "--device", "cpu", "-q") == 0
    assert (tmp_path / "b.gguf").read_bytes() == (tmp_path / "c.gguf").read_bytes()
    with pytest.raises(ValueError, match="--synthetic only"):
        _run(str(tmp_path), str(tmp_path / "d.gguf"), "--device", "cuda")


@pytest.mark.gpu
def test_synthetic_gguf_made_on_cuda_equals_the_in_memory_model(tmp_path):
    """The CUDA file holds the bytes synthetic_quantized_weights builds on the same GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ds4x.formats.ggml_tensor import GGMLTensor
    from ds4x.weights.gguf import load_gguf
    from ds4x.weights.synthetic_gguf import synthetic_quantized_weights

    cfg = CFG.replace(hidden_size=256, moe_intermediate_size=256)
    write_synthetic_gguf(tmp_path / "g.gguf", cfg, "q2", seed=5, device="cuda")
    _, from_file, _ = load_gguf(tmp_path / "g.gguf", dtype=torch.bfloat16)
    built = synthetic_quantized_weights(cfg, "q2", seed=5, dtype=torch.bfloat16, device="cuda")
    for name, a in built.items():
        b = from_file[name]
        if isinstance(a, GGMLTensor):
            assert torch.equal(a.raw.cpu(), b.raw), name
        else:
            assert torch.equal(a.cpu(), b), name


def test_a_terminated_convert_leaves_no_partial_file(tmp_path):
    """`timeout` or `kill` (SIGTERM) halfway through a long convert: exit 143 and nothing left in the output's
    folder (the hidden partial file, gigabytes for Flash, removed), as Ctrl-C already did."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    out = tmp_path / "flash.gguf"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "ds4x", "convert", "--synthetic", "flash", "--mix", "q2", "--out",
                             str(out), "-q"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(p.stat().st_size > 2**20 for p in tmp_path.glob(".flash.gguf.*.partial")):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no partial file grew within 120 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "terminated" in err
    assert list(tmp_path.iterdir()) == []
