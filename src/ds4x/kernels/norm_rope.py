"""RMSNorm and rotary embedding as one Triton launch each, for CUDA.

The torch references (:mod:`ds4x.model.norms`, :mod:`ds4x.model.rope`) take six to twelve small kernels per
call; a decode step calls them about ten times per layer, so on the GPU they are launch count, not bytes.
Both kernels keep the reference's arithmetic in float32 with one rounding to the output dtype; only the order
of the sum of squares differs (a tree instead of torch's reduction), so values agree to float32 rounding, not
bit for bit. Every row is computed alone: results do not depend on the batch. The interpreter
(``TRITON_INTERPRET=1``) runs them on CPU tensors for the parity tests.
"""

from __future__ import annotations

from typing import Any

import torch

from ds4x.formats.pdl import launch_options
from ds4x.formats.triton_mode import HAVE_TRITON, interpret_mode, module_for_current_mode, tl, triton

_DEFINED_INTERPRETED = interpret_mode()

if HAVE_TRITON:
    from ds4x.formats.pdl import wait_upstream

    @triton.jit
    def _rms_norm_kernel(x, w, out, cos, sin, M, D: tl.constexpr, eps, BLOCK: tl.constexpr, HAS_W: tl.constexpr,
                         HALF: tl.constexpr, PDL: tl.constexpr = False):
        # HALF > 0: then RoPE on the trailing 2 * HALF dims of the row (token row // M) in interleaved pairs, from
        # the normalised values rounded to out's dtype, as the two separate kernels compute it
        wait_upstream(PDL, RELEASE=True)
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK)
        m = d < D
        v = tl.load(x + row * D + d, mask=m, other=0.0).to(tl.float32)
        y = v * (1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps))
        if HAS_W:
            y = tl.load(w + d, mask=m, other=0.0).to(tl.float32) * y
        y = y.to(out.dtype.element_ty)
        if HALF > 0:
            even, odd = tl.split(tl.reshape(y.to(tl.float32), (BLOCK // 2, 2)))
            i = tl.arange(0, BLOCK // 2) - (D // 2 - HALF)  # pair index within the rotated dims
            rot = (i >= 0) & (i < HALF)
            c = tl.load(cos + (row // M) * HALF + i, mask=rot, other=1.0)
            s = tl.load(sin + (row // M) * HALF + i, mask=rot, other=0.0)
            re = tl.where(rot, even * c - odd * s, even).to(out.dtype.element_ty)
            ro = tl.where(rot, odd * c + even * s, odd).to(out.dtype.element_ty)
            y = tl.reshape(tl.join(re, ro), (BLOCK,))
        tl.store(out + row * D + d, y, mask=m)

    @triton.jit
    def _rope_kernel(x, cos, sin, out, M, D: tl.constexpr, KEEP: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_KEEP: tl.constexpr, INVERSE: tl.constexpr, PDL: tl.constexpr = False):
        # row r of x [R, D] belongs to token r // M; dims [KEEP, D) rotate in interleaved pairs
        wait_upstream(PDL, RELEASE=True)
        row = tl.program_id(0).to(tl.int64)
        base = x + row * D
        dst = out + row * D
        if KEEP > 0:
            k = tl.arange(0, BLOCK_KEEP)
            tl.store(dst + k, tl.load(base + k, mask=k < KEEP).to(out.dtype.element_ty), mask=k < KEEP)
        i = tl.arange(0, HALF)
        c = tl.load(cos + (row // M) * HALF + i)
        s = tl.load(sin + (row // M) * HALF + i)
        if INVERSE:
            s = -s
        even = tl.load(base + KEEP + 2 * i).to(tl.float32)
        odd = tl.load(base + KEEP + 2 * i + 1).to(tl.float32)
        # explicit FMAs, so the attention merge's inverse RoPE (triton_attention.combine_kernel) has these bits
        tl.store(dst + KEEP + 2 * i, tl.fma(even, c, -(odd * s)).to(out.dtype.element_ty))
        tl.store(dst + KEEP + 2 * i + 1, tl.fma(odd, c, even * s).to(out.dtype.element_ty))


def _kernels() -> Any:
    return module_for_current_mode(__name__, __file__, _DEFINED_INTERPRETED)


def supported(x: torch.Tensor) -> bool:
    """Triton present and a CUDA tensor (or the interpreter)."""
    return HAVE_TRITON and (x.is_cuda or interpret_mode())


def rope_supported(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """The rope kernel's tiles need a power-of-two count of rotated pairs."""
    half = cos.shape[-1]
    return supported(x) and x.dim() >= 2 and half > 0 and half & (half - 1) == 0


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., D] -> x / rms(x) (* weight), computed in float32, returned in x's dtype. ``rope``: (cos, sin)
    [T, rope_dim/2] of x [T, ..., D]: then also `rope_fused` of the result, in the same launch, with the same
    bits as the two calls."""
    d = x.shape[-1]
    xc = x.contiguous()
    out = torch.empty_like(xc)
    rows = xc.numel() // d if d else 0
    if rows:
        w = weight.contiguous() if weight is not None else xc
        block = triton.next_power_of_2(d)
        cos, sin = (c.float().contiguous() for c in rope) if rope is not None else (xc, xc)
        half = rope[0].shape[-1] if rope is not None else 0
        _kernels()._rms_norm_kernel[(rows,)](xc, w, out, cos, sin, max(1, rows // x.shape[0]), d, eps, BLOCK=block,
                                             HAS_W=weight is not None, HALF=half,
                                             num_warps=min(16, max(1, block // 256)),
                                             **launch_options(x.device, "norm_rope"))
    return out


def norm_rope_supported(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rms_norm_fused` can apply RoPE too: a power-of-two pair count within an even row."""
    return rope_supported(x, cos) and x.shape[-1] % 2 == 0 and 2 * cos.shape[-1] <= x.shape[-1]


def rope_fused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """`ds4x.model.rope.apply_rope` in one launch: x [T, ..., D], cos/sin [T, rope_dim/2] float32; the result in
    ``dtype`` (x's by default: each value rounds once, so the bits of a cast after)."""
    t, d, half = x.shape[0], x.shape[-1], cos.shape[-1]
    xc = x.contiguous()
    out = torch.empty_like(xc, dtype=dtype or xc.dtype)
    rows = xc.numel() // d if d else 0
    if rows:
        keep = d - 2 * half
        _kernels()._rope_kernel[(rows,)](xc, cos.float().contiguous(), sin.float().contiguous(), out,
                                         rows // t, d, keep, half, BLOCK_KEEP=triton.next_power_of_2(max(keep, 1)),
                                         INVERSE=inverse, **launch_options(x.device, "norm_rope"))
    return out
