"""GGMLTensor: a weight that stays in its GGML block format in memory.

A GGUF weight is held as the raw bytes of its blocks (exactly as in the file, so a memory-mapped
file is not copied) plus its GGML type and its logical torch shape: ``[out, in]`` for a matrix,
``[E, out, in]`` for stacked routed experts. The raw bytes are a ``uint8`` tensor of shape
``[*shape[:-1], row_bytes]``: every row of ``in`` weights is a whole number of blocks, so indexing
the leading dimensions is a plain view of the bytes and ``w[e]`` (one expert) copies nothing.

The model never reads a GGMLTensor's storage itself: ``ds4x.kernels.linear`` multiplies by it (on
the CPU by dequantizing with the bit-exact decoders of :mod:`ds4x.formats.ggml`, on CUDA with the
kernels of :mod:`ds4x.kernels.quant_matmul`).
"""

from __future__ import annotations

import math

import torch

from ds4x.formats.ggml import QUANT_SIZES, GGMLQuantizationType, dequantize, quantized_nbytes

__all__ = ["GGMLTensor"]


class GGMLTensor:
    """Raw GGML blocks + type + logical shape; see the module docstring."""

    __slots__ = ("raw", "qtype", "_shape")

    def __init__(self, raw: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, ...]):
        try:
            qt = GGMLQuantizationType(int(qtype))
        except ValueError:
            raise ValueError(f"unknown GGML type {qtype!r}") from None
        if qt not in QUANT_SIZES:
            raise ValueError(f"GGML type {qt.name} is not supported")
        shape = tuple(int(s) for s in shape)
        if not shape:
            raise ValueError("GGMLTensor needs at least one dimension")
        if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
            raise TypeError(f"GGMLTensor raw data must be a uint8 tensor, got {getattr(raw, 'dtype', type(raw))}")
        row_bytes = quantized_nbytes(qt, shape[-1:])  # also checks the block alignment of a row
        want = (*shape[:-1], row_bytes)
        if raw.numel() != math.prod(want):
            raise ValueError(
                f"{qt.name} tensor of shape {list(shape)} needs {math.prod(want)} bytes, got {raw.numel()}"
            )
        # rows of whole blocks, contiguous, so leading-dim indexing is a view and kernels can take
        # a row stride
        self.raw = raw.reshape(want) if tuple(raw.shape) != want else raw
        if not self.raw.is_contiguous():
            self.raw = self.raw.contiguous()
        self.qtype = qt
        self._shape = torch.Size(shape)

    # ---- tensor-like surface ------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self._shape

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self._shape if dim is None else self._shape[dim]

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def dim(self) -> int:
        return len(self._shape)

    def numel(self) -> int:
        return math.prod(self._shape)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        """Bytes held (the quantized size)."""
        return self.raw.numel()

    @property
    def row_bytes(self) -> int:
        return self.raw.shape[-1]

    @property
    def is_cuda(self) -> bool:
        return self.raw.is_cuda

    def to(self, device: torch.device | str | None = None, *, non_blocking: bool = False) -> GGMLTensor:
        """The same blocks on ``device`` (self if already there). Quantized weights have no dtype to
        convert to: dequantize for that."""
        if isinstance(device, torch.dtype):
            raise TypeError(f"a {self.qtype.name} GGMLTensor has no dtype to convert to {device}; use dequantize()")
        if device is None or torch.device(device) == self.raw.device:
            return self
        return GGMLTensor(self.raw.to(device, non_blocking=non_blocking), self.qtype, tuple(self._shape))

    def __getitem__(self, index: int | slice) -> GGMLTensor:
        """Index the first dimension (an expert of ``[E, out, in]``, or a row range): a view."""
        if len(self._shape) < 2:
            raise IndexError("a 1-D GGMLTensor cannot be indexed (its last dimension is packed)")
        if isinstance(index, bool) or not isinstance(index, int | slice):
            raise TypeError(f"GGMLTensor indices must be int or slice, got {type(index).__name__}")
        if isinstance(index, slice) and index.step not in (None, 1):
            raise IndexError("GGMLTensor slices must have step 1")
        raw = self.raw[index]
        rest = tuple(self._shape[1:]) if isinstance(index, int) else (raw.shape[0], *self._shape[1:])
        return GGMLTensor(raw, self.qtype, rest)

    def __len__(self) -> int:
        return self._shape[0]

    def __repr__(self) -> str:
        return f"GGMLTensor({self.qtype.name}, shape={list(self._shape)}, device={self.device})"

    # ---- decoding -----------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense tensor of the logical shape (float32 decode, bit-exact to gguf; then cast)."""
        out = dequantize(self.raw, self.qtype, tuple(self._shape))
        return out if out.dtype == dtype else out.to(dtype)

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``rows`` (any shape of indices into the first dim of a 2-D tensor), dequantized:
        ``[*rows.shape, in]``. Only the selected rows are decoded (embedding lookups)."""
        if len(self._shape) != 2:
            raise ValueError(f"dequantize_rows needs a 2-D tensor, this one is {list(self._shape)}")
        idx = rows.reshape(-1).to(device=self.raw.device, dtype=torch.long)
        picked = self.raw.index_select(0, idx)
        out = dequantize(picked, self.qtype, (idx.numel(), self._shape[1]))
        out = out if out.dtype == dtype else out.to(dtype)
        return out.reshape(*rows.shape, self._shape[1])
