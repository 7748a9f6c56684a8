"""Third-party ds4-layout GGUFs the other GGUF tests do not write: routed experts in the K / IQ2 quants ds4
ships (random valid blocks, since ``gguf.quants`` cannot quantize them) with BF16 / Q8_0 dense tensors, and
files whose metadata or weights are wrong in ways that used to load silently (layers dropped, NaN logits).

Files come from ``tests/test_gguf_third_party.py``'s ``gguf.GGUFWriter``-only writer; edits go through a
plain GGUFReader -> GGUFWriter rewrite, so nothing of ds4x's own writer is involved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFValueType as V  # noqa: E402

from ds4x.weights.checkpoint import load_checkpoint  # noqa: E402
from ds4x.weights.gguf import GGUFError, load_gguf  # noqa: E402
from tests import test_gguf_third_party as tp  # noqa: E402

# rows of whole K-quant blocks (256) for the routed experts; sliding, CSA, HCA, CSA
DK = tp.Dims(hidden=256, ratios=(0, 4, 8, 4), n_hash=1, heads=4, head_dim=64, rope=16, q_lora=64, o_groups=2,
             o_lora=32, experts=4, used=2, ff=256, window=8, idx_heads=16, idx_dim=32, idx_topk=3)


def _random_blocks(qt: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random but valid raw blocks: any code bytes, small positive fp16 scale fields."""
    block, size = gguf.GGML_QUANT_SIZES[qt]
    n = int(np.prod(shape)) // block
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    scales = {Q.Q2_K: (80, 82), Q.Q4_K: (0, 2), Q.IQ2_XXS: (0,)}[qt]
    for off in scales:
        b[:, off:off + 2] = rng.uniform(5e-4, 2e-3, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return b.reshape(*shape[:-1], shape[-1] // block * size)


def _encoded(weights: dict[str, np.ndarray], types: Callable[[str], Q], seed: int = 5
             ) -> tuple[dict[int, tuple[np.ndarray, Q | None]], dict[str, np.ndarray]]:
    """Each tensor's bytes as the file will hold them (keyed by id of the source array) and the float
    values they decode to with gguf's own dequantizers (the reference's weights)."""
    rng = np.random.default_rng(seed)
    enc, stored = {}, {}
    for name, arr in weights.items():
        qt = Q.I32 if arr.dtype == np.int32 else types(name)
        if qt in (Q.F32, Q.F16, Q.I32):
            data, raw = arr.astype({Q.F32: np.float32, Q.F16: np.float16, Q.I32: np.int32}[qt]), None
        elif qt in (Q.Q2_K, Q.Q4_K, Q.IQ2_XXS):
            data, raw = _random_blocks(qt, arr.shape, rng), qt
        else:
            data, raw = gguf.quants.quantize(arr.astype(np.float32), qt), qt
        enc[id(arr)] = (data, raw)
        stored[name] = (gguf.quants.dequantize(data, raw) if raw is not None else data).astype(arr.dtype)
    return enc, stored


def _write_encoded(path: Path, weights: dict[str, np.ndarray], enc: dict, d: tp.Dims, style: tp.Style) -> None:
    orig = tp._encode
    tp._encode = lambda arr, qt: enc[id(arr)]  # the third-party writer, with our bytes for every tensor
    try:
        tp.write_third_party(path, weights, d, dataclasses.replace(style, types=lambda n: Q.F32))
    finally:
        tp._encode = orig


def _rewrite(src: Path, dst: Path, kv: Callable[[list], list] | None = None,
             tensors: Callable[[list], list] | None = None) -> None:
    """``src`` read back and written again with edited metadata ``[key, value, type, sub_type]`` and / or
    tensors ``[name, array, type]``."""
    r = gguf.GGUFReader(str(src))
    kvs = [[k, f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None]
           for k, f in r.fields.items() if not k.startswith("GGUF.")]
    ts = [[t.name, np.array(t.data), Q(int(t.tensor_type))] for t in r.tensors]
    kvs, ts = (kv or (lambda x: x))(kvs), (tensors or (lambda x: x))(ts)
    w = gguf.GGUFWriter(str(dst), "deepseek4")
    w.kv_data[0].clear()
    for k, v, t, st in kvs:
        w.add_key_value(k, v, t, sub_type=st)
    for name, data, qt in ts:
        w.add_tensor(name, data, raw_dtype=None if qt in (Q.F32, Q.F16, Q.I32) else qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _set(key: str, value: Any, vtype: V | None = None) -> Callable[[list], list]:
    def edit(kvs: list) -> list:
        for item in kvs:
            if item[0] == key:
                item[1], item[2] = value, item[2] if vtype is None else vtype
        return kvs
    return edit


def _tensor(name: str, fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[list], list]:
    def edit(ts: list) -> list:
        for item in ts:
            if item[0] == name:
                item[1] = fn(item[1].copy())
        return ts
    return edit


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("probe") / "f32.gguf"
    tp.write_third_party(path, tp.random_weights(tp.D, seed=0))
    return path


# ---- routed experts in ds4's quant types ---------------------------------------------------------

def _mix(gate_up: Q, down: Q, dense: Q, proj: Q) -> Callable[[str], Q]:
    def types(name: str) -> Q:
        if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            return gate_up
        if name.endswith("ffn_down_exps.weight"):
            return down
        if name.endswith(("norm.weight", "_scale.weight", "_base.weight", "attn_sinks.weight", "exp_probs_b.bias")):
            return Q.F32
        if name == "output.weight" or any(k in name for k in ("attn_q_", "attn_kv.", "attn_output_", "_shexp.")):
            return proj
        return dense
    return types


@pytest.mark.parametrize("gate_up,down,dense,proj", [
    (Q.IQ2_XXS, Q.Q2_K, Q.F16, Q.Q8_0),  # the published ds4 mix
    (Q.Q4_K, Q.Q4_K, Q.BF16, Q.BF16),
    (Q.Q2_K, Q.IQ2_XXS, Q.BF16, Q.Q8_0),
], ids=["iq2-q2k-f16-q8", "q4k-bf16", "q2k-iq2-bf16-q8"])
def test_k_quant_experts_match_gguf_dequantized(tmp_path, gate_up, down, dense, proj):
    weights = tp.random_weights(DK, seed=0)
    enc, stored = _encoded(weights, _mix(gate_up, down, dense, proj))
    cfg_ref, w_ref = load_checkpoint(tp.write_official(tmp_path / "ref", stored, DK))
    ref = tp.logits(cfg_ref, w_ref)
    path = tmp_path / "k.gguf"
    _write_encoded(path, weights, enc, DK, tp.Style(shuffle=True))
    cfg, w, _ = load_gguf(path)
    assert w["layers.2.ffn.experts.w1"].qtype.name == gate_up.name
    assert w["layers.2.ffn.experts.w2"].qtype.name == down.name
    got = tp.logits(cfg, w)
    assert torch.isfinite(got).all() and ref.std() > 0.5
    assert tp.rel(got, ref) <= 1e-5, tp.rel(got, ref)


# ---- metadata that contradicts the tensors -------------------------------------------------------

@pytest.mark.parametrize("edit,match", [
    # HCA layer 2 declared sliding: its compressor would be dropped and the layer run as sliding
    (_set("deepseek4.attention.compress_ratios", [0, 4, 0, 4, 0]),
     r"'blk.2.attn_compressor_ape.weight' \(and 3 more\) does not fit the metadata: layer 2 has compress ratio 0"),
    # one layer fewer than the file holds: the last layer would be dropped
    (_set("deepseek4.block_count", 4), r"'blk.4.\w+.weight' \(and \d+ more\) does not fit the metadata: layer 4 is "
                                       r"past 'deepseek4.block_count' = 4"),
    # layer 0's tid2eid table ignored, the layer routed by score with a zero bias
    (_set("deepseek4.hash_layer_count", 0), r"'blk.0.ffn_gate_tid2eid.weight' does not fit the metadata: layer 0 "
                                            r"is not a hash layer \('deepseek4.hash_layer_count' = 0\)"),
], ids=["ratio", "block_count", "hash_layer_count"])
def test_tensors_the_metadata_does_not_use_are_refused(f32_file, tmp_path, edit, match):
    path = tmp_path / "bad.gguf"
    _rewrite(f32_file, path, kv=edit)
    with pytest.raises(GGUFError, match=match):
        load_gguf(path)


@pytest.mark.parametrize("vtype", [V.UINT8, V.UINT32, V.INT32])
def test_expert_weights_norm_as_integer(f32_file, tmp_path, vtype):
    """ds4.c wants a BOOL; a writer storing 1 as an integer meant true (it was refused as 'is false')."""
    path = tmp_path / "int.gguf"
    _rewrite(f32_file, path, kv=_set("deepseek4.expert_weights_norm", 1, vtype))
    cfg, _, _ = load_gguf(path)
    assert cfg.routed_scaling_factor == tp.D.scale
    _rewrite(f32_file, path, kv=_set("deepseek4.expert_weights_norm", 2, vtype))
    with pytest.raises(GGUFError, match="'deepseek4.expert_weights_norm' must be a boolean, got 2"):
        load_gguf(path)
    _rewrite(f32_file, path, kv=_set("deepseek4.expert_weights_norm", 0, vtype))
    with pytest.raises(GGUFError, match="'deepseek4.expert_weights_norm' is false"):
        load_gguf(path)


# ---- non-finite weights --------------------------------------------------------------------------

def _poke(index: int, value: float) -> Callable[[np.ndarray], np.ndarray]:
    def fn(a: np.ndarray) -> np.ndarray:
        a.reshape(-1)[index % a.size] = value
        return a
    return fn


@pytest.mark.parametrize("name,value,match", [
    ("blk.1.attn_norm.weight", np.nan, r"'blk.1.attn_norm.weight' \(F32, 'layers.1.attn_norm.weight'\) holds 1 NaN"),
    ("output_norm.weight", np.inf, r"'output_norm.weight' \(F32, 'norm.weight'\) holds 1 NaN / Inf .* \[7\]: inf"),
    ("blk.2.attn_sinks.weight", -np.inf, r"'blk.2.attn_sinks.weight' .* holds 1 NaN / Inf"),
    ("blk.0.hc_attn_base.weight", np.nan, r"'blk.0.hc_attn_base.weight' .* holds 1 NaN / Inf"),
    ("token_embd.weight", np.nan, r"'token_embd.weight' .* holds 1 NaN / Inf values in the file, first at torch "
                                  r"index \[0, 7\]"),
])
def test_non_finite_plain_weight_is_refused(f32_file, tmp_path, name, value, match):
    """A NaN in a norm used to load and turn every logit NaN (an embedding row only the tokens that use it)."""
    path = tmp_path / "nan.gguf"
    _rewrite(f32_file, path, tensors=_tensor(name, _poke(7, value)))
    with pytest.raises(GGUFError, match=match):
        load_gguf(path)


def test_weight_overflowing_the_working_dtype_is_named(f32_file, tmp_path):
    path = tmp_path / "big.gguf"
    _rewrite(f32_file, path, tensors=_tensor("blk.1.attn_kv.weight", _poke(3, 1e6)))
    assert load_gguf(path)[1]["layers.1.attn.wkv.weight"].dtype == torch.float32  # fine in float32
    with pytest.raises(GGUFError, match=r"'blk.1.attn_kv.weight' .* holds values that overflow torch.float16 "
                                        r"\(finite in the file's F32\), first at torch index \[0, 3\]: inf"):
        load_gguf(path, dtype=torch.float16)


@pytest.mark.parametrize("edit", ["misaligned", "overlapping"])
def test_corrupt_tensor_table_is_refused(tmp_path: Path, edit: str) -> None:
    """A tensor whose data offset breaks the file's alignment, or whose bytes overlap another tensor's, means a
    corrupt tensor table: refused by name, before anything reads garbage weights."""
    from ds4x.weights.gguf import open_gguf

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek4")
    w.add_tensor("a", np.arange(64, dtype=np.float32))
    w.add_tensor("b", np.arange(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert len(open_gguf(path).tensors) == 2
    raw = gguf.GGUFReader(str(path), "r+")
    offset = raw.tensors[1].field.parts[-1]
    offset[0] = 4 if edit == "misaligned" else 32  # "a" holds bytes 0..256 of the data section
    raw.data.flush()
    del raw
    with pytest.raises(GGUFError, match="alignment" if edit == "misaligned" else "share bytes"):
        open_gguf(path)


def test_token_list_longer_than_the_vocabulary_is_refused(f32_file, tmp_path):
    """A tokenizer with more tokens than the embedding has rows would emit ids the model cannot embed: refused at
    load, not at the first prompt that uses one."""
    tokens = gguf.GGUFReader(str(f32_file)).fields["tokenizer.ggml.tokens"].contents()
    path = tmp_path / "vocab.gguf"
    _rewrite(f32_file, path, kv=_set("deepseek4.vocab_size", len(tokens) - 1))
    with pytest.raises(GGUFError, match=rf"token list has {len(tokens)} tokens but 'deepseek4.vocab_size' = "
                                        rf"{len(tokens) - 1}"):
        load_gguf(path)


@pytest.mark.parametrize("qt,field", [(Q.Q8_0, 0), (Q.Q2_K, 82), (Q.Q4_K, 2), (Q.IQ2_XXS, 0)])
def test_non_finite_block_scale_is_refused(tmp_path, qt, field):
    """A quantized block whose fp16 scale (d, or dmin) is NaN / Inf decodes to NaN weights: refused at load, naming
    the tensor, and counted by the block check itself."""
    from ds4x.formats.ggml import nonfinite_scale_blocks

    weights = tp.random_weights(DK, seed=0)
    enc, _ = _encoded(weights, _mix(qt, qt, Q.F16, Q.Q8_0))
    data, raw = enc[id(weights["blk.2.ffn_down_exps.weight"])]
    blocks = data.reshape(-1, gguf.GGML_QUANT_SIZES[qt][1])
    assert nonfinite_scale_blocks(torch.from_numpy(blocks.copy()), qt) == 0
    blocks[3, field:field + 2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    blocks[9, field:field + 2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    assert nonfinite_scale_blocks(torch.from_numpy(blocks.copy()), qt) == 2
    path = tmp_path / "bad.gguf"
    _write_encoded(path, weights, enc, DK, tp.Style())
    with pytest.raises(GGUFError, match=rf"'blk.2.ffn_down_exps.weight'.* \({qt.name}\) has 2 blocks whose fp16 "
                                        r"scale is NaN or infinite"):
        load_gguf(path)
