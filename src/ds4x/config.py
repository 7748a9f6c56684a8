"""ModelConfig: the shape and hyper-parameters of a DeepSeek-V4 model.

Parsed from an HF ``config.json`` in either spelling (the official checkpoint's
``compress_ratios`` / ``num_hash_layers`` / ``qk_rope_head_dim`` / ``rope_scaling``,
or transformers' ``layer_types`` / ``compress_rates`` / ``mlp_layer_types`` /
``rope_parameters``), or built from a preset. Everything downstream reads only
this dataclass, never the raw JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING, CSA, HCA = "sliding", "csa", "hca"

# transformers' layer-type names -> ours
_HF_LAYER_TYPES = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
_TO_HF_LAYER_TYPES = {v: k for k, v in _HF_LAYER_TYPES.items()}
_HF_MLP_TYPES = ("hash_moe", "moe")


class ConfigError(ValueError):
    """A config.json (or preset override) that is malformed or inconsistent; the message names the field."""


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # V4 does not scale cos/sin magnitude (transformers forces 1.0 for this model).
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_shared_experts: int
    n_experts_per_tok: int
    moe_intermediate_size: int
    # per layer: attention kind (sliding/csa/hca) and compression ratio (0 for sliding)
    attn_kinds: tuple[str, ...]
    compress_ratios: tuple[int, ...]
    mlp_hash: tuple[bool, ...]  # per layer: routed by the fixed tid2eid table (hash) instead of scores
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    swiglu_limit: float = 10.0
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    num_mtp_layers: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived -------------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def num_hash_layers(self) -> int:
        return sum(self.mlp_hash)

    def is_hash_layer(self, layer: int) -> bool:
        return self.mlp_hash[layer]

    def layer_summary(self) -> str:
        """Compact schedule, e.g. 'sliding x2, csa/4 x21, hca/128 x20'."""
        counts: dict[str, int] = {}
        for kind, ratio in zip(self.attn_kinds, self.compress_ratios, strict=True):
            key = kind if kind == SLIDING else f"{kind}/{ratio}"
            counts[key] = counts.get(key, 0) + 1
        return ", ".join(f"{k} x{v}" for k, v in counts.items())

    # ---- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
        positive = [
            "vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank", "o_groups",
            "o_lora_rank", "n_routed_experts", "n_experts_per_tok", "moe_intermediate_size", "sliding_window",
            "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field '{name}' must be a positive integer, got {value!r}")
        if self.rope_head_dim <= 0 or self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise ConfigError(
                f"config field 'qk_rope_head_dim' must be even and in (0, head_dim={self.head_dim}], "
                f"got {self.rope_head_dim}"
            )
        # the grouped output projection splits the flat heads * head_dim output, so a group may hold part of a
        # head (transformers builds such models); only the flat width must divide
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ConfigError(
                f"config field 'o_groups' ({self.o_groups}) must divide num_attention_heads * head_dim "
                f"({self.num_heads} * {self.head_dim})"
            )
        if self.n_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"config field 'num_experts_per_tok' ({self.n_experts_per_tok}) exceeds "
                f"n_routed_experts ({self.n_routed_experts})"
            )
        # transformers and the official model both build exactly one shared expert of width
        # moe_intermediate_size; a config that says otherwise describes another architecture.
        if self.n_shared_experts != 1:
            raise ConfigError(f"config field 'n_shared_experts' must be 1 for DeepSeek-V4, got {self.n_shared_experts}")
        if len(self.attn_kinds) != self.num_layers:
            raise ConfigError(
                f"config field 'layer_types'/'compress_ratios' has {len(self.attn_kinds)} entries, "
                f"expected num_hidden_layers = {self.num_layers}"
            )
        if len(self.compress_ratios) != self.num_layers:
            raise ConfigError(
                f"config field 'compress_ratios' has {len(self.compress_ratios)} entries for "
                f"{self.num_layers} layers"
            )
        for i, (kind, ratio) in enumerate(zip(self.attn_kinds, self.compress_ratios, strict=True)):
            if kind not in (SLIDING, CSA, HCA):
                raise ConfigError(f"config field 'layer_types[{i}]' has unknown kind {kind!r}")
            if (kind == SLIDING) != (ratio == 0) or ratio < 0:
                raise ConfigError(f"config field 'compress_ratios[{i}]' = {ratio} does not fit layer kind {kind}")
        if len(self.mlp_hash) != self.num_layers:
            raise ConfigError(
                f"config field 'mlp_layer_types' has {len(self.mlp_hash)} entries for {self.num_layers} layers"
            )
        if CSA in self.attn_kinds:
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                value = getattr(self, name)
                if not isinstance(value, int) or value <= 0:
                    raise ConfigError(f"config field '{name}' must be a positive integer, got {value!r}")
            if self.index_head_dim % 2 or self.index_head_dim < self.rope_head_dim:
                raise ConfigError(
                    f"config field 'index_head_dim' ({self.index_head_dim}) must be even and at least "
                    f"qk_rope_head_dim ({self.rope_head_dim})"
                )
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ConfigError(f"config field 'scoring_func' must be sqrtsoftplus/softmax/sigmoid, got "
                              f"{self.scoring_func!r}")
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "swiglu_limit",
                     "routed_scaling_factor"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"config field '{name}' must be a positive number, got {value!r}")
        y = self.compress_rope_scaling
        if y is not None:
            # the YaRN tables take logs of these and divide by them: a bad value must not reach rope.py
            # (a ZeroDivisionError there, or NaN logits for a zero factor)
            for name in ("factor", "beta_fast", "beta_slow"):
                value = getattr(y, name)
                if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                    raise ConfigError(f"config field 'rope_scaling.{name}' must be a positive number, got {value!r}")
            orig = y.original_max_position_embeddings
            if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
                raise ConfigError(f"config field 'rope_scaling.original_max_position_embeddings' must be a positive "
                                  f"integer, got {orig!r}")
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            raise ConfigError(f"config field 'bos_token_id' ({self.bos_token_id}) is outside the vocabulary")
        for tok in self.eos_token_ids:
            if not 0 <= tok < self.vocab_size:
                raise ConfigError(f"config field 'eos_token_id' ({tok}) is outside the vocabulary")

    def native_cache_error(self) -> str | None:
        """Why the native (FP8/MXFP4) cache cannot be used with this config, or None if it can."""
        if self.nope_head_dim % 64:
            return (f"native cache needs the non-RoPE head width to be a multiple of 64; this model has "
                    f"{self.nope_head_dim} (head_dim {self.head_dim} - qk_rope_head_dim {self.rope_head_dim})")
        if CSA in self.attn_kinds and self.index_head_dim != 128:
            return f"native cache needs index_head_dim = 128 (Hadamard-128); this model has {self.index_head_dim}"
        return None

    # ---- serialisation -------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The official config.json spelling (what `save_checkpoint` writes)."""
        rope_scaling = None
        if self.compress_rope_scaling is not None:
            y = self.compress_rope_scaling
            rope_scaling = {
                "type": "yarn", "factor": y.factor, "original_max_position_embeddings":
                y.original_max_position_embeddings, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
                "attention_factor": y.attention_factor,
            }
        return {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.n_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "compress_ratios": list(self.compress_ratios),
            "layer_types": [_TO_HF_LAYER_TYPES[k] for k in self.attn_kinds],
            **({"compress_rates": rates} if (rates := self._uniform_rates()) is not None else {}),
            "num_hash_layers": self.num_hash_layers,
            "mlp_layer_types": ["hash_moe" if h else "moe" for h in self.mlp_hash],
            "sliding_window": self.sliding_window,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "swiglu_limit": self.swiglu_limit,
            "scoring_func": self.scoring_func,
            "routed_scaling_factor": self.routed_scaling_factor,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "num_nextn_predict_layers": self.num_mtp_layers,
            "tie_word_embeddings": False,
        }

    def _uniform_rates(self) -> dict[str, int] | None:
        """transformers' per-kind compress_rates, when every layer of a kind shares one ratio."""
        rates: dict[str, int] = {}
        for kind, ratio in zip(self.attn_kinds, self.compress_ratios, strict=True):
            if kind != SLIDING and rates.setdefault(_TO_HF_LAYER_TYPES[kind], ratio) != ratio:
                return None
        return rates

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# ---- parsing -----------------------------------------------------------------------------------

def _need(d: dict[str, Any], *names: str, default: Any = ...) -> Any:
    for name in names:
        if name in d and d[name] is not None:
            return d[name]
    if default is ...:
        raise ConfigError(f"config.json is missing field '{names[0]}'")
    return default


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ConfigError(f"config field '{name}' must be an integer, got {value!r}")
    return int(value)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _parse_yarn(d: dict[str, Any] | None, name: str, infer_attention: bool = False) -> YarnScaling | None:
    """YaRN from a rope dict. ``infer_attention``: an absent ``attention_factor`` is derived from the factor
    (and ``mscale`` / ``mscale_all_dim``) as transformers' YaRN does; transformers pins it to 1.0 only when
    it builds the nested dict itself from a flat ``rope_scaling``, so a config.json that already holds the
    nested ``rope_parameters.compress`` without it gets the magnitude scaling."""
    if not d:
        return None
    if not isinstance(d, dict):
        raise ConfigError(f"config field '{name}' must be an object, got {type(d).__name__}")
    kind = d.get("rope_type", d.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind != "yarn":
        raise ConfigError(f"config field '{name}.rope_type' must be 'yarn' or 'default', got {kind!r}")
    try:
        factor = float(d["factor"])
        original = _as_int(d["original_max_position_embeddings"], f"{name}.original_max_position_embeddings")
    except KeyError as exc:
        raise ConfigError(f"config field '{name}' is missing '{exc.args[0]}'") from None
    if factor <= 0 or original <= 0:
        raise ConfigError(f"config field '{name}' needs factor > 0 and original_max_position_embeddings > 0")
    attention = d.get("attention_factor")
    if attention is None:
        attention = 1.0
        if infer_attention:
            mscale, mscale_all = d.get("mscale"), d.get("mscale_all_dim")
            attention = (_yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
                         if mscale and mscale_all else _yarn_mscale(factor))
    return YarnScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(d.get("beta_fast") or 32),
        beta_slow=float(d.get("beta_slow") or 1),
        attention_factor=float(attention),
    )


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """Parse a DeepSeek-V4 config.json (official or transformers spelling)."""
    if not isinstance(d, dict):
        raise ConfigError("config.json must hold a JSON object")
    model_type = d.get("model_type")
    if model_type not in (None, "deepseek_v4"):
        raise ConfigError(f"config field 'model_type' is {model_type!r}; ds4x runs 'deepseek_v4' models")
    # the experts here are bias-free SwiGLU (the official model); transformers builds other activations and
    # biased shared experts from these fields, which would otherwise run as SwiGLU with silently wrong logits
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"config field 'hidden_act' must be 'silu' (SwiGLU experts), got {act!r}")
    if d.get("mlp_bias"):
        raise ConfigError("config field 'mlp_bias' must be false (the shared expert has no biases)")
    kv_heads = d.get("num_key_value_heads", 1)
    if kv_heads != 1:
        raise ConfigError(f"config field 'num_key_value_heads' must be 1 (shared-KV MQA), got {kv_heads!r}")

    n_layers = _as_int(_need(d, "num_hidden_layers", "n_layers"), "num_hidden_layers")
    head_dim = _as_int(_need(d, "head_dim"), "head_dim")
    nested = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    nested_factor = (nested.get("main") or {}).get("partial_rotary_factor") if isinstance(nested.get("main"),
                                                                                        dict) else None
    # transformers rotates int(head_dim * rope_parameters[kind].partial_rotary_factor) dims whatever the
    # top-level qk_rope_head_dim says: the nested factors, where given, are the ones the model runs
    nested_dims = {int(head_dim * float(sub["partial_rotary_factor"])) for key in ("main", "compress")
                   if isinstance(sub := nested.get(key), dict) and sub.get("partial_rotary_factor") is not None}
    if len(nested_dims) > 1:
        raise ConfigError(f"config field 'rope_parameters' gives main and compress RoPE different widths "
                          f"{sorted(nested_dims)}; ds4x rotates one width")
    if nested_dims:
        rope_dim = nested_dims.pop()
    elif "qk_rope_head_dim" in d:
        rope_dim = _as_int(d["qk_rope_head_dim"], "qk_rope_head_dim")
    elif d.get("partial_rotary_factor") is not None or nested_factor is not None:
        factor = d.get("partial_rotary_factor")
        rope_dim = int(head_dim * float(factor if factor is not None else nested_factor))
    else:
        rope_dim = 64 if head_dim >= 64 else head_dim // 8

    # attention schedule: kinds from layer_types (transformers) or inferred from the ratios (official);
    # per-layer ratios from compress_ratios when given (official), else from the per-kind compress_rates.
    raw_ratios = d.get("compress_ratios")
    if raw_ratios is not None:
        if not isinstance(raw_ratios, list):
            raise ConfigError("config field 'compress_ratios' must be a list")
        if len(raw_ratios) < n_layers:
            raise ConfigError(
                f"config field 'compress_ratios' has {len(raw_ratios)} entries, expected at least {n_layers}"
            )
        raw_ratios = [_as_int(r, f"compress_ratios[{i}]") for i, r in enumerate(raw_ratios[:n_layers])]
    if d.get("layer_types") is not None:
        types = d["layer_types"]
        if not isinstance(types, list) or len(types) < n_layers:
            raise ConfigError(f"config field 'layer_types' must list {n_layers} entries")
        rates = dict(d.get("compress_rates") or {})
        for legacy, key in (("compress_rate_csa", "compressed_sparse_attention"),
                            ("compress_rate_hca", "heavily_compressed_attention")):
            if d.get(legacy) is not None:
                rates[key] = d[legacy]
        rates.setdefault("compressed_sparse_attention", 4)
        rates.setdefault("heavily_compressed_attention", 128)
        kinds, ratios = [], []
        for i, t in enumerate(types[:n_layers]):
            if t not in _HF_LAYER_TYPES:
                raise ConfigError(f"config field 'layer_types[{i}]' = {t!r} is not one of {list(_HF_LAYER_TYPES)}")
            kinds.append(_HF_LAYER_TYPES[t])
            if raw_ratios is not None:
                ratios.append(raw_ratios[i])
            else:
                ratios.append(0 if t == "sliding_attention" else _as_int(rates[t], f"compress_rates[{t}]"))
    elif raw_ratios is not None:
        ratios = raw_ratios
        # The official code gives ratio-4 layers the overlapping compressor and the indexer (CSA);
        # any other non-zero ratio is a plain non-overlapping compressor (HCA).
        kinds = [SLIDING if r == 0 else CSA if r == 4 else HCA for r in ratios]
    else:
        raise ConfigError("config.json is missing field 'compress_ratios' (or 'layer_types')")
    for i, r in enumerate(ratios):
        if r < 0 or (kinds[i] != SLIDING and r < 1):
            raise ConfigError(f"config field 'compress_ratios[{i}]' must be >= 1 for a compressed layer, got {r}")

    if d.get("mlp_layer_types") is not None:
        mlp = d["mlp_layer_types"]
        if not isinstance(mlp, list) or len(mlp) < n_layers:
            raise ConfigError(f"config field 'mlp_layer_types' must list {n_layers} entries")
        for i, t in enumerate(mlp[:n_layers]):
            if t not in _HF_MLP_TYPES:
                raise ConfigError(f"config field 'mlp_layer_types[{i}]' = {t!r} is not one of {_HF_MLP_TYPES}")
        mlp_hash = tuple(t == "hash_moe" for t in mlp[:n_layers])
    else:
        n_hash = _as_int(d.get("num_hash_layers", 3), "num_hash_layers")
        if n_hash < 0:
            raise ConfigError(f"config field 'num_hash_layers' must be >= 0, got {n_hash}")
        mlp_hash = tuple(i < n_hash for i in range(n_layers))

    # rope
    compress_scaling: YarnScaling | None
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        rope_theta = float(rp["main"].get("rope_theta", d.get("rope_theta", 10000.0)))
        compress_theta = float(rp["compress"].get("rope_theta", d.get("compress_rope_theta", 160000.0)))
        compress_scaling = _parse_yarn(rp["compress"], "rope_parameters.compress", infer_attention=True)
        # sliding layers run plain RoPE here (and in the GGUF layout); transformers would scale them too
        main_kind = rp["main"].get("rope_type", rp["main"].get("type", "default"))
        if main_kind not in ("default", None):
            raise ConfigError(f"config field 'rope_parameters.main.rope_type' must be 'default', got {main_kind!r}")
    else:
        rope_theta = float(d.get("rope_theta", 10000.0))
        compress_theta = float(d.get("compress_rope_theta", 160000.0))
        flat = rp if isinstance(rp, dict) else d.get("rope_scaling")
        compress_scaling = _parse_yarn(flat, "rope_scaling")

    eos = d.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))

    try:
        return ModelConfig(
            vocab_size=_as_int(_need(d, "vocab_size"), "vocab_size"),
            hidden_size=_as_int(_need(d, "hidden_size", "dim"), "hidden_size"),
            num_layers=n_layers,
            num_heads=_as_int(_need(d, "num_attention_heads", "n_heads"), "num_attention_heads"),
            head_dim=head_dim,
            rope_head_dim=rope_dim,
            q_lora_rank=_as_int(_need(d, "q_lora_rank"), "q_lora_rank"),
            o_groups=_as_int(_need(d, "o_groups"), "o_groups"),
            o_lora_rank=_as_int(_need(d, "o_lora_rank"), "o_lora_rank"),
            n_routed_experts=_as_int(_need(d, "n_routed_experts", "num_local_experts"), "n_routed_experts"),
            n_shared_experts=_as_int(d.get("n_shared_experts", 1), "n_shared_experts"),
            n_experts_per_tok=_as_int(_need(d, "num_experts_per_tok", "n_activated_experts"),
                                      "num_experts_per_tok"),
            moe_intermediate_size=_as_int(_need(d, "moe_intermediate_size", "moe_inter_dim"),
                                          "moe_intermediate_size"),
            attn_kinds=tuple(kinds),
            compress_ratios=tuple(ratios),
            mlp_hash=mlp_hash,
            sliding_window=_as_int(d.get("sliding_window", 128), "sliding_window"),
            index_n_heads=_as_int(d.get("index_n_heads", 64), "index_n_heads"),
            index_head_dim=_as_int(d.get("index_head_dim", 128), "index_head_dim"),
            index_topk=_as_int(d.get("index_topk", 512), "index_topk"),
            hc_mult=_as_int(d.get("hc_mult", 4), "hc_mult"),
            hc_sinkhorn_iters=_as_int(d.get("hc_sinkhorn_iters", 20), "hc_sinkhorn_iters"),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            swiglu_limit=float(d.get("swiglu_limit", 10.0)),
            scoring_func=str(d.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            rope_theta=rope_theta,
            compress_rope_theta=compress_theta,
            compress_rope_scaling=compress_scaling,
            max_position_embeddings=_as_int(d.get("max_position_embeddings", 1048576),
                                            "max_position_embeddings"),
            bos_token_id=d.get("bos_token_id", 0),
            eos_token_ids=tuple(int(t) for t in eos_ids),
            num_mtp_layers=_as_int(d.get("num_nextn_predict_layers", 0), "num_nextn_predict_layers"),
            # transformers accepts tied embeddings (save_pretrained then writes no lm_head): the checkpoint
            # loader reads the head from the embedding
            extra={"tie_word_embeddings": True} if d.get("tie_word_embeddings") else {},
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"config.json: {exc}") from None


def load_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` from a file or a checkpoint directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json at {p}")
    try:
        data = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p} is not valid JSON: {exc}") from None
    return config_from_dict(data)


# ---- presets -----------------------------------------------------------------------------------

_FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,)


def flash_config() -> ModelConfig:
    """DeepSeek-V4-Flash: 43 layers, 4096 hidden, 256 experts top-6 (DESIGN §4)."""
    return ModelConfig(
        vocab_size=129280, hidden_size=4096, num_layers=43, num_heads=64, head_dim=512, rope_head_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=256, n_shared_experts=1,
        n_experts_per_tok=6, moe_intermediate_size=2048,
        attn_kinds=tuple(SLIDING if r == 0 else CSA if r == 4 else HCA for r in _FLASH_RATIOS),
        compress_ratios=_FLASH_RATIOS, mlp_hash=(True,) * 3 + (False,) * 40, sliding_window=128, index_n_heads=64,
        index_head_dim=128, index_topk=512, compress_rope_scaling=YarnScaling(16.0, 65536, 32.0, 1.0),
        num_mtp_layers=1,
    )


def tiny_config(vocab_size: int = 512) -> ModelConfig:
    """A small model with every feature: sliding, CSA (top-k below the row count), HCA, hash + score MoE."""
    ratios = (0, 4, 8, 4, 0, 8)
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=128, num_layers=len(ratios), num_heads=8, head_dim=128,
        rope_head_dim=64, q_lora_rank=64, o_groups=4, o_lora_rank=32, n_routed_experts=8, n_shared_experts=1,
        n_experts_per_tok=2, moe_intermediate_size=64,
        attn_kinds=tuple(SLIDING if r == 0 else CSA if r == 4 else HCA for r in ratios),
        compress_ratios=ratios, mlp_hash=(True, True) + (False,) * 4, sliding_window=16, index_n_heads=16,
        index_head_dim=128, index_topk=6, compress_rope_scaling=YarnScaling(4.0, 256, 32.0, 1.0),
        max_position_embeddings=8192,
    )


PRESETS = {"flash": flash_config, "tiny": tiny_config}
