"""SYNTHETIC quantized models generated straight on a device (benchmarks only: outputs are noise).

The full-size Flash in the ds4 q2 mix is 80.8 GiB: writing it as a GGUF and reading it back costs minutes
of disk and RAM, so the speed benchmarks build the same tensors on the GPU instead. Every tensor gets the
GGML type the policy gives it (``ds4x.weights.gguf_writer.tensor_type``) and the bytes
``write_synthetic_gguf`` would write for it (``synthetic_tensor_bytes``), then is bound exactly as the GGUF
loader binds a file's tensor (``ds4x.weights.gguf.bind_raw``): quantized ones stay GGMLTensors.
Same seed, config and policy give the same model on the same kind of device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds4x.config import ModelConfig
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.weights.gguf import bind_raw
from ds4x.weights.gguf_writer import TypePolicy, synthetic_tensor_bytes, tensor_type
from ds4x.weights.names import expected_shapes


def synthetic_quantized_weights(
    cfg: ModelConfig, policy: TypePolicy | str = "q2", seed: int = 0, dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda", progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, torch.Tensor | GGMLTensor]:
    """Canonical weights of ``cfg`` with ``policy``'s GGML types, generated on ``device``."""
    pol = TypePolicy.preset(policy) if isinstance(policy, str) else policy
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    want = expected_shapes(cfg)
    out: dict[str, torch.Tensor | GGMLTensor] = {}
    for i, (name, shape) in enumerate(want.items()):
        qt = tensor_type(name, shape, pol)
        raw = synthetic_tensor_bytes(name, shape, qt, cfg, g)
        out[name] = bind_raw(raw.to(device), qt, name, shape, dtype, device, cfg.n_routed_experts,
                             f"synthetic tensor '{name}'")
        if progress:
            progress(name, i + 1, len(want))
    return out


def weight_bytes(weights: dict[str, torch.Tensor | GGMLTensor]) -> int:
    """Bytes the weights occupy in memory (quantized ones at their block size)."""
    return sum(w.nbytes if isinstance(w, GGMLTensor) else w.numel() * w.element_size() for w in weights.values())


def active_weight_bytes(cfg: ModelConfig, weights: dict[str, torch.Tensor | GGMLTensor],
                        quantized_only: bool = False) -> int:
    """Weight bytes one decode token must read (DESIGN §7's floor): everything except the routed experts
    and the embedding table, plus ``n_experts_per_tok`` routed experts per layer and one embedding row
    (``quantized_only``: of the GGMLTensors alone)."""
    total = 0
    for name, w in weights.items():
        if quantized_only and not isinstance(w, GGMLTensor):
            continue
        n = w.nbytes if isinstance(w, GGMLTensor) else w.numel() * w.element_size()
        if ".ffn.experts." in name:
            n = n * cfg.n_experts_per_tok // cfg.n_routed_experts
        elif name == "embed.weight":
            n //= cfg.vocab_size
        elif name.endswith("tid2eid"):
            n //= cfg.vocab_size  # one row of the hash table
        total += n
    return total
