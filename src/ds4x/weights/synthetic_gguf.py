"""SYNTHETIC quantized models generated straight on a device (benchmarks only: outputs are noise).

The full-size Flash in the ds4 q2 mix is 80.8 GiB: writing it as a GGUF and reading it back costs minutes
of disk and RAM, so the speed benchmarks build the same tensors on the GPU instead. Every tensor gets the
GGML type the policy gives it (``ds4x.weights.gguf_writer.tensor_type``) and the bytes
``write_synthetic_gguf`` would write for it (``synthetic_tensor_bytes``), then is bound exactly as the GGUF
loader binds a file's tensor (``ds4x.weights.gguf.bind_raw``): quantized ones stay GGMLTensors.
Same seed, config and policy give the same model on the same kind of device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ds4x.config import ModelConfig
from ds4x.formats.ggml import quantized_nbytes
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.memory import free_memory
from ds4x.weights.gguf import QUANTIZED_TYPES, bind_raw
from ds4x.weights.gguf_writer import TypePolicy, synthetic_tensor_bytes, tensor_type
from ds4x.weights.names import expected_shapes


def synthetic_quantized_weights(
    cfg: ModelConfig, policy: TypePolicy | str = "q2", seed: int = 0, dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda", progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, torch.Tensor | GGMLTensor]:
    """Canonical weights of ``cfg`` with ``policy``'s GGML types, generated on ``device``; refused up front
    (MemoryError) where they cannot fit its free memory (flash:q2 on a CPU of 22 GiB free grew past 8 GiB before it
    was stopped)."""
    pol = TypePolicy.preset(policy) if isinstance(policy, str) else policy
    device = torch.device(device)
    want = expected_shapes(cfg)
    types = {name: tensor_type(name, shape, pol) for name, shape in want.items()}
    # quantized tensors stay in their blocks; the others are bound in the working dtype
    need = sum(quantized_nbytes(types[name], shape) if types[name] in QUANTIZED_TYPES
               else math.prod(shape) * dtype.itemsize for name, shape in want.items())
    free = free_memory(device)
    if need > free:
        raise MemoryError(f"the synthetic model needs {need / 2**30:.2f} GiB on {device}, which has "
                          f"{free / 2**30:.2f} GiB free")
    g = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor | GGMLTensor] = {}
    for i, (name, shape) in enumerate(want.items()):
        qt = types[name]
        raw = synthetic_tensor_bytes(name, shape, qt, cfg, g)
        out[name] = bind_raw(raw.to(device), qt, name, shape, dtype, device, cfg.n_routed_experts,
                             f"synthetic tensor '{name}'")
        if progress:
            progress(name, i + 1, len(want))
    return out


def weight_bytes(weights: dict[str, torch.Tensor | GGMLTensor]) -> int:
    """Bytes the weights occupy in memory (quantized ones at their block size)."""
    return sum(w.nbytes if isinstance(w, GGMLTensor) else w.numel() * w.element_size() for w in weights.values())


def expected_distinct_experts(cfg: ModelConfig, tokens: int) -> float:
    """Expected number of distinct routed experts of one layer that ``tokens`` independently routed tokens meet
    (each picks ``n_experts_per_tok`` of ``n_routed_experts``, every expert equally likely): a batched step reads
    each of them once, so its weight bytes grow far slower than its tokens."""
    if tokens < 1:
        raise ValueError(f"tokens must be at least 1, got {tokens}")
    n, k = cfg.n_routed_experts, cfg.n_experts_per_tok
    return n * (1 - (1 - k / n) ** tokens)


def active_weight_bytes(cfg: ModelConfig, weights: dict[str, torch.Tensor | GGMLTensor],
                        quantized_only: bool = False, tokens: int = 1) -> int:
    """Weight bytes a decode step of ``tokens`` tokens (one per session) must read (DESIGN §7's floor):
    everything except the routed experts and the embedding table, plus the expected distinct routed experts
    per layer (``n_experts_per_tok`` at one token; ``expected_distinct_experts``) and one embedding row per token
    (``quantized_only``: of the GGMLTensors alone)."""
    total = 0
    for name, w in weights.items():
        if quantized_only and not isinstance(w, GGMLTensor):
            continue
        n = w.nbytes if isinstance(w, GGMLTensor) else w.numel() * w.element_size()
        if ".ffn.experts." in name:
            n = round(n * expected_distinct_experts(cfg, tokens) / cfg.n_routed_experts)
        elif name == "embed.weight":
            n = n // cfg.vocab_size * tokens
        elif name.endswith("tid2eid"):
            n = n // cfg.vocab_size * tokens  # one row of the hash table a token
        total += n
    return total
