"""Products and lookups against weights, whatever form a weight is held in.

Today every weight is a dense tensor and these are plain torch ops; quantized weights (GGUF blocks)
dispatch here to their own kernels, so the model layer never touches a weight's storage directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T in x's dtype."""
    return F.linear(x, weight.to(x.dtype) if weight.dtype != x.dtype else weight)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal product: x [T, G, in_g] with weight [G*out_g, in_g] -> [T, G, out_g]."""
    w = weight.view(groups, -1, weight.shape[-1]).to(x.dtype)
    return torch.einsum("tgi,goi->tgo", x, w)


def embedding(weight: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``tokens`` of the embedding table, in ``dtype``."""
    return weight[tokens].to(dtype)
