"""A DeepSeek-V4 GGUF written the way a third party would write one, from the layout alone.

Our other GGUF tests write files with ds4x's own writer, so they cannot notice where the loader expects
something that writer happens to do. Here the file is written with nothing but ``gguf.GGUFWriter`` and
the ds4 layout as antirez/ds4 defines it: tensor names and GGUF dims from ``ds4.c``'s ``weights_bind`` /
``weights_validate_layout`` (dims innermost first, i.e. the reverse of the numpy shape, which
``GGUFWriter.add_tensor`` does for us) and the name mapping of ``gguf-tools/deepseek4-quantize.c``;
metadata keys and the value types ``ds4.c`` accepts for them (``required_u32`` / ``required_u64`` /
``required_f32`` / ``required_bool``, ``validate_compress_ratio_metadata``,
``validate_swiglu_clamp_metadata``, ``vocab_load``). Nothing from ds4x's writers is used.

The reference is the same weights as an official-layout safetensors checkpoint (per-expert tensors,
``config.json`` in the official spelling), written here by hand and read by ds4x's checkpoint loader.

The model is deliberately not the ``tiny`` preset (hidden 96, head dim 96 with 32 RoPE dims, an HCA
ratio of 16, one hash layer) so the loader is exercised on "any size of the architecture".
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFValueType as V  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from ds4x.model.transformer import Transformer  # noqa: E402
from ds4x.weights.checkpoint import load_checkpoint  # noqa: E402
from ds4x.weights.gguf import GGUFError, load_gguf  # noqa: E402

# ---- the model ----------------------------------------------------------------------------------

# ds4's special tokens (vocab_load looks these up by text)
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
            "</think>", "｜DSML｜"]


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map (byte-level BPE token text), in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


BYTE_TOKENS = _byte_alphabet()
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
TOKENS = BYTE_TOKENS + [m.replace(" ", "") for m in MERGES] + SPECIALS
BOS, EOS = TOKENS.index(SPECIALS[0]), TOKENS.index(SPECIALS[1])


@dataclass(frozen=True)
class Dims:
    vocab: int = len(TOKENS)  # 272
    hidden: int = 96
    ratios: tuple[int, ...] = (0, 4, 16, 4, 0)  # sliding, CSA, HCA, CSA, sliding
    n_hash: int = 1
    heads: int = 4
    head_dim: int = 96
    rope: int = 32
    q_lora: int = 64
    o_groups: int = 2
    o_lora: int = 32
    experts: int = 8
    used: int = 2
    ff: int = 64
    window: int = 16
    idx_heads: int = 16
    idx_dim: int = 64
    idx_topk: int = 4
    hc: int = 4
    sinkhorn: int = 20
    hc_eps: float = 1e-6
    rms_eps: float = 1e-6
    clamp: float = 10.0
    scale: float = 1.5
    theta: float = 10000.0
    c_theta: float = 160000.0
    yarn: float = 4.0
    yarn_orig: int = 64
    ctx: int = 4096


D = Dims()
PROMPT = [BOS, 104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, *range(33, 60), 256, 262, 7]  # 42 tokens


def ds4_tensors(d: Dims) -> dict[str, tuple[int, ...]]:
    """ds4 GGUF name -> numpy shape (the reverse of ds4.c's GGUF dims), from weights_validate_layout."""
    hc_dim, mix = d.hc * d.hidden, (2 + d.hc) * d.hc
    t: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (d.vocab, d.hidden),
        "output_hc_base.weight": (d.hc,),
        "output_hc_fn.weight": (d.hc, hc_dim),
        "output_hc_scale.weight": (1,),
        "output_norm.weight": (d.hidden,),
        "output.weight": (d.vocab, d.hidden),
    }
    for i, ratio in enumerate(d.ratios):
        p = f"blk.{i}."
        t |= {
            p + "hc_attn_fn.weight": (mix, hc_dim), p + "hc_attn_scale.weight": (3,), p + "hc_attn_base.weight": (mix,),
            p + "attn_norm.weight": (d.hidden,),
            p + "attn_q_a.weight": (d.q_lora, d.hidden), p + "attn_q_a_norm.weight": (d.q_lora,),
            p + "attn_q_b.weight": (d.heads * d.head_dim, d.q_lora),
            p + "attn_kv.weight": (d.head_dim, d.hidden), p + "attn_kv_a_norm.weight": (d.head_dim,),
            p + "attn_sinks.weight": (d.heads,),
            p + "attn_output_a.weight": (d.o_groups * d.o_lora, d.head_dim * d.heads // d.o_groups),
            p + "attn_output_b.weight": (d.hidden, d.o_groups * d.o_lora),
        }
        if ratio:
            width = (2 if ratio == 4 else 1) * d.head_dim
            t |= {p + "attn_compressor_ape.weight": (ratio, width),
                  p + "attn_compressor_kv.weight": (width, d.hidden),
                  p + "attn_compressor_gate.weight": (width, d.hidden),
                  p + "attn_compressor_norm.weight": (d.head_dim,)}
        if ratio == 4:
            w = 2 * d.idx_dim
            t |= {p + "indexer.attn_q_b.weight": (d.idx_heads * d.idx_dim, d.q_lora),
                  p + "indexer.proj.weight": (d.idx_heads, d.hidden),
                  p + "indexer_compressor_ape.weight": (ratio, w), p + "indexer_compressor_kv.weight": (w, d.hidden),
                  p + "indexer_compressor_gate.weight": (w, d.hidden),
                  p + "indexer_compressor_norm.weight": (d.idx_dim,)}
        t |= {
            p + "hc_ffn_fn.weight": (mix, hc_dim), p + "hc_ffn_scale.weight": (3,), p + "hc_ffn_base.weight": (mix,),
            p + "ffn_norm.weight": (d.hidden,), p + "ffn_gate_inp.weight": (d.experts, d.hidden),
            p + "ffn_gate_exps.weight": (d.experts, d.ff, d.hidden),
            p + "ffn_up_exps.weight": (d.experts, d.ff, d.hidden),
            p + "ffn_down_exps.weight": (d.experts, d.hidden, d.ff),
            p + "ffn_gate_shexp.weight": (d.ff, d.hidden), p + "ffn_up_shexp.weight": (d.ff, d.hidden),
            p + "ffn_down_shexp.weight": (d.hidden, d.ff),
        }
        if i < d.n_hash:
            t[p + "ffn_gate_tid2eid.weight"] = (d.vocab, d.used)  # GGUF dims [used, vocab], I32
        else:
            t[p + "exp_probs_b.bias"] = (d.experts,)
    return t


def random_weights(d: Dims, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic float32 (int32 for tid2eid) weights at scales that keep a random model's activations O(1)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in ds4_tensors(d).items():
        def normal(std: float, shape: tuple[int, ...] = shape) -> np.ndarray:
            return (rng.standard_normal(shape) * std).astype(np.float32)
        if name.endswith("tid2eid.weight"):
            out[name] = np.argsort(rng.random((d.vocab, d.experts)), axis=1)[:, : d.used].astype(np.int32)
        elif name.endswith("norm.weight") or name.endswith("_scale.weight"):
            out[name] = 1.0 + normal(0.1)
        elif name.endswith("_fn.weight"):
            out[name] = normal(0.5 / np.sqrt(shape[-1]))
        elif name.endswith(("_base.weight", "exp_probs_b.bias")):
            out[name] = normal(0.1)
        elif name.endswith(("attn_sinks.weight", "_ape.weight")):
            out[name] = normal(0.5)
        elif name == "token_embd.weight":
            out[name] = normal(1.0)
        else:
            out[name] = normal((3.0 if name == "output.weight" else 1.0) / np.sqrt(shape[-1]))
    return out


# ---- the third party's GGUF writer ----------------------------------------------------------------

@dataclass(frozen=True)
class Style:
    """How the third party writes the file: every field is a choice ds4.c accepts (or ignores)."""
    u32: V = V.UINT32  # integer keys (ds4.c: required_u32 wants UINT32; extra leniency is ds4x's)
    u64: V = V.UINT64  # context_length / rope.scaling.original_context_length (required_u64: U64 or U32)
    f32: V = V.FLOAT32  # float keys (required_f32: F32, F64, U32 or I32)
    ints_as_floats: bool = False  # integral float keys (theta, yarn betas...) written as UINT32 ints
    ratios: V = V.INT32  # compress_ratios array (INT32 or UINT32)
    clamp: V = V.FLOAT32  # swiglu_clamp_exp array (FLOAT32 or FLOAT64)
    flash_arrays: bool = False  # per-layer arrays carry one more entry (the MTP layer), as Flash's do
    tokenizer: bool = True
    token_ids: bool = True  # tokenizer.ggml.bos/eos_token_id (ds4 finds them by text)
    optional_keys: bool = True  # keys ds4.c never reads (name, gating func, value_length, template ...)
    bias: bool = True  # blk.N.exp_probs_b.bias (ds4.c: tensor_by_namef, optional)
    hash_bias: bool = False  # a routing bias in the hash layers too (ds4.c binds it, routing ignores it)
    shuffle: bool = False
    alignment: int | None = None
    extras: bool = False  # unknown metadata keys and tensors
    types: Callable[[str], Q] | None = None  # per-tensor GGML type; None: all F32 (I32 for tid2eid)
    drop: tuple[str, ...] = ()  # metadata keys left out


def _encode(arr: np.ndarray, qt: Q) -> tuple[np.ndarray, Q | None]:
    if qt == Q.F32:
        return arr.astype(np.float32), None
    if qt == Q.F16:
        return arr.astype(np.float16), None
    if qt == Q.I32:
        return arr.astype(np.int32), None
    return gguf.quants.quantize(arr.astype(np.float32), qt), qt


def write_third_party(path: Path, weights: dict[str, np.ndarray], d: Dims = D, s: Style = Style()) -> None:
    w = gguf.GGUFWriter(str(path), "deepseek4")  # writes general.architecture
    if s.alignment is not None:
        w.add_custom_alignment(s.alignment)

    def u32(key: str, v: int) -> None:
        w.add_key_value(f"deepseek4.{key}", v, s.u32)

    def f32(key: str, v: float) -> None:
        if s.ints_as_floats and float(v).is_integer():
            w.add_key_value(f"deepseek4.{key}", int(v), V.UINT32)
        else:
            w.add_key_value(f"deepseek4.{key}", v, s.f32)

    n = len(d.ratios)
    if s.optional_keys:
        w.add_name("third-party tiny DeepSeek-V4")
        u32("expert_gating_func", 4)  # llama.cpp's SQRT_SOFTPLUS; ds4.c does not read it
        u32("attention.value_length", d.head_dim)
        u32("expert_group_count", 0)
        u32("expert_group_used_count", 0)
        u32("leading_dense_block_count", 0)
    w.add_key_value("deepseek4.context_length", d.ctx, s.u64)
    u32("block_count", n)
    u32("embedding_length", d.hidden)
    u32("vocab_size", d.vocab)
    u32("attention.head_count", d.heads)
    u32("attention.head_count_kv", 1)
    u32("attention.key_length", d.head_dim)
    u32("rope.dimension_count", d.rope)
    u32("attention.q_lora_rank", d.q_lora)
    u32("attention.output_lora_rank", d.o_lora)
    u32("attention.output_group_count", d.o_groups)
    u32("expert_count", d.experts)
    u32("expert_used_count", d.used)
    u32("expert_feed_forward_length", d.ff)
    u32("expert_shared_count", 1)
    u32("hash_layer_count", d.n_hash)
    u32("attention.sliding_window", d.window)
    u32("attention.indexer.head_count", d.idx_heads)
    u32("attention.indexer.key_length", d.idx_dim)
    u32("attention.indexer.top_k", d.idx_topk)
    u32("hyper_connection.count", d.hc)
    u32("hyper_connection.sinkhorn_iterations", d.sinkhorn)
    f32("hyper_connection.epsilon", d.hc_eps)
    f32("attention.layer_norm_rms_epsilon", d.rms_eps)
    f32("rope.freq_base", d.theta)
    f32("attention.compress_rope_freq_base", d.c_theta)
    f32("rope.scaling.factor", d.yarn)
    w.add_key_value("deepseek4.rope.scaling.original_context_length", d.yarn_orig, s.u64)
    f32("rope.scaling.yarn_beta_fast", 32.0)
    f32("rope.scaling.yarn_beta_slow", 1.0)
    f32("expert_weights_scale", d.scale)
    w.add_bool("deepseek4.expert_weights_norm", True)
    extra = [0] if s.flash_arrays else []
    w.add_key_value("deepseek4.attention.compress_ratios", [*d.ratios, *extra], V.ARRAY, sub_type=s.ratios)
    w.add_key_value("deepseek4.swiglu_clamp_exp", [d.clamp] * (n + len(extra)), V.ARRAY, sub_type=s.clamp)
    if s.tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("joyai-llm")
        w.add_token_list(TOKENS)
        w.add_token_merges(MERGES)
        w.add_token_types([3 if t in SPECIALS else 1 for t in TOKENS])
        if s.token_ids:
            w.add_bos_token_id(BOS)
            w.add_eos_token_id(EOS)
        if s.optional_keys:
            w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    if s.extras:
        w.add_string("deepseek4.some_future_key", "ignored")
        w.add_key_value("quantize.imatrix.entries_count", 7, V.INT32)
        w.add_array("third_party.floats", [1.0, 2.0])

    for key in s.drop:
        w.kv_data[0].pop(key)

    items = list(weights.items())
    if not s.bias:
        items = [(k, v) for k, v in items if not k.endswith("exp_probs_b.bias")]
    if s.hash_bias:
        rng = np.random.default_rng(99)
        items += [(f"blk.{i}.exp_probs_b.bias", rng.standard_normal(d.experts).astype(np.float32))
                  for i in range(d.n_hash)]
    if s.extras:
        items += [("rope_freqs.weight", np.ones(d.rope // 2, np.float32)),
                  ("blk.0.attn_future.weight", np.ones((8, 32), np.float32))]
    if s.shuffle:
        random.Random(7).shuffle(items)
    for name, arr in items:
        qt = Q.I32 if arr.dtype == np.int32 else (s.types(name) if s.types else Q.F32)
        data, raw = _encode(arr, qt)
        w.add_tensor(name, data, raw_dtype=raw)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def ds4_types(name: str) -> Q:
    """The published ds4 mix where the gguf package can quantize: attention projections, shared experts
    and output Q8_0; embedding, mHC, compressor, indexer and router F16; norms, sinks, biases F32. (Routed
    experts stay F16: gguf-py has no K-quant / IQ2 quantizer.)"""
    q8 = ("attn_q_a.", "attn_q_b.", "attn_kv.", "attn_output_a.", "attn_output_b.", "_shexp.")
    if name == "output.weight" or any(k in name for k in q8):
        return Q.Q8_0
    f32 = ("norm.weight", "_scale.weight", "_base.weight", "attn_sinks.weight", "exp_probs_b.bias")
    return Q.F32 if name.endswith(f32) else Q.F16


def stored_values(weights: dict[str, np.ndarray], types: Callable[[str], Q]) -> dict[str, np.ndarray]:
    """What the file holds after ``types`` (gguf's own dequantizers)."""
    out = {}
    for name, arr in weights.items():
        qt = Q.I32 if arr.dtype == np.int32 else types(name)
        data, raw = _encode(arr, qt)
        out[name] = (gguf.quants.dequantize(data, raw) if raw is not None else data).astype(arr.dtype)
    return out


# ---- the reference: an official-layout safetensors checkpoint ------------------------------------

# ds4 GGUF name -> official checkpoint name (gguf-tools/deepseek4-quantize.c top_map / layer_map)
TOP = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight", "output.weight": "head.weight",
       "output_hc_base.weight": "hc_head_base", "output_hc_fn.weight": "hc_head_fn",
       "output_hc_scale.weight": "hc_head_scale"}
LAYER = {
    "hc_attn_base.weight": "hc_attn_base", "hc_attn_fn.weight": "hc_attn_fn", "hc_attn_scale.weight": "hc_attn_scale",
    "hc_ffn_base.weight": "hc_ffn_base", "hc_ffn_fn.weight": "hc_ffn_fn", "hc_ffn_scale.weight": "hc_ffn_scale",
    "attn_sinks.weight": "attn.attn_sink", "attn_q_a.weight": "attn.wq_a.weight", "attn_q_b.weight": "attn.wq_b.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight", "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight", "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight", "attn_compressor_ape.weight": "attn.compressor.ape",
    "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight", "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight", "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight", "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight", "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight", "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
}
EXPERTS = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2"}


def official_config(d: Dims) -> dict[str, Any]:
    return {
        "model_type": "deepseek_v4", "vocab_size": d.vocab, "hidden_size": d.hidden, "num_hidden_layers": len(d.ratios),
        "num_attention_heads": d.heads, "num_key_value_heads": 1, "head_dim": d.head_dim, "qk_rope_head_dim": d.rope,
        "q_lora_rank": d.q_lora, "o_groups": d.o_groups, "o_lora_rank": d.o_lora, "n_routed_experts": d.experts,
        "n_shared_experts": 1, "num_experts_per_tok": d.used, "moe_intermediate_size": d.ff,
        "compress_ratios": list(d.ratios), "num_hash_layers": d.n_hash, "sliding_window": d.window,
        "index_n_heads": d.idx_heads, "index_head_dim": d.idx_dim, "index_topk": d.idx_topk, "hc_mult": d.hc,
        "hc_sinkhorn_iters": d.sinkhorn, "hc_eps": d.hc_eps, "rms_norm_eps": d.rms_eps, "swiglu_limit": d.clamp,
        "scoring_func": "sqrtsoftplus", "routed_scaling_factor": d.scale, "rope_theta": d.theta,
        "compress_rope_theta": d.c_theta, "max_position_embeddings": d.ctx,
        "rope_scaling": {"type": "yarn", "factor": d.yarn, "original_max_position_embeddings": d.yarn_orig,
                         "beta_fast": 32, "beta_slow": 1},
        "bos_token_id": BOS, "eos_token_id": EOS, "tie_word_embeddings": False,
    }


def write_official(path: Path, weights: dict[str, np.ndarray], d: Dims = D) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    out: dict[str, np.ndarray] = {}
    for name, arr in weights.items():
        if name in TOP:
            out[TOP[name]] = arr
            continue
        _, layer, rest = name.split(".", 2)
        if rest in EXPERTS:
            for e in range(arr.shape[0]):
                out[f"layers.{layer}.ffn.experts.{e}.{EXPERTS[rest]}.weight"] = np.ascontiguousarray(arr[e])
        else:
            out[f"layers.{layer}.{LAYER[rest]}"] = arr.astype(np.int64) if arr.dtype == np.int32 else arr
    save_file(out, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(official_config(d)))
    return path


def logits(cfg: Any, weights: dict[str, Any]) -> torch.Tensor:
    model = Transformer(cfg, weights)
    return model.forward(torch.tensor(PROMPT), model.new_cache(64), all_logits=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return random_weights(D, seed=0)


@pytest.fixture(scope="module")
def reference(weights, tmp_path_factory) -> tuple[Any, torch.Tensor]:
    cfg, w = load_checkpoint(write_official(tmp_path_factory.mktemp("ref"), weights))
    return cfg, logits(cfg, w)


# ---- tests --------------------------------------------------------------------------------------

def _check(path: Path, reference: tuple[Any, torch.Tensor], tol: float = 1e-5) -> tuple[Any, dict, dict]:
    cfg_ref, ref = reference
    cfg, w, meta = load_gguf(path)
    # bos / eos come from the tokenizer metadata, which some variants leave out
    assert cfg.replace(bos_token_id=cfg_ref.bos_token_id, eos_token_ids=cfg_ref.eos_token_ids) == cfg_ref
    got = logits(cfg, w)
    assert torch.isfinite(got).all() and ref.std() > 0.5
    assert rel(got, ref) <= tol, rel(got, ref)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    return cfg, w, meta


def test_reference_is_sensitive(weights, reference, tmp_path):
    """The comparison can fail: one transposed square matrix, or one swapped gate/up, moves the logits."""
    for swap in (("blk.1.attn_output_b.weight", None), ("blk.2.ffn_gate_shexp.weight", "blk.2.ffn_up_shexp.weight")):
        w = dict(weights)
        a, b = swap
        if b is None:
            sq = w[a].reshape(-1)[: 64 * 64].reshape(64, 64)
            w[a] = np.concatenate([sq.T.reshape(-1), w[a].reshape(-1)[64 * 64:]]).reshape(w[a].shape)
        else:
            w[a], w[b] = w[b], w[a]
        path = tmp_path / "wrong.gguf"
        write_third_party(path, w)
        cfg, wg, _ = load_gguf(path)
        assert rel(logits(cfg, wg), reference[1]) > 1e-3, swap


def test_f32_matches_official_checkpoint(weights, reference, tmp_path):
    path = tmp_path / "f32.gguf"
    write_third_party(path, weights)
    cfg, w, meta = _check(path, reference)
    assert cfg.bos_token_id == BOS and cfg.eos_token_ids == (EOS,)
    assert cfg.compress_rope_scaling is not None and cfg.compress_rope_scaling.factor == D.yarn
    assert [cfg.attn_kinds[i] for i in range(5)] == ["sliding", "csa", "hca", "csa", "sliding"]
    assert cfg.mlp_hash == (True, False, False, False, False)
    # orientation: GGUF dims [in, out] are the reverse of the numpy shape the third party handed over
    np.testing.assert_array_equal(w["layers.1.attn.wo_a.weight"].numpy(), weights["blk.1.attn_output_a.weight"])
    np.testing.assert_array_equal(w["layers.3.ffn.experts.w2"].numpy(), weights["blk.3.ffn_down_exps.weight"])
    np.testing.assert_array_equal(w["layers.0.ffn.gate.tid2eid"].numpy(), weights["blk.0.ffn_gate_tid2eid.weight"])
    np.testing.assert_array_equal(w["layers.2.attn.compressor.ape"].numpy(),
                                  weights["blk.2.attn_compressor_ape.weight"])
    assert meta["tokenizer.ggml.pre"] == "joyai-llm"


VARIANTS = {
    # integer keys as INT32 / UINT64 (ds4.c wants UINT32; ds4x may be more lenient but must read the same numbers)
    "int32-keys": Style(u32=V.INT32, u64=V.UINT32),
    "uint64-keys": Style(u32=V.UINT64),
    "uint32-ratios-f64-clamp": Style(ratios=V.UINT32, clamp=V.FLOAT64),
    "float64-floats": Style(f32=V.FLOAT64),
    "integral-floats-as-uint32": Style(ints_as_floats=True),  # required_f32 accepts UINT32
    "flash-length-arrays": Style(flash_arrays=True),
    "no-tokenizer": Style(tokenizer=False),
    "tokenizer-without-ids": Style(token_ids=False),
    "no-optional-keys": Style(optional_keys=False),
    "hash-layers-with-bias": Style(hash_bias=True),
    "shuffled-aligned-64-extras": Style(shuffle=True, alignment=64, extras=True),
    "aligned-1": Style(alignment=1),
    "aligned-4096": Style(alignment=4096),
    # ds4.c requires hash_layer_count; without it the tid2eid tables still say which layers hash-route
    "no-hash-layer-count": Style(drop=("deepseek4.hash_layer_count",)),
}


@pytest.mark.parametrize("style", VARIANTS.values(), ids=VARIANTS.keys())
def test_variants_ds4_accepts(weights, reference, tmp_path, style):
    path = tmp_path / "v.gguf"
    write_third_party(path, weights, s=style)
    _check(path, reference)


def test_routing_bias_is_optional(weights, tmp_path):
    """ds4.c binds blk.N.exp_probs_b.bias with tensor_by_namef (optional) and adds it only if present:
    a file without it routes by the unbiased scores, i.e. a zero bias."""
    no_bias = {k: (np.zeros_like(v) if k.endswith("exp_probs_b.bias") else v) for k, v in weights.items()}
    cfg_ref, w_ref = load_checkpoint(write_official(tmp_path / "ref0", no_bias))
    path = tmp_path / "nobias.gguf"
    write_third_party(path, weights, s=Style(bias=False))
    _check(path, (cfg_ref, logits(cfg_ref, w_ref)))


def test_ds4_type_mix_matches_dequantized(weights, tmp_path):
    """F16 / Q8_0 as ds4 stores them (gguf.quants.quantize) against the same values dequantized by gguf."""
    stored = stored_values(weights, ds4_types)
    assert not np.array_equal(stored["blk.1.attn_q_b.weight"], weights["blk.1.attn_q_b.weight"])  # really quantized
    cfg_ref, w_ref = load_checkpoint(write_official(tmp_path / "ref", stored))
    path = tmp_path / "mix.gguf"
    write_third_party(path, weights, s=Style(types=ds4_types))
    _, w, _ = _check(path, (cfg_ref, logits(cfg_ref, w_ref)))
    assert w["layers.1.attn.wq_b.weight"].qtype.name == "Q8_0" and w["head.weight"].qtype.name == "Q8_0"
    assert w["embed.weight"].dtype == torch.float32  # F16 widened to the working dtype


def test_engine_loads_third_party_file(weights, reference, tmp_path):
    from ds4x.runtime.engine import Engine

    path = tmp_path / "engine.gguf"
    write_third_party(path, weights, s=Style(types=lambda n: Q.F32))
    eng = Engine.load(str(path), device="cpu")
    assert eng.tokenizer is not None
    assert eng.tokenizer.encode("<｜begin▁of▁sentence｜>hello world") == [BOS, TOKENS.index("hello"),
                                                                        TOKENS.index("Ġworld")]
    assert eng.tokenizer.decode(eng.tokenizer.encode("hello world")) == "hello world"
    s = eng.new_session(ctx=64, cache="float", announce=False)
    last = s.prefill(PROMPT)
    assert rel(last, reference[1][-1]) <= 1e-5


@pytest.mark.parametrize("edit,match", [
    (lambda w: w.pop("blk.2.attn_kv.weight"), "'blk.2.attn_kv.weight'"),
    (lambda w: w.__setitem__("blk.1.attn_q_a.weight", w["blk.1.attn_q_a.weight"].T.copy()),
     r"'blk.1.attn_q_a.weight' has GGUF dims \[64, 96\]"),
    (lambda w: w.__setitem__("blk.0.ffn_gate_tid2eid.weight", w["blk.0.ffn_gate_tid2eid.weight"] + 8),
     r"'blk.0.ffn_gate_tid2eid.weight' holds expert ids outside \[0, 8\)"),
])
def test_errors_name_the_tensor(weights, tmp_path, edit, match):
    w = dict(weights)
    edit(w)
    path = tmp_path / "bad.gguf"
    write_third_party(path, w)
    with pytest.raises(GGUFError, match=match):
        load_gguf(path)


@pytest.mark.parametrize("key", ["deepseek4.attention.compress_ratios", "deepseek4.embedding_length"])
def test_missing_required_key_is_named(weights, tmp_path, key):
    path = tmp_path / "nokey.gguf"
    write_third_party(path, weights, s=Style(drop=(key,)))
    with pytest.raises(GGUFError, match=f"'{key}' is missing"):
        load_gguf(path)
