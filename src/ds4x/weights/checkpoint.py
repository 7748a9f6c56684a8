"""HF / official safetensors checkpoints: load (memory-mapped, sharded or not) and save.

Two tensor namings are accepted and mapped onto the canonical names of ``names.py``:
- official (``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1.weight``, ...), where dense
  weights may be FP8 E4M3 with a UE8M0 scale per 128x128 block and routed experts FP4 E2M1 (two per
  byte) with a UE8M0 scale per 32 values; both are dequantized exactly on load;
- transformers' (``model.layers.N.self_attn.q_a_proj.weight``, ``mlp.experts.gate_up_proj``, ...).

:func:`open_checkpoint` validates a directory from the headers and reads tensors one at a time (what
``ds4x convert`` streams from); :func:`load_checkpoint` reads them all (what the engine runs on).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ds4x.config import ModelConfig, load_config
from ds4x.formats import dequantize_fp4_expert_weight, dequantize_fp8_block_weight
from ds4x.formats.e4m3 import scale_to_float32
from ds4x.weights.names import expected_shapes, is_integer_tensor, keeps_fp32

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


# (transformers suffix, canonical suffix) inside a layer; both directions use this one table.
_HF_LAYER_NAMES = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
    ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
]
_HF_GLOBAL_NAMES = [
    ("model.embed_tokens.weight", "embed.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.hc_head.hc_base", "hc_head_base"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
]
_HF_TO_CANON_LAYER = dict(_HF_LAYER_NAMES)
_CANON_TO_HF_LAYER = {c: h for h, c in _HF_LAYER_NAMES}
_HF_TO_CANON_GLOBAL = dict(_HF_GLOBAL_NAMES)
_CANON_TO_HF_GLOBAL = {c: h for h, c in _HF_GLOBAL_NAMES}

# other spellings of canonical layer names seen in exports
_OFFICIAL_ALIASES = {"attn.norm.weight": "attn.kv_norm.weight"}

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_IGNORED = re.compile(r"(^|\.)mtp\.|rotary_emb|inv_freq")


def all_finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """torch.isfinite(t).all() without a bool copy of a whole embedding (0.5 GB for Flash's)."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))


class _SafetensorsDir:
    """Memory-mapped view of every tensor in a checkpoint directory (sharded or not)."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        has_index = index.is_file()
        if has_index:
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from None
            files = sorted({path / f for f in weight_map.values()})
        else:
            files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {path}")
        self.where: dict[str, object] = {}
        self._handles = []
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"checkpoint shard {f} is missing")
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"cannot read {f}: {exc}") from None
            self._handles.append(h)
            for k in h.keys():
                if has_index:
                    # the index decides which shard holds a tensor (as transformers reads it): a stale copy
                    # in another shard must not replace it, whatever the file order
                    if path / weight_map.get(k, "") == f:
                        self.where[k] = h
                elif k in self.where:
                    raise CheckpointError(f"tensor '{k}' is stored in more than one file of {path}")
                else:
                    self.where[k] = h
        if has_index:
            absent = [k for k in weight_map if k not in self.where]
            if absent:
                raise CheckpointError(f"{index} lists tensor '{absent[0]}' in {weight_map[absent[0]]}, "
                                      f"which does not hold it ({len(absent)} such tensors)")

    def names(self) -> list[str]:
        return list(self.where)

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """safetensors dtype string (``F32``, ``F8_E4M3``, ``I8``, ...) and torch shape, without reading data."""
        try:
            s = self.where[name].get_slice(name)  # type: ignore[attr-defined]
            dtype, shape = s.get_dtype(), tuple(s.get_shape())
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor '{name}': {exc}") from None
        if dtype == "F4":  # safetensors counts FP4 values, torch's float4_e2m1fn_x2 holds two per element
            shape = (*shape[:-1], shape[-1] // 2)
        return dtype, shape

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor, or only ``index`` of it (read from the mapped file without the rest)."""
        try:
            h = self.where[name]
            return h.get_tensor(name) if index is None else h.get_slice(name)[index]  # type: ignore[attr-defined]
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor '{name}': {exc}") from None


def _scale_name(names: set[str], weight_name: str) -> str | None:
    base = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    for cand in (base + ".scale", base + ".weight_scale_inv", base + ".weight_scale", base + ".scale_inv"):
        if cand in names:
            return cand
    return None


def _canonical(name: str) -> str:
    """Map any accepted spelling of a tensor name to its canonical name (unknown names pass through).

    Accepted: official names, transformers' module names, and what transformers' ``save_pretrained``
    writes (official names under a ``model.`` prefix, with a few transformers leftovers).
    """
    bare = name[len("model."):] if name.startswith("model.") else name
    if name in _HF_TO_CANON_GLOBAL:
        return _HF_TO_CANON_GLOBAL[name]
    if "model." + bare in _HF_TO_CANON_GLOBAL:
        return _HF_TO_CANON_GLOBAL["model." + bare]
    m = _LAYER.match(bare)
    if not m:
        return bare
    rest = m.group(2)
    rest = _HF_TO_CANON_LAYER.get(rest, _OFFICIAL_ALIASES.get(rest, rest))
    return f"layers.{m.group(1)}.{rest}"


@dataclass(frozen=True)
class _Part:
    """Where a canonical tensor, or one expert of a stacked one, is stored in the checkpoint."""

    name: str  # checkpoint tensor name
    shape: tuple[int, ...]  # after dequantization and slicing
    kind: str = "plain"  # plain, fp8 (128x128 UE8M0 blocks) or fp4 (E2M1 pairs, UE8M0 per 32)
    scale: str | None = None
    rows: slice | None = None  # the gate or up half of transformers' fused gate_up_proj (dim 1)
    scale_shape: tuple[int, ...] | None = None  # from the scale's header


_FP8_DTYPES = ("F8_E4M3",)
_FP4_DTYPES = ("I8", "U8", "F4")  # official experts are int8 on disk; F4 is float4_e2m1fn_x2
_SCALE_DTYPES = ("F8_E8M0", "U8", "F32", "BF16", "F16", "F64")  # UE8M0 (official), raw E8M0 bytes, or floats


def _stored_part(st: _SafetensorsDir, names: set[str], n: str) -> _Part:
    """Classify checkpoint tensor ``n`` from its header: plain, or FP8/FP4 with its scale."""
    dtype, shape = st.header(n)
    scale = _scale_name(names, n) if n.endswith(".weight") else None
    if scale is None:
        if dtype in _FP8_DTYPES:
            raise CheckpointError(f"FP8 tensor '{n}' has no scale tensor")
        return _Part(n, shape)
    if dtype in _FP8_DTYPES:
        part = _Part(n, shape, "fp8", scale)
    elif dtype in _FP4_DTYPES:
        part = _Part(n, (*shape[:-1], 2 * shape[-1]), "fp4", scale)
    else:
        raise CheckpointError(f"tensor '{n}' has a scale '{scale}' but dtype {dtype}")
    # checked from the headers, so a bad scale fails at open, not halfway through writing a GGUF
    s_dtype, s_shape = st.header(scale)
    if s_dtype not in _SCALE_DTYPES:
        raise CheckpointError(f"scale '{scale}' has dtype {s_dtype}, expected one of {', '.join(_SCALE_DTYPES)}")
    return replace(part, scale_shape=s_shape)


def _check_scale(p: _Part) -> None:
    """The scale's header shape against its (already shape-checked) weight: 128x128 blocks for FP8, 32 values
    per scale for FP4; checked at open, so a bad scale fails before ``ds4x convert`` writes anything."""
    if p.kind == "plain":
        return
    out_dim, in_dim = p.shape[-2:] if len(p.shape) >= 2 else (0, 0)
    want = (-(-out_dim // 128), -(-in_dim // 128)) if p.kind == "fp8" else (out_dim, -(-in_dim // 32))
    if len(p.shape) != 2 or p.scale_shape != want:
        raise CheckpointError(f"scale '{p.scale}' has shape {list(p.scale_shape or ())}, expected {list(want)} "
                              f"for {p.kind.upper()} weight '{p.name}' of shape {list(p.shape)}")


class LazyCheckpoint(Mapping[str, torch.Tensor]):
    """The canonical tensors of a checkpoint directory, each read only when asked for.

    Opening checks names, shapes and experts from the safetensors headers alone; ``ckpt[name]`` (or
    :meth:`load`) then reads and dequantizes that one tensor from the memory-mapped files (a stacked
    routed-expert tensor is filled expert by expert), so a consumer that drops each tensor after use,
    such as ``ds4x convert``, never holds more than one.
    """

    def __init__(self, cfg: ModelConfig, st: _SafetensorsDir, parts: dict[str, _Part | list[_Part]]):
        self.cfg = cfg
        self._st = st
        self._parts = parts
        self.shapes = expected_shapes(cfg)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.load(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def _read(self, p: _Part) -> torch.Tensor:
        t = self._st.get(p.name, None if p.rows is None else (slice(None), p.rows))
        if p.kind == "plain":
            # a NaN / Inf in a weight (a norm, a sink...) makes every logit NaN far from its cause, as the GGUF
            # loader says too
            if t.is_floating_point() and not all_finite(t):
                raise CheckpointError(f"tensor '{p.name}' holds {int((~torch.isfinite(t)).sum())} NaN or infinite "
                                      f"values")
            return t
        scale = self._st.get(p.scale)  # type: ignore[arg-type]
        # a NaN/inf scale (E8M0 0xFF) would silently make the whole block NaN; the GGUF loader refuses those too
        if not bool(torch.isfinite(scale_to_float32(scale)).all()):
            raise CheckpointError(f"scale '{p.scale}' of tensor '{p.name}' holds NaN or infinite values")
        dequant = dequantize_fp8_block_weight if p.kind == "fp8" else dequantize_fp4_expert_weight
        return dequant(t, scale)

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor ``name`` on the CPU in ``dtype`` (float32-by-contract tensors float32, expert ids int64)."""
        part = self._parts[name]
        if is_integer_tensor(name):
            t = self._read(part)  # type: ignore[arg-type]
            if t.is_floating_point():
                raise CheckpointError(f"tensor '{name}' must be integer, got {t.dtype}")
            if int(t.min()) < 0 or int(t.max()) >= self.cfg.n_routed_experts:
                raise CheckpointError(f"tensor '{name}' holds expert ids outside [0, {self.cfg.n_routed_experts})")
            return t.to(torch.int64)
        dt = torch.float32 if keeps_fp32(name) else dtype
        if isinstance(part, _Part):
            return self._read(part).to(dt)
        out = torch.empty(self.shapes[name], dtype=dt)
        for e, p in enumerate(part):
            out[e] = self._read(p)  # one expert in flight, never a list of them
        return out


def open_checkpoint(path: str | Path) -> LazyCheckpoint:
    """A checkpoint directory as a :class:`LazyCheckpoint`: validated, nothing read but the headers."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint path {root} is not a directory")
    cfg = load_config(root)
    st = _SafetensorsDir(root)
    names = set(st.names())
    scales = {s for n in names if n.endswith(".weight") and (s := _scale_name(names, n)) is not None}
    want = expected_shapes(cfg)
    I = cfg.moe_intermediate_size
    parts: dict[str, _Part | list[_Part]] = {}
    experts: dict[str, dict[int, _Part]] = {}
    unexpected: list[str] = []
    for n in sorted(names):
        if n in scales or _IGNORED.search(n):
            continue
        part = _stored_part(st, names, n)
        name = _canonical(n)
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers' fused [E, 2I, H]
            if len(part.shape) != 3 or part.shape[1] != 2 * I:
                raise CheckpointError(f"tensor '{n}' has shape {list(part.shape)}, expected [E, {2 * I}, H]")
            if part.kind != "plain":
                raise CheckpointError(f"tensor '{n}': quantized fused gate_up_proj is not supported")
            p, half = name[: -len("mlp.experts.gate_up_proj")], (part.shape[0], I, part.shape[2])
            found = [(p + "ffn.experts.w1", replace(part, shape=half, rows=slice(0, I))),
                     (p + "ffn.experts.w3", replace(part, shape=half, rows=slice(I, 2 * I)))]
        elif name.endswith("mlp.experts.down_proj"):
            found = [(name[: -len("mlp.experts.down_proj")] + "ffn.experts.w2", part)]
        else:
            found = [(name, part)]
        for cname, cpart in found:
            m = _EXPERT.match(cname)
            if m:
                experts.setdefault(f"layers.{m.group(1)}.ffn.experts.{m.group(3)}", {})[int(m.group(2))] = cpart
            elif cname in want:
                parts[cname] = cpart
            elif not cname.endswith("ffn.gate.bias"):
                # hash layers in some exports carry an unused routing bias; anything else is reported
                unexpected.append(cname)
    for name, per_expert in experts.items():
        n_exp = cfg.n_routed_experts
        missing = [e for e in range(n_exp) if e not in per_expert]
        if missing:
            raise CheckpointError(f"checkpoint is missing expert tensors {name.replace('experts.', 'experts.{e}.')}"
                                  f" for experts {missing[:8]}{'...' if len(missing) > 8 else ''}")
        if name not in want:
            unexpected.append(name)
            continue
        parts[name] = [per_expert[e] for e in range(n_exp)]
    if unexpected:
        log.warning("ignoring %d tensors not used by DeepSeek-V4: %s", len(unexpected), ", ".join(unexpected[:5]))

    if cfg.extra.get("tie_word_embeddings") and "embed.weight" in parts:
        # tied as transformers ties them: the embedding is the head, whatever lm_head.weight the files hold
        parts["head.weight"] = parts["embed.weight"]
    missing = [n for n in want if n not in parts]
    if missing:
        raise CheckpointError(
            f"checkpoint {root} is missing {len(missing)} tensors, e.g. '{missing[0]}' "
            f"(expected shape {list(want[missing[0]])})"
        )
    for name, shape in want.items():
        part = parts[name]
        for p, expect in ([(part, shape)] if isinstance(part, _Part) else [(q, shape[1:]) for q in part]):
            if p.shape != expect:
                shown = name if isinstance(part, _Part) else p.name
                raise CheckpointError(f"tensor '{shown}' has shape {list(p.shape)}, expected {list(expect)}")
            _check_scale(p)
    return LazyCheckpoint(cfg, st, parts)


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and canonical weights (working dtype; fp32-by-contract tensors fp32) from a directory,
    all in memory; :func:`open_checkpoint` gives them one at a time."""
    ckpt = open_checkpoint(path)
    return ckpt.cfg, {name: ckpt.load(name, dtype).to(device) for name in ckpt}


def to_hf_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical -> transformers naming (experts fused into gate_up_proj)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name in _CANON_TO_HF_GLOBAL:
            out[_CANON_TO_HF_GLOBAL[name]] = t
            continue
        m = _LAYER.match(name)
        assert m, name
        layer, rest = m.group(1), m.group(2)
        p = f"model.layers.{layer}."
        if rest == "ffn.experts.w1":
            out[p + "mlp.experts.gate_up_proj"] = torch.cat([t, weights[f"layers.{layer}.ffn.experts.w3"]], dim=1)
        elif rest == "ffn.experts.w3":
            continue
        elif rest == "ffn.experts.w2":
            out[p + "mlp.experts.down_proj"] = t
        else:
            out[p + _CANON_TO_HF_LAYER[rest]] = t
    return out


def to_official_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical -> official naming (one tensor per expert)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        m = re.match(r"^(layers\.\d+\.ffn\.experts)\.(w[123])$", name)
        if m:
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def save_checkpoint(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], path: str | Path, naming: str = "official",
    shard_bytes: int = 0,
) -> None:
    """Write config.json and safetensors (optionally sharded with an index) in either naming."""
    if naming not in ("official", "hf"):
        raise ValueError(f"naming must be 'official' or 'hf', got {naming!r}")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    named = to_hf_names(weights) if naming == "hf" else to_official_names(weights)
    named = {k: v.detach().contiguous().cpu() for k, v in named.items()}
    if shard_bytes <= 0:
        save_file(named, str(root / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(named):
        nbytes = named[k].numel() * named[k].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = named[k]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
