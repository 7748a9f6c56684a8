"""Bit-exact storage formats: E4M3 + UE8M0, MXFP4 (E2M1 + UE8M0), Hadamard-128,
and the packed 583-byte KV row / 68-byte indexer row of the DS4X ABI.

The Triton kernels (``pack_kv_rows_triton`` ...) are exported lazily: importing this
package never imports triton.
"""

from __future__ import annotations

from typing import Any

from .e4m3 import (
    E4M3_AMAX_FLOOR,
    E4M3_MAX,
    ceil_log2_f32,
    dequantize_fp8_block_weight,
    e4m3_block_dequantize,
    e4m3_block_quantize,
    e4m3_block_roundtrip,
    e4m3_block_scale_exponents,
    e4m3_decode,
    pow2_f32,
    ue8m0_decode,
    ue8m0_encode,
)
from .hadamard import HADAMARD_DIM, hadamard128
from .mxfp4 import (
    E2M1_MAX,
    E2M1_VALUES,
    MXFP4_AMAX_FLOOR,
    dequantize_fp4_expert_weight,
    e2m1_decode,
    e2m1_encode,
    mxfp4_block_scale_exponents,
    mxfp4_dequantize,
    mxfp4_quantize,
    mxfp4_roundtrip,
)
from .rows import (
    INDEXER_BLOCK,
    INDEXER_DIM,
    INDEXER_ROW_BYTES,
    KV_BLOCK,
    KV_DIM,
    KV_NOPE_DIM,
    KV_ROPE_DIM,
    KV_ROW_BYTES,
    kv_row_bytes,
    pack_indexer_rows,
    pack_kv_rows,
    unpack_indexer_rows,
    unpack_kv_rows,
)

_TRITON_NAMES = (
    "pack_kv_rows_triton",
    "unpack_kv_rows_triton",
    "pack_indexer_rows_triton",
    "unpack_indexer_rows_triton",
    "hadamard128_triton",
)

__all__ = [
    "E4M3_MAX",
    "E4M3_AMAX_FLOOR",
    "E2M1_MAX",
    "E2M1_VALUES",
    "MXFP4_AMAX_FLOOR",
    "HADAMARD_DIM",
    "KV_DIM",
    "KV_NOPE_DIM",
    "KV_ROPE_DIM",
    "KV_BLOCK",
    "KV_ROW_BYTES",
    "INDEXER_DIM",
    "INDEXER_BLOCK",
    "INDEXER_ROW_BYTES",
    "ceil_log2_f32",
    "pow2_f32",
    "ue8m0_encode",
    "ue8m0_decode",
    "e4m3_decode",
    "e4m3_block_scale_exponents",
    "e4m3_block_quantize",
    "e4m3_block_dequantize",
    "e4m3_block_roundtrip",
    "dequantize_fp8_block_weight",
    "e2m1_decode",
    "e2m1_encode",
    "mxfp4_block_scale_exponents",
    "mxfp4_quantize",
    "mxfp4_dequantize",
    "mxfp4_roundtrip",
    "dequantize_fp4_expert_weight",
    "hadamard128",
    "kv_row_bytes",
    "pack_kv_rows",
    "unpack_kv_rows",
    "pack_indexer_rows",
    "unpack_indexer_rows",
    *_TRITON_NAMES,
]


def __getattr__(name: str) -> Any:
    # rows_triton itself imports triton only when a kernel is first used; this keeps
    # even that module out of `import ds4x.formats`.
    if name in _TRITON_NAMES:
        from . import rows_triton

        return getattr(rows_triton, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
