"""GGUF checkpoints in the antirez/ds4 layout: config, canonical weights and metadata.

``load_gguf(path)`` memory-maps the file through the ``gguf`` package's reader, turns the
``deepseek4.*`` metadata into a :class:`~ds4x.config.ModelConfig` for any size of the architecture,
binds ds4's tensor names (``blk.N.attn_q_a.weight`` ...) to the canonical names of
:mod:`ds4x.weights.names` and checks every tensor's shape and type. Quantized tensors (Q8_0, Q2_K,
Q4_K, IQ2_XXS) stay quantized as :class:`~ds4x.formats.ggml_tensor.GGMLTensor` views of the mapped
file; plain tensors (F32, F16, BF16, I32) become dense torch tensors in the working dtype (the
float32-by-contract ones in float32), exactly as the safetensors loader gives them.

GGUF lists dims innermost first: ``[in, out]`` for a matrix, ``[in, out, experts]`` for stacked
routed experts; the torch shape is the reverse. Every problem raises :class:`GGUFError` (a
:class:`~ds4x.weights.checkpoint.CheckpointError`) naming the metadata key or tensor and what was
expected.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ds4x.config import CSA, HCA, SLIDING, ConfigError, ModelConfig, YarnScaling
from ds4x.formats.ggml import QUANT_SIZES, GGMLQuantizationType, dequantize, nonfinite_scale_blocks
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.weights.checkpoint import CheckpointError, all_finite
from ds4x.weights.names import expected_shapes, is_integer_tensor, keeps_fp32

log = logging.getLogger(__name__)

ARCH = "deepseek4"
# ds4's separate MTP GGUF (DeepSeek-V4-Flash-MTP-*.gguf) declares its own architecture string
MTP_ARCHS = (ARCH, "deepseek4_mtp_support")
T = GGMLQuantizationType

# Types a plain (read directly by the model) tensor may have, and those a matrix may have.
PLAIN_TYPES = (T.F32, T.F16, T.BF16)
MATRIX_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q2_K, T.Q4_K, T.IQ2_XXS)
QUANTIZED_TYPES = (T.Q8_0, T.Q2_K, T.Q4_K, T.IQ2_XXS)

# llama.cpp's expert gating enum as written by the ds4 converter (4 is V4's sqrt(softplus)).
_GATING_FUNCS = {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}

# ds4 GGUF name <-> canonical name (weights/names.py). Top-level tensors:
GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "embed.weight",
    "output.weight": "head.weight",
    "output_norm.weight": "norm.weight",
    "output_hc_fn.weight": "hc_head_fn",
    "output_hc_base.weight": "hc_head_base",
    "output_hc_scale.weight": "hc_head_scale",
}
# ... and inside a block (``blk.N.`` in GGUF, ``layers.N.`` canonical; ``mtp.N.`` for both in MTP):
LAYER_NAMES: dict[str, str] = {
    "hc_attn_fn.weight": "hc_attn_fn",
    "hc_attn_base.weight": "hc_attn_base",
    "hc_attn_scale.weight": "hc_attn_scale",
    "hc_ffn_fn.weight": "hc_ffn_fn",
    "hc_ffn_base.weight": "hc_ffn_base",
    "hc_ffn_scale.weight": "hc_ffn_scale",
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_q_b.weight": "attn.wq_b.weight",
    "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight",
    "attn_sinks.weight": "attn.attn_sink",
    "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_ape.weight": "attn.compressor.ape",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight",
    "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
    "ffn_gate_exps.weight": "ffn.experts.w1",
    "ffn_up_exps.weight": "ffn.experts.w3",
    "ffn_down_exps.weight": "ffn.experts.w2",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
}
# tensors only the MTP block has (``mtp.N.`` prefix on both sides)
MTP_ONLY_NAMES: dict[str, str] = {
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn.weight": "hc_head_fn",
    "hc_head_base.weight": "hc_head_base",
    "hc_head_scale.weight": "hc_head_scale",
}
_CANON_GLOBAL = {c: g for g, c in GLOBAL_NAMES.items()}
_CANON_LAYER = {c: g for g, c in LAYER_NAMES.items()}
_CANON_MTP = {c: g for g, c in MTP_ONLY_NAMES.items()}


class GGUFError(CheckpointError):
    """A GGUF file that cannot be loaded; the message names the file, key or tensor."""


class GGUFTruncatedError(GGUFError):
    """A tensor's data runs past the end of the file."""


def gguf_tensor_name(canonical: str) -> str:
    """The ds4 GGUF name of a canonical tensor name (``layers.3.attn.wq_a.weight`` -> ``blk.3.attn_q_a.weight``)."""
    if canonical in _CANON_GLOBAL:
        return _CANON_GLOBAL[canonical]
    head, _, rest = canonical.partition(".")
    num, _, suffix = rest.partition(".")
    if head == "layers" and num.isdigit() and suffix in _CANON_LAYER:
        return f"blk.{num}.{_CANON_LAYER[suffix]}"
    if head == "mtp" and num.isdigit():
        if suffix in _CANON_MTP:
            return f"mtp.{num}.{_CANON_MTP[suffix]}"
        if suffix in _CANON_LAYER:
            return f"mtp.{num}.{_CANON_LAYER[suffix]}"
    raise KeyError(f"no GGUF name for tensor '{canonical}'")


def canonical_tensor_name(name: str) -> str | None:
    """The canonical name of a ds4 GGUF tensor name, or None if it is not one ds4x knows."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    head, _, rest = name.partition(".")
    num, _, suffix = rest.partition(".")
    if not num.isdigit():
        return None
    if head == "blk" and suffix in LAYER_NAMES:
        return f"layers.{num}.{LAYER_NAMES[suffix]}"
    if head == "mtp":
        if suffix in MTP_ONLY_NAMES:
            return f"mtp.{num}.{MTP_ONLY_NAMES[suffix]}"
        if suffix in LAYER_NAMES:
            return f"mtp.{num}.{LAYER_NAMES[suffix]}"
    return None


def allowed_types(canonical: str) -> tuple[GGMLQuantizationType, ...]:
    """GGML types a canonical tensor may be stored as: the model reads norms, mHC, sinks, position
    biases and routing biases directly (plain floats only); every matrix goes through the kernels."""
    if is_integer_tensor(canonical):
        return (T.I32,)
    if keeps_fp32(canonical):
        return PLAIN_TYPES
    return MATRIX_TYPES


def mtp_expected_shapes(cfg: ModelConfig, index: int = 0) -> dict[str, tuple[int, ...]]:
    """Canonical names and torch shapes of MTP block ``index`` (a sliding-window, score-routed block
    plus its embedding / hidden projections and its own HC head)."""
    one = cfg.replace(num_layers=1, attn_kinds=(SLIDING,), compress_ratios=(0,), mlp_hash=(False,))
    H, hc = cfg.hidden_size, cfg.hc_mult
    p = f"mtp.{index}."
    shapes = {p + n[len("layers.0."):]: s for n, s in expected_shapes(one).items() if n.startswith("layers.0.")}
    shapes.update({
        p + "e_proj.weight": (H, H), p + "h_proj.weight": (H, H),
        p + "enorm.weight": (H,), p + "hnorm.weight": (H,), p + "norm.weight": (H,),
        p + "hc_head_fn": (hc, hc * H), p + "hc_head_base": (hc,), p + "hc_head_scale": (1,),
    })
    return shapes


# ---- reading -----------------------------------------------------------------------------------

def _reader_class() -> type:
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - optional dependency
        raise GGUFError("reading GGUF files needs the 'gguf' package (pip install 'ds4x[gguf]')") from exc

    class _Reader(GGUFReader):
        """GGUFReader that first checks every tensor's type, block alignment and extent, so a bad
        or truncated file names the offending tensor instead of failing inside numpy; and slices a
        plain ndarray view of the map (np.memmap slicing costs ~10 us each, and the token list
        alone is 260K slices)."""

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            itemsize = np.dtype(dtype).itemsize
            if offset + itemsize * count > len(plain):  # a slice past the end would be short, not an error
                raise GGUFTruncatedError(f"the header needs bytes {offset}..{offset + itemsize * count} but the file "
                                         f"has {len(plain)}: truncated, or a length field is corrupt")
            arr = plain[offset : offset + itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            from gguf import GGUFValueType

            if raw_type == GGUFValueType.ARRAY:  # gguf reads an array entry by entry: bound its length first
                item, n = int(self._get(orig_offs, np.uint32)[0]), int(self._get(orig_offs + 4, np.uint64)[0])
                try:
                    itype = self.gguf_scalar_to_np.get(GGUFValueType(item))
                except ValueError:  # an unknown type: the reader names it at the first entry
                    itype = None
                least = np.dtype(itype).itemsize if itype is not None else 8  # a string or array: its 8-byte length
                left = len(self.data) - orig_offs - 12
                if n * least > left:
                    raise GGUFTruncatedError(f"a metadata array at byte {orig_offs} declares {n} entries, more than "
                                             f"the {left} bytes left in the file hold")
            return super()._get_field_parts(orig_offs, raw_type)

        def _build_tensors(self, start_offs: int, fields: list) -> None:  # type: ignore[override]
            from gguf import GGML_QUANT_SIZES

            size = len(self.data)
            spans = []  # (start, end, name): tensors must not share bytes
            for field in fields:
                _nlen, name_data, _ndims, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    qt = GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise GGUFError(f"tensor '{name}' has unknown GGML type {int(raw_dtype[0])}") from None
                block, type_size = GGML_QUANT_SIZES[qt]
                dims_l = [int(d) for d in dims]
                if dims_l and dims_l[0] % block:
                    raise GGUFError(f"tensor '{name}' ({qt.name}) has row length {dims_l[0]}, not a multiple of "
                                    f"the block size {block}")
                nbytes = math.prod(dims_l) // block * type_size
                if int(offset[0]) % self.alignment:  # the format aligns every tensor's data (general.alignment)
                    raise GGUFError(f"tensor '{name}' has data offset {int(offset[0])}, not a multiple of the file's "
                                    f"alignment {self.alignment}: the tensor table is corrupt")
                start = start_offs + int(offset[0])
                if start + nbytes > size:
                    raise GGUFTruncatedError(
                        f"tensor '{name}' ({qt.name}, GGUF dims {dims_l}) needs bytes {start}..{start + nbytes} "
                        f"but the file has {size} bytes: the file is truncated"
                    )
                spans.append((start, start + nbytes, name))
            spans.sort()
            for (_, end, first), (start, _, second) in itertools.pairwise(spans):
                if start < end:
                    raise GGUFError(f"tensors '{first}' and '{second}' share bytes {start}..{end}: the tensor table "
                                    f"is corrupt")
            super()._build_tensors(start_offs, fields)

    return _Reader


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file: a ``.gguf`` suffix in any case, or a file that starts with the format's
    magic (a model saved as ``model.bin``)."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` (copy-on-write memory map) over ``path``, with errors as GGUFError."""
    p = Path(path)
    if not p.is_file():
        raise GGUFError(f"GGUF file {p} does not exist")
    reader_cls = _reader_class()
    try:
        reader = reader_cls(str(p), mode="c")
    except GGUFError as exc:
        raise type(exc)(f"{p}: {exc}") from None
    except Exception as exc:  # numpy / struct errors from a damaged header
        size = p.stat().st_size
        raise GGUFError(f"{p} ({size} bytes) is not a readable GGUF file (truncated or corrupt header?): "
                        f"{type(exc).__name__}: {exc}") from None
    if reader.byte_order != "I":
        raise GGUFError(f"{p} is a big-endian GGUF; only little-endian files are supported")
    return reader


def _short_f32(v: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips in float32 (1e-6 stays
    1e-6, not 9.99999997e-07), so configs compare equal to the ones they were written from."""
    return float(str(np.float32(v)))


def _field_value(field: Any) -> Any:
    from gguf import GGUFValueType

    types = field.types or [None]
    value = field.contents()
    if types[-1] == GGUFValueType.FLOAT32:
        return [_short_f32(v) for v in value] if isinstance(value, list) else _short_f32(value)
    if types[-1] == GGUFValueType.BOOL:
        return [bool(v) for v in value] if isinstance(value, list) else bool(value)
    return value


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata key -> Python value (str, int, float, bool or list); ``GGUF.*`` header fields skipped."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = _field_value(field)
    return out


class _Meta:
    """Typed access to ``deepseek4.*`` metadata with errors naming the key."""

    def __init__(self, meta: dict[str, Any], path: Path):
        self.meta, self.path = meta, path

    def key(self, name: str) -> str:
        return name if name.startswith(("general.", "tokenizer.")) else f"{ARCH}.{name}"

    def has(self, name: str) -> bool:
        return self.key(name) in self.meta

    def raw(self, name: str, *alts: str) -> Any:
        for n in (name, *alts):
            if self.key(n) in self.meta:
                return self.meta[self.key(n)]
        raise GGUFError(f"{self.path}: required GGUF metadata key '{self.key(name)}' is missing")

    def get_int(self, name: str, *alts: str, default: Any = ...) -> int:
        if default is not ... and not any(self.has(n) for n in (name, *alts)):
            return default
        v = self.raw(name, *alts)
        if isinstance(v, bool) or not isinstance(v, int):
            raise GGUFError(f"{self.path}: GGUF metadata key '{self.key(name)}' must be an integer, got {v!r}")
        return v

    def get_float(self, name: str, default: Any = ...) -> float:
        if default is not ... and not self.has(name):
            return default
        v = self.raw(name)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise GGUFError(f"{self.path}: GGUF metadata key '{self.key(name)}' must be a number, got {v!r}")
        return float(v)

    def get_list(self, name: str, length: int, kind: type) -> list:
        v = self.raw(name)
        if not isinstance(v, list):
            v = [v] * length if isinstance(v, int | float) and not isinstance(v, bool) else v
        if not isinstance(v, list) or len(v) < length:
            got = len(v) if isinstance(v, list) else repr(v)
            raise GGUFError(f"{self.path}: GGUF metadata key '{self.key(name)}' must be an array of at least "
                            f"{length} entries (one per layer), got {got}")
        for i, x in enumerate(v[:length]):
            if isinstance(x, bool) or not isinstance(x, int | float) or (kind is int and not isinstance(x, int)):
                raise GGUFError(f"{self.path}: GGUF metadata key '{self.key(name)}[{i}]' must be "
                                f"{'an integer' if kind is int else 'a number'}, got {x!r}")
        return [kind(x) for x in v]


def _token_id(meta: dict[str, Any], key: str, text: str) -> int | None:
    if isinstance(meta.get(key), int):
        return int(meta[key])
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        try:
            return tokens.index(text)
        except ValueError:
            return None
    return None


# ModelConfig field (as ConfigError names it) -> the GGUF metadata key it was read from
_FIELD_KEYS: dict[str, str] = {
    "vocab_size": "vocab_size", "hidden_size": "embedding_length", "num_layers": "block_count",
    "num_heads": "attention.head_count", "head_dim": "attention.key_length",
    "qk_rope_head_dim": "rope.dimension_count", "q_lora_rank": "attention.q_lora_rank",
    "o_groups": "attention.output_group_count", "o_lora_rank": "attention.output_lora_rank",
    "n_routed_experts": "expert_count", "n_shared_experts": "expert_shared_count",
    "n_experts_per_tok": "expert_used_count", "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length", "sliding_window": "attention.sliding_window",
    "index_n_heads": "attention.indexer.head_count", "index_head_dim": "attention.indexer.key_length",
    "index_topk": "attention.indexer.top_k", "hc_mult": "hyper_connection.count",
    "hc_sinkhorn_iters": "hyper_connection.sinkhorn_iterations", "hc_eps": "hyper_connection.epsilon",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon", "swiglu_limit": "swiglu_clamp_exp",
    "routed_scaling_factor": "expert_weights_scale",
    "rope_theta": "rope.freq_base", "compress_rope_theta": "attention.compress_rope_freq_base",
    "max_position_embeddings": "context_length", "compress_ratios": "attention.compress_ratios",
    "layer_types": "attention.compress_ratios",
    "rope_scaling.factor": "rope.scaling.factor", "rope_scaling.beta_fast": "rope.scaling.yarn_beta_fast",
    "rope_scaling.beta_slow": "rope.scaling.yarn_beta_slow",
    "rope_scaling.original_max_position_embeddings": "rope.scaling.original_context_length",
    "bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_id": "tokenizer.ggml.eos_token_id",
}


def _config_field_key(message: str, m: _Meta) -> str:
    """`` (GGUF metadata key '...')`` for the config field a ConfigError names, so the error names what to fix
    in the file rather than a field of ds4x's config; empty if the field has no key."""
    match = re.search(r"config field '([\w.]+)", message)
    key = _FIELD_KEYS.get(match.group(1)) if match else None
    return f" (GGUF metadata key '{m.key(key)}')" if key else ""


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str], path: str | Path = "<gguf>") -> ModelConfig:
    """ModelConfig from ds4 GGUF metadata; ``tensor_names`` tells CSA layers (ratio 4 with indexer
    tensors) from HCA ones (any other non-zero ratio)."""
    p = Path(path)
    m = _Meta(meta, p)
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{p}: GGUF metadata key 'general.architecture' is {arch!r}; ds4x loads {ARCH!r} files")
    n_layers = m.get_int("block_count")
    if n_layers <= 0:
        raise GGUFError(f"{p}: GGUF metadata key '{m.key('block_count')}' must be positive, got {n_layers}")
    layers_present = 1 + max((int(part) for name in tensor_names if name.startswith("blk.")
                              and (part := name.split(".")[1]).isdigit()), default=-1)
    if n_layers > layers_present:  # before anything per layer is built (a corrupt count is a huge allocation)
        raise GGUFError(f"{p}: GGUF metadata key '{m.key('block_count')}' is {n_layers}, but the file has tensors "
                        f"for {layers_present} layers (blk.0 .. blk.{layers_present - 1})")
    kv_heads = m.get_int("attention.head_count_kv")
    if kv_heads != 1:
        raise GGUFError(f"{p}: GGUF metadata key '{m.key('attention.head_count_kv')}' must be 1 "
                        f"(shared-KV MQA), got {kv_heads}")
    head_dim = m.get_int("attention.key_length")
    if m.has("attention.value_length") and m.get_int("attention.value_length") != head_dim:
        raise GGUFError(f"{p}: GGUF metadata key '{m.key('attention.value_length')}' must equal "
                        f"attention.key_length ({head_dim}): DeepSeek-V4 uses K = V")
    for key in ("expert_group_count", "expert_group_used_count"):
        if m.get_int(key, default=0) not in (0, 1):
            raise GGUFError(f"{p}: GGUF metadata key '{m.key(key)}' must be 0 (no group-limited routing), "
                            f"got {m.get_int(key)}")
    if m.has("expert_weights_norm"):
        norm = m.raw("expert_weights_norm")
        # ds4.c wants a BOOL; an integer 0 / 1 (a writer without add_bool) reads the same, anything else is named
        if not (isinstance(norm, int) and norm in (0, 1)):  # bool is an int
            raise GGUFError(f"{p}: GGUF metadata key '{m.key('expert_weights_norm')}' must be a boolean, got {norm!r}")
        if not norm:
            raise GGUFError(f"{p}: GGUF metadata key '{m.key('expert_weights_norm')}' is false; DeepSeek-V4 always "
                            f"renormalises the selected expert weights")
    gating = m.get_int("expert_gating_func", default=4)
    if gating not in _GATING_FUNCS:
        raise GGUFError(f"{p}: GGUF metadata key '{m.key('expert_gating_func')}' = {gating} is not one of "
                        f"{sorted(_GATING_FUNCS)} ({', '.join(_GATING_FUNCS.values())})")

    ratios = m.get_list("attention.compress_ratios", n_layers, int)[:n_layers]
    # any of a layer's indexer tensors makes it CSA, so one of them missing is named as missing
    indexed = {int(part) for name in tensor_names if name.startswith("blk.") and ".indexer." in name
               and (part := name.split(".")[1]).isdigit()}
    kinds = []
    for i, r in enumerate(ratios):
        has_indexer = i in indexed
        if r < 0:
            raise GGUFError(f"{p}: GGUF metadata key '{m.key('attention.compress_ratios')}[{i}]' is negative ({r})")
        if r == 0:
            kind = SLIDING
        elif r == 4 and has_indexer:
            kind = CSA
        else:
            kind = HCA
        if has_indexer and kind != CSA:
            raise GGUFError(f"{p}: layer {i} has indexer tensors (blk.{i}.indexer.*) but compress ratio {r}; only "
                            f"ratio-4 layers are CSA (see '{m.key('attention.compress_ratios')}')")
        kinds.append(kind)
    clamps = m.get_list("swiglu_clamp_exp", n_layers, float)[:n_layers] if m.has("swiglu_clamp_exp") else [10.0]
    if any(c != clamps[0] for c in clamps):
        raise GGUFError(f"{p}: GGUF metadata key '{m.key('swiglu_clamp_exp')}' varies by layer ({sorted(set(clamps))});"
                        f" ds4x supports one SwiGLU clamp for all layers")
    if m.has("hash_layer_count"):
        n_hash = m.get_int("hash_layer_count")
    else:
        # ds4.c requires the key; without it the leading layers that carry a tid2eid table are the hash
        # layers (0 would route them by score, with the zero bias an absent exp_probs_b.bias means)
        n_hash = 0
        while f"blk.{n_hash}.ffn_gate_tid2eid.weight" in tensor_names:
            n_hash += 1
    if not 0 <= n_hash <= n_layers:
        raise GGUFError(f"{p}: GGUF metadata key '{m.key('hash_layer_count')}' = {n_hash} is outside [0, {n_layers}]")

    scaling = None
    if not m.has("rope.scaling.factor"):  # ds4's files carry it; without it the compressed layers' RoPE is plain
        log.warning("%s: no GGUF metadata key '%s': the compressed layers' RoPE runs without YaRN scaling", p,
                    m.key("rope.scaling.factor"))
    else:
        factor = m.get_float("rope.scaling.factor")
        if factor != 1.0:
            scaling = YarnScaling(
                factor=factor,
                original_max_position_embeddings=m.get_int("rope.scaling.original_context_length"),
                beta_fast=m.get_float("rope.scaling.yarn_beta_fast", default=32.0),
                beta_slow=m.get_float("rope.scaling.yarn_beta_slow", default=1.0),
            )

    if m.has("vocab_size"):
        vocab = m.get_int("vocab_size")
    elif isinstance(meta.get("tokenizer.ggml.tokens"), list):
        vocab = len(meta["tokenizer.ggml.tokens"])
    else:
        raise GGUFError(f"{p}: GGUF metadata key '{m.key('vocab_size')}' is missing (and there is no token list)")
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > vocab:  # the tokenizer would emit ids the embedding lacks
        raise GGUFError(f"{p}: the token list has {len(tokens)} tokens but '{m.key('vocab_size')}' = {vocab}")
    bos = _token_id(meta, "tokenizer.ggml.bos_token_id", "<｜begin▁of▁sentence｜>")
    eos = _token_id(meta, "tokenizer.ggml.eos_token_id", "<｜end▁of▁sentence｜>")
    has_csa = CSA in kinds
    heads, groups = m.get_int("attention.head_count"), m.get_int("attention.output_group_count")
    if groups > 0 and heads % groups:  # ds4 splits the output projection by whole heads (head_dim * heads / groups)
        raise GGUFError(f"{p}: GGUF metadata key '{m.key('attention.output_group_count')}' (o_groups = {groups}) "
                        f"must divide '{m.key('attention.head_count')}' ({heads})")
    try:
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=m.get_int("embedding_length"),
            num_layers=n_layers,
            num_heads=m.get_int("attention.head_count"),
            head_dim=head_dim,
            rope_head_dim=m.get_int("rope.dimension_count"),
            q_lora_rank=m.get_int("attention.q_lora_rank"),
            o_groups=m.get_int("attention.output_group_count"),
            o_lora_rank=m.get_int("attention.output_lora_rank"),
            n_routed_experts=m.get_int("expert_count"),
            n_shared_experts=m.get_int("expert_shared_count", default=1),
            n_experts_per_tok=m.get_int("expert_used_count"),
            moe_intermediate_size=m.get_int("expert_feed_forward_length"),
            attn_kinds=tuple(kinds),
            compress_ratios=tuple(ratios),
            mlp_hash=tuple(i < n_hash for i in range(n_layers)),
            sliding_window=m.get_int("attention.sliding_window"),
            index_n_heads=m.get_int("attention.indexer.head_count", "indexer.head_count") if has_csa else 64,
            index_head_dim=m.get_int("attention.indexer.key_length", "indexer.key_length") if has_csa else 128,
            index_topk=m.get_int("attention.indexer.top_k", "indexer.top_k") if has_csa else 512,
            hc_mult=m.get_int("hyper_connection.count"),
            hc_sinkhorn_iters=m.get_int("hyper_connection.sinkhorn_iterations"),
            hc_eps=m.get_float("hyper_connection.epsilon"),
            rms_norm_eps=m.get_float("attention.layer_norm_rms_epsilon"),
            swiglu_limit=clamps[0],
            scoring_func=_GATING_FUNCS[gating],
            # required, as ds4.c requires it: a default would scale every routed output silently wrong
            routed_scaling_factor=m.get_float("expert_weights_scale"),
            rope_theta=m.get_float("rope.freq_base"),
            compress_rope_theta=m.get_float("attention.compress_rope_freq_base"),
            compress_rope_scaling=scaling,
            max_position_embeddings=m.get_int("context_length", default=1048576),
            bos_token_id=bos,
            eos_token_ids=(eos,) if eos is not None else (),
            num_mtp_layers=m.get_int("nextn_predict_layers", default=0),
        )
    except ConfigError as exc:
        raise GGUFError(f"{p}: GGUF metadata does not describe a valid DeepSeek-V4 model: {exc}"
                        f"{_config_field_key(str(exc), m)}") from None


# ---- binding -----------------------------------------------------------------------------------

def _torch_bytes(t: Any) -> torch.Tensor:
    """The raw bytes of a reader tensor as a uint8 torch tensor sharing the mapped memory."""
    arr = np.asarray(t.data).reshape(-1).view(np.uint8)
    return torch.from_numpy(arr)


def _bind(reader_tensor: Any, canonical: str, want: tuple[int, ...], dtype: torch.dtype,
          device: torch.device | str, path: Path, n_experts: int) -> torch.Tensor | GGMLTensor:
    name = reader_tensor.name
    qt = GGMLQuantizationType(int(reader_tensor.tensor_type))
    gguf_dims = [int(d) for d in reader_tensor.shape]
    # GGUF pads trailing dims with 1 in some writers; compare without them
    while len(gguf_dims) > len(want) and gguf_dims[-1] == 1:
        gguf_dims.pop()
    shape = tuple(reversed(gguf_dims))
    if shape != want:
        raise GGUFError(f"{path}: tensor '{name}' has GGUF dims {gguf_dims}, expected {list(reversed(want))} "
                        f"(torch shape {list(want)} for '{canonical}')")
    ok = allowed_types(canonical)
    if qt not in ok:
        raise GGUFError(f"{path}: tensor '{name}' has type {qt.name}, expected one of "
                        f"{', '.join(t.name for t in ok)}")
    if qt not in QUANT_SIZES:  # pragma: no cover - allowed_types is a subset
        raise GGUFError(f"{path}: tensor '{name}' has unsupported type {qt.name}")
    return bind_raw(_torch_bytes(reader_tensor), qt, canonical, shape, dtype, device, n_experts,
                    f"{path}: tensor '{name}'")


def bind_raw(raw: torch.Tensor, qt: GGMLQuantizationType, canonical: str, shape: tuple[int, ...],
             dtype: torch.dtype, device: torch.device | str, n_experts: int,
             what: str = "tensor") -> torch.Tensor | GGMLTensor:
    """The model-side form of one tensor's GGML bytes: block types stay quantized (a GGMLTensor on
    ``device``), plain ones become ``dtype`` tensors (float32 where the model keeps float32), I32
    expert tables int64 (checked against ``n_experts``)."""
    if qt in QUANTIZED_TYPES:
        out = GGMLTensor(raw, qt, shape).to(device)
        # a NaN / Inf block scale decodes to NaN weights: checked on the device copy (a few percent of the bytes)
        bad = nonfinite_scale_blocks(out.raw, qt)
        if bad:
            raise GGUFError(f"{what} ({qt.name}) has {bad} blocks whose fp16 scale is NaN or infinite")
        return out
    if qt in PLAIN_TYPES:
        # one cast from the mapped bytes (ggml.dequantize's fp16 path also preserves NaN payloads
        # bit for bit, which is 50x slower and moot for weights); always a copy, never the map
        plain = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qt]
        target = torch.float32 if keeps_fp32(canonical) else dtype
        src = raw.view(plain).reshape(shape)
        out = src.to(device=device, dtype=target, copy=True)
        # a NaN / Inf in a plain weight (a norm, mHC, sink...) makes every logit NaN far from its cause: one
        # more pass over the copy just made
        if not all_finite(out):
            first = tuple(int(i) for i in (~torch.isfinite(out)).nonzero()[0])
            n_src = int((~torch.isfinite(src)).sum())
            why = (f"{n_src} NaN / Inf values in the file" if n_src else
                   f"values that overflow {out.dtype} (finite in the file's {qt.name})")
            raise GGUFError(f"{what} ({qt.name}, '{canonical}') holds {why}, first at torch index {list(first)}: "
                            f"{float(out[first])}")
        return out
    out = dequantize(raw, qt, shape)
    if qt == T.I32:
        if out.numel() and (int(out.min()) < 0 or int(out.max()) >= n_experts):
            raise GGUFError(f"{what} holds expert ids outside [0, {n_experts})")
        return out.to(device=device, dtype=torch.int64)
    return out.to(device=device, dtype=torch.float32 if keeps_fp32(canonical) else dtype)


def _bind_all(reader: Any, want: dict[str, tuple[int, ...]], cfg: ModelConfig, dtype: torch.dtype,
              device: torch.device | str, path: Path, what: str) -> dict[str, torch.Tensor | GGMLTensor]:
    by_name = {t.name: t for t in reader.tensors}
    out: dict[str, torch.Tensor | GGMLTensor] = {}
    missing = [c for c in want if gguf_tensor_name(c) not in by_name]
    if missing:
        c = missing[0]
        raise GGUFError(f"{path}: {what} is missing {len(missing)} tensors, e.g. '{gguf_tensor_name(c)}' "
                        f"(canonical '{c}', expected GGUF dims {list(reversed(want[c]))})")
    for c, shape in want.items():
        out[c] = _bind(by_name[gguf_tensor_name(c)], c, shape, dtype, device, path, cfg.n_routed_experts)
    return out


def _refuse_stray_tensors(extra: set[str], cfg: ModelConfig, meta: dict[str, Any], path: Path) -> None:
    """A ds4 tensor the config does not use means the metadata contradicts the file (block_count, a
    compress ratio, hash_layer_count): loading would silently drop those weights, so refuse, naming the key."""
    stray = []
    for n in sorted(extra):
        canon = canonical_tensor_name(n)
        if canon is None or not canon.startswith("layers."):
            continue  # unknown names are only warned about; mtp.* binds separately
        layer = int(canon.split(".")[1])
        if layer < cfg.num_layers and canon.endswith(".ffn.gate.bias") and cfg.is_hash_layer(layer):
            continue  # ds4.c binds a hash layer's routing bias, its routing ignores it
        stray.append((n, layer, canon))
    if not stray:
        return
    n, layer, canon = stray[0]
    if layer >= cfg.num_layers:
        why = f"layer {layer} is past '{ARCH}.block_count' = {cfg.num_layers}"
    elif canon.endswith("tid2eid"):
        why = (f"layer {layer} is not a hash layer ('{ARCH}.hash_layer_count' = "
               f"{meta.get(f'{ARCH}.hash_layer_count', sum(cfg.mlp_hash))})")
    elif ".compressor." in canon or ".indexer." in canon:
        why = (f"layer {layer} has compress ratio {cfg.compress_ratios[layer]} ({cfg.attn_kinds[layer]}) in "
               f"'{ARCH}.attention.compress_ratios'")
    else:  # pragma: no cover - every other per-layer tensor is expected for every layer
        why = f"layer {layer} ({cfg.attn_kinds[layer]}) does not use it"
    more = f" (and {len(stray) - 1} more)" if len(stray) > 1 else ""
    raise GGUFError(f"{path}: tensor '{n}'{more} does not fit the metadata: {why}")


def _mtp_blocks(names: set[str]) -> list[int]:
    return sorted({int(n.split(".")[1]) for n in names if n.startswith("mtp.") and n.split(".")[1].isdigit()})


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    mtp_path: str | Path | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor | GGMLTensor], dict[str, Any]]:
    """Config, canonical weights and all GGUF metadata from a ds4-layout GGUF file.

    ``mtp_path``: an optional separate GGUF holding the MTP block (``mtp.0.*``); its tensors (and
    any ``mtp.*`` tensors of the main file) are bound under ``mtp.N.<canonical suffix>``.
    """
    p = Path(path)
    reader = open_gguf(p)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = config_from_gguf(meta, names, p)

    want = expected_shapes(cfg)
    # ds4.c binds blk.N.exp_probs_b.bias with tensor_by_namef (optional, unlike every other tensor) and
    # adds it to the selection scores only when present (layer_topk_selected_experts_from_probs): a file
    # without it routes by the unbiased scores, which is a zero bias here.
    no_bias = {c: want.pop(c) for c in list(want) if c.endswith(".ffn.gate.bias") and gguf_tensor_name(c) not in names}
    weights = _bind_all(reader, want, cfg, dtype, device, p, "GGUF")
    for c, shape in no_bias.items():
        weights[c] = torch.zeros(shape, dtype=torch.float32, device=device)
    if no_bias:
        log.info("%s: %d layers have no routing bias (exp_probs_b.bias); routing by the unbiased scores", p,
                 len(no_bias))
    # a hash layer may carry an (unused) routing bias; anything else unknown is reported
    known = {gguf_tensor_name(c) for c in want}
    _refuse_stray_tensors(names - known, cfg, meta, p)
    unknown = [n for n in names - known if not n.startswith("mtp.")
               and not (n.endswith(".exp_probs_b.bias") and canonical_tensor_name(n) is not None)]
    if unknown:
        log.warning("%s: ignoring %d tensors not used by DeepSeek-V4: %s", p, len(unknown),
                    ", ".join(sorted(unknown)[:5]))

    mtp_sources = [(reader, p)] if _mtp_blocks(names) else []
    if mtp_path is not None:
        mp = Path(mtp_path)
        mreader = open_gguf(mp)
        march = read_metadata(mreader).get("general.architecture")
        if march is not None and march not in MTP_ARCHS:
            raise GGUFError(f"{mp}: GGUF metadata key 'general.architecture' is {march!r}; expected one of "
                            f"{', '.join(repr(a) for a in MTP_ARCHS)}")
        if not _mtp_blocks({t.name for t in mreader.tensors}):
            raise GGUFError(f"{mp}: MTP GGUF holds no 'mtp.N.*' tensors")
        mtp_sources.append((mreader, mp))
    n_mtp = 0
    for r, rp in mtp_sources:
        for idx in _mtp_blocks({t.name for t in r.tensors}):
            weights.update(_bind_all(r, mtp_expected_shapes(cfg, idx), cfg, dtype, device, rp, f"MTP block {idx}"))
            n_mtp = max(n_mtp, idx + 1)
    if n_mtp:
        cfg = cfg.replace(num_mtp_layers=n_mtp)
    return cfg, weights, meta


def describe_gguf(path: str | Path) -> dict[str, Any]:
    """What ``ds4x inspect`` needs from a GGUF without loading a weight: config, name, tensor count,
    bytes per GGML type, and whether the file is a synthetic (benchmark-only) model."""
    p = Path(path)
    reader = open_gguf(p)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = config_from_gguf(meta, names, p)
    by_type: dict[str, int] = {}
    for t in reader.tensors:
        name = GGMLQuantizationType(int(t.tensor_type)).name
        by_type[name] = by_type.get(name, 0) + int(t.n_bytes)
    return {
        "config": cfg,
        "name": meta.get("general.name"),
        "tensors": len(reader.tensors),
        "bytes_by_type": by_type,
        "tensor_bytes": sum(by_type.values()),
        "file_bytes": p.stat().st_size,
        "synthetic": bool(meta.get("ds4x.synthetic", False)),
        "has_tokenizer": isinstance(meta.get("tokenizer.ggml.tokens"), list),
    }
