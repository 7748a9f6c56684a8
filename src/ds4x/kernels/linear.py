"""Matrix multiply against a weight, whatever form the weight is held in.

Today every weight is a dense tensor and this is ``F.linear``; quantized weights (GGUF blocks, FP8)
will dispatch here to their own kernels, so the model never needs to know the storage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T in x's dtype."""
    return F.linear(x, weight.to(x.dtype) if weight.dtype != x.dtype else weight)
