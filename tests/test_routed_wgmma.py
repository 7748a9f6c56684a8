"""The Hopper tensor-core routed-expert kernel (kernels/routed_wgmma.py): decoded tables on the CPU, products on
the GPU against the bf16 experts of ``dequantize_gpu`` (the same weight bits) multiplied in float64."""

from __future__ import annotations

import pytest
import torch

from ds4x.formats.ggml import GGMLQuantizationType as T
from ds4x.formats.ggml import dequantize, random_blocks
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.kernels import routed_wgmma as rw


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 255 for i in range(4)] + [(b >> (8 * i)) & 255 for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _bf16_bits(v: float) -> int:
    return int(torch.tensor([v]).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def test_iq2_xxs_decode_gives_the_bf16_weights() -> None:
    """Emulate the kernel's decode of every pair (levels from the 2-bit table, selector and sign mask computed,
    prmt of the scaled magnitudes) and compare with dequantize() rounded to bf16, bit for bit."""
    g = torch.Generator().manual_seed(0)
    raw = random_blocks(T.IQ2_XXS, (8, 256), g)
    want = dequantize(raw, T.IQ2_XXS, (8, 256)).to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
    levels = rw.iq2_xxs_levels(torch.device("cpu")).long() & 0xFFFF
    for r in range(8):
        row = raw[r].tolist()
        d = torch.tensor([row[0] | (row[1] << 8)], dtype=torch.int32).to(torch.int16).view(torch.float16).float()
        for e in range(32):
            gq = 2 + 8 * (e // 4)
            aux = int.from_bytes(bytes(row[gq + 4 : gq + 8]), "little")
            db = float(d * (((aux >> 28) & 15) * 0.25 + 0.125))
            va = _bf16_bits(db * 8.0) | _bf16_bits(db * 25.0) << 16
            vb = _bf16_bits(db * 43.0) | _bf16_bits(db * 43.0) << 16
            s7 = (aux >> (7 * (e % 4))) & 127
            s8 = s7 | ((bin(s7).count("1") & 1) << 7)
            lv = int(levels[row[gq + e % 4]])
            for p in range(4):
                x = (lv >> (4 * p)) & 15
                sel = ((x & 3) | ((x >> 2) << 8)) * 0x22 + 0x1010
                neg = ((s8 >> (2 * p)) * 0x40008000) & 0x80008000
                word = _prmt(va, vb, sel) ^ neg
                assert word & 0xFFFF == want[r, 8 * e + 2 * p], (r, e, p)
                assert word >> 16 == want[r, 8 * e + 2 * p + 1], (r, e, p)


def test_q2_k_decode_gives_the_bf16_weights() -> None:
    """The same for Q2_K: a pair's selector from its two 2-bit codes into the four values d sc q - dmin m."""
    g = torch.Generator().manual_seed(1)
    raw = random_blocks(T.Q2_K, (4, 256), g)
    want = dequantize(raw, T.Q2_K, (4, 256)).to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
    for r in range(4):
        row = raw[r].tolist()
        d, dmin = (torch.tensor([row[o] | (row[o + 1] << 8)], dtype=torch.int32).to(torch.int16)
                   .view(torch.float16).float() for o in (80, 82))
        for k in range(0, 256, 2):
            h, kk, jj, i = k // 128, (k % 128) // 32, (k % 32) // 16, k % 16
            sc = row[8 * h + 2 * kk + jj]
            dl, ml = d * (sc & 15), dmin * (sc >> 4)
            vals = [_bf16_bits(float(dl * q - ml)) for q in range(4)]
            qb = 16 + 32 * h + 16 * jj + i
            codes = ((row[qb] | row[qb + 1] << 8) >> (2 * kk)) & 0x0303
            word = _prmt(vals[0] | vals[1] << 16, vals[2] | vals[3] << 16, codes * 0x22 + 0x1010)
            assert (word & 0xFFFF, word >> 16) == (want[r, k], want[r, k + 1]), (r, k)


def test_not_available_without_a_hopper_gpu() -> None:
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    w = GGMLTensor(random_blocks(T.IQ2_XXS, (4, 8, 256)), T.IQ2_XXS, (4, 8, 256))
    assert not rw.available(x, w)
    with pytest.raises(RuntimeError, match="sm_90"):
        rw.routed_wgmma(x, w, torch.zeros(2, 1, dtype=torch.int32), 1)


def _use_variant(monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    reg, xa = rw.VARIANTS[variant]
    monkeypatch.setattr(rw, "REGISTER_WEIGHTS", reg)
    monkeypatch.setattr(rw, "ASYNC_ACTIVATIONS", xa)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and rw.HAVE_GLUON


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.Q2_K, "IQ2_XXS split"])
@pytest.mark.parametrize("tokens,k,config", [(1, 6, None), (7, 6, (16, 64, 4)), (40, 2, (16, 128, 8)),
                                             (300, 6, None), (64, 6, (64, 128, 4)), (300, 6, (128, 64, 4))])
@pytest.mark.parametrize("variant", list(rw.VARIANTS))
def test_routed_wgmma_matches_the_bf16_experts_on_gpu(qtype: T | str, tokens: int, k: int,
                                                      config: tuple[int, int, int] | None, variant: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every variant (the weights through shared memory or in the wgmma's registers, the activations through
    registers or by cp.async) against the dequantized experts."""
    from ds4x.kernels.quant_matmul import dequantize_gpu, kernel_layout

    _use_variant(monkeypatch, variant)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    split = qtype == "IQ2_XXS split"
    qtype = T.IQ2_XXS if split else qtype
    n_exp, n, kdim = 16, 200, 1024 if split else 512  # 200 rows: the last row tile is partial; split rows: K % 1024
    w = GGMLTensor(random_blocks(qtype, (n_exp, n, kdim), g, device=dev), qtype, (n_exp, n, kdim))
    dense = dequantize_gpu(w, torch.bfloat16).double()
    if split:
        w = kernel_layout(w)
        assert w.layout == "split"
    x = torch.randn(tokens, kdim, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, n_exp // 2, (tokens, k), device=dev, generator=g, dtype=torch.int32)  # half unused
    y = rw.routed_wgmma(x, w, ids, k, config).view(tokens, k, n)
    ref = torch.einsum("ti,tkoi->tko", x.double(), dense[ids.long()])
    # float32 sums of exact bf16 products, then one rounding of the result to bf16
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-7 + 1e-6 * ref.abs().max()).all()


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("variant", list(rw.VARIANTS))
def test_routed_wgmma_rows_do_not_depend_on_their_chunk_on_gpu(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pair gets the same bits alone as in a call where other pairs share its expert's chunk."""
    _use_variant(monkeypatch, variant)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(2)
    n_exp, n, kdim = 8, 128, 1024
    w = GGMLTensor(random_blocks(T.IQ2_XXS, (n_exp, n, kdim), g, device=dev), T.IQ2_XXS, (n_exp, n, kdim))
    x = torch.randn(24, kdim, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 3, (24, 2), device=dev, generator=g, dtype=torch.int32)
    together = rw.routed_wgmma(x, w, ids, 2).view(24, 2, n)
    for t in (0, 5, 23):
        alone = rw.routed_wgmma(x[t : t + 1], w, ids[t : t + 1], 2).view(1, 2, n)
        assert torch.equal(alone[0], together[t])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("variant", list(rw.VARIANTS))
def test_routed_wgmma_compiles_under_the_compile_watch(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton hands a kernel's constexprs to its JIT hooks as JSON, and the server's compile watch sets those
    hooks: a constexpr that JSON cannot hold (a Gluon layout, as this kernel once took) failed every compile of the
    kernel after the watch started, so a server's first routed product past its warm-up raised."""
    from ds4x.kernels.jit_watch import watch

    _use_variant(monkeypatch, variant)
    w_ = watch()
    before = w_.count["_routed_wgmma_kernel"]
    rw._routed_wgmma_kernel.device_caches.clear()  # this process's compiled variants: the next launch compiles
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    n_exp, n, kdim = 4, 128, 512
    w = GGMLTensor(random_blocks(T.Q2_K, (n_exp, n, kdim), g, device=dev), T.Q2_K, (n_exp, n, kdim))
    x = torch.randn(2, kdim, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, n_exp, (2, 2), device=dev, generator=g, dtype=torch.int32)
    y = rw.routed_wgmma(x, w, ids, 2)
    torch.cuda.synchronize()
    assert torch.isfinite(y.float()).all()
    assert w_.count["_routed_wgmma_kernel"] == before + 1
