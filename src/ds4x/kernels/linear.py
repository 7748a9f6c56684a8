"""Products and lookups against weights, whatever form a weight is held in.

A weight is either a dense tensor (plain torch ops, unchanged) or a
:class:`~ds4x.formats.ggml_tensor.GGMLTensor` (GGUF blocks kept quantized). Quantized weights go to
their own kernels here, so the model layer never touches a weight's storage directly:

- CPU (and any device without the Triton kernels): the reference, dequantize (bit-exact to gguf)
  then multiply in the activation dtype. The activations are not quantized, so a GGUF and the same
  weights in safetensors give the same logits.
- CUDA: :mod:`ds4x.kernels.quant_matmul` multiplies straight from the packed blocks. Set
  ``DS4X_QUANT_KERNEL=torch`` to force the reference there too.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ds4x.formats.ggml_tensor import GGMLTensor

Weight = torch.Tensor | GGMLTensor


def _quant_kernels(w: GGMLTensor):  # -> module or None
    """The Triton module when it can serve this weight, else None (the torch reference)."""
    if not w.is_cuda or os.environ.get("DS4X_QUANT_KERNEL", "auto").lower() == "torch":
        return None
    from ds4x.kernels import quant_matmul

    return quant_matmul if quant_matmul.supports(w) else None


def quant_kernel_name(w: Weight) -> str:
    """Which kernel serves products with ``w`` (for the startup log)."""
    if not isinstance(w, GGMLTensor):
        return "torch dense"
    if _quant_kernels(w) is not None:
        return f"triton quant_matmul ({w.qtype.name})"
    return f"torch dequantize+matmul ({w.qtype.name})"


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T in x's dtype."""
    if isinstance(weight, GGMLTensor):
        qm = _quant_kernels(weight)
        if qm is not None:
            return qm.quant_linear(x, weight)
        return F.linear(x, weight.dequantize(x.dtype))
    return F.linear(x, weight.to(x.dtype) if weight.dtype != x.dtype else weight)


def grouped_linear(x: torch.Tensor, weight: Weight, groups: int) -> torch.Tensor:
    """Block-diagonal product: x [T, G, in_g] with weight [G*out_g, in_g] -> [T, G, out_g]."""
    if isinstance(weight, GGMLTensor):
        qm = _quant_kernels(weight)
        if qm is not None:
            return qm.quant_grouped_linear(x, weight, groups)
        w = weight.dequantize(x.dtype).view(groups, -1, weight.shape[-1])
        return torch.einsum("tgi,goi->tgo", x, w)
    w = weight.view(groups, -1, weight.shape[-1]).to(x.dtype)
    return torch.einsum("tgi,goi->tgo", x, w)


def has_routed_kernel(weight: Weight) -> bool:
    """Whether ``routed_linear`` runs one fused kernel for these stacked experts (else a loop)."""
    return isinstance(weight, GGMLTensor) and _quant_kernels(weight) is not None


def routed_linear(x: torch.Tensor, weight: Weight, ids: torch.Tensor) -> torch.Tensor:
    """Stacked experts weight [E, out, in], x [T, in], ids [T, k] -> y [T, k, out] with
    y[t, j] = x[t] @ weight[ids[t, j]].T: one launch and no host sync on the quantized kernels,
    else one product per (row, slot) pair (the reference)."""
    if has_routed_kernel(weight):
        return _quant_kernels(weight).quant_matmul_routed(x, weight, ids)
    t, k = ids.shape
    rows = [linear(x[i : i + 1], weight[int(e)]) for i in range(t) for e in ids[i].tolist()]
    return torch.cat(rows).view(t, k, -1)


def embedding(weight: Weight, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``tokens`` of the embedding table, in ``dtype``."""
    if isinstance(weight, GGMLTensor):
        return weight.dequantize_rows(tokens, torch.float32).to(dtype)
    return weight[tokens].to(dtype)
