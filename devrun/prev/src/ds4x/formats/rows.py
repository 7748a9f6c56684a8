"""The packed persistent rows of the DS4X ABI (DESIGN.md 5): exact bytes.

KV row, 583 bytes (one attention row of 512 values: 448 non-RoPE + 64 RoPE):

====================  =====================================================
bytes 0 .. 447        E4M3FN code of value ``d`` (d = 0..447) divided by the
                      scale of its 64-value block ``d // 64``
bytes 448 .. 575      RoPE value ``448 + j`` (j = 0..63) as IEEE binary16,
                      little-endian, at bytes ``448 + 2j`` (low) / ``449 + 2j``
bytes 576 .. 582      UE8M0 scale byte (exponent + 127) of blocks 0..6
====================  =====================================================

Indexer row, 68 bytes (128 values, already Hadamard-rotated by the caller):

====================  =====================================================
bytes 0 .. 63         E2M1 codes: byte ``i`` holds element ``2i`` in its LOW
                      nibble and ``2i + 1`` in its HIGH nibble
bytes 64 .. 67        UE8M0 scale byte of the 32-value blocks 0..3
====================  =====================================================

Other model sizes use the same layout with their own widths (``kv_row_bytes``): a row of
``n`` non-RoPE values (a multiple of 64) and ``r`` RoPE values takes ``n + 2r + n/64`` bytes;
the Flash row above is the case n = 448, r = 64.

Packing is lossless relative to the native simulation: ``unpack_kv_rows(pack_kv_rows(x))``
equals ``cat(e4m3_block_roundtrip(x[..., :448]), x[..., 448:].half().float())`` and
``unpack_indexer_rows(pack_indexer_rows(x))`` equals ``mxfp4_roundtrip(x)``, bit for bit.

Input is converted to float32 first. Signs, including of zero, are kept: ``-0.0``
(and a negative value that rounds to zero) is stored as E4M3 ``0x80`` / E2M1 code
``8`` / FP16 ``0x8000`` and unpacks to ``-0.0``.

NaN/Inf are never stored: with ``validate=True`` (default) the pack functions raise
``ValueError`` for non-finite input, and ``pack_kv_rows`` also for RoPE values that
overflow FP16 (``|x| >= 65520``). ``validate=False`` skips the check (it needs a
device-to-host sync, which CUDA-graph capture forbids); the caller then guarantees
finite input. If that promise is broken, a non-RoPE block holding NaN/Inf gets scale
byte 0xFF (NaN) and unpacks to NaN rather than to a plausible number, and a non-finite
RoPE value is stored as that FP16 NaN/Inf.

Unpacking decodes faithfully: an E4M3 NaN code (0x7F/0xFF) or a scale byte 0xFF
gives NaN; no packer here ever writes those for finite input.
"""

from __future__ import annotations

import torch

from .e4m3 import e4m3_block_quantize, e4m3_decode, ue8m0_decode, ue8m0_encode
from .mxfp4 import e2m1_decode, mxfp4_quantize

KV_DIM = 512
KV_NOPE_DIM = 448
KV_ROPE_DIM = 64
KV_BLOCK = 64
KV_NUM_BLOCKS = KV_NOPE_DIM // KV_BLOCK  # 7
KV_ROPE_OFFSET = KV_NOPE_DIM  # 448
KV_SCALE_OFFSET = KV_ROPE_OFFSET + 2 * KV_ROPE_DIM  # 576
KV_ROW_BYTES = KV_SCALE_OFFSET + KV_NUM_BLOCKS  # 583

INDEXER_DIM = 128
INDEXER_BLOCK = 32
INDEXER_NUM_BLOCKS = INDEXER_DIM // INDEXER_BLOCK  # 4
INDEXER_SCALE_OFFSET = INDEXER_DIM // 2  # 64
INDEXER_ROW_BYTES = INDEXER_SCALE_OFFSET + INDEXER_NUM_BLOCKS  # 68

FP16_MAX = 65504.0

__all__ = [
    "KV_DIM",
    "KV_NOPE_DIM",
    "KV_ROPE_DIM",
    "KV_BLOCK",
    "KV_NUM_BLOCKS",
    "KV_ROPE_OFFSET",
    "KV_SCALE_OFFSET",
    "KV_ROW_BYTES",
    "INDEXER_DIM",
    "INDEXER_BLOCK",
    "INDEXER_NUM_BLOCKS",
    "INDEXER_SCALE_OFFSET",
    "INDEXER_ROW_BYTES",
    "kv_row_bytes",
    "check_kv_input",
    "check_indexer_input",
    "pack_kv_rows",
    "unpack_kv_rows",
    "pack_indexer_rows",
    "unpack_indexer_rows",
]


def kv_row_bytes(dim: int = KV_DIM, rope_dim: int = KV_ROPE_DIM) -> int:
    """Bytes of one packed KV row of ``dim`` values whose last ``rope_dim`` are RoPE dims."""
    nope = dim - rope_dim
    if nope <= 0 or nope % KV_BLOCK or rope_dim < 0:
        raise ValueError(f"a packed KV row needs a positive multiple of {KV_BLOCK} non-RoPE values; "
                         f"got dim {dim} with {rope_dim} RoPE dims")
    return nope + 2 * rope_dim + nope // KV_BLOCK


def _kv_dims(row_bytes: int, rope_dim: int) -> tuple[int, int]:
    """(dim, nope) of a packed KV row of ``row_bytes`` bytes."""
    nope, rem = divmod((row_bytes - 2 * rope_dim) * KV_BLOCK, KV_BLOCK + 1)
    if rem or nope <= 0 or nope % KV_BLOCK:
        raise ValueError(f"{row_bytes} bytes is not a packed KV row with {rope_dim} RoPE dims")
    return nope + rope_dim, nope


def _check_float_rows(x: torch.Tensor, width: int, fn: str, to_float32: bool = True) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{fn}: expected a floating-point tensor [..., {width}], got {got}")
    if x.dim() == 0 or x.shape[-1] != width:
        raise ValueError(f"{fn}: expected last dim {width}, got shape {tuple(x.shape)}")
    return x.to(torch.float32) if to_float32 else x


def _check_finite(x32: torch.Tensor, fn: str) -> None:
    bad = ~torch.isfinite(x32)
    if bool(bad.any()):
        n = int(bad.sum())
        raise ValueError(f"{fn}: input has {n} NaN/Inf value(s); non-finite values are never stored")


def check_kv_input(x: torch.Tensor, fn: str = "pack_kv_rows", dim: int = KV_DIM,
                   rope_dim: int = KV_ROPE_DIM) -> torch.Tensor:
    """Validate KV rows (shape, dtype, finite, RoPE within FP16); return them as float32."""
    x32 = _check_float_rows(x, dim, fn)
    _check_finite(x32, fn)
    rope = x32[..., dim - rope_dim :]
    over = torch.isinf(rope.to(torch.float16))
    if bool(over.any()):
        raise ValueError(
            f"{fn}: {int(over.sum())} RoPE value(s) (dims {dim - rope_dim}..{dim - 1}) overflow FP16 "
            f"(|x| >= 65520); they would be stored as Inf"
        )
    return x32


def check_indexer_input(x: torch.Tensor, fn: str = "pack_indexer_rows") -> torch.Tensor:
    """Validate indexer rows (shape, dtype, finite); return them as float32."""
    x32 = _check_float_rows(x, INDEXER_DIM, fn)
    _check_finite(x32, fn)
    return x32


def _check_byte_rows(rows: torch.Tensor, width: int, fn: str) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8:
        got = rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"{fn}: expected a uint8 tensor [..., {width}], got {got}")
    if rows.dim() == 0 or rows.shape[-1] != width:
        raise ValueError(f"{fn}: expected last dim {width}, got shape {tuple(rows.shape)}")


def pack_kv_rows(x: torch.Tensor, *, validate: bool = True, rope_dim: int = KV_ROPE_DIM) -> torch.Tensor:
    """``x [..., 512]`` float -> ``uint8 [..., 583]`` KV rows (layout in the module doc).

    Other widths: the last ``rope_dim`` values are the RoPE dims (see ``kv_row_bytes``).
    """
    dim = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else KV_DIM
    kv_row_bytes(dim, rope_dim)  # validates the split
    nope = dim - rope_dim
    if validate:
        x32 = check_kv_input(x, "pack_kv_rows", dim, rope_dim)
    else:
        x32 = _check_float_rows(x, dim, "pack_kv_rows")
    codes, e = e4m3_block_quantize(x32[..., :nope], KV_BLOCK)
    # FP16 bits split into bytes by arithmetic, so the layout is little-endian on any host.
    h = x32[..., nope:].to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    rope = torch.stack((h & 0xFF, h >> 8), dim=-1).flatten(-2).to(torch.uint8)
    return torch.cat((codes, rope, ue8m0_encode(e)), dim=-1)


def unpack_kv_rows(rows: torch.Tensor, *, rope_dim: int = KV_ROPE_DIM) -> torch.Tensor:
    """``uint8 [..., 583]`` KV rows -> float32 ``[..., 512]`` (other widths: see ``kv_row_bytes``)."""
    width = rows.shape[-1] if isinstance(rows, torch.Tensor) and rows.dim() else KV_ROW_BYTES
    _, n = _kv_dims(width, rope_dim)
    _check_byte_rows(rows, width, "unpack_kv_rows")
    scale_at = n + 2 * rope_dim
    vals = e4m3_decode(rows[..., :n]).unflatten(-1, (n // KV_BLOCK, KV_BLOCK))
    scale = ue8m0_decode(rows[..., scale_at:width])
    nope = (vals * scale.unsqueeze(-1)).flatten(-2)
    rb = rows[..., n:scale_at].to(torch.int32)
    h = rb[..., 0::2] | (rb[..., 1::2] << 8)
    h = torch.where(h >= 0x8000, h - 0x10000, h).to(torch.int16)  # two's complement, no overflow cast
    rope = h.view(torch.float16).to(torch.float32)
    return torch.cat((nope, rope), dim=-1)


def pack_indexer_rows(x: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
    """``x [..., 128]`` float -> ``uint8 [..., 68]`` indexer rows (layout in the module doc)."""
    if validate:
        x32 = check_indexer_input(x, "pack_indexer_rows")
    else:
        x32 = _check_float_rows(x, INDEXER_DIM, "pack_indexer_rows")
    codes, e = mxfp4_quantize(x32, INDEXER_BLOCK)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.cat((packed, ue8m0_encode(e)), dim=-1)


def unpack_indexer_rows(rows: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., 68]`` indexer rows -> float32 ``[..., 128]``."""
    _check_byte_rows(rows, INDEXER_ROW_BYTES, "unpack_indexer_rows")
    packed = rows[..., :INDEXER_SCALE_OFFSET]
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    vals = e2m1_decode(codes).unflatten(-1, (INDEXER_NUM_BLOCKS, INDEXER_BLOCK))
    scale = ue8m0_decode(rows[..., INDEXER_SCALE_OFFSET:INDEXER_ROW_BYTES])
    return (vals * scale.unsqueeze(-1)).flatten(-2)
