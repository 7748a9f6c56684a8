"""GGUF (ds4 layout): GGMLTensor, loader, writer, validation errors, tokenizer, convert CLI."""

from __future__ import annotations

import argparse
import functools
import math
import random
import re
import time

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("gguf")

from ds4x.config import HCA, tiny_config  # noqa: E402
from ds4x.formats.ggml import GGMLQuantizationType as T  # noqa: E402
from ds4x.formats.ggml import random_blocks  # noqa: E402
from ds4x.formats.ggml_tensor import GGMLTensor  # noqa: E402
from ds4x.kernels.linear import embedding, grouped_linear, linear  # noqa: E402
from ds4x.model.transformer import Transformer  # noqa: E402
from ds4x.runtime.gguf_tokenizer import GGUFTokenizer, ds4_split  # noqa: E402
from ds4x.weights.checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402
from ds4x.weights.gguf import (  # noqa: E402
    GGUFError,
    GGUFTruncatedError,
    describe_gguf,
    load_gguf,
    mtp_expected_shapes,
)
from ds4x.weights.gguf_writer import (  # noqa: E402
    TypePolicy,
    encode_tensor,
    synthetic_vocab,
    tensor_plan,
    write_gguf,
    write_synthetic_gguf,
)
from ds4x.weights.synthetic import synthetic_weights  # noqa: E402

PROMPT = torch.tensor([5, 17, 300, 2, 99, 100, 101, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 1, 2, 3, 200, 201, 7, 7])


def logits(cfg, weights, tokens=PROMPT) -> torch.Tensor:
    model = Transformer(cfg, weights)
    return model.forward(tokens, model.new_cache(64), all_logits=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config()
    return cfg, synthetic_weights(cfg, seed=0)


@pytest.fixture(scope="module")
def tiny_k():
    """A tiny model whose rows are whole K-quant blocks (256): hidden and expert width 256."""
    cfg = tiny_config().replace(hidden_size=256, moe_intermediate_size=256)
    return cfg, synthetic_weights(cfg, seed=1)


@pytest.fixture(scope="module")
def f32_gguf(tiny, tmp_path_factory):
    cfg, w = tiny
    path = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    write_gguf(path, cfg, w, "f32")
    return path


# ---- GGMLTensor and the kernels' reference path ---------------------------------------------------

def test_ggml_tensor_basics():
    g = torch.Generator().manual_seed(0)
    raw = random_blocks(T.Q4_K, (3, 8, 512), g)
    w = GGMLTensor(raw, T.Q4_K, (3, 8, 512))
    assert w.shape == torch.Size([3, 8, 512]) and w.ndim == 3 and w.device == torch.device("cpu")
    assert w.nbytes == 3 * 8 * 2 * 144 and w.numel() == 3 * 8 * 512
    e1 = w[1]
    assert isinstance(e1, GGMLTensor) and e1.shape == (8, 512)
    assert e1.raw.data_ptr() == raw[1].data_ptr()  # a view, no copy
    dense = w.dequantize()
    assert torch.equal(e1.dequantize(), dense[1])
    assert torch.equal(w[1:3].dequantize(), dense[1:3])
    assert w.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert w.to("cpu") is w
    with pytest.raises(TypeError, match="dequantize"):
        w.to(torch.float16)
    with pytest.raises(ValueError, match="block size"):
        GGMLTensor(torch.zeros(100, dtype=torch.uint8), T.Q8_0, (1, 100))
    with pytest.raises(ValueError, match="needs"):
        GGMLTensor(torch.zeros(33, dtype=torch.uint8), T.Q8_0, (1, 32))


def test_split_layout_keeps_the_weights():
    # Q8_0 rows re-laid as codes then scales: same size, same values, the file's bytes back on request
    g = torch.Generator().manual_seed(2)
    w = GGMLTensor(random_blocks(T.Q8_0, (3, 5, 256), g), T.Q8_0, (3, 5, 256))
    s = w.split()
    assert s.layout == "split" and s.split() is s and w.blocks() is w and s.raw.shape == w.raw.shape
    blocks = w.raw.view(3, 5, 8, 34)
    assert torch.equal(s.raw[..., :256], blocks[..., 2:].flatten(-2))  # codes first, in order
    assert torch.equal(s.raw[..., 256:], blocks[..., :2].flatten(-2))  # then the fp16 scales
    assert torch.equal(s.blocks().raw, w.raw)
    assert torch.equal(s.dequantize(), w.dequantize())
    assert s[1].layout == "split" and torch.equal(s[1:3].dequantize(), w[1:3].dequantize())
    tokens = torch.tensor([4, 0, 4])
    assert torch.equal(s[2].dequantize_rows(tokens), w[2].dequantize_rows(tokens))
    assert "split" in repr(s) and s.to("cpu") is s
    iq = GGMLTensor(random_blocks(T.IQ2_XXS, (2, 1024), g), T.IQ2_XXS, (2, 1024))
    iqs = iq.split()
    assert torch.equal(iqs.raw[:, :256], iq.raw.view(2, 4, 66)[..., 2:].flatten(-2))  # 64 code bytes a block
    assert torch.equal(iqs.blocks().raw, iq.raw) and torch.equal(iqs.dequantize(), iq.dequantize())
    with pytest.raises(ValueError, match="split layout is for Q8_0 and IQ2_XXS"):
        GGMLTensor(random_blocks(T.Q4_K, (2, 256), g), T.Q4_K, (2, 256)).split()
    with pytest.raises(ValueError, match="unknown GGMLTensor layout"):
        GGMLTensor(w.raw, T.Q8_0, (3, 5, 256), "rows")


def test_linear_embedding_grouped_accept_ggml():
    g = torch.Generator().manual_seed(1)
    w = GGMLTensor(random_blocks(T.Q8_0, (32, 64), g), T.Q8_0, (32, 64))
    x = torch.randn(5, 64, generator=g)
    dense = w.dequantize()
    assert torch.equal(linear(x, w), F.linear(x, dense))
    xb = x.bfloat16()
    assert torch.equal(linear(xb, w), F.linear(xb, dense.bfloat16()))
    tokens = torch.tensor([[3, 0], [31, 3]])
    assert torch.equal(embedding(w, tokens, torch.float32), dense[tokens])
    xg = torch.randn(5, 4, 64, generator=g)
    assert torch.equal(grouped_linear(xg, w, 4), grouped_linear(xg, dense, 4))


# ---- loader: exact and quantized ------------------------------------------------------------------

def test_f32_gguf_matches_safetensors(tiny, f32_gguf, tmp_path):
    cfg, w = tiny
    save_checkpoint(cfg, w, tmp_path / "st")
    cfg_st, w_st = load_checkpoint(tmp_path / "st")
    cfg_g, w_g, meta = load_gguf(f32_gguf)
    assert cfg_g == cfg_st == cfg
    assert meta["general.architecture"] == "deepseek4"
    ref, got = logits(cfg_st, w_st), logits(cfg_g, w_g)
    assert rel(got, ref) <= 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_loader_dtype_and_kinds(tiny, f32_gguf):
    cfg, _ = tiny
    cfg_g, w, _ = load_gguf(f32_gguf, dtype=torch.bfloat16)
    assert cfg_g.attn_kinds == cfg.attn_kinds  # ratio 4 + indexer -> CSA, ratio 8 -> HCA
    assert w["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert w["layers.0.hc_attn_fn"].dtype == torch.float32  # fp32 by contract
    assert w["layers.0.ffn.gate.tid2eid"].dtype == torch.int64


def test_ratio4_without_indexer_is_hca(tiny, tmp_path):
    cfg, w = tiny
    cfg4 = cfg.replace(attn_kinds=tuple(HCA if r == 4 else k for k, r in zip(cfg.attn_kinds, cfg.compress_ratios,
                                                                              strict=True)))
    w4 = {k: v for k, v in synthetic_weights(cfg4, seed=0).items()}
    write_gguf(tmp_path / "hca4.gguf", cfg4, w4, "f32")
    cfg_g, _, _ = load_gguf(tmp_path / "hca4.gguf")
    assert cfg_g.attn_kinds[1] == HCA and cfg_g.compress_ratios[1] == 4


@pytest.mark.parametrize("experts,down,max_rel,min_top5", [
    ("Q8_0", "Q8_0", 0.15, 1.0),
    ("Q4_K", "Q4_K", 0.5, 0.8),
    ("IQ2_XXS", "Q2_K", 1.0, 0.4),  # untrained random weights: 2-bit experts move it a lot (chance: 1%)
])
def test_quantized_gguf_stays_quantized_and_plausible(tiny_k, tmp_path, experts, down, max_rel, min_top5):
    cfg, w = tiny_k
    policy = TypePolicy(attn=T.Q8_0, shared=T.Q8_0, output=T.Q8_0, embed=T.F16, small=T.F16).with_overrides(
        experts=experts, experts_down=down)
    path = tmp_path / f"tiny-{experts}.gguf"
    write_gguf(path, cfg, w, policy)
    cfg_g, wq, _ = load_gguf(path)
    assert isinstance(wq["layers.1.attn.wq_a.weight"], GGMLTensor)
    assert wq["layers.1.attn.wq_a.weight"].qtype == T.Q8_0
    e1 = wq["layers.1.ffn.experts.w1"]
    assert isinstance(e1, GGMLTensor) and e1.qtype == T[experts] and e1.shape == (8, 256, 256)
    assert wq["layers.1.ffn.experts.w2"].qtype == T[down]
    ref, got = logits(cfg, w), logits(cfg_g, wq)
    err = rel(got, ref)
    top5 = ref.topk(5, dim=-1).indices
    in_top5 = (top5 == got.argmax(-1, keepdim=True)).any(-1).float().mean().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"\n{experts}/{down} experts, Q8_0 attention: logits rel err {err:.3f}, greedy agreement {agree:.2f}, "
          f"greedy token in reference top-5 {in_top5:.2f}")
    assert torch.isfinite(got).all()
    assert err < max_rel
    assert in_top5 >= min_top5


def test_quantizers_round_trip():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 512, generator=g)
    from gguf.quants import dequantize as gguf_dequantize

    for qt, bound in ((T.Q8_0, 0.01), (T.Q4_K, 0.1), (T.Q2_K, 0.4), (T.IQ2_XXS, 0.45)):
        raw = encode_tensor(x, qt)
        y = GGMLTensor(raw, qt, tuple(x.shape)).dequantize()
        assert rel(y, x) < bound, qt.name
        assert torch.equal(y, torch.from_numpy(gguf_dequantize(raw.numpy(), qt)))  # valid blocks for gguf too


# ---- synthetic streaming writer, MTP, convert CLI -----------------------------------------------

def test_synthetic_streaming_q2(tiny_k, tmp_path):
    cfg, _ = tiny_k
    path = tmp_path / "syn.gguf"
    seen = []
    write_synthetic_gguf(path, cfg, "q2", seed=3, progress=lambda p: seen.append(p.name))
    cfg_g, w, meta = load_gguf(path)
    assert cfg_g == cfg
    assert meta["ds4x.synthetic"] is True and "SYNTHETIC" in meta["ds4x.synthetic.note"]
    assert "SYNTHETIC" in meta["general.name"]
    assert w["layers.1.ffn.experts.w1"].qtype == T.IQ2_XXS and w["layers.1.ffn.experts.w2"].qtype == T.Q2_K
    assert w["head.weight"].qtype == T.Q8_0
    assert len(seen) == len(set(seen)) > 50
    out = logits(cfg_g, w)
    assert torch.isfinite(out).all() and out.std() > 0
    info = describe_gguf(path)
    assert info["synthetic"] and info["config"] == cfg and info["has_tokenizer"]
    assert set(info["bytes_by_type"]) == {"F16", "F32", "I32", "Q8_0", "IQ2_XXS", "Q2_K"}
    assert info["tensor_bytes"] < info["file_bytes"]
    tok = GGUFTokenizer.from_metadata(meta)
    assert tok.decode(tok.encode("synthetic ok")) == "synthetic ok"


def test_mtp_gguf_binding(tiny, f32_gguf, tmp_path):
    cfg, _ = tiny
    g = torch.Generator().manual_seed(4)
    shapes = mtp_expected_shapes(cfg)
    mtp_w = {n: (torch.randint(0, cfg.n_routed_experts, s, generator=g) if n.endswith("tid2eid")
                 else torch.randn(s, generator=g) * 0.1) for n, s in shapes.items()}
    plan = tensor_plan(cfg, {**synthetic_weights(cfg, seed=0), **mtp_w}, "f32")
    mtp_plan = [p for p in plan if p[0].startswith("mtp.")]
    assert mtp_plan and all(p[0].startswith("mtp.0.") for p in mtp_plan)
    write_gguf(tmp_path / "mtp.gguf", cfg, {}, plan=mtp_plan)
    cfg_g, w, _ = load_gguf(f32_gguf, mtp_path=tmp_path / "mtp.gguf")
    assert cfg_g.num_mtp_layers == 1
    for name in ("mtp.0.e_proj.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight", "mtp.0.ffn.experts.w1",
                 "mtp.0.ffn.gate.bias"):
        assert torch.equal(w[name].float(), mtp_w[name].float()), name
    with pytest.raises(GGUFError, match="no 'mtp.N"):
        load_gguf(f32_gguf, mtp_path=f32_gguf)


def test_convert_cli(tiny, tmp_path):
    from ds4x.cli import convert

    cfg, w = tiny
    save_checkpoint(cfg, w, tmp_path / "st")
    parser = argparse.ArgumentParser()
    convert.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["convert", str(tmp_path / "st"), str(tmp_path / "c.gguf"), "--mix", "f32", "-q"])
    assert convert.run(args) == 0
    cfg_g, wg, meta = load_gguf(tmp_path / "c.gguf")
    assert cfg_g == cfg and rel(logits(cfg_g, wg), logits(cfg, w)) <= 1e-5
    args = parser.parse_args(["convert", str(tmp_path / "st"), str(tmp_path / "q.gguf"), "--mix", "f32",
                              "--type-attn", "Q8_0", "-q"])
    assert convert.run(args) == 0
    assert load_gguf(tmp_path / "q.gguf")[1]["layers.0.attn.wkv.weight"].qtype == T.Q8_0
    args = parser.parse_args(["convert", "--synthetic", "tiny", "--mix", "q8", "--out", str(tmp_path / "s.gguf"),
                              "-q"])
    assert convert.run(args) == 0
    assert load_gguf(tmp_path / "s.gguf")[2]["ds4x.synthetic"] is True
    args = parser.parse_args(["convert", str(tmp_path / "st"), str(tmp_path / "bad.gguf"), "--type-experts", "Q4_K"])
    with pytest.raises(GGUFError, match="not a multiple of the Q4_K block size"):
        convert.run(args)
    # a GGML type ds4x does not write is refused by name (Q6_K was written as F16 without a word)
    args = parser.parse_args(["convert", str(tmp_path / "st"), str(tmp_path / "bad.gguf"), "--type-experts", "Q6_K"])
    with pytest.raises(ValueError, match="'Q6_K' is not one ds4x writes"):
        convert.run(args)
    args = parser.parse_args(["convert", "--synthetic", "tiny", "--out", str(tmp_path / "s.gguf"), "--seed", "-1"])
    with pytest.raises(ValueError, match="--seed must be"):
        convert.run(args)
    assert not (tmp_path / "bad.gguf").exists()


# ---- validation errors --------------------------------------------------------------------------

def _bad_file(tmp_path, tiny, *, meta=None, plan_edit=None, name="bad.gguf"):
    cfg, w = tiny
    plan = tensor_plan(cfg, w, "f32")
    if plan_edit is not None:
        plan = plan_edit(plan)
    path = tmp_path / name
    write_gguf(path, cfg, w, plan=plan, metadata_hook=meta)
    return path


def _set(key, value, vtype=None):
    from gguf import GGUFValueType

    def hook(wr):
        if value is None:
            wr.kv_data[0].pop(key)
        else:
            wr.add_key_value(key, value, vtype or GGUFValueType.UINT32,
                             sub_type=GGUFValueType.FLOAT32 if isinstance(value, list) else None)
    return hook


def test_error_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf")


def test_error_not_gguf(tmp_path):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_gguf(p)
    assert issubclass(GGUFError, CheckpointError)


def test_error_wrong_architecture(tmp_path, tiny):
    from gguf import GGUFValueType

    p = _bad_file(tmp_path, tiny, meta=_set("general.architecture", "llama", GGUFValueType.STRING))
    with pytest.raises(GGUFError, match="general.architecture.*'llama'"):
        load_gguf(p)


@pytest.mark.parametrize("key", ["deepseek4.embedding_length", "deepseek4.expert_weights_scale"])
def test_error_missing_key(tmp_path, tiny, key):
    """A required key is named; expert_weights_scale among them (ds4.c requires it: a default would scale every
    routed expert's output silently wrong)."""
    p = _bad_file(tmp_path, tiny, meta=_set(key, None))
    with pytest.raises(GGUFError, match=f"'{key}' is missing"):
        load_gguf(p)


def test_error_key_type(tmp_path, tiny):
    from gguf import GGUFValueType

    p = _bad_file(tmp_path, tiny, meta=_set("deepseek4.block_count", "six", GGUFValueType.STRING))
    with pytest.raises(GGUFError, match="'deepseek4.block_count' must be an integer"):
        load_gguf(p)


@pytest.mark.parametrize("key,value,match", [
    ("deepseek4.attention.head_count_kv", 2, "head_count_kv' must be 1"),
    ("deepseek4.expert_gating_func", 7, "expert_gating_func' = 7"),
    ("deepseek4.attention.head_count", 5, "o_groups"),
])
def test_error_bad_values(tmp_path, tiny, key, value, match):
    p = _bad_file(tmp_path, tiny, meta=_set(key, value))
    with pytest.raises(GGUFError, match=match):
        load_gguf(p)


def test_error_indexer_on_a_layer_not_of_ratio_4(tmp_path, tiny):
    """Layer 1 is CSA (ratio 4, indexer tensors); the file says ratio 8 there: the error names the layer, its
    indexer tensors and the ratios' key."""
    from gguf import GGUFValueType

    def hook(wr):
        wr.kv_data[0].pop("deepseek4.attention.compress_ratios")
        wr.add_key_value("deepseek4.attention.compress_ratios", [0, 8, 8, 4, 0, 8], GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.UINT32)

    p = _bad_file(tmp_path, tiny, meta=hook)
    with pytest.raises(GGUFError, match=r"layer 1 has indexer tensors \(blk\.1\.indexer\.\*\) but compress "
                                        r"ratio 8.*deepseek4\.attention\.compress_ratios"):
        load_gguf(p)


def test_error_clamp_varies(tmp_path, tiny):
    from gguf import GGUFValueType

    p = _bad_file(tmp_path, tiny, meta=_set("deepseek4.swiglu_clamp_exp", [10.0, 7.0] + [10.0] * 4,
                                            GGUFValueType.ARRAY))
    with pytest.raises(GGUFError, match="swiglu_clamp_exp' varies"):
        load_gguf(p)


def test_error_missing_tensor(tmp_path, tiny):
    p = _bad_file(tmp_path, tiny, plan_edit=lambda plan: [e for e in plan if e[0] != "blk.2.attn_kv.weight"])
    with pytest.raises(GGUFError, match=r"missing 1 tensors, e.g. 'blk.2.attn_kv.weight'"):
        load_gguf(p)


def _replace(name, shape=None, qtype=None, fill=0.0):
    """Plan editor: tensor ``name`` gets another shape and/or type, filled with ``fill``."""
    def edit(plan):
        out = []
        for gname, s, qt, src in plan:
            if gname == name:
                s, qt = shape or s, qtype or qt
                src = functools.partial(encode_tensor, torch.full(s, fill), qt)
            out.append((gname, s, qt, src))
        return out
    return edit


def test_error_wrong_shape(tmp_path, tiny):
    p = _bad_file(tmp_path, tiny, plan_edit=_replace("blk.1.attn_q_a.weight", shape=(32, 128)))
    with pytest.raises(GGUFError, match=r"'blk.1.attn_q_a.weight' has GGUF dims \[128, 32\], expected \[128, 64\]"):
        load_gguf(p)


def test_error_wrong_type(tmp_path, tiny):
    # the model reads norms directly: plain floats only
    p = _bad_file(tmp_path, tiny, plan_edit=_replace("blk.0.attn_norm.weight", qtype=T.Q8_0, fill=1.0))
    with pytest.raises(GGUFError, match="'blk.0.attn_norm.weight' has type Q8_0, expected one of F32, F16, BF16"):
        load_gguf(p)


def test_error_bad_expert_ids(tmp_path, tiny):
    p = _bad_file(tmp_path, tiny, plan_edit=_replace("blk.0.ffn_gate_tid2eid.weight", fill=99))
    with pytest.raises(GGUFError, match=r"tid2eid.weight' holds expert ids outside \[0, 8\)"):
        load_gguf(p)


def test_error_truncated(tmp_path, f32_gguf):
    data = f32_gguf.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFTruncatedError, match="truncated"):
        load_gguf(p)
    p.write_bytes(data[:200])  # inside the header: where the header's bytes ran out
    with pytest.raises(GGUFTruncatedError, match=r"the header needs bytes \d+\.\.\d+ but the file has 200: truncated"):
        load_gguf(p)


def test_error_array_length_past_the_end_of_the_file(tmp_path, f32_gguf):
    """An array's declared length that the rest of the file cannot hold is refused at once (gguf reads arrays entry
    by entry: a length of 2^62 looped at the end of the file, growing memory without bound)."""
    import struct

    from gguf import GGUFReader

    field = GGUFReader(f32_gguf).fields["deepseek4.attention.compress_ratios"]
    at = field.offset + sum(int(part.nbytes) for part in field.parts[:3])  # the value: item type, then length
    data = bytearray(f32_gguf.read_bytes())
    for length in (2**62, 10_000_000):
        data[at + 4 : at + 12] = struct.pack("<Q", length)
        p = tmp_path / "long_array.gguf"
        p.write_bytes(bytes(data))
        t0 = time.monotonic()
        with pytest.raises(GGUFTruncatedError, match=f"declares {length} entries"):
            load_gguf(p)
        assert time.monotonic() - t0 < 5


def test_error_block_count_past_the_layers_present(tmp_path, tiny):
    """A block count far past the file's blk.N tensors is refused before anything per layer is built (with a scalar
    compress ratio it was expanded to 2^32 entries: a ~32 GiB allocation and an empty MemoryError)."""
    from gguf import GGUFValueType

    def hook(wr):
        wr.kv_data[0].pop("deepseek4.block_count")
        wr.add_key_value("deepseek4.block_count", 2**32 - 1, GGUFValueType.UINT32)
        wr.kv_data[0].pop("deepseek4.attention.compress_ratios")
        wr.add_key_value("deepseek4.attention.compress_ratios", 0, GGUFValueType.INT32)

    p = _bad_file(tmp_path, tiny, meta=hook)
    with pytest.raises(GGUFError, match=r"block_count' is 4294967295, but the file has tensors for 6 layers"):
        load_gguf(p)


def test_error_a_csa_layer_missing_one_indexer_tensor_names_it(tmp_path, tiny):
    """Any indexer tensor makes a ratio-4 layer CSA, so the one missing is named (deciding by attn_q_b alone made
    the layer HCA and blamed its compressor's shape)."""
    p = _bad_file(tmp_path, tiny, plan_edit=lambda plan: [e for e in plan if e[0] != "blk.1.indexer.attn_q_b.weight"])
    with pytest.raises(GGUFError, match=r"missing 1 tensors, e.g. 'blk.1.indexer.attn_q_b.weight'"):
        load_gguf(p)


@pytest.mark.parametrize("key,value", [("tokenizer.ggml.tokens", [1, 2, 3]), ("tokenizer.ggml.merges", [7]),
                                       ("tokenizer.ggml.pre", ["joyai-llm"])])
def test_tokenizer_metadata_of_the_wrong_type_is_named(f32_gguf, key, value):
    _, _, meta = load_gguf(f32_gguf)
    with pytest.raises(ValueError, match=re.escape(f"'{key}'")):
        GGUFTokenizer.from_metadata({**meta, key: value})


def test_writer_refuses_a_target_that_is_not_a_regular_file(tiny, tmp_path):
    """The writer renames its finished file over the target: a pipe there is refused, not replaced."""
    import os
    import stat

    cfg, w = tiny
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        write_gguf(fifo, cfg, w, plan=tensor_plan(cfg, w, "f32"))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_writer_refuses_unrepresentable(tiny, tmp_path):
    cfg, w = tiny
    odd = cfg.replace(mlp_hash=(False, True) + (False,) * 4)
    with pytest.raises(GGUFError, match="hash_layer_count"):
        write_gguf(tmp_path / "x.gguf", odd, synthetic_weights(odd), "f32")


# ---- tokenizer ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok1000():
    v = synthetic_vocab(1000)
    return GGUFTokenizer(v.tokens, v.merges)


# Token ids produced by antirez/ds4's own tokenizer (bpe_tokenize_text / tokenize_rendered_chat,
# compiled from ds4.c) for synthetic_vocab(1000).
DS4_GOLDEN = [
    ("Hello, world!\n\n    int x = 42;", False,
     [79, 108, 115, 115, 118, 51, 312, 118, 121, 115, 107, 40, 17, 17, 263, 39, 298, 117, 123, 313, 441, 39, 59,
      57, 66]),
    ("naïve café 日本語テキスト 12345 😀", False,
     [117, 104, 202, 182, 125, 108, 292, 104, 109, 202, 176, 356, 158, 172, 237, 163, 179, 239, 177, 165, 234, 138,
      141, 234, 137, 180, 234, 137, 192, 234, 138, 143, 39, 56, 57, 58, 59, 60, 366, 166, 159, 135]),
    ("a  \t\n\n b;;\n>;\n  )", False, [104, 263, 16, 17, 17, 291, 66, 66, 17, 69, 66, 17, 39, 421]),
    ("<｜User｜>hi<｜Assistant｜></think>ok", True, [2, 111, 112, 3, 5, 118, 114]),
]


@pytest.mark.parametrize("text,specials,ids", DS4_GOLDEN)
def test_tokenizer_matches_ds4(tok1000, text, specials, ids):
    got = tok1000.encode(text) if specials else tok1000.encode_plain(text)
    assert got == ids
    assert tok1000.decode(got) == text


def test_ds4_split_rules():
    assert ds4_split("12345") == ["123", "45"]
    assert ds4_split("    int") == ["   ", " int"]
    assert ds4_split("a ;;\n\nb") == ["a", " ;;\n\n", "b"]
    assert ds4_split("x.y") == ["x", ".y"]
    assert ds4_split("日本語abc") == ["日本語", "abc"]
    assert ds4_split("") == []


def test_tokenizer_round_trips_arbitrary_utf8(tok1000):
    rng = random.Random(0)
    pools = ["abcXYZ019 \t\n\r.,;:!?()[]{}<>-_+=*/\\'\"`~@#$%^&|", "éàüßøñ中日カな한😀🎉\u00a0\u3000\u200b\x00\x7f"]
    for _ in range(300):
        text = "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, 80)))
        ids = tok1000.encode(text)
        assert all(0 <= i < 1000 for i in ids)
        assert tok1000.decode(ids) == text
    every = "".join(chr(c) for c in range(1, 0x800) if not 0xD800 <= c < 0xE000)
    assert tok1000.decode(tok1000.encode(every)) == every


def test_tokenizer_specials_and_metadata(f32_gguf):
    _, _, meta = load_gguf(f32_gguf)
    tok = GGUFTokenizer.from_metadata(meta)
    assert tok.vocab_size == 512
    assert tok.bos_id == 0 and tok.eos_ids == (1,)
    assert tok.encode("<think>x</think>") == [4, *tok.encode_plain("x"), 5]
    assert tok.decode([0, 2]) == "<｜begin▁of▁sentence｜><｜User｜>"
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        GGUFTokenizer.from_metadata({})
    assert math.isfinite(len(GGUFTokenizer.from_gguf(f32_gguf).encode("abc")))


@pytest.mark.parametrize("pre", ["default", "llama-bpe", None])
def test_tokenizer_unknown_or_missing_pre_splits_as_deepseek_v4(f32_gguf, pre):
    """ds4 never reads tokenizer.ggml.pre: a file naming a split ds4x does not know still loads, split as
    DeepSeek-V4 (joyai-llm) is."""
    _, _, meta = load_gguf(f32_gguf)
    meta = {k: v for k, v in meta.items() if k != "ds4x.tokenizer.pre_tokenizer"}
    meta["tokenizer.ggml.pre"] = "joyai-llm"
    want = GGUFTokenizer.from_metadata(meta)
    if pre is None:
        del meta["tokenizer.ggml.pre"]
    else:
        meta["tokenizer.ggml.pre"] = pre
    tok = GGUFTokenizer.from_metadata(meta)
    assert tok.pre == "joyai-llm"
    text = "naïve café 日本語 12345, x=42\n\n  y"
    assert tok.encode(text) == want.encode(text)


# ---- regressions from the adversarial probe (devrun/gguf_probe_adversarial.py) --------------------------

@pytest.mark.parametrize("key,value,vtype", [
    ("deepseek4.expert_weights_scale", 0.0, "FLOAT32"),
    ("deepseek4.expert_weights_scale", -1.5, "FLOAT32"),
    ("deepseek4.expert_used_count", 0, "UINT32"),
    ("deepseek4.attention.sliding_window", 0, "UINT32"),
    ("deepseek4.hyper_connection.epsilon", 0.0, "FLOAT32"),
])
def test_error_bad_config_value_names_the_gguf_key(tmp_path, tiny, key, value, vtype):
    # ModelConfig's own check names its field ('n_experts_per_tok'); the GGUF error must name the file's key
    from gguf import GGUFValueType

    p = _bad_file(tmp_path, tiny, meta=_set(key, value, GGUFValueType[vtype]))
    with pytest.raises(GGUFError, match=f"GGUF metadata key '{key}'"):
        load_gguf(p)


def test_a_file_without_yarn_scaling_says_so(tmp_path, tiny, caplog):
    """ds4's files carry rope.scaling.factor; one without it loads with plain RoPE, and the log says so."""
    p = _bad_file(tmp_path, tiny, meta=_set("deepseek4.rope.scaling.factor", None))
    with caplog.at_level("WARNING", logger="ds4x.weights.gguf"):
        cfg, _, _ = load_gguf(p)
    assert cfg.compress_rope_scaling is None
    assert any("rope.scaling.factor" in r.message and "without YaRN" in r.message for r in caplog.records)


@pytest.mark.parametrize("key,value,vtype", [
    ("deepseek4.rope.scaling.factor", 0.0, "FLOAT32"),  # was NaN logits
    ("deepseek4.rope.scaling.yarn_beta_fast", 0.0, "FLOAT32"),  # was a ZeroDivisionError in rope.py
    ("deepseek4.rope.scaling.yarn_beta_slow", -1.0, "FLOAT32"),  # was "math domain error"
    ("deepseek4.rope.scaling.original_context_length", 0, "UINT64"),
])
def test_error_bad_yarn_values_are_refused_at_load(tmp_path, tiny, key, value, vtype):
    from gguf import GGUFValueType

    def meta(wr):
        wr.add_key_value("deepseek4.rope.scaling.factor", 4.0, GGUFValueType.FLOAT32)
        wr.add_key_value("deepseek4.rope.scaling.original_context_length", 64, GGUFValueType.UINT64)
        for k in ("yarn_beta_fast", "yarn_beta_slow"):
            wr.add_key_value(f"deepseek4.rope.scaling.{k}", 2.0, GGUFValueType.FLOAT32)
        wr.kv_data[0].pop(key, None)
        wr.add_key_value(key, value, GGUFValueType[vtype])
    p = _bad_file(tmp_path, tiny, meta=meta)
    with pytest.raises(GGUFError, match=f"GGUF metadata key '{key}'"):
        load_gguf(p)


def test_mtp_sidecar_with_ds4_architecture(tiny, f32_gguf, tmp_path):
    # ds4's DeepSeek-V4-Flash-MTP GGUF declares general.architecture 'deepseek4_mtp_support'
    from gguf import GGUFValueType

    cfg, _ = tiny
    g = torch.Generator().manual_seed(5)
    mtp_w = {n: torch.randn(s, generator=g) * 0.1 for n, s in mtp_expected_shapes(cfg).items()}
    plan = [e for e in tensor_plan(cfg, {**synthetic_weights(cfg, seed=0), **mtp_w}, "f32") if e[0].startswith("mtp.")]
    side = tmp_path / "mtp-sidecar.gguf"
    write_gguf(side, cfg, {}, plan=plan,
               metadata_hook=_set("general.architecture", "deepseek4_mtp_support", GGUFValueType.STRING))
    cfg_g, w, _ = load_gguf(f32_gguf, mtp_path=side)
    assert cfg_g.num_mtp_layers == 1 and torch.equal(w["mtp.0.e_proj.weight"], mtp_w["mtp.0.e_proj.weight"])
    other = tmp_path / "mtp-llama.gguf"
    write_gguf(other, cfg, {}, plan=plan, metadata_hook=_set("general.architecture", "llama", GGUFValueType.STRING))
    with pytest.raises(GGUFError, match="general.architecture' is 'llama'"):
        load_gguf(f32_gguf, mtp_path=other)
