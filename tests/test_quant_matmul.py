"""Triton quantized products vs dequantize-then-matmul in float64.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set per test by a fixture so it does
not leak into other tests; quant_matmul loads a private interpreter copy of itself when the mode
differs from the one it was imported under). ``gpu`` tests run the compiled kernels at real shapes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("gguf")  # the IQ2_XXS grid

from ds4x.formats.ggml import GGMLQuantizationType as T  # noqa: E402
from ds4x.formats.ggml import random_blocks  # noqa: E402
from ds4x.formats.ggml_tensor import GGMLTensor  # noqa: E402
from ds4x.kernels import quant_matmul as qm  # noqa: E402

TYPES = [T.Q8_0, T.Q2_K, T.Q4_K, T.IQ2_XXS]
INT8_TYPES = [T.Q8_0, T.Q2_K, T.IQ2_XXS]  # types whose matvec has an int8-activation path beside the float one
MV = (16, 64, 2)  # the interpreter runs every program in numpy: few programs and K steps, each a few ops
MM = (16, 16, 64, 4)
INT8_TOL = 2e-2  # int8 activations (16 per scale): measured ~5e-3 relative error on random data


@pytest.fixture
def interp(monkeypatch):
    """The interpreter, per test (a module-wide TRITON_INTERPRET would also send this file's GPU tests to it). On a
    CUDA machine Triton has loaded in compiled mode and its interpreter cannot run these kernels' nested helpers
    (see tests/conftest.py): those cases are skipped there; the ``gpu`` tests cover the compiled kernels."""
    if torch.cuda.is_available():
        pytest.skip("interpreter case: Triton is loaded in compiled mode on a CUDA machine")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all()
    return float((y.double() - ref).norm() / ref.norm())


def weight(qt, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return GGMLTensor(random_blocks(qt, shape, g), qt, shape)


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,force,cfg", [(1, "mv", MV), (2, "mv", MV), (5, "mm", MM)])
def test_linear_interpreter(interp, qt, m, force, cfg):
    # three K steps of the skinny kernel; N = 9 is not a multiple of R / BN (rows past N are read, not stored)
    w = weight(qt, (9, 768), seed=int(qt) * 10 + m)
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(m))
    y = qm.quant_linear(x, w, config=cfg, force=force, int8=False)
    assert y.shape == (m, 9) and y.dtype == torch.float32
    assert rel(y, x.double() @ w.dequantize().double().T) < 1e-6


@pytest.mark.parametrize("qt", INT8_TYPES, ids=lambda t: t.name)
def test_int8_activations_interpreter(interp, qt):
    # the int8-activation matvec: a tolerance, not exactness; rows are independent (batch invariance)
    w = weight(qt, (9, 512), seed=int(qt) + 40)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(41))
    y = qm.quant_linear(x, w, config=MV, force="mv", int8=True)
    assert rel(y, x.double() @ w.dequantize().double().T) < INT8_TOL
    assert torch.equal(qm.quant_linear(x[1:], w, config=MV, force="mv", int8=True)[0], y[1])
    if qt == T.Q8_0:  # the split rows the model runs give the same bits
        assert torch.equal(qm.quant_linear(x, qm.kernel_layout(w), config=MV, force="mv", int8=True), y)


def test_int8_activation_default(monkeypatch):
    monkeypatch.delenv("DS4X_QUANT_ACT", raising=False)
    assert qm.int8_activations(T.Q2_K) and qm.int8_activations(T.IQ2_XXS) and qm.int8_activations(T.Q8_0)
    assert not qm.int8_activations(T.IQ2_XXS, False) and qm.int8_activations(T.Q8_0, True)
    assert not qm.int8_activations(T.Q4_K, True)  # Q4_K has the float matvec only
    monkeypatch.setenv("DS4X_QUANT_ACT", "float")
    assert not qm.int8_activations(T.Q2_K) and not qm.int8_activations(T.Q8_0) and qm.int8_activations(T.Q2_K, True)
    monkeypatch.setenv("DS4X_QUANT_ACT", "int8")
    assert qm.int8_activations(T.Q2_K) and qm.int8_activations(T.IQ2_XXS) and qm.int8_activations(T.Q8_0)
    assert not qm.int8_activations(T.Q4_K) and not qm.int8_activations(T.IQ2_XXS, False)


@pytest.mark.parametrize("qt", [T.Q8_0, T.IQ2_XXS], ids=lambda t: t.name)
def test_unit_count_not_a_power_of_two_interpreter(interp, qt):
    # K = 320 (Q8_0: 40 units of 8) / 1280 (IQ2_XXS: 40 units of 32): a K step of 64 units shrinks to 8
    k = 320 if qt == T.Q8_0 else 1280
    w = weight(qt, (3, k), seed=7)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(8))
    for force, cfg in (("mv", (4, 64, 2)), ("mm", (16, 16, 256, 4))):
        y = qm.quant_linear(x, w, config=cfg, force=force, int8=False)
        assert rel(y, x.double() @ w.dequantize().double().T) < 1e-6


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens,force,cfg", [(1, "mv", MV), (4, "mm", MM)])
def test_routed_interpreter(interp, qt, tokens, force, cfg):
    n_exp, n, k = 5, 12, 512
    w = weight(qt, (n_exp, n, k), seed=int(qt) + tokens)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, k, generator=g)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:3] for _ in range(tokens)])
    ref = torch.einsum("tk,tjnk->tjn", x.double(), w.dequantize().double()[ids])
    y = qm.quant_matmul_routed(x, w, ids, config=cfg, force=force, int8=False)
    assert y.shape == (tokens, 3, n)
    assert rel(y, ref) < 1e-6
    if qt in INT8_TYPES and force == "mv":
        assert rel(qm.quant_matmul_routed(x, w, ids, config=cfg, force=force, int8=True), ref) < INT8_TOL


@pytest.mark.parametrize("force,cfg", [("mv", MV), ("mm", MM)])
def test_grouped_interpreter(interp, force, cfg):
    w = weight(T.Q8_0, (4 * 4, 256), seed=21)
    x = torch.randn(2, 4, 256, generator=torch.Generator().manual_seed(22))
    y = qm.quant_grouped_linear(x, w, 4, config=cfg, force=force, int8=False)
    ref = torch.einsum("tgi,goi->tgo", x.double(), w.dequantize().double().view(4, 4, 256))
    assert rel(y, ref) < 1e-6
    if force == "mv":  # the default for Q8_0: int8 activations
        assert rel(qm.quant_grouped_linear(x, w, 4, config=cfg, force=force), ref) < INT8_TOL


def _quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] as `quantize_activations` leaves it (codes times their 16-value scales), in float64."""
    xq = qm.quantize_activations(x)
    codes = xq.codes.contiguous().view(torch.int8).double().view(x.shape[0], -1, 16)
    return (codes * xq.scales.double()[..., None]).view(x.shape)


def test_token_tile_interpreter(interp):
    # batched rows with mirrors on: 2 .. TOKEN_TILE_MAX_ROWS rows of split Q8_0 rows take the token tile, whose
    # sums are those of the weights times x quantized per 16 values (float32 rounding only); N = 9 is not a
    # multiple of its 4 rows, and 3 / 5 rows leave tokens of the tile unused
    w = qm.kernel_layout(weight(T.Q8_0, (9, 768), seed=71))
    wd = w.dequantize().double()
    x = torch.randn(qm.TOKEN_TILE_MAX_ROWS + 1, 768, generator=torch.Generator().manual_seed(72))
    qm.use_dense_mirrors(True)
    try:
        for m in (2, 3, 5):
            assert qm._token_tile_tokens(w, m, None) == (4 if m == 3 else 8 if m == 5 else m)
            y = qm.quant_linear(x[:m], w)
            assert rel(y, _quantized_rows(x[:m]) @ wd.T) < 1e-6, m
            assert rel(y, x[:m].double() @ wd.T) < INT8_TOL, m
        assert not qm._token_tile_tokens(w, 1, None)
        assert not qm._token_tile_tokens(w, qm.TOKEN_TILE_MAX_ROWS + 1, None)
        assert not qm._token_tile_tokens(w, 2, False)  # float activations keep the matvec
        assert not qm._token_tile_tokens(weight(T.Q8_0, (9, 768), seed=71), 2, None)  # the file's blocks
        gw = qm.kernel_layout(weight(T.Q8_0, (4 * 12, 256), seed=73))
        xg = torch.randn(3, 4, 256, generator=torch.Generator().manual_seed(74))
        yg = qm.quant_grouped_linear(xg, gw, 4)
        ref = torch.einsum("tgi,goi->tgo", _quantized_rows(xg.reshape(12, 256)).view(3, 4, 256),
                           gw.dequantize().double().view(4, 12, 256))
        assert yg.shape == (3, 4, 12) and rel(yg, ref) < 1e-6
    finally:
        qm.use_dense_mirrors(False)
    assert not qm._token_tile_tokens(w, 2, None)  # mirrors off: each row alone (batch invariance)
    assert qm.token_tile_config(32768, 1, 8, 64) == (4, 32, 1)
    assert qm.token_tile_config(4096, 1, 4, 512) == (4, 64, 2)
    assert qm.token_tile_config(1024, 1, 2, 256) == (4, 128, 4)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
def test_dense_token_tile_interpreter(interp, wdtype):
    # 2 .. DENSE_TOKEN_TILE_MAX_ROWS rows of 16-bit x times a dense 16-bit weight, each weight read once for all rows:
    # float32 sums of the exact products (`linear` sends such rows there on CUDA: test_gpu_dense_matvec_and_dispatch)
    g = torch.Generator().manual_seed(81)
    w = (torch.randn(9, 96, generator=g) * 0.05).to(wdtype)
    x = torch.randn(qm.DENSE_TOKEN_TILE_MAX_ROWS + 1, 96, generator=g).bfloat16()
    for m in (2, 3, qm.DENSE_TOKEN_TILE_MAX_ROWS):
        y = qm.dense_token_tile(x[:m], w)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 9)
        ref = x[:m].double() @ w.double().T
        assert float((y.double() - ref).abs().max()) <= 1e-2 * float(ref.abs().max()), m
    assert not qm.dense_token_tile_serves(x[:1], w) and not qm.dense_token_tile_serves(x, w)
    assert not qm.dense_token_tile_serves(x[:2].float(), w)
    with pytest.raises(ValueError, match="dense_token_tile"):
        qm.dense_token_tile(x, w)


def test_half_activations_interpreter(interp):
    w = weight(T.Q4_K, (16, 256), seed=31)
    for dt in (torch.float16, torch.bfloat16):
        for m, force, cfg in ((1, "mv", MV), (17, "mm", (32, 16, 128, 4))):
            x = torch.randn(m, 256, generator=torch.Generator().manual_seed(32)).to(dt)
            y = qm.quant_linear(x, w, config=cfg, force=force)
            assert y.dtype == dt
            assert rel(y, x.double() @ w.dequantize().double().T) < 1e-2


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_dequantize_gpu_interpreter(interp, qt):
    # the decode kernel gives the reference's float32 values exactly, for a whole weight, an expert slice and into
    # a larger scratch (bf16 is compared on the GPU: the interpreter truncates float32 -> bf16)
    w = weight(qt, (3, 40, 512), seed=int(qt) + 50)
    assert torch.equal(qm.dequantize_gpu(w, torch.float32), w.dequantize())
    scratch = torch.full((5 * 40 * 512,), float("nan"))
    assert torch.equal(qm.dequantize_gpu(w, torch.float32, slice(1, 3), out=scratch), w.dequantize()[1:3])
    assert torch.equal(qm.dequantize_gpu(w[2], torch.float32), w.dequantize()[2])


@pytest.mark.parametrize("qt", [T.Q8_0, T.IQ2_XXS])
def test_split_rows_interpreter(interp, qt):
    # rows split into codes and scales (the layout kernel_layout picks): every kernel gives the bits of the
    # file's block layout, which decodes the same values in the same order, in float and int8 activations
    k = 768 if qt == T.Q8_0 else 1024  # split rows stay 8-byte aligned
    w = weight(qt, (9, k), seed=61)
    s = qm.kernel_layout(w)
    assert s.layout == "split" and qm.supports(s)
    assert qm.kernel_layout(weight(T.Q8_0, (4, 320), seed=1)).layout == "blocks"  # codes not 8-byte aligned
    assert qm.kernel_layout(weight(T.Q4_K, (4, 256), seed=1)).layout == "blocks"
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(62))
    for m, force, cfg in ((1, "mv", MV), (2, "mv", (4, 32, 1)), (5, "mm", MM)):
        for int8 in (False, True):
            assert torch.equal(qm.quant_linear(x[:m], s, config=cfg, force=force, int8=int8),
                               qm.quant_linear(x[:m], w, config=cfg, force=force, int8=int8)), (m, force)
    assert torch.equal(qm.dequantize_gpu(s, torch.float32), w.dequantize())
    e = weight(qt, (5, 12, 512), seed=63)
    ids = torch.tensor([[0, 4, 2], [3, 3, 1]])
    for force, cfg in (("mv", MV), ("mm", MM)):
        assert torch.equal(qm.quant_matmul_routed(x[:2, :512], e.split(), ids, config=cfg, force=force),
                           qm.quant_matmul_routed(x[:2, :512], e, ids, config=cfg, force=force))
    assert torch.equal(qm.dequantize_gpu(e.split(), torch.float32, slice(1, 3)), e.dequantize()[1:3])
    gw = weight(qt, (16, 256), seed=64)
    xg = torch.randn(2, 4, 256, generator=torch.Generator().manual_seed(65))
    assert torch.equal(qm.quant_grouped_linear(xg, gw.split(), 4, config=MV, force="mv"),
                       qm.quant_grouped_linear(xg, gw, 4, config=MV, force="mv"))


def test_q8_0_weights_loaded_before_the_wait_interpreter(interp, monkeypatch):
    # PRELOAD_WEIGHTS: split Q8_0 rows whose whole K is one tile step load their words before the wait for
    # upstream; the same bits as the K loop, in float and int8 activations; a tile of two K steps keeps the loop, and
    # so does a launch with ids (grouped here; routed experts' ids come from upstream)
    s = qm.kernel_layout(weight(T.Q8_0, (9, 512), seed=71))
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(72))
    xg = torch.randn(2, 4, 128, generator=torch.Generator().manual_seed(73))
    gw = qm.kernel_layout(weight(T.Q8_0, (16, 128), seed=74))
    launches = []
    kernel = qm._kernels()._qmv_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append(kw["PRELOAD"])
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(qm._kernels(), "_qmv_kernel", Spy())
    for cfg in ((4, 64, 1), (4, 32, 1)):  # 64 units: all of K; 32: two steps
        for int8 in (False, True):
            monkeypatch.setattr(qm, "PRELOAD_WEIGHTS", False)
            ref = qm.quant_linear(x[:1], s, config=cfg, force="mv", int8=int8)
            ref_g = qm.quant_grouped_linear(xg, gw, 4, config=(4, 16, 1), force="mv", int8=int8)
            monkeypatch.setattr(qm, "PRELOAD_WEIGHTS", True)
            assert torch.equal(qm.quant_linear(x[:1], s, config=cfg, force="mv", int8=int8), ref)
            assert torch.equal(qm.quant_grouped_linear(xg, gw, 4, config=(4, 16, 1), force="mv", int8=int8), ref_g)
    assert launches == [False, False, True, False] * 2 + [False] * 8, launches


@pytest.mark.parametrize("qt", [T.IQ2_XXS, T.Q2_K, T.Q8_0], ids=lambda t: t.name)
def test_routed_swiglu_interpreter(interp, monkeypatch, qt):
    # gate / up experts stacked by expert [2E, N, K] in one launch: the bits of the stacked routed product and
    # then the SwiGLU kernel, in float and int8 activations, bf16 and float32, the file's blocks and split rows;
    # N = 9 is not a multiple of a program's R / 2 = 8 rows, and the limit clamps some gates and ups
    from ds4x.kernels.moe import swiglu_fused
    from ds4x.model.moe import stacked_slots

    n_exp, n, k, limit = 5, 9, 512, 0.25
    w13 = weight(qt, (2 * n_exp, n, k), seed=71)
    ids = torch.tensor([[0, 4, 2], [3, 3, 1]])
    g = torch.Generator().manual_seed(72)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, k, generator=g).to(dtype)
        for w in (w13, w13.split()) if qt != T.Q2_K else (w13,):
            for int8 in (False, True):
                gu = qm.quant_matmul_routed(x, w, stacked_slots(ids, n_exp), config=MV, force="mv", int8=int8)
                want = swiglu_fused(gu[:, :3], gu[:, 3:], limit)
                assert (gu.float().abs() > limit).any()
                got = qm.quant_routed_swiglu(x, w, ids, limit, config=MV, int8=int8)
                assert got.shape == (2, 3, n) and got.dtype == dtype
                assert torch.equal(got, want), (dtype, int8, w.layout)
                if qt == T.IQ2_XXS and int8:  # x quantized once beforehand: the same bits
                    xq = qm.quantize_activations(x)
                    assert xq.codes.shape == (2, k // 4) and xq.scales.shape == (2, k // 16)
                    assert torch.equal(qm.quant_routed_swiglu(x, w, ids, limit, config=MV, int8=int8, xq=xq), want)
                    with pytest.raises(ValueError, match="prepared int8 activations"):
                        qm.quant_routed_swiglu(x, w, ids, limit, config=MV, int8=False, xq=xq)
    prepared = qm.routed_swiglu_input(x, w13, 3)
    assert (prepared is not None) == (qt == T.IQ2_XXS and qm.int8_activations(qt))
    # past the matvec's range (prompts) the caller runs the product and SwiGLU apart
    monkeypatch.setitem(qm.ROUTED_MATVEC_MAX_ROWS, qt, 0)
    assert qm.quant_routed_swiglu(x, w13, ids, limit, config=MV) is None
    with pytest.raises(ValueError, match="w13"):
        qm.quant_routed_swiglu(x, weight(qt, (5, n, k), seed=1), ids, limit)


def test_routed_swiglu_decodes_each_expert_once_for_its_pairs_interpreter(interp, monkeypatch):
    # several tokens' pairs (a batched decode step, x quantized once): a program runs all pairs of its expert, two
    # at a time (an expert met by 5 pairs: three rounds, the last with one pair), with each pair's bits of the
    # launch of one program per pair; experts 5 and 6 are met once
    n_exp, n, k, limit = 7, 9, 512, 0.25
    w13 = weight(T.IQ2_XXS, (2 * n_exp, n, k), seed=73).split()
    ids = torch.tensor([[0, 1, 2], [0, 3, 4], [0, 1, 4], [2, 0, 3], [5, 0, 6]])
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(74)).to(torch.bfloat16)
    xq = qm.quantize_activations(x)
    monkeypatch.setattr(qm, "EXPERT_PAIRS_MIN", 2)  # 15 pairs here
    got = qm.quant_routed_swiglu(x, w13, ids, limit, config=MV, int8=True, xq=xq)
    monkeypatch.setattr(qm, "EXPERT_PAIRS", False)
    want = qm.quant_routed_swiglu(x, w13, ids, limit, config=MV, int8=True, xq=xq)
    assert torch.equal(got, want)
    assert (want.float().abs() > 0).all()  # every pair's row written


def test_routed_q2_k_reads_x_quantized_once_interpreter(interp, monkeypatch):
    # the routed down projection's form (one x row per pair) past Q2_K_PREPARED_MIN_PAIRS: x quantized once per row
    # with its groups' sums gives the bits of each program quantizing it; fewer pairs keep the per-program path
    n_exp, n, k = 5, 9, 512
    w = weight(T.Q2_K, (n_exp, n, k), seed=75)
    g = torch.Generator().manual_seed(76)
    ids = torch.randint(0, n_exp, (6, 1), generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6, k, generator=g).to(dtype)
        want = qm.quant_matmul_routed(x, w, ids, config=MV, force="mv", int8=True)
        xq = qm.quantize_activations(x, sums=True)
        assert xq.sums.shape == (6, k // 16) and torch.allclose(xq.sums, x.float().view(6, -1, 16).sum(-1), atol=1e-5)
        monkeypatch.setattr(qm, "Q2_K_PREPARED_ACTIVATIONS", True)
        monkeypatch.setattr(qm, "Q2_K_PREPARED_MIN_PAIRS", 6)
        calls = []
        monkeypatch.setattr(qm, "quantize_activations", lambda x, sums=False, f=qm.quantize_activations, c=calls:
                            c.append(sums) or f(x, sums))
        assert torch.equal(qm.quant_matmul_routed(x, w, ids, config=MV, force="mv", int8=True), want)
        assert calls == [True]
        monkeypatch.setattr(qm, "Q2_K_PREPARED_MIN_PAIRS", 7)
        assert torch.equal(qm.quant_matmul_routed(x, w, ids, config=MV, force="mv", int8=True), want)
        assert calls == [True]
        monkeypatch.undo()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="prepared int8 activations"):  # Q2_K needs the groups' sums
        qm._launch(x, w, ids, 1, 6, 1, 1, MV, "mv", True, xq=qm.quantize_activations(x))


def test_routed_grouped_interpreter(interp, monkeypatch):
    # bf16 activations past the routed matvec's range: bf16 experts + torch._grouped_mm, in slices of experts
    # (a 2-expert scratch here), with an expert no row picks
    monkeypatch.setattr(qm, "GROUPED_SCRATCH_BYTES", 2 * 16 * 256 * 2)
    n_exp, n, k = 5, 16, 256
    w = weight(T.IQ2_XXS, (n_exp, n, k), seed=61)
    g = torch.Generator().manual_seed(62)
    x = torch.randn(12, k, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(4, generator=g)[:3] for _ in range(12)])  # expert 4 unused
    assert 12 * 3 // n_exp > qm.ROUTED_MATVEC_MAX_ROWS[T.IQ2_XXS] and qm._grouped_path(x)
    ref = torch.einsum("tk,tjnk->tjn", x.double(), w.dequantize().double()[ids])
    y = qm.quant_matmul_routed(x, w, ids)
    assert y.shape == (12, 3, n) and y.dtype == torch.bfloat16
    assert rel(y, ref) < 1e-2
    # the down projection's form: one activation row per (token, slot) pair
    xd = torch.randn(36, k, generator=g).bfloat16()
    yd = qm.quant_matmul_routed(xd, w, ids.reshape(36, 1))
    assert rel(yd.view(36, n), torch.einsum("pk,pnk->pn", xd.double(), w.dequantize().double()[ids.reshape(36)])) < 1e-2


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_dense_matvec_interpreter(interp, monkeypatch, wdtype):
    """Dense 16-bit weights through the matvec: float32 sums of the exact weights, each row alone."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(9, 256, generator=g) * 0.5).to(wdtype)
    x = torch.randn(3, 256, generator=g)
    monkeypatch.setattr(qm, "matvec_config", lambda *a: (4, 8, 1))  # few programs for the interpreter
    y = qm.dense_linear(x, w)
    assert y.shape == (3, 9) and y.dtype == torch.float32
    assert rel(y, x.double() @ w.double().T) < 1e-6
    assert torch.equal(qm.dense_linear(x[1:2], w), y[1:2])  # a row's bits do not depend on the others
    assert qm.dense_linear(x.bfloat16(), w).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="cannot take"):
        qm.dense_linear(x, w.float())


def test_errors():
    w = weight(T.Q8_0, (8, 64), seed=1)
    with pytest.raises(ValueError, match="features"):
        qm.quant_linear(torch.randn(1, 32), w)
    with pytest.raises(TypeError, match="float32"):
        qm.quant_linear(torch.ones(1, 64, dtype=torch.int32), w)
    with pytest.raises(ValueError, match="no kernel for F16"):
        qm.quant_linear(torch.randn(1, 64), GGMLTensor(torch.zeros(8 * 128, dtype=torch.uint8), T.F16, (8, 64)))
    assert not qm.supports(w) or qm.interpret_mode()  # a CPU weight is served only by the interpreter


# ---- GPU: compiled kernels at real shapes --------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("qt,n,k", [
    (T.Q8_0, 1024, 4096), (T.Q8_0, 32768, 1024), (T.Q8_0, 4096, 8192),
    (T.IQ2_XXS, 2048, 4096), (T.Q2_K, 4096, 2048), (T.Q4_K, 2048, 4096),
])
def test_gpu_real_shapes(qt, n, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = GGMLTensor(random_blocks(qt, (n, k), g), qt, (n, k))
    wd = w.dequantize().double()
    mv_bound = INT8_TOL if qm.int8_activations(qt) else 1e-5
    for m, bound in ((1, mv_bound), (3, mv_bound), (qm.MATVEC_MAX_ROWS, mv_bound), (32, 3e-3), (64, 3e-3)):
        x = torch.randn(m, k, device="cuda", generator=g)
        y = qm.quant_linear(x, w)
        assert rel(y, x.double() @ wd.T) < bound, (m, qt.name)
        assert torch.equal(qm.quant_linear(x, qm.kernel_layout(w)), y), m  # split Q8_0 rows: the same bits
        if m == 3:  # the matvec computes each row alone: the same bits as a batch of one
            assert torch.equal(y[1], qm.quant_linear(x[1:2], w)[0])
            assert rel(qm.quant_linear(x, w, int8=False), x.double() @ wd.T) < 1e-5
    xb = torch.randn(64, k, device="cuda", generator=g).bfloat16()
    assert rel(qm.quant_linear(xb, w), xb.double() @ wd.T) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1024, 4096), (32768, 1024), (4096, 2048)])
def test_gpu_q8_0_weights_loaded_before_the_wait(monkeypatch, n, k):
    # PRELOAD_WEIGHTS at the Flash shapes whose tile covers K (wq_a, wq_b, the shared expert's down): the same bits,
    # in float and int8 activations, bf16 x
    g = torch.Generator(device="cuda").manual_seed(1)
    w = qm.kernel_layout(GGMLTensor(random_blocks(T.Q8_0, (n, k), g), T.Q8_0, (n, k)))
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    for int8 in (False, True):
        monkeypatch.setattr(qm, "PRELOAD_WEIGHTS", False)
        ref = qm.quant_linear(x, w, int8=int8)
        monkeypatch.setattr(qm, "PRELOAD_WEIGHTS", True)
        assert torch.equal(qm.quant_linear(x, w, int8=int8), ref), int8


@pytest.mark.gpu
def test_gpu_dequantize_and_grouped(monkeypatch):
    # bf16 decode bit-exact to the reference's rounding; the grouped routed path at a prefill-like shape (48 pairs
    # per expert) against float64 and the skinny kernel (on Hopper that shape goes to the tensor-core kernel, so
    # the grouped path is taken with it turned off, then the default is checked too)
    g = torch.Generator(device="cuda").manual_seed(3)
    for qt in TYPES:
        w = GGMLTensor(random_blocks(qt, (4, 256, 1024), g), qt, (4, 256, 1024))
        assert torch.equal(qm.dequantize_gpu(w), w.dequantize(torch.bfloat16)), qt.name
    w = GGMLTensor(random_blocks(T.IQ2_XXS, (16, 512, 1024), g), T.IQ2_XXS, (16, 512, 1024))
    x = torch.randn(128, 1024, device="cuda", generator=g).bfloat16()
    ids = torch.rand(128, 16, device="cuda", generator=g).topk(6, dim=1).indices
    ref = torch.einsum("tk,tjnk->tjn", x.double(), w.dequantize().double()[ids])
    assert qm._grouped_path(x)
    default = qm.quant_matmul_routed(x, w, ids)
    monkeypatch.setenv("DS4X_ROUTED_WGMMA", "off")
    assert rel(qm.quant_matmul_routed(x, w, ids), ref) < 1e-2
    assert rel(default, ref) < 1e-2
    assert rel(qm.quant_matmul_routed(x, w, ids, force="mm"), ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2048, 4096), (512, 4096), (64, 4096), (256, 4096), (8192, 1024)])
def test_gpu_dense_matvec_and_dispatch(n, k):
    """The Flash compressor / indexer / router shapes: the matvec and the token tile against float64, and `linear`
    sending one row to the matvec, 2 .. DENSE_TOKEN_TILE_MAX_ROWS rows to the token tile (the matvec when rows are
    computed alone), more to cuBLAS."""
    from ds4x.kernels.linear import linear, rowwise_products

    g = torch.Generator(device="cuda").manual_seed(n)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
    x = torch.randn(qm.DENSE_TOKEN_TILE_MAX_ROWS + 1, k, generator=g, device="cuda").bfloat16()
    ref = x.double() @ w.double().T
    y = qm.dense_linear(x[: qm.DENSE_MATVEC_MAX_ROWS], w)
    assert float((y.double() - ref[: len(y)]).abs().max()) <= 1e-2 * float(ref.abs().max())
    assert torch.equal(qm.dense_linear(x[:1], w), y[:1])
    assert torch.equal(linear(x[:1], w), y[:1])
    for m in (2, 3, qm.DENSE_TOKEN_TILE_MAX_ROWS):
        t = linear(x[:m], w)
        assert torch.equal(t, qm.dense_token_tile(x[:m], w))
        assert float((t.double() - ref[:m]).abs().max()) <= 1e-2 * float(ref.abs().max()), m
        with rowwise_products():
            assert torch.equal(linear(x[:m], w), qm.dense_linear(x[:m], w))
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.gpu
def test_gpu_dense_mirrors_for_batched_rows():
    """With mirrors on, 2 .. TOKEN_TILE_MAX_ROWS rows take the token tile (against x quantized per 16 values, at
    the Flash wq_b / grouped wo_a shapes), more rows the weight decoded once to bf16 (kept on it); one row keeps
    the block kernel."""
    g = torch.Generator(device="cuda").manual_seed(2)
    w = qm.kernel_layout(GGMLTensor(random_blocks(T.Q8_0, (32768, 1024), g), T.Q8_0, (32768, 1024)))
    wd = w.dequantize().double()
    gw = qm.kernel_layout(GGMLTensor(random_blocks(T.Q8_0, (8 * 1024, 4096), g), T.Q8_0, (8 * 1024, 4096)))
    x = torch.randn(qm.TOKEN_TILE_MAX_ROWS + 1, 1024, device="cuda", generator=g).bfloat16()
    xg = torch.randn(qm.TOKEN_TILE_MAX_ROWS, 8, 4096, device="cuda", generator=g).bfloat16()
    qm.use_dense_mirrors(True)
    try:
        for m in (2, 5, qm.TOKEN_TILE_MAX_ROWS):
            y = qm.quant_linear(x[:m], w)
            assert rel(y.float(), _quantized_rows(x[:m]) @ wd.T) < 1e-2, m  # bf16 output rounding
            yg = qm.quant_grouped_linear(xg[:m], gw, 8)
            ref = torch.einsum("tgi,goi->tgo", _quantized_rows(xg[:m].reshape(8 * m, 4096)).view(m, 8, 4096),
                               gw.dequantize().double().view(8, 1024, 4096))
            assert rel(yg.float(), ref) < 1e-2, m
        assert w.dense_mirror is None
        y = qm.quant_linear(x, w)
        assert w.dense_mirror is not None and w.dense_mirror.dtype == torch.bfloat16
        assert torch.equal(y, torch.nn.functional.linear(x, qm.dequantize_gpu(w, torch.bfloat16)))
        assert torch.equal(qm.quant_linear(x[:1], w), qm.quant_linear(x[:1], w, force="mv"))
    finally:
        qm.use_dense_mirrors(False)
        w.dense_mirror = None


@pytest.mark.gpu
def test_gpu_routed_and_linear_dispatch():
    from ds4x.kernels.linear import linear, quant_kernel_name

    g = torch.Generator(device="cuda").manual_seed(1)
    w = GGMLTensor(random_blocks(T.IQ2_XXS, (16, 512, 1024), g), T.IQ2_XXS, (16, 512, 1024))
    x = torch.randn(3, 1024, device="cuda", generator=g)
    ids = torch.randint(0, 16, (3, 6), device="cuda", generator=g)
    ref = torch.einsum("tk,tjnk->tjn", x.double(), w.dequantize().double()[ids])
    assert rel(qm.quant_matmul_routed(x, w, ids, force="mm"), ref) < 3e-3
    assert rel(qm.quant_matmul_routed(x, w, ids, force="mv", int8=False), ref) < 1e-5
    assert rel(qm.quant_matmul_routed(x, w, ids, force="mv", int8=True), ref) < INT8_TOL
    assert "triton" in quant_kernel_name(w[0])
    bound = INT8_TOL if qm.int8_activations(T.IQ2_XXS) else 1e-5
    assert rel(linear(x, w[3]), x.double() @ w[3].dequantize().double().T) < bound


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8])
def test_gpu_routed_swiglu_matches_product_then_swiglu(t):
    """Flash's routed gate / up (IQ2_XXS split rows, 2 x 64 experts of 2048 x 4096, bf16, the default activations)
    with SwiGLU in the matvec's epilogue: the bits of the stacked product followed by the SwiGLU kernel."""
    from ds4x.kernels.moe import swiglu_fused
    from ds4x.model.moe import stacked_slots

    g = torch.Generator(device="cuda").manual_seed(3)
    n_exp, n, k, limit = 64, 2048, 4096, 10.0  # 64 experts: 8 tokens stay on the matvec
    w13 = qm.kernel_layout(GGMLTensor(random_blocks(T.IQ2_XXS, (2 * n_exp, n, k), g), T.IQ2_XXS, (2 * n_exp, n, k)))
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    ids = torch.randint(0, n_exp, (t, 6), device="cuda", generator=g)
    gu = qm.quant_matmul_routed(x, w13, stacked_slots(ids, n_exp))
    got = qm.quant_routed_swiglu(x, w13, ids, limit)
    assert torch.equal(got, swiglu_fused(gu[:, :6], gu[:, 6:], limit))
    prepared = qm.routed_swiglu_input(x, w13, 6)  # x quantized once beforehand (int8 activations): the same bits
    assert (prepared is not None) == qm.int8_activations(T.IQ2_XXS)
    assert torch.equal(qm.quant_routed_swiglu(x, w13, ids, limit, xq=prepared), got)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [2, 8])
def test_gpu_routed_q2_k_prepared_activations_give_the_same_bits(monkeypatch, t):
    """Flash's routed down projection (Q2_K, 64 experts of 4096 x 2048, one x row per pair) with x quantized once per
    row with its groups' sums (Q2_K_PREPARED_ACTIVATIONS): the bits of each program quantizing x itself."""
    g = torch.Generator(device="cuda").manual_seed(5)
    n_exp, n, k = 64, 4096, 2048
    w2 = GGMLTensor(random_blocks(T.Q2_K, (n_exp, n, k), g), T.Q2_K, (n_exp, n, k))
    x = torch.randn(6 * t, k, device="cuda", generator=g).bfloat16()
    ids = torch.randint(0, n_exp, (6 * t, 1), device="cuda", generator=g)
    monkeypatch.setattr(qm, "Q2_K_PREPARED_ACTIVATIONS", False)
    want = qm.quant_matmul_routed(x, w2, ids, force="mv", int8=True)
    monkeypatch.setattr(qm, "Q2_K_PREPARED_ACTIVATIONS", True)
    monkeypatch.setattr(qm, "Q2_K_PREPARED_MIN_PAIRS", 1)
    got = qm.quant_matmul_routed(x, w2, ids, force="mv", int8=True)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_startup_line_names_the_routed_decode_kernels(monkeypatch):
    # the startup log's kernel line says how a decode step's routed experts run, and follows the A/B switch
    from ds4x.kernels import dispatch, routed_wgmma

    monkeypatch.setattr(dispatch, "use_triton", lambda device: True)
    monkeypatch.setattr(routed_wgmma, "hopper", lambda device: True)
    monkeypatch.setenv("DS4X_QUANT_ACT", "int8")
    line = dispatch.describe(torch.device("cpu"), "packed")
    assert "routed experts at decode: triton matvec" in line and "quantized once per token" in line
    monkeypatch.setattr(qm, "PREPARED_ACTIVATIONS", False)
    assert "quantized once per token" not in dispatch.describe(torch.device("cpu"), "packed")
    monkeypatch.setattr(dispatch, "use_triton", lambda device: False)
    assert "routed experts at decode: torch reference" in dispatch.describe(torch.device("cpu"), "packed")
