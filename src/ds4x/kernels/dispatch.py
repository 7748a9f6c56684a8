"""Which implementation runs each hot op, decided once per device (and said in the startup log).

``DS4X_KERNELS=reference`` forces the torch reference everywhere (for A/B runs and debugging).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    if os.environ.get("DS4X_KERNELS", "") == "reference":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(device: torch.device) -> bool:
    return device.type == "cuda" and triton_available()


def describe(device: torch.device, cache_mode: str) -> str:
    """One line naming the kernel of each hot op on ``device`` for a cache in ``cache_mode``."""
    fast = use_triton(device) and cache_mode in ("native", "packed")
    decode = "torch reference"
    if fast:
        from ds4x.kernels import routed_wgmma

        decode = "triton, rows read in place (flash-decoding attention; indexer on fp16 tensor cores)"
        if routed_wgmma.hopper(device):
            decode += ("; on this Hopper GPU gluon wgmma kernels instead (attention: all heads per program for up to "
                       "64 heads of 512-value rows; indexer: up to 64 heads)")
    prefill = "torch reference"
    if fast and cache_mode == "packed":
        from ds4x.kernels import attention, routed_wgmma

        prefill = ("gluon wgmma, the decode kernel over the chunk in one pass (all heads and rows of a query per "
                   "program; torch in reference mode)" if attention.PREFILL_WGMMA and routed_wgmma.hopper(device)
                   else "triton (TF32; torch in reference mode)")
    routed = routed_decode = "torch reference"
    if use_triton(device):
        from ds4x.formats.ggml import GGMLQuantizationType
        from ds4x.kernels import quant_matmul, routed_wgmma

        routed_decode = "triton matvec from the quantized blocks, gate / up and SwiGLU in one launch"
        if quant_matmul.PREPARED_ACTIVATIONS and quant_matmul.int8_activations(GGMLQuantizationType.IQ2_XXS):
            routed_decode += " (IQ2_XXS on int8 activations quantized once per token, beside the router)"

        routed = ("IQ2_XXS / Q2_K: tensor-core decode-once kernel (gluon wgmma) from a few pairs per expert; others: "
                  "bf16 decode + torch._grouped_mm" if routed_wgmma.hopper(device)
                  else "bf16 decode + torch._grouped_mm")
    return (f"decode attention + indexer scoring: {decode}; top-k: {'triton radix select' if fast else 'torch'}"
            f"; mHC pre/post, RMSNorm, RoPE, compressor emit (pool + norm + RoPE), MoE routing and SwiGLU, "
            f"row packing and Hadamard: {'triton fused' if use_triton(device) else 'torch reference'}"
            f"; prefill attention: {prefill}"
            f"; routed experts at decode: {routed_decode}"
            f"; routed experts at prefill: {routed}")
