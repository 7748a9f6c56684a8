"""Products and lookups against weights, whatever form a weight is held in.

A weight is either a dense tensor (plain torch ops, unchanged) or a
:class:`~ds4x.formats.ggml_tensor.GGMLTensor` (GGUF blocks kept quantized). Quantized weights go to
their own kernels here, so the model layer never touches a weight's storage directly:

- CPU (and any device without the Triton kernels): the reference, dequantize (bit-exact to gguf)
  then multiply in the activation dtype. The activations are not quantized, so a GGUF and the same
  weights in safetensors give the same logits.
- CUDA: :mod:`ds4x.kernels.quant_matmul` multiplies straight from the packed blocks, and dense 16-bit
  weights by a few rows (a decode step's) with its matvec too. Set ``DS4X_QUANT_KERNEL=torch`` to force the
  reference (and cuBLAS) there too.

Inside ``rowwise_products()`` every product computes each row on its own (batch invariance): a matmul
library picks its kernel, and so its reduction order, by the number of rows, so a row's result otherwise
depends on how many other rows share the call. Row by row (the same call a batch of one makes, once per row), a
batched step gives each row exactly what a batch of one gives it (the server's decode steps use this on the CPU;
it reads the weight once per row).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from ds4x.formats.ggml_tensor import GGMLTensor

Weight = torch.Tensor | GGMLTensor

_ROWWISE: ContextVar[bool] = ContextVar("ds4x_rowwise_products", default=False)


@contextmanager
def rowwise_products(enabled: bool = True) -> Iterator[None]:
    """Within the block (this thread/context), ``linear`` and ``grouped_linear`` compute each row alone."""
    token = _ROWWISE.set(enabled)
    try:
        yield
    finally:
        _ROWWISE.reset(token)


def rowwise_enabled() -> bool:
    return _ROWWISE.get()


def _each_row(product, x: torch.Tensor) -> torch.Tensor:
    """``product`` applied to each row x[i : i + 1] alone, concatenated: the very call a batch of one makes, so the
    bits cannot depend on how a library picks kernels by row count (with one bmm over the rows instead, the row-wise
    bit-identity tests of tests/test_batch.py failed on one machine's CPU)."""
    if x.shape[0] <= 1:
        return product(x)
    return torch.cat([product(x[i : i + 1]) for i in range(x.shape[0])])


def _product_kernels(w: Weight):  # -> module or None
    """The Triton product kernels for a weight on CUDA, unless DS4X_QUANT_KERNEL=torch asks for the reference."""
    if not w.is_cuda or os.environ.get("DS4X_QUANT_KERNEL", "auto").lower() == "torch":
        return None
    from ds4x.kernels import quant_matmul

    return quant_matmul


def _quant_kernels(w: GGMLTensor):  # -> module or None
    """The Triton module when it can serve this weight, else None (the torch reference)."""
    quant_matmul = _product_kernels(w)
    return quant_matmul if quant_matmul is not None and quant_matmul.supports(w) else None


def _dense_product(x: torch.Tensor, w: torch.Tensor, rowwise: bool):  # -> callable or None
    """The Triton product for a dense weight and a few rows, else None (torch): the matvec for one row or rows
    computed alone (it is row-wise by construction, so a batch-invariant step and a decode step get the same
    bits), the token tile for 2 .. DENSE_TOKEN_TILE_MAX_ROWS rows of 16-bit x (each weight read once for all rows), the
    matvec for up to DENSE_MATVEC_MAX_ROWS other rows."""
    quant_matmul = _product_kernels(w)
    if quant_matmul is None or not quant_matmul.dense_serves(x, w):
        return None
    rows = x.numel() // max(1, x.shape[-1])
    if not rowwise and quant_matmul.dense_token_tile_serves(x, w):
        return quant_matmul.dense_token_tile
    if rowwise or rows <= quant_matmul.DENSE_MATVEC_MAX_ROWS:
        return quant_matmul.dense_linear
    return None


def quant_kernel_name(w: Weight) -> str:
    """Which kernel serves products with ``w`` (for the startup log)."""
    if not isinstance(w, GGMLTensor):
        return "torch dense"
    if (qm := _quant_kernels(w)) is not None:
        act = ", int8 activations in the matvec" if qm.int8_activations(w.qtype) else ""
        return f"triton quant_matmul ({w.qtype.name}{', split rows' if w.layout == 'split' else ''}{act})"
    return f"torch dequantize+matmul ({w.qtype.name})"


def kernel_form(weight: Weight) -> Weight:
    """``weight`` stored the way its product kernels read it fastest (the same values; the CUDA kernels take
    Q8_0 rows split into codes and scales), else unchanged."""
    if isinstance(weight, GGMLTensor):
        qm = _quant_kernels(weight)
        if qm is not None:
            return qm.kernel_layout(weight)
    return weight


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T in x's dtype."""
    rowwise = _ROWWISE.get()
    if isinstance(weight, GGMLTensor):
        qm = _quant_kernels(weight)
        if qm is not None:
            return _each_row(lambda r: qm.quant_linear(r, weight), x) if rowwise else qm.quant_linear(x, weight)
        dense = weight.dequantize(x.dtype)
    elif (product := _dense_product(x, weight, rowwise)) is not None:
        return product(x, weight)
    else:
        dense = weight.to(x.dtype) if weight.dtype != x.dtype else weight
    return _each_row(lambda r: F.linear(r, dense), x) if rowwise else F.linear(x, dense)


def grouped_linear(x: torch.Tensor, weight: Weight, groups: int) -> torch.Tensor:
    """Block-diagonal product: x [T, G, in_g] with weight [G*out_g, in_g] -> [T, G, out_g]."""
    if isinstance(weight, GGMLTensor):
        qm = _quant_kernels(weight)
        if qm is not None:
            if _ROWWISE.get():
                return _each_row(lambda r: qm.quant_grouped_linear(r, weight, groups), x)
            return qm.quant_grouped_linear(x, weight, groups)
        w = weight.dequantize(x.dtype).view(groups, -1, weight.shape[-1])
    else:
        w = weight.view(groups, -1, weight.shape[-1]).to(x.dtype)
    if _ROWWISE.get():
        return _each_row(lambda r: torch.einsum("tgi,goi->tgo", r, w), x)
    return torch.einsum("tgi,goi->tgo", x, w)


def has_routed_kernel(weight: Weight) -> bool:
    """Whether ``routed_linear`` runs one fused kernel for these stacked experts (else a loop)."""
    return isinstance(weight, GGMLTensor) and _quant_kernels(weight) is not None


def routes_without_sync(weight: Weight) -> bool:
    """Whether ``routed_linear`` needs no host sync for these stacked experts (the quantized kernel, or dense
    weights on CUDA)."""
    return has_routed_kernel(weight) or (isinstance(weight, torch.Tensor) and weight.is_cuda)


def routed_linear(x: torch.Tensor, weight: Weight, ids: torch.Tensor) -> torch.Tensor:
    """Stacked experts weight [E, out, in], x [T, in], ids [T, k] -> y [T, k, out] with
    y[t, j] = x[t] @ weight[ids[t, j]].T: one launch and no host sync on the quantized kernels; dense CUDA
    weights are gathered per pair (no host sync either: a CUDA graph can hold it); else one product per
    (row, slot) pair (the reference)."""
    if has_routed_kernel(weight):
        return _quant_kernels(weight).quant_matmul_routed(x, weight, ids)
    if isinstance(weight, torch.Tensor) and weight.is_cuda and not _ROWWISE.get():
        return torch.einsum("ti,tkoi->tko", x, weight[ids].to(x.dtype))
    t, k = ids.shape
    rows = [linear(x[i : i + 1], weight[int(e)]) for i in range(t) for e in ids[i].tolist()]
    return torch.cat(rows).view(t, k, -1)


def routed_swiglu(x: torch.Tensor, w13: Weight, ids: torch.Tensor, limit: float,
                  prepared: Any = None) -> torch.Tensor | None:
    """SwiGLU of the routed gate and up products of stacked experts ``w13 [2E, out, in]`` (the E gate experts,
    then the E up experts) -> [T, k, out], in one launch where the quantized routed matvec serves it (decode
    steps; the same bits as `routed_linear` then SwiGLU); None elsewhere (the caller runs the two).
    ``prepared``: `routed_swiglu_input` of x (None: the launch prepares x itself)."""
    if has_routed_kernel(w13) and not _ROWWISE.get():
        return _quant_kernels(w13).quant_routed_swiglu(x, w13, ids, limit, xq=prepared)
    return None


def routed_swiglu_input(x: torch.Tensor, w13: Weight, k: int) -> Any:
    """x [T, in] prepared for `routed_swiglu` over k experts a row (int8 activations quantized once), or None
    where that launch prepares x itself; independent of the routing, so it can run beside the router."""
    if has_routed_kernel(w13) and not _ROWWISE.get():
        return _quant_kernels(w13).routed_swiglu_input(x, w13, k)
    return None


def embedding(weight: Weight, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``tokens`` of the embedding table, in ``dtype``."""
    if isinstance(weight, GGMLTensor):
        return weight.dequantize_rows(tokens, torch.float32).to(dtype)
    return weight[tokens].to(dtype)
