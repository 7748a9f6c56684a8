"""The int8 tensor-core Q8_0 kernel (kernels/q8_mma.py): its torch reference against float64, the activation
quantizer in the Triton interpreter against its torch form (bit for bit), the host wrapper's checks, an offline
sm_90 compile (slow), and on a Hopper GPU the kernel against the reference (bit for bit) and batch invariance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds4x.formats.ggml import GGMLQuantizationType as T
from ds4x.formats.ggml import random_blocks
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.formats.triton_mode import interpret_mode
from ds4x.kernels import q8_mma as qm

INT8_TOL = 2e-2  # int8 activations, as tests/test_quant_matmul.py (measured ~5e-3 on random data)


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all()
    return float((y.double() - ref).norm() / ref.norm())


def q8_weight(n: int, k: int, seed: int = 0, device: str = "cpu") -> GGMLTensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return GGMLTensor(random_blocks(T.Q8_0, (n, k), g, device=device), T.Q8_0, (n, k)).split()


@pytest.mark.parametrize("groups,split", [(1, None), (1, 1), (1, 2), (4, None)])
def test_reference_matches_float64(groups: int, split: int | None) -> None:
    n, k, t = 48, 512, 5
    w = q8_weight(groups * n, k, seed=1)
    x = torch.randn(t, groups, k, generator=torch.Generator().manual_seed(2))
    x = x[:, 0] if groups == 1 else x
    y = qm.q8_mma_reference(x, w, groups, split)
    wd = w.dequantize(torch.float64).reshape(groups, n, k)
    ref = torch.einsum("tgk,gnk->tgn", x.double().reshape(t, groups, k), wd).reshape(t, groups * n)
    assert y.shape == (t, groups * n) and y.dtype == x.dtype
    assert rel(y, ref) < INT8_TOL


def test_reference_is_batch_invariant_and_groups_are_independent_products() -> None:
    n, k, groups = 32, 384, 3
    w = q8_weight(groups * n, k, seed=3)
    x = torch.randn(7, groups, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y = qm.q8_mma_reference(x, w, groups, split=3)
    for t in (0, 6):
        assert torch.equal(qm.q8_mma_reference(x[t : t + 1], w, groups, split=3)[0], y[t])
    for gi in range(groups):
        alone = qm.q8_mma_reference(x[:, gi], w[gi * n : (gi + 1) * n], 1, split=3)
        assert torch.equal(alone, y[:, gi * n : (gi + 1) * n])


def test_config_depends_on_shape_only_and_divides_k() -> None:
    # the Flash Q8_0 shapes (N, K, groups)
    for n, k, groups in [(1024, 4096, 1), (32768, 1024, 1), (1024, 4096, 8), (4096, 8192, 1), (4096, 4096, 1),
                         (4096, 2048, 1)]:
        split = qm.q8_mma_config(n, k, groups)
        stages = k // (qm.BLOCK * qm.KB)
        assert stages % split == 0 and stages // split >= min(stages, qm.MIN_STAGES_PER_SLICE)
    assert qm.q8_mma_config(1024, 4096) == 8 and qm.q8_mma_config(32768, 1024) == 1


def _halfway_rows() -> torch.Tensor:
    # amax 127 gives inv = 1 exactly, so k + 0.5 is a tie for the rounding (half to even: 2.5 -> 2, 3.5 -> 4)
    tie = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -126.5] * 4)
    return torch.stack([tie, torch.zeros(32), -tie.flip(0)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_activations_32_matches_torch_bit_for_bit(dtype: torch.dtype) -> None:
    if not interpret_mode():
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 (set by conftest without CUDA)")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 256, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, codes 0
    x[2] = 0.0
    x = torch.cat([x, torch.cat([_halfway_rows(), torch.zeros(3, 224)], 1), torch.randn(40, 256, generator=g)])
    x = x.to(dtype)
    codes, scales = qm.quantize_activations_32(x)
    want_codes, want_scales = qm.quantize_activations_32_reference(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))
    assert codes[6, :8].tolist() == [127, 2, 4, -2, 0, 0, 2, -126]
    assert scales[2].abs().sum() == 0 and codes[2].abs().sum() == 0
    assert codes.abs().max() <= 127


def test_quantize_activations_32_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        qm.quantize_activations_32(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="float32"):
        qm.quantize_activations_32(torch.zeros(2, 64, dtype=torch.int32))


def test_wrapper_checks() -> None:
    w = q8_weight(64, 256)
    x = torch.zeros(2, 256)
    with pytest.raises(ValueError, match="Q8_0 GGMLTensor"):
        qm.q8_mma_linear(x, GGMLTensor(random_blocks(T.Q2_K, (64, 256)), T.Q2_K, (64, 256)))
    with pytest.raises(ValueError, match="Q8_0 GGMLTensor"):
        qm.q8_mma_linear(x, torch.zeros(64, 256))
    with pytest.raises(ValueError, match="split row layout"):
        qm.q8_mma_linear(x, w.blocks())
    with pytest.raises(ValueError, match="2-D"):
        qm.q8_mma_linear(x, GGMLTensor(random_blocks(T.Q8_0, (2, 64, 256)), T.Q8_0, (2, 64, 256)).split())
    with pytest.raises(ValueError, match="multiple of 128"):
        qm.q8_mma_linear(torch.zeros(2, 160), q8_weight(64, 160))
    with pytest.raises(ValueError, match="multiple of 256"):  # whole stages, but rows of 408 bytes
        qm.q8_mma_linear(torch.zeros(2, 384), q8_weight(64, 384))
    with pytest.raises(ValueError, match="groups do not divide"):
        qm.q8_mma_linear(x, w, groups=3)
    with pytest.raises(ValueError, match="K = 256"):
        qm.q8_mma_linear(torch.zeros(2, 128), w)
    with pytest.raises(ValueError, match=r"\[T, groups, K\]"):
        qm.q8_mma_linear(x, w, groups=2)
    with pytest.raises(ValueError, match="float32"):
        qm.q8_mma_linear(x.to(torch.int32), w)
    with pytest.raises(ValueError, match="at least one token"):
        qm.q8_mma_linear(torch.zeros(0, 256), w)
    shifted = torch.empty(w.raw.numel() + 8, dtype=torch.uint8)[8:].view(w.raw.shape)  # 8 bytes past an allocation
    shifted.copy_(w.raw)
    with pytest.raises(ValueError, match="16-byte aligned"):
        qm.q8_mma_linear(x, GGMLTensor(shifted, T.Q8_0, (64, 256), "split"))
    if qm.HAVE_GLUON:
        with pytest.raises(ValueError, match="CUDA device"):
            qm.q8_mma_linear(x, w)


@pytest.mark.slow
@pytest.mark.skipif(not qm.HAVE_GLUON, reason="needs Triton's Gluon")
def test_kernel_compiles_for_sm90_to_imma_without_spills(tmp_path: Path) -> None:
    """Offline (no GPU, a few seconds): scripts/kernel_sass.py compiles the Gluon kernel for sm_90 and checks for
    IMMA and LDGSTS, no local memory, no FFMA (the reference's separate products and sums), IEEE divisions in the
    quantizer. A fresh process: after the interpreter has run kernels in this one, Triton's language stays
    patched and a compile here fails."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    script = str(root / "scripts" / "kernel_sass.py")
    out = subprocess.run([sys.executable, script, "q8_mma", "--bt", "16,32", "--split", "1,4", "--dump", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    loops = [line for line in out.stdout.splitlines() if line.strip().startswith("loop:")]
    assert [f"IMMA {qm.KB * bt // 8}," in line for line, bt in zip(loops, (16, 32, 16, 32), strict=True)] == [True] * 4


_ONE_TOKEN_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from ds4x.kernels import q8_mma as qm
args = ("xq_ptr", "xs_ptr", "w_ptr", "y_ptr", "part_ptr", "count_ptr", "N", "K", "row_bytes", "n_tok", "groups",
        "stride_y")
ptrs = {"xq_ptr": "*i8", "xs_ptr": "*fp32", "w_ptr": "*u8", "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
sig = {a: ptrs.get(a, "i32") for a in args}
consts = {"n_tok": 1, "groups": 1, "BT": 8, "KB": qm.KB, "STAGES": qm.STAGES, "SPLIT": 8, "num_warps": qm.NUM_WARPS}
sig.update(dict.fromkeys(consts, "constexpr"))
attrs = {(args.index(a),): [["tt.divisibility", 16]] for a in ("xq_ptr", "w_ptr", "K", "row_bytes")}
triton.compile(GluonASTSource(qm._q8_mma_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
               options={"num_warps": qm.NUM_WARPS, "enable_fp_fusion": False})
"""


@pytest.mark.slow
@pytest.mark.skipif(not qm.HAVE_GLUON, reason="needs Triton's Gluon")
def test_kernel_compiles_for_one_token_with_split_k() -> None:
    """Triton passes an int argument equal to 1 as a constexpr: one token (n_tok = 1) and groups = 1 with split-K
    (wq_a at T = 1) must compile for sm_90 (offline, in a fresh process as above)."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    out = subprocess.run([sys.executable, "-c", _ONE_TOKEN_COMPILE], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]


# ---- GPU -----------------------------------------------------------------------------------------------------------


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and qm.HAVE_GLUON


FLASH = {"wq_a": (1024, 4096, 1), "wq_b": (32768, 1024, 1), "wo_a": (1024, 4096, 8), "wo_b": (4096, 8192, 1),
         "shared_gate_up": (4096, 4096, 1), "shared_down": (4096, 2048, 1)}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("shape", list(FLASH))
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 16, 32])
def test_kernel_matches_reference_bit_for_bit_on_gpu(shape: str, tokens: int) -> None:
    """Exact integer block dots, then the reference's float32 products and sums in the same order (compiled without
    FMA contraction, IEEE divisions in the quantizer): the same bits. Also close to float64."""
    n, k, groups = FLASH[shape]
    dev = "cuda"
    w = q8_weight(groups * n, k, seed=7, device=dev)
    g = torch.Generator(device=dev).manual_seed(8)
    x = torch.randn(tokens, groups, k, device=dev, generator=g).to(torch.bfloat16)
    x = x[:, 0] if groups == 1 else x
    y = qm.q8_mma_linear(x, w, groups)
    ref = qm.q8_mma_reference(x, w, groups)
    assert torch.equal(y, ref), float((y.float() - ref.float()).abs().max())
    wd = w.dequantize(torch.float64).reshape(groups, n, k)
    dense = torch.einsum("tgk,gnk->tgn", x.double().reshape(tokens, groups, k), wd).reshape(tokens, groups * n)
    assert rel(y, dense) < INT8_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("split,num_warps,stages", [(1, 4, 3), (4, 4, 3), (2, 2, 4), (8, 8, 2)])
def test_kernel_configurations_and_ragged_rows_on_gpu(split: int, num_warps: int, stages: int) -> None:
    """Tuning knobs give the reference's bits for their split; N not a multiple of the row tile, float32 / fp16 x."""
    w = q8_weight(200, 2048, seed=9, device="cuda")
    for dtype, tokens in [(torch.float32, 3), (torch.float16, 19)]:
        x = torch.randn(tokens, 2048, device="cuda").to(dtype)
        y = qm.q8_mma_linear(x, w, split=split, num_warps=num_warps, stages=stages)
        assert torch.equal(y, qm.q8_mma_reference(x, w, split=split))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU and Gluon")
def test_kernel_is_batch_invariant_on_gpu() -> None:
    """Token t's row has the same bits alone (T = 1) as in a call of 8 or 32 tokens; repeated calls too (the split-K
    counters reset themselves)."""
    w = q8_weight(1024, 4096, seed=10, device="cuda")  # split-K 8
    x = torch.randn(32, 4096, device="cuda").to(torch.bfloat16)
    y32 = qm.q8_mma_linear(x, w)
    y8 = qm.q8_mma_linear(x[:8], w)
    assert torch.equal(y8, y32[:8])
    for t in (0, 3, 7):
        assert torch.equal(qm.q8_mma_linear(x[t : t + 1], w)[0], y8[t])
    assert torch.equal(qm.q8_mma_linear(x, w), y32)


def test_batched_q8_0_products_go_to_the_kernel_where_switched_on(monkeypatch) -> None:
    """With ``quant_matmul.Q8_MMA`` and mirrors on, 2-32 rows of a split Q8_0 product (plain and grouped) call
    ``q8_mma_linear``; one row, 33 rows, or the switch off do not."""
    from ds4x.kernels import quant_matmul

    calls = []

    def fake(x, w, groups=1):
        calls.append((tuple(x.shape), groups))
        return torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype)

    monkeypatch.setattr(qm, "serves", lambda w, groups=1: True)
    monkeypatch.setattr(qm, "q8_mma_linear", fake)
    monkeypatch.setitem(quant_matmul._mirrors, "on", True)
    monkeypatch.setattr(quant_matmul, "Q8_MMA", True)
    w = q8_weight(64, 256)
    assert quant_matmul._q8_mma_serves(w, 8, 1, None) == quant_matmul.int8_activations(T.Q8_0)
    monkeypatch.setenv("DS4X_QUANT_ACT", "int8")
    assert quant_matmul.quant_linear(torch.randn(8, 256), w).shape == (8, 64)
    assert quant_matmul.quant_grouped_linear(torch.randn(3, 4, 256), w, 4).shape == (3, 4, 16)
    assert calls == [((8, 256), 1), ((3, 4, 256), 4)]
    assert not quant_matmul._q8_mma_serves(w, 1, 1, None) and not quant_matmul._q8_mma_serves(w, 33, 1, None)
    assert not quant_matmul._q8_mma_serves(w, 8, 1, False)  # float activations keep the other paths
    monkeypatch.setattr(quant_matmul, "Q8_MMA", False)
    assert not quant_matmul._q8_mma_serves(w, 8, 1, None)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU and Gluon")
def test_switched_on_quant_linear_gives_the_kernels_bits_on_gpu(monkeypatch) -> None:
    """The batched step's entry points with ``Q8_MMA`` on (mirrors on, as the server's pool runs): the kernel's bits
    for a plain and a grouped product of 8 rows."""
    from ds4x.kernels import quant_matmul

    monkeypatch.setitem(quant_matmul._mirrors, "on", True)
    monkeypatch.setattr(quant_matmul, "Q8_MMA", True)
    monkeypatch.setenv("DS4X_QUANT_ACT", "int8")
    w = q8_weight(8 * 1024, 4096, seed=11, device="cuda")
    x = torch.randn(8, 4096, device="cuda").to(torch.bfloat16)
    assert torch.equal(quant_matmul.quant_linear(x, w), qm.q8_mma_reference(x, w))
    xg = torch.randn(8, 8, 4096, device="cuda").to(torch.bfloat16)
    assert torch.equal(quant_matmul.quant_grouped_linear(xg, w, 8).reshape(8, -1), qm.q8_mma_reference(xg, w, 8))


def test_counter_ring_runs_and_refuses_a_capture(monkeypatch) -> None:
    """Each call takes the next run of the ring (wrapping at its end); the ring is never first made in a capture."""
    dev = torch.device("cpu")  # the ring's bookkeeping is device-agnostic
    monkeypatch.setattr(qm, "_COUNTERS", {})
    monkeypatch.setattr(qm, "_NEXT_COUNTER", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="not in a capture"):
        qm._counters(dev, 4)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    a, b = qm._counters(dev, 4), qm._counters(dev, 6)
    assert a.data_ptr() + 4 * 4 == b.data_ptr() and not a.any() and not b.any()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # made already: fine in a capture
    c = qm._counters(dev, qm._COUNTER_SLOTS - 5)  # does not fit after the 10 taken: starts over
    assert c.data_ptr() == a.data_ptr()
