"""Fused mHC kernels (Triton; the interpreter on CPU) against the reference in model/hyper.py."""

import pytest
import torch

from ds4x.config import tiny_config
from ds4x.kernels import hyper as hk
from ds4x.model.hyper import hc_post, hc_pre

pytestmark = pytest.mark.skipif(not hk.HAVE_TRITON, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels on a GPU, else the interpreter


def _fast_pre(streams, fn, base, scale, cfg):
    out = hk.hc_pre_fused(streams.to(DEV), fn.to(DEV), base.to(DEV), scale.to(DEV), cfg.rms_norm_eps, cfg.hc_eps,
                          cfg.hc_sinkhorn_iters)
    return tuple(t.cpu() for t in out)


def _fast_post(streams, block_out, post, comb):
    out, partials = hk.hc_post_fused(streams.to(DEV), block_out.to(DEV), post.to(DEV), comb.to(DEV))
    assert partials is None
    return out.cpu()


def _inputs(t: int, n: int, hd: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    streams = (torch.randn(t, n, hd, generator=g) * 2).to(dtype)
    fn = torch.randn(2 * n + n * n, n * hd, generator=g) * 0.5 / (n * hd) ** 0.5
    base = torch.randn(2 * n + n * n, generator=g) * 0.1
    scale = 1 + torch.randn(3, generator=g) * 0.1
    return streams, fn, base, scale


@pytest.mark.parametrize("t,hd", [(1, 256), (3, 320), (5, 96)])
def test_hc_pre_matches_reference(t, hd):
    cfg = tiny_config().replace(hidden_size=hd)
    n = cfg.hc_mult
    streams, fn, base, scale = _inputs(t, n, hd, seed=t + hd)
    ref = hc_pre(streams, fn, base, scale, cfg)
    fast = _fast_pre(streams, fn, base, scale, cfg)
    for a, b, what in zip(fast, ref, ("block input", "post", "comb"), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=what)
    comb = fast[2]  # doubly stochastic after Sinkhorn
    torch.testing.assert_close(comb.sum(-2), torch.ones(t, n), atol=1e-4, rtol=0)


@pytest.mark.parametrize("t,hd", [(1, 256), (4, 300)])
def test_hc_post_matches_reference(t, hd):
    cfg = tiny_config().replace(hidden_size=hd)
    n = cfg.hc_mult
    streams, fn, base, scale = _inputs(t, n, hd, seed=7)
    _, post, comb = hc_pre(streams, fn, base, scale, cfg)
    block_out = torch.randn(t, hd, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_fast_post(streams, block_out, post, comb),
                               hc_post(streams, block_out, post, comb)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,hd,dtype", [(1, 256, torch.float32), (3, 320, torch.bfloat16), (2, 96, torch.float32)])
def test_post_computes_the_next_blocks_mixing(t, hd, dtype):
    """hc_post with the next block's fn: the same new streams, and the next hc_pre given its partials (one launch)
    gives what the next hc_pre computes from the stored streams itself (to float32 rounding: other chunks)."""
    cfg = tiny_config().replace(hidden_size=hd)
    n = cfg.hc_mult
    streams, fn, base, scale = _inputs(t, n, hd, seed=11, dtype=dtype)
    _, fn2, base2, scale2 = _inputs(t, n, hd, seed=12)
    _, post, comb = hc_pre(streams.float(), fn, base, scale, cfg)
    block_out = torch.randn(t, hd, generator=torch.Generator().manual_seed(2)).to(dtype)
    args = [a.to(DEV) for a in (streams, block_out, post, comb)]
    plain, none = hk.hc_post_fused(*args)
    new, partials = hk.hc_post_fused(*args, next_fn=fn2.to(DEV))
    assert none is None and partials is not None
    assert torch.equal(new, plain)
    alone = hk.hc_pre_fused(new, fn2.to(DEV), base2.to(DEV), scale2.to(DEV), cfg.rms_norm_eps, cfg.hc_eps,
                            cfg.hc_sinkhorn_iters)
    ahead = hk.hc_pre_fused(new, fn2.to(DEV), base2.to(DEV), scale2.to(DEV), cfg.rms_norm_eps, cfg.hc_eps,
                            cfg.hc_sinkhorn_iters, partials)
    for a, b, what in zip(ahead, alone, ("block input", "post", "comb"), strict=True):
        tol = 1e-2 if a.dtype == torch.bfloat16 else 2e-5
        torch.testing.assert_close(a.float().cpu(), b.float().cpu(), rtol=tol, atol=tol, msg=what)
    with pytest.raises(ValueError, match="partials"):
        hk.hc_pre_fused(new, fn2.to(DEV)[:3], base2.to(DEV), scale2.to(DEV), cfg.rms_norm_eps, cfg.hc_eps,
                        cfg.hc_sinkhorn_iters, partials)


@pytest.mark.parametrize("t,hd,dtype,ahead", [(1, 256, torch.bfloat16, True), (3, 320, torch.float32, False),
                                              (2, 96, torch.bfloat16, False)])
def test_pre_applies_the_blocks_rms_norm(t, hd, dtype, ahead):
    """hc_pre with the block's norm weights: the RMSNorm of the collapse in the same launch, its mean square from the
    streams' Gram matrix (partials computed by hc_pre itself or ahead by hc_post), against the reference collapse
    followed by the norm: the same to the rounding of the working dtype."""
    cfg = tiny_config().replace(hidden_size=hd)
    n = cfg.hc_mult
    streams, fn, base, scale = _inputs(t, n, hd, seed=31 + hd, dtype=dtype)
    norm = 1 + torch.randn(hd, generator=torch.Generator().manual_seed(5)) * 0.2
    partials = None
    if ahead:  # the streams as the previous block's hc_post leaves them, with the partials it computed
        _, fn0, base0, scale0 = _inputs(t, n, hd, seed=30)
        _, post0, comb0 = hc_pre(streams.float(), fn0, base0, scale0, cfg)
        block_out = torch.randn(t, hd, generator=torch.Generator().manual_seed(6)).to(dtype)
        new, partials = hk.hc_post_fused(streams.to(DEV), block_out.to(DEV), post0.to(DEV), comb0.to(DEV),
                                         next_fn=fn.to(DEV))
        streams = new.cpu()
    got = hk.hc_pre_fused(streams.to(DEV), fn.to(DEV), base.to(DEV), scale.to(DEV), cfg.rms_norm_eps, cfg.hc_eps,
                          cfg.hc_sinkhorn_iters, partials, norm.to(DEV))
    want = hc_pre(streams, fn, base, scale, cfg, norm=norm)
    assert got[0].dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for a, b, what in zip(got, want, ("normalised block input", "post", "comb"), strict=True):
        torch.testing.assert_close(a.float().cpu(), b.float(), rtol=tol, atol=tol, msg=what)


def test_bf16_streams_round_once():
    cfg = tiny_config().replace(hidden_size=256)
    streams, fn, base, scale = _inputs(2, cfg.hc_mult, 256, seed=3, dtype=torch.bfloat16)
    x, post, comb = _fast_pre(streams, fn, base, scale, cfg)
    assert x.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
    ref = hc_pre(streams, fn, base, scale, cfg)
    torch.testing.assert_close(x.float(), ref[0].float(), rtol=1e-2, atol=1e-2)
    y = _fast_post(streams, x, post, comb)
    assert y.dtype == torch.bfloat16 and y.shape == streams.shape


def test_supported_needs_power_of_two_streams():
    s = torch.zeros(1, 3, 8)
    assert not hk.supported(s, 3)


def test_model_with_fused_mhc_matches_reference(monkeypatch):
    """The whole model (default trained model, packed cache) with the fused mHC kernels forced on (interpreter
    on CPU) against the reference ops: same greedy tokens, logits within float32 rounding."""
    from ds4x.model import hyper
    from ds4x.runtime.engine import Engine

    if torch.cuda.is_available():
        pytest.skip("the interpreter case; on a GPU the model's CUDA tests run the fused kernels")
    engine = Engine.load("default", device="cpu")
    prompt = engine.tokenizer.encode("def add(a, b):\n    return")

    def run() -> tuple[torch.Tensor, list[int]]:
        s = engine.new_session(64, cache="packed", announce=False)
        logits = s.prefill(prompt)
        first, out = logits.clone(), []
        for _ in range(6):
            out.append(int(logits.argmax()))
            logits = s.step(out[-1])
        return first, out

    ref_logits, ref_tokens = run()
    monkeypatch.setattr(hyper, "use_fused", lambda streams: hk.supported(streams, streams.shape[1]))
    fast_logits, fast_tokens = run()
    assert fast_tokens == ref_tokens
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("t,hd,dtype,mix", [(1, 256, torch.bfloat16, True), (3, 320, torch.float32, False)])
def test_post_sums_the_moe_parts_with_the_combine_bits(t, hd, dtype, mix):
    """hc_post given the MoE block's parts (routed outputs, weights, shared expert) sums them in its own launch:
    the bits of the combine kernel followed by hc_post, new streams and the next block's mixing partials."""
    from ds4x.kernels.moe import combine_fused
    from ds4x.model.moe import MoEParts

    cfg = tiny_config().replace(hidden_size=hd)
    n, k = cfg.hc_mult, 6
    streams, fn, base, scale = _inputs(t, n, hd, seed=21, dtype=dtype)
    _, post, comb = hc_pre(streams.float(), fn, base, scale, cfg)
    g = torch.Generator().manual_seed(4)
    routed = torch.randn(t, k, hd, generator=g).to(dtype).to(DEV)
    weights = torch.rand(t, k, generator=g).to(DEV)
    shared = torch.randn(t, hd, generator=g).to(dtype).to(DEV)
    args = [a.to(DEV) for a in (streams, post, comb)]
    next_fn = fn.to(DEV) if mix else None
    want, want_mix = hk.hc_post_fused(args[0], combine_fused(routed, weights, shared), *args[1:], next_fn)
    got, got_mix = hk.hc_post_fused(args[0], shared, *args[1:], next_fn, routed=(routed, weights))
    assert torch.equal(got, want)
    if mix:
        assert all(torch.equal(a, b) for a, b in zip(got_mix, want_mix, strict=True))
    ref = hc_post(streams, MoEParts(routed.cpu(), weights.cpu(), shared.cpu()), post, comb)[0]
    torch.testing.assert_close(got.float().cpu(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_take_the_mixing_partials_from_matmuls(monkeypatch, dtype):
    """Past MATMUL_PARTIALS_TOKENS the mixing partials (of hc_post's new streams, or of hc_pre's own streams) are
    float32 GEMMs in one chunk: the same streams and, to float32 rounding, the same partials' sums and hc_pre
    outputs as the kernels' per-block partials."""
    cfg = tiny_config().replace(hidden_size=320)
    n, t = cfg.hc_mult, 7
    streams, fn, base, scale = _inputs(t, n, 320, seed=25, dtype=dtype)
    _, post, comb = hc_pre(streams.float(), fn, base, scale, cfg)
    block_out = torch.randn(t, 320, generator=torch.Generator().manual_seed(6)).to(dtype)
    args = [a.to(DEV) for a in (streams, block_out, post, comb)]
    pre_args = (fn.to(DEV), base.to(DEV), scale.to(DEV), cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)

    def run():
        new, partials = hk.hc_post_fused(*args, next_fn=fn.to(DEV))
        return (new, partials, hk.hc_pre_fused(new, *pre_args, partials=partials),
                hk.hc_pre_fused(args[0], *pre_args))

    kernels = run()
    monkeypatch.setattr(hk, "MATMUL_PARTIALS_TOKENS", 1)
    gemms = run()
    assert gemms[1].mix.shape[1] == 1 and kernels[1].mix.shape[1] > 1  # one chunk against the blocks
    assert torch.equal(gemms[0], kernels[0])
    for a, b in zip(gemms[1], kernels[1], strict=True):
        torch.testing.assert_close(a.sum(1), b.sum(1), rtol=1e-5, atol=1e-5)
    for a, b in zip(gemms[2] + gemms[3], kernels[2] + kernels[3], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
