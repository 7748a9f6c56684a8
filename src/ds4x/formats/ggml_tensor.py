"""GGMLTensor: a weight that stays in its GGML block format in memory.

A GGUF weight is held as the raw bytes of its blocks (exactly as in the file, so a memory-mapped
file is not copied) plus its GGML type and its logical torch shape: ``[out, in]`` for a matrix,
``[E, out, in]`` for stacked routed experts. The raw bytes are a ``uint8`` tensor of shape
``[*shape[:-1], row_bytes]``: every row of ``in`` weights is a whole number of blocks, so indexing
the leading dimensions is a plain view of the bytes and ``w[e]`` (one expert) copies nothing.

Q8_0 and IQ2_XXS rows have a second byte layout, ``"split"``: the same bytes of each row re-laid as the
codes of its nb blocks (32 bytes each for Q8_0, 64 for IQ2_XXS) followed by its nb fp16 scales (a row is still
``row_bytes`` long, so views and row strides are unchanged). The CUDA matvec reads it with 8-byte loads, where
the 34- and 66-byte blocks of the file only allow 2-byte ones; everything that needs the file's bytes (decoding
on the CPU, writing a GGUF, fingerprints) goes through :meth:`GGMLTensor.blocks`.

The model never reads a GGMLTensor's storage itself: ``ds4x.kernels.linear`` multiplies by it (on
the CPU by dequantizing with the bit-exact decoders of :mod:`ds4x.formats.ggml`, on CUDA with the
kernels of :mod:`ds4x.kernels.quant_matmul`).
"""

from __future__ import annotations

import math

import torch

from ds4x.formats.ggml import QUANT_SIZES, GGMLQuantizationType, dequantize, quantized_nbytes

__all__ = ["LAYOUTS", "GGMLTensor"]

LAYOUTS = ("blocks", "split")
# types with a split layout: block bytes; each block is a 2-byte fp16 scale, then its codes
SPLIT_BLOCK_BYTES = {GGMLQuantizationType.Q8_0: 34, GGMLQuantizationType.IQ2_XXS: 66}


class GGMLTensor:
    """Raw GGML blocks + type + logical shape; see the module docstring."""

    __slots__ = ("raw", "qtype", "_shape", "layout", "dense_mirror")

    def __init__(self, raw: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, ...],
                 layout: str = "blocks"):
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
        if layout not in LAYOUTS:
            raise ValueError(f"unknown GGMLTensor layout {layout!r} (have {', '.join(LAYOUTS)})")
        if layout == "split" and qt not in SPLIT_BLOCK_BYTES:
            raise ValueError(f"the split layout is for Q8_0 and IQ2_XXS rows, not {qt.name}")
        self.qtype = qt
        self._shape = torch.Size(shape)
        self.layout = layout
        # the same values decoded to a dense tensor, kept by kernels that chose to (batched products on CUDA)
        self.dense_mirror: torch.Tensor | None = None

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
        return GGMLTensor(self.raw.to(device, non_blocking=non_blocking), self.qtype, tuple(self._shape), self.layout)

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
        return GGMLTensor(raw, self.qtype, rest, self.layout)

    def __len__(self) -> int:
        return self._shape[0]

    def __repr__(self) -> str:
        split = ", layout=split" if self.layout == "split" else ""
        return f"GGMLTensor({self.qtype.name}, shape={list(self._shape)}, device={self.device}{split})"

    # ---- layouts ------------------------------------------------------------------------------
    def split(self) -> GGMLTensor:
        """The same Q8_0 / IQ2_XXS weights with every row re-laid as its codes, then its scales (self if already
        so)."""
        if self.layout == "split":
            return self
        if self.qtype not in SPLIT_BLOCK_BYTES:
            raise ValueError(f"the split layout is for Q8_0 and IQ2_XXS rows, not {self.qtype.name}")
        blocks = self.raw.view(*self.raw.shape[:-1], -1, SPLIT_BLOCK_BYTES[self.qtype])
        raw = torch.cat((blocks[..., 2:].flatten(-2), blocks[..., :2].flatten(-2)), dim=-1)
        return GGMLTensor(raw, self.qtype, tuple(self._shape), "split")

    def blocks(self) -> GGMLTensor:
        """The same weights with the file's block layout (self if already so)."""
        if self.layout == "blocks":
            return self
        return GGMLTensor(_rows_as_blocks(self.raw, SPLIT_BLOCK_BYTES[self.qtype]), self.qtype, tuple(self._shape))

    # ---- decoding -----------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense tensor of the logical shape (float32 decode, bit-exact to gguf; then cast)."""
        out = dequantize(self.blocks().raw, self.qtype, tuple(self._shape))
        return out if out.dtype == dtype else out.to(dtype)

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``rows`` (any shape of indices into the first dim of a 2-D tensor), dequantized:
        ``[*rows.shape, in]``. Only the selected rows are decoded (embedding lookups)."""
        if len(self._shape) != 2:
            raise ValueError(f"dequantize_rows needs a 2-D tensor, this one is {list(self._shape)}")
        idx = rows.reshape(-1).to(device=self.raw.device, dtype=torch.long)
        picked = self.raw.index_select(0, idx)
        if self.layout == "split":
            picked = _rows_as_blocks(picked, SPLIT_BLOCK_BYTES[self.qtype])
        out = dequantize(picked, self.qtype, (idx.numel(), self._shape[1]))
        out = out if out.dtype == dtype else out.to(dtype)
        return out.reshape(*rows.shape, self._shape[1])


def _rows_as_blocks(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """Split-layout rows ``[..., row_bytes]`` back in the file's blocks of ``block_bytes``."""
    nb = raw.shape[-1] // block_bytes
    codes = raw[..., : (block_bytes - 2) * nb].unflatten(-1, (nb, block_bytes - 2))
    scales = raw[..., (block_bytes - 2) * nb :].unflatten(-1, (nb, 2))
    return torch.cat((scales, codes), dim=-1).flatten(-2)
