"""Write GGUF files in the antirez/ds4 layout (the inverse of :mod:`ds4x.weights.gguf`).

- :func:`write_gguf`: a ModelConfig + canonical weights -> GGUF, with one GGML type per tensor class
  (:class:`TypePolicy`). F32 / F16 / BF16 and Q8_0 are exact conversions (Q8_0 is bit-exact to
  ggml's reference quantizer); Q4_K / Q2_K / IQ2_XXS use the simple round-to-nearest quantizers
  below (real quantizations of the given weights, no importance matrix, so lower quality than
  ds4's own quantizer), or, with ``synthetic=True``, random valid blocks.
  ``weights`` may be a lazy mapping (``open_checkpoint``): each tensor is read, encoded and written
  in turn, so converting a checkpoint holds one tensor, not the model.
- :func:`write_synthetic_gguf`: a synthetic model of any config (the full-size Flash included)
  streamed tensor by tensor, never holding the model in RAM: plain tensors come from
  :mod:`ds4x.weights.synthetic`, quantized ones from :func:`ds4x.formats.ggml.random_blocks`, on the
  CPU or the GPU. Its metadata says so (``ds4x.synthetic = true``, a note, the seed): it is for
  benchmarks only.

Metadata follows ds4 (``deepseek4.*`` keys, ``tokenizer.ggml.*`` byte-level BPE). Without a
tokenizer a synthetic one is written (special tokens, the 256 byte symbols, filler merges).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ds4x.config import CSA, ModelConfig
from ds4x.files import replaceable_target
from ds4x.formats.ggml import (
    QK_K,
    GGMLQuantizationType,
    _iq2xxs_grid_cpu,
    quantize_q8_0,
    quantized_nbytes,
    random_blocks,
)
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.weights.gguf import ARCH, MATRIX_TYPES, GGUFError, allowed_types, gguf_tensor_name, mtp_expected_shapes
from ds4x.weights.names import expected_shapes, is_integer_tensor, keeps_fp32
from ds4x.weights.pretokenizers import pre_tokenizer_name

T = GGMLQuantizationType

# the special tokens ds4 looks up by text (runtime/gguf_tokenizer.py uses the same list)
SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<think>", "</think>", "｜DSML｜",
)
_GATING = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}


# ---- type policy -------------------------------------------------------------------------------

@dataclass(frozen=True)
class TypePolicy:
    """GGML type per tensor class (see :func:`tensor_class`). Norms, mHC bases/scales, sinks and
    routing biases are always F32 and tid2eid I32, as ds4 requires."""

    embed: GGMLQuantizationType = T.F16
    output: GGMLQuantizationType = T.Q8_0
    attn: GGMLQuantizationType = T.Q8_0  # wq_a, wq_b, wkv, wo_a, wo_b
    shared: GGMLQuantizationType = T.Q8_0  # shared expert
    experts: GGMLQuantizationType = T.IQ2_XXS  # routed gate / up
    experts_down: GGMLQuantizationType = T.Q2_K  # routed down
    small: GGMLQuantizationType = T.F16  # mHC fn, compressor, indexer, router, position biases

    @classmethod
    def preset(cls, name: str) -> TypePolicy:
        """``q2`` (the ds4 2-bit file), ``q4`` (Q4_K routed experts), ``q8`` (Q8_0 everywhere it can),
        ``f16``, ``f32`` (everything plain: lossless)."""
        if name == "q2":
            return cls()
        if name == "q4":
            return cls(experts=T.Q4_K, experts_down=T.Q4_K)
        if name == "q8":
            return cls(experts=T.Q8_0, experts_down=T.Q8_0)
        if name in ("f16", "f32"):
            t = T.F16 if name == "f16" else T.F32
            return cls(embed=t, output=t, attn=t, shared=t, experts=t, experts_down=t, small=t)
        raise ValueError(f"unknown type preset {name!r} (q2, q4, q8, f16, f32)")

    def with_overrides(self, **types: str | GGMLQuantizationType | None) -> TypePolicy:
        return replace(self, **{k: parse_type(v) for k, v in types.items() if v is not None})


def parse_type(name: str | GGMLQuantizationType) -> GGMLQuantizationType:
    if isinstance(name, GGMLQuantizationType):
        return name
    key = name.strip().upper().replace("-", "_")
    t = T.__members__.get(key)
    if t not in MATRIX_TYPES:  # a type ds4x has no encoder or kernel for was written as F16 without a word
        raise ValueError(f"GGML type {name!r} is not one ds4x writes: {', '.join(t.name for t in MATRIX_TYPES)}")
    return t


_ATTN_PROJ = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight")


def tensor_class(canonical: str) -> str:
    """int, plain, embed, output, attn, shared, experts, experts_down or small."""
    if is_integer_tensor(canonical):
        return "int"
    if canonical in ("embed.weight",):
        return "embed"
    if canonical == "head.weight":
        return "output"
    if canonical.endswith(".experts.w2"):
        return "experts_down"
    if canonical.endswith((".experts.w1", ".experts.w3")):
        return "experts"
    if ".shared_experts." in canonical:
        return "shared"
    if canonical.endswith(_ATTN_PROJ) or canonical.endswith(("e_proj.weight", "h_proj.weight")):
        return "attn"
    if keeps_fp32(canonical):
        # ds4 keeps the mHC mixing matrices and the compressor position biases in F16, the rest F32
        return "small" if canonical.endswith(("_fn", ".ape")) else "plain"
    return "small"


def tensor_type(canonical: str, shape: tuple[int, ...], policy: TypePolicy) -> GGMLQuantizationType:
    """The policy's type for a tensor, F32 for plain ones; a block type that does not fit the row
    length (or is not allowed for the tensor) falls back to F16 for small tensors and is an error
    for the big ones."""
    cls = tensor_class(canonical)
    if cls == "int":
        return T.I32
    if cls == "plain":
        return T.F32
    t = getattr(policy, cls)
    block = quantized_block(t)
    if t not in allowed_types(canonical):
        t = T.F16 if T.F16 in allowed_types(canonical) else T.F32
    elif shape[-1] % block:
        if cls == "small":
            return T.F16
        raise GGUFError(f"tensor '{canonical}' has rows of {shape[-1]} values, not a multiple of the "
                        f"{t.name} block size {block}")
    return t


def quantized_block(t: GGMLQuantizationType) -> int:
    return {T.Q8_0: 32, T.Q2_K: QK_K, T.Q4_K: QK_K, T.IQ2_XXS: QK_K}.get(t, 1)


# ---- quantizers --------------------------------------------------------------------------------

def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _safe_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b > 0, a / torch.where(b > 0, b, torch.ones_like(b)), torch.zeros_like(a))


def _kquant_minmax(sub: torch.Tensor, qmax: int, smax: int) -> tuple[torch.Tensor, ...]:
    """Per-sub-block affine quantization ``w ~ d*sc*q - dmin*m`` (q in [0, qmax], sc and m in
    [0, smax]) by min/max, with d and dmin rounded to fp16 before the codes are chosen."""
    lo = torch.clamp(sub.amin(-1), max=0.0)
    hi = sub.amax(-1)
    scale = (hi - lo) / qmax
    mins = -lo
    d = scale.amax(-1, keepdim=True) / smax
    dmin = mins.amax(-1, keepdim=True) / smax
    d16, dmin16 = d.half().float(), dmin.half().float()
    sc = torch.clamp(torch.round(_safe_div(scale, d16)), 0, smax)
    mq = torch.clamp(torch.round(_safe_div(mins, dmin16)), 0, smax)
    eff_s = (d16 * sc).unsqueeze(-1)
    eff_m = (dmin16 * mq).unsqueeze(-1)
    q = torch.clamp(torch.round(_safe_div(sub + eff_m, eff_s.expand_as(sub))), 0, qmax)
    return d16.squeeze(-1), dmin16.squeeze(-1), sc.to(torch.uint8), mq.to(torch.uint8), q.to(torch.uint8)


def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """Q4_K by per-32 min/max (no search, no importance weights): ``[..., K] -> uint8 [..., K/256*144]``."""
    n = x.numel() // QK_K
    d, dmin, sc, mn, q = _kquant_minmax(x.float().reshape(n, 8, 32), 15, 63)
    out = torch.zeros((n, 144), dtype=torch.uint8)
    out[:, 0:2] = _f16_bytes(d)
    out[:, 2:4] = _f16_bytes(dmin)
    out[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    q = q.reshape(n, 4, 2, 32)  # chunk, low/high nibble, byte
    out[:, 16:] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * 144)


def quantize_q2_k(x: torch.Tensor) -> torch.Tensor:
    """Q2_K by per-16 min/max: ``[..., K] -> uint8 [..., K/256*84]``."""
    n = x.numel() // QK_K
    d, dmin, sc, mn, q = _kquant_minmax(x.float().reshape(n, 16, 16), 3, 15)
    out = torch.zeros((n, 84), dtype=torch.uint8)
    out[:, 0:16] = sc | (mn << 4)
    q = q.reshape(n, 2, 4, 32)  # half, bit pair, byte
    packed = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    out[:, 16:80] = packed.reshape(n, 64)
    out[:, 80:82] = _f16_bytes(d)
    out[:, 82:84] = _f16_bytes(dmin)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * 84)


def quantize_iq2_xxs(x: torch.Tensor, chunk: int = 1 << 16) -> torch.Tensor:
    """IQ2_XXS by nearest grid point: per 32 weights a 4-bit scale from the group's max, per 8 the
    even-parity signs (the smallest magnitude absorbs a parity flip, as in ggml) and the grid entry
    nearest to the magnitudes. ``[..., K] -> uint8 [..., K/256*66]``."""
    n = x.numel() // QK_K
    xs = x.float().reshape(n, 8, 4, 8)
    neg = xs < 0
    a = xs.abs()
    odd = (neg.sum(-1) % 2) == 1
    smallest = a.argmin(-1, keepdim=True)
    flip = torch.zeros_like(neg).scatter_(-1, smallest, True) & odd.unsqueeze(-1)
    neg = neg ^ flip
    sign7 = (neg[..., :7].to(torch.int64) << torch.arange(7)).sum(-1)  # (n, 8, 4)

    gmax = a.amax((-1, -2))  # (n, 8)
    target = gmax / 43.0  # the largest grid magnitude lands on the group max
    d = (target.amax(-1, keepdim=True) * 4.0 / 15.5).half().float()  # (n, 1)
    s = torch.clamp(torch.round(_safe_div(target * 4.0, d.expand_as(target)) - 0.5), 0, 15)
    db = d * (0.5 + s) * 0.25  # (n, 8)
    v = _safe_div(a, db[..., None, None].expand_as(a)).reshape(-1, 8)
    grid = _iq2xxs_grid_cpu()  # (256, 8)
    g2 = (grid * grid).sum(-1)
    idx = torch.empty(v.shape[0], dtype=torch.int64)
    for i in range(0, v.shape[0], chunk):
        part = v[i : i + chunk]
        idx[i : i + chunk] = (g2 - 2.0 * part @ grid.T).argmin(-1)
    idx = idx.reshape(n, 8, 4)

    out = torch.zeros((n, 66), dtype=torch.uint8)
    out[:, 0:2] = _f16_bytes(d.squeeze(-1))
    word = (sign7 << torch.tensor([0, 7, 14, 21])).sum(-1) | (s.to(torch.int64) << 28)  # (n, 8)
    groups = torch.zeros((n, 8, 8), dtype=torch.uint8)
    groups[:, :, 0:4] = idx.to(torch.uint8)
    groups[:, :, 4:8] = ((word.unsqueeze(-1) >> torch.tensor([0, 8, 16, 24])) & 255).to(torch.uint8)
    out[:, 2:] = groups.reshape(n, 64)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * 66)


def encode_tensor(x: torch.Tensor, qtype: GGMLQuantizationType, chunk_values: int = 1 << 24) -> torch.Tensor:
    """``x`` (logical torch shape) as GGML bytes ``uint8 [*shape[:-1], row_bytes]`` (CPU).

    Block types are quantized ``chunk_values`` values (whole rows) at a time: the quantizers' temporaries
    are several times their input, and every block depends on its own values only, so the bytes are the
    same as in one go while the peak stays near the size of ``x``.
    """
    x = x.detach().cpu()
    if qtype == T.I32:
        return x.to(torch.int32).contiguous().view(torch.uint8).reshape(*x.shape[:-1], -1)
    dtypes = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
    if qtype in dtypes:
        return x.to(dtypes[qtype]).contiguous().view(torch.uint8).reshape(*x.shape[:-1], -1)
    quantizers: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
        T.Q8_0: quantize_q8_0, T.Q4_K: quantize_q4_k, T.Q2_K: quantize_q2_k, T.IQ2_XXS: quantize_iq2_xxs,
    }
    if qtype not in quantizers:
        raise ValueError(f"cannot write type {qtype.name}")
    if x.shape[-1] % quantized_block(qtype):
        raise ValueError(f"{qtype.name}: rows of {x.shape[-1]} values are not whole blocks")
    rows = x.reshape(-1, x.shape[-1])
    step = max(1, chunk_values // x.shape[-1])
    out = torch.empty((rows.shape[0], quantized_nbytes(qtype, (x.shape[-1],))), dtype=torch.uint8)
    for i in range(0, rows.shape[0], step):
        out[i : i + step] = quantizers[qtype](rows[i : i + step].float())
    return out.reshape(*x.shape[:-1], -1)


# ---- tokenizer ---------------------------------------------------------------------------------

def _byte_symbols() -> list[str]:
    """GPT-2 byte-level alphabet: byte b -> its printable stand-in character."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


BYTE_SYMBOLS = _byte_symbols()


@dataclass
class GGUFVocab:
    tokens: list[str]
    merges: list[str]
    token_types: list[int]  # 1 normal, 3 control, 5 unused (gguf's TokenType)
    bos_id: int
    eos_id: int
    synthetic: bool = False
    # how text is split before BPE: the tokenizer.ggml.pre name, and the source tokenizer.json's own
    # pre_tokenizer / normalizer (JSON text, None when absent) and BPE ignore_merges flag, so that the GGUF
    # tokenizer (runtime/gguf_tokenizer.py) reproduces the source's ids exactly
    pre: str = "joyai-llm"
    pre_tokenizer: str | None = None
    normalizer: str | None = None
    ignore_merges: bool = False


def synthetic_vocab(vocab_size: int) -> GGUFVocab:
    """SYNTHETIC tokenizer of exactly ``vocab_size`` tokens: ds4's special tokens (ids 0..6, bos 0,
    eos 1), the 256 byte symbols, then merges of byte pairs (letters and space first) and triples,
    so every text still tokenizes (byte fallback is never needed)."""
    specials = list(SPECIAL_TOKENS)
    base = len(specials) + 256
    if vocab_size < base:
        raise ValueError(f"a synthetic GGUF vocabulary needs at least {base} tokens, got {vocab_size}")
    tokens = specials + BYTE_SYMBOLS
    types = [3] * len(specials) + [1] * 256
    order = sorted(range(256), key=lambda b: (not (chr(b).isalpha() or b == 32), b))
    syms = [BYTE_SYMBOLS[b] for b in order]
    merges: list[str] = []
    need = vocab_size - base
    seen = set(tokens)
    pairs: list[str] = []
    for a in syms:
        for b in syms:
            if len(merges) >= need:
                break
            merges.append(f"{a} {b}")
            pairs.append(a + b)
        if len(merges) >= need:
            break
    i = 0
    while len(merges) < need:  # triples: (pair, symbol)
        pair = pairs[i // 256]
        sym = syms[i % 256]
        i += 1
        if pair + sym in seen:
            continue
        seen.add(pair + sym)
        merges.append(f"{pair} {sym}")
    tokens += [m.replace(" ", "") for m in merges]
    types += [1] * len(merges)
    return GGUFVocab(tokens, merges, types, bos_id=0, eos_id=1, synthetic=True)


def _has_byte_level(pre: Any) -> bool:
    if not isinstance(pre, dict):
        return False
    if pre.get("type") == "ByteLevel":
        return True
    return pre.get("type") == "Sequence" and any(_has_byte_level(p) for p in pre.get("pretokenizers", []))


def vocab_from_tokenizer_json(path: str | Path, vocab_size: int, bos_id: int | None,
                              eos_id: int | None) -> GGUFVocab:
    """A GGUF vocabulary from an HF ``tokenizer.json`` (byte-level BPE), padded to ``vocab_size``.

    Its pre-tokenizer is kept: ``tokenizer.ggml.pre`` names it when it is a known one (``joyai-llm`` for
    DeepSeek-V3/V4's, ``gpt-2`` for GPT-2's byte-level regex), and the JSON itself is stored too, as is a
    normalizer, so the GGUF tokenizer gives the same ids as this file."""
    data = json.loads(Path(path).read_text())
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: only byte-level BPE tokenizers can be written to GGUF, got {model.get('type')!r}")
    pre_json = data.get("pre_tokenizer")
    if not _has_byte_level(pre_json):
        raise ValueError(f"{path}: only byte-level BPE tokenizers can be written to GGUF; its pre_tokenizer has no "
                         f"ByteLevel step")
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout", "byte_fallback"):
        if model.get(key):
            raise ValueError(f"{path}: the BPE model sets {key!r}, which a byte-level GGUF tokenizer cannot represent")
    norm = data.get("normalizer")
    if isinstance(norm, dict) and norm.get("type") == "Sequence" and not norm.get("normalizers"):
        norm = None
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    types = {i: 1 for i in by_id}
    for added in data.get("added_tokens", []):
        by_id[int(added["id"])] = added["content"]
        types[int(added["id"])] = 3 if added.get("special") else 4
    if by_id and max(by_id) >= vocab_size:
        raise ValueError(f"{path}: token id {max(by_id)} does not fit the model's vocabulary of {vocab_size}")
    tokens = [by_id.get(i, f"<｜unused_{i}｜>") for i in range(vocab_size)]
    ttypes = [types.get(i, 5) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return GGUFVocab(tokens, merges, ttypes, bos_id=0 if bos_id is None else bos_id,
                     eos_id=1 if eos_id is None else eos_id, pre=pre_tokenizer_name(pre_json) or "ds4x-json",
                     pre_tokenizer=json.dumps(pre_json, ensure_ascii=False),
                     normalizer=None if norm is None else json.dumps(norm, ensure_ascii=False),
                     ignore_merges=bool(model.get("ignore_merges", False)))


# ---- metadata ----------------------------------------------------------------------------------

def _check_representable(cfg: ModelConfig) -> None:
    n_hash = cfg.num_hash_layers
    if any(cfg.mlp_hash[i] != (i < n_hash) for i in range(cfg.num_layers)):
        raise GGUFError("the ds4 GGUF layout stores hash routing as a count of leading layers "
                        "('deepseek4.hash_layer_count'); this config has hash layers elsewhere")
    for i, (kind, r) in enumerate(zip(cfg.attn_kinds, cfg.compress_ratios, strict=True)):
        if kind == CSA and r != 4:
            raise GGUFError(f"layer {i} is CSA with compress ratio {r}; the ds4 GGUF layout marks CSA as ratio 4")
    if cfg.n_shared_experts != 1:
        raise GGUFError("the ds4 GGUF layout has exactly one shared expert")
    if cfg.num_heads % cfg.o_groups:
        raise GGUFError(f"the ds4 GGUF layout groups the output projection by whole heads; o_groups "
                        f"{cfg.o_groups} does not divide {cfg.num_heads} heads")
    y = cfg.compress_rope_scaling
    if y is not None and y.attention_factor != 1.0:  # no key holds it: the converted model would differ
        raise GGUFError(f"the ds4 GGUF layout has no YaRN attention factor; this model's is {y.attention_factor}")


def write_metadata(w: Any, cfg: ModelConfig, vocab: GGUFVocab, name: str, extra: dict[str, Any] | None) -> None:
    """Every ``deepseek4.*`` and ``tokenizer.ggml.*`` key ds4 reads."""
    from gguf import GGUFValueType

    _check_representable(cfg)
    k = ARCH + "."
    w.add_string("general.name", name)
    u32 = {
        "block_count": cfg.num_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "vocab_size": cfg.vocab_size,
        "attention.head_count": cfg.num_heads, "attention.head_count_kv": 1,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "rope.dimension_count": cfg.rope_head_dim, "attention.q_lora_rank": cfg.q_lora_rank,
        "attention.output_lora_rank": cfg.o_lora_rank, "attention.output_group_count": cfg.o_groups,
        "expert_count": cfg.n_routed_experts, "expert_used_count": cfg.n_experts_per_tok,
        "expert_feed_forward_length": cfg.moe_intermediate_size, "expert_shared_count": cfg.n_shared_experts,
        "expert_group_count": 0, "expert_group_used_count": 0,
        "hash_layer_count": cfg.num_hash_layers, "attention.sliding_window": cfg.sliding_window,
        "attention.indexer.head_count": cfg.index_n_heads, "attention.indexer.key_length": cfg.index_head_dim,
        "attention.indexer.top_k": cfg.index_topk, "hyper_connection.count": cfg.hc_mult,
        "hyper_connection.sinkhorn_iterations": cfg.hc_sinkhorn_iters,
        "expert_gating_func": _GATING[cfg.scoring_func],
    }
    if cfg.num_mtp_layers:
        u32["nextn_predict_layers"] = cfg.num_mtp_layers
    for key, v in u32.items():
        w.add_uint32(k + key, int(v))
    y = cfg.compress_rope_scaling
    f32 = {
        "hyper_connection.epsilon": cfg.hc_eps, "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        "rope.freq_base": cfg.rope_theta, "attention.compress_rope_freq_base": cfg.compress_rope_theta,
        "expert_weights_scale": cfg.routed_scaling_factor,
        "rope.scaling.factor": y.factor if y else 1.0,
        "rope.scaling.yarn_beta_fast": y.beta_fast if y else 32.0,
        "rope.scaling.yarn_beta_slow": y.beta_slow if y else 1.0,
    }
    for key, v in f32.items():
        w.add_float32(k + key, float(v))
    w.add_uint32(k + "rope.scaling.original_context_length",
                 y.original_max_position_embeddings if y else cfg.max_position_embeddings)
    w.add_bool(k + "expert_weights_norm", True)
    # one entry per layer plus the MTP block (sliding window only), as ds4's files have
    ratios = [*cfg.compress_ratios, *([0] * cfg.num_mtp_layers)]
    w.add_key_value(k + "attention.compress_ratios", ratios, GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
    clamps = [float(cfg.swiglu_limit)] * len(ratios)
    w.add_key_value(k + "swiglu_clamp_exp", clamps, GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    w.add_key_value(k + "swiglu_clamp_shexp", clamps, GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)

    w.add_string("tokenizer.ggml.model", "gpt2")
    # the text split before BPE: a name ds4 / llama.cpp know ("joyai-llm": DeepSeek-V4's; "ds4x-json" when
    # none fits), and for a converted tokenizer.json its exact pre-tokenizer, which ds4x's loader prefers
    w.add_string("tokenizer.ggml.pre", vocab.pre)
    w.add_key_value("tokenizer.ggml.tokens", vocab.tokens, GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.token_type", vocab.token_types, GGUFValueType.ARRAY,
                    sub_type=GGUFValueType.INT32)
    w.add_key_value("tokenizer.ggml.merges", vocab.merges, GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    w.add_uint32("tokenizer.ggml.bos_token_id", vocab.bos_id)
    w.add_uint32("tokenizer.ggml.eos_token_id", vocab.eos_id)
    if vocab.pre_tokenizer is not None:
        w.add_string("ds4x.tokenizer.pre_tokenizer", vocab.pre_tokenizer)
    if vocab.normalizer is not None:
        w.add_string("ds4x.tokenizer.normalizer", vocab.normalizer)
    if vocab.ignore_merges:
        w.add_bool("ds4x.tokenizer.ignore_merges", True)
    if vocab.synthetic:
        w.add_bool("ds4x.tokenizer.synthetic", True)
    for key, v in (extra or {}).items():
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint64(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        else:
            w.add_string(key, str(v))


# ---- writing -----------------------------------------------------------------------------------

TensorSource = Callable[[], torch.Tensor]  # -> encoded bytes uint8 [*shape[:-1], row_bytes], any device


@dataclass(frozen=True)
class WriteProgress:
    """Where a GGUF write stands after tensor ``index`` (1-based) of ``count``."""

    name: str  # GGUF name of the tensor just written
    index: int
    count: int
    bytes_done: int  # tensor data written so far
    bytes_total: int  # tensor data of the whole file


ProgressFn = Callable[[WriteProgress], None]


def _write(path: Path, cfg: ModelConfig, vocab: GGUFVocab, name: str, extra: dict[str, Any],
           plan: Iterable[tuple[str, tuple[int, ...], GGMLQuantizationType, TensorSource]],
           progress: ProgressFn | None = None,
           metadata_hook: Callable[[Any], None] | None = None) -> None:
    """Header from ``plan`` (name, torch shape, type, lazy bytes), then each tensor's bytes in turn, so
    only one tensor's bytes exist at a time. ``metadata_hook(writer)`` may edit the metadata before it is
    written (tests build bad files)."""
    from gguf import GGUFWriter

    plan = list(plan)
    path = replaceable_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # written beside the target and renamed at the end: a failure halfway (a bad tensor, a full disk) leaves
    # neither a truncated GGUF nor a clobbered earlier file at ``path``
    final, path = path, path.with_name(f".{path.name}.{os.getpid()}.partial")
    w = GGUFWriter(str(path), ARCH)
    write_metadata(w, cfg, vocab, name, extra)
    if metadata_hook is not None:
        metadata_hook(w)
    total = 0
    for gname, shape, qt, _src in plan:
        nbytes = quantized_nbytes(qt, shape)
        total += nbytes
        w.add_tensor_info(gname, (*shape[:-1], nbytes // max(1, math.prod(shape[:-1]))), np.dtype(np.uint8),
                          nbytes, raw_dtype=qt)
    try:
        w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        done = 0
        for i, (gname, shape, qt, src) in enumerate(plan):
            data = src()
            want = quantized_nbytes(qt, shape)
            if data.dtype != torch.uint8 or data.numel() != want:
                raise GGUFError(f"tensor '{gname}': encoder gave {data.numel()} bytes, expected {want}")
            w.write_tensor_data(data.contiguous().reshape(-1).cpu().numpy())
            del data  # before the next tensor is made: one tensor's bytes at a time
            done += want
            if progress:
                progress(WriteProgress(gname, i + 1, len(plan), done, total))
        w.close()
        os.replace(path, final)
    except BaseException:
        w.close()
        path.unlink(missing_ok=True)
        raise


def _canonical_plan(cfg: ModelConfig, weights: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    want = dict(expected_shapes(cfg))
    for i in sorted({int(k.split(".")[1]) for k in weights if k.startswith("mtp.") and k.split(".")[1].isdigit()}):
        want.update(mtp_expected_shapes(cfg, i))
    return want


PlanEntry = tuple[str, tuple[int, ...], GGMLQuantizationType, TensorSource]


def tensor_plan(
    cfg: ModelConfig, weights: Mapping[str, torch.Tensor | GGMLTensor], policy: TypePolicy | str = "q2", *,
    synthetic: bool = False, seed: int = 0,
) -> list[PlanEntry]:
    """(GGUF name, torch shape, type, lazy encoder) for every tensor of ``cfg`` (MTP ones too when
    ``weights`` has them), in canonical order; the encoders run only when the file is written and look
    ``weights[name]`` up then, so a lazy mapping (:class:`ds4x.weights.checkpoint.LazyCheckpoint`) is
    read one tensor at a time."""
    pol = TypePolicy.preset(policy) if isinstance(policy, str) else policy
    want = _canonical_plan(cfg, weights)
    missing = [c for c in want if c not in weights]
    if missing:
        raise GGUFError(f"cannot write GGUF: weights lack '{missing[0]}' ({len(missing)} missing)")
    g = torch.Generator().manual_seed(seed)

    def source(c: str, shape: tuple[int, ...], qt: GGMLQuantizationType) -> TensorSource:
        def make() -> torch.Tensor:
            t = weights[c]
            if tuple(t.shape) != shape:
                raise GGUFError(f"tensor '{c}' has shape {list(t.shape)}, expected {list(shape)}")
            if isinstance(t, GGMLTensor):
                if t.qtype == qt:
                    return t.blocks().raw.cpu()
                t = t.dequantize()
            if synthetic and qt in (T.Q2_K, T.Q4_K, T.IQ2_XXS):
                return random_blocks(qt, shape, g, std=max(float(t.float().std()), 1e-6))
            return encode_tensor(t, qt)
        return make

    return [(gguf_tensor_name(c), s, (qt := tensor_type(c, s, pol)), source(c, s, qt)) for c, s in want.items()]


def write_gguf(
    path: str | Path,
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor | GGMLTensor],
    policy: TypePolicy | str = "q2",
    *,
    vocab: GGUFVocab | None = None,
    name: str = "ds4x DeepSeek-V4",
    synthetic: bool = False,
    seed: int = 0,
    extra: dict[str, Any] | None = None,
    plan: list[PlanEntry] | None = None,
    metadata_hook: Callable[[Any], None] | None = None,
    progress: ProgressFn | None = None,
) -> None:
    """Write canonical ``weights`` of ``cfg`` as a ds4-layout GGUF.

    Quantized targets are real quantizations of the weights, unless ``synthetic`` (then Q2_K, Q4_K
    and IQ2_XXS tensors are random blocks from ``seed`` and the metadata says so). A weight that is
    already a GGMLTensor of the target type is copied as is. MTP tensors (``mtp.N.*``) are written
    when present. ``plan`` (from :func:`tensor_plan`, possibly edited) and ``metadata_hook(writer)``
    exist so tests can build deliberately broken files.
    """
    vocab = vocab or synthetic_vocab(cfg.vocab_size)
    if len(vocab.tokens) != cfg.vocab_size:
        raise GGUFError(f"the vocabulary has {len(vocab.tokens)} tokens, the model {cfg.vocab_size}")
    meta = dict(extra or {})
    quantizer = "ds4x min/max round-to-nearest (no imatrix)"
    if synthetic:
        meta.update(_synthetic_labels(seed))
        quantizer = "none: random blocks (synthetic)"
    meta.setdefault("ds4x.quantizer", quantizer)
    if plan is None:
        plan = tensor_plan(cfg, weights, policy, synthetic=synthetic, seed=seed)
    _write(Path(path), cfg, vocab, name, meta, plan, progress, metadata_hook)


def _synthetic_labels(seed: int) -> dict[str, Any]:
    return {
        "ds4x.synthetic": True,
        "ds4x.synthetic.seed": seed,
        "ds4x.synthetic.note": "SYNTHETIC BENCHMARK WEIGHTS: random values and random quantized blocks, "
                               "not a trained model; outputs are noise",
    }


def _synthetic_std(name: str, shape: tuple[int, ...]) -> float:
    """The spread ds4x.weights.synthetic gives a matrix (random blocks are drawn to match it)."""
    fan_in = shape[-1]
    if name == "head.weight":
        return 3.0 / math.sqrt(fan_in)
    if name.endswith(("experts.w2", "shared_experts.w2.weight", "wo_b.weight")):
        return 0.5 / math.sqrt(fan_in)
    return 1.0 / math.sqrt(fan_in)


def synthetic_tensor_bytes(canonical: str, shape: tuple[int, ...], qtype: GGMLQuantizationType, cfg: ModelConfig,
                           g: torch.Generator) -> torch.Tensor:
    """SYNTHETIC: the raw GGML bytes of one tensor, on ``g``'s device: random valid blocks of the spread
    ds4x.weights.synthetic would give it for block types, that rule's values encoded otherwise."""
    from ds4x.weights.synthetic import _init

    if qtype in (T.Q2_K, T.Q4_K, T.IQ2_XXS, T.Q8_0):
        return random_blocks(qtype, shape, g, std=_synthetic_std(canonical, shape))
    return encode_tensor(_init(canonical, shape, cfg, g), qtype)


def write_synthetic_gguf(
    path: str | Path, cfg: ModelConfig, policy: TypePolicy | str = "q2", seed: int = 0,
    progress: ProgressFn | None = None, name: str | None = None, device: torch.device | str = "cpu",
) -> None:
    """SYNTHETIC model of ``cfg`` streamed to ``path`` one tensor at a time (peak memory is one
    tensor, so the full-size Flash works): plain tensors from ds4x.weights.synthetic's rules,
    quantized ones as random valid blocks of the same spread. Labelled synthetic in the metadata.

    The values come from a generator on ``device`` (``cuda`` makes the blocks on the GPU, the same
    bytes :func:`ds4x.weights.synthetic_gguf.synthetic_quantized_weights` builds there): a seed gives
    the same file on the same kind of device, but CPU and CUDA streams differ."""
    pol = TypePolicy.preset(policy) if isinstance(policy, str) else policy
    want = expected_shapes(cfg)
    g = torch.Generator(device=device).manual_seed(seed)

    def source(c: str, shape: tuple[int, ...], qt: GGMLQuantizationType) -> TensorSource:
        return lambda: synthetic_tensor_bytes(c, shape, qt, cfg, g)

    plan = [(gguf_tensor_name(c), s, (qt := tensor_type(c, s, pol)), source(c, s, qt)) for c, s in want.items()]
    label = name or f"SYNTHETIC ds4x DeepSeek-V4 {cfg.num_layers}L/{cfg.hidden_size} (random weights, seed {seed})"
    meta = {**_synthetic_labels(seed), "ds4x.quantizer": "none: random blocks (synthetic)"}
    _write(Path(path), cfg, synthetic_vocab(cfg.vocab_size), label, meta, plan, progress)
