"""Exact top-k selection of compressed rows (DESIGN §3.3).

The k highest scores among the visible rows; ties go to the lower row index; a row a query cannot
see is never selected. Every fused or hierarchical variant must return the same set as
`select_topk`.
"""

from __future__ import annotations

import torch


def select_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices [T, min(k, N)] of the selected rows and their validity [T, min(k, N)].

    A stable descending sort keeps equal scores in index order, so its first k are exactly the set
    the tie rule defines. Fewer than k visible rows leave invalid slots (index 0, valid False).
    """
    T, n = scores.shape
    kk = min(k, n)
    if kk <= 0:
        empty = torch.zeros(T, 0, dtype=torch.long, device=scores.device)
        return empty, empty.bool()
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :kk]
    valid = visible.gather(1, order)
    return torch.where(valid, order, torch.zeros_like(order)), valid


def selection_mask(index: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
    """The selected set as a boolean mask [T, n] (for comparing selections)."""
    counts = torch.zeros(index.shape[0], n, dtype=torch.int32, device=index.device)
    return counts.scatter_add_(1, index, valid.int()) > 0  # padding slots add 0 (never unselect)
