"""The compressor's emit step in one Triton launch: window pooling, RMSNorm and RoPE of compressed rows.

The torch reference (:func:`ds4x.model.attention._emit_windows`, then RMSNorm, the RoPE tables and RoPE) takes
about forty small kernels per call, and a decode step re-emits the open window of every CSA/HCA compressor
(62 calls for Flash), so on the GPU it is launch count. Here a program per window and block of channels walks
the window's slots in tiles with an online softmax per channel; the window's last program to finish normalises
the pooled row and rotates its RoPE dims at the window's first position. Values agree with the reference to
float32 rounding (the softmax is accumulated online and ``cos``/``sin`` come from Triton's math library), not bit
for bit; the interpreter (``TRITON_INTERPRET=1``) runs it on CPU tensors for the parity test.
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
    def _emit_kernel(proj, cap, ring_stride, windows, last, last_stride, ape, norm, inv_freq, out, parts, arrived,
                     magnitude, eps,
                     RATIO: tl.constexpr, OVERLAP: tl.constexpr, WIDTH: tl.constexpr, ROPE_HALF: tl.constexpr,
                     BLOCK_C: tl.constexpr, NCB: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr,
                     PDL: tl.constexpr = False):
        # program (window i, channel block cb): pools BLOCK_C channels over the window's slots and stores them with
        # their sum of squares; the window's last program to arrive (a counter in ``arrived``, zero on entry)
        # normalises the whole row and rotates its RoPE dims, and leaves the counter at zero. Splitting the
        # channels spreads one window's reads over NCB SMs (a decode step emits one window per compressor).
        # proj: the ring [cap, 2 * KV] of [kv | gate] projections by position, KV = WIDTH * (2 if OVERLAP else 1);
        # with ring_stride (a batch of rings, one window each) window i reads ring i and its own last position.
        # With OVERLAP a window pools 2 * RATIO slots: the previous window's positions through channels
        # [0, WIDTH) of kv and gate ("a" lane), then its own through [WIDTH, 2 * WIDTH) ("b" lane).
        KV: tl.constexpr = WIDTH * (2 if OVERLAP else 1)
        NSLOT: tl.constexpr = RATIO * (2 if OVERLAP else 1)
        wait_upstream(PDL, RELEASE=True)
        i = tl.program_id(0)
        cb = tl.program_id(1)
        # positions in int32 (< 2^31): the ring slot's modulo on int64 compiled to a called routine per slot (32 a
        # thread at ratio 128)
        w = tl.load(windows + i).to(tl.int32)
        last_pos = tl.load(last + i * last_stride).to(tl.int32)
        proj += i.to(tl.int64) * ring_stride
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < WIDTH
        m = tl.full([BLOCK_C], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_C], tl.float32)
        acc = tl.zeros([BLOCK_C], tl.float32)
        for s0 in range(0, NSLOT, BLOCK_S):
            j = s0 + tl.arange(0, BLOCK_S)
            if OVERLAP:
                lane = j // RATIO
                pos = (w - 1 + lane) * RATIO + j % RATIO
            else:
                lane = j * 0
                pos = w * RATIO + j
            live = (j < NSLOT) & (pos >= 0) & (pos <= last_pos)
            slot = tl.where(live, pos % cap, 0).to(tl.int64)
            ch = lane[:, None] * WIDTH + c[None, :]
            lm = live[:, None] & cm[None, :]
            k = tl.load(proj + slot[:, None] * (2 * KV) + ch, mask=lm, other=0.0)
            g = tl.load(proj + slot[:, None] * (2 * KV) + KV + ch, mask=lm, other=0.0)
            g += tl.load(ape + (j % RATIO)[:, None] * KV + ch, mask=lm, other=0.0).to(tl.float32)
            g = tl.where(lm, g, float("-inf"))
            m_new = tl.maximum(m, tl.max(g, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(g - m_safe[None, :])
            acc = acc * alpha + tl.sum(k * p, axis=0)
            den = den * alpha + tl.sum(p, axis=0)
            m = m_new
        pooled = tl.where(cm, acc / tl.where(den > 0, den, 1.0), 0.0)
        row = out + i.to(tl.int64) * WIDTH
        tl.store(row + c, pooled, mask=cm)
        tl.store(parts + i * NCB + cb, tl.sum(pooled * pooled, axis=0))
        # what the last program needs besides the other programs' sums and rows, loaded and computed before the
        # arrival (off its path): the norm weights and the RoPE angles at the window's first position
        NOPE: tl.constexpr = WIDTH - 2 * ROPE_HALF
        cw = tl.arange(0, BLOCK_W)
        wm = cw < NOPE
        nw = tl.load(norm + cw, mask=wm, other=0.0).to(tl.float32)
        h = tl.arange(0, ROPE_HALF)
        nw_even = tl.load(norm + NOPE + 2 * h).to(tl.float32)
        nw_odd = tl.load(norm + NOPE + 2 * h + 1).to(tl.float32)
        freq = (w * RATIO).to(tl.float32) * tl.load(inv_freq + h)
        cos = tl.cos(freq) * magnitude
        sin = tl.sin(freq) * magnitude
        # acq_rel: this program's stores are visible to the one that sees the count complete, and that one sees
        # all of theirs
        if tl.atomic_add(arrived + i, 1, sem="acq_rel") == NCB - 1:
            tl.atomic_xchg(arrived + i, 0)  # zero again for the next call (the counters are kept, not re-filled)
            total = tl.sum(tl.load(parts + i * NCB + tl.arange(0, NCB), cache_modifier=".cg"), axis=0)
            inv = 1.0 / tl.sqrt(total / WIDTH + eps)
            y = tl.load(row + cw, mask=wm, other=0.0, cache_modifier=".cg") * inv
            # the RoPE dims (the trailing 2 * ROPE_HALF, interleaved pairs) normalised and rotated in registers
            base = row + NOPE
            even = nw_even * (tl.load(base + 2 * h, cache_modifier=".cg") * inv)
            odd = nw_odd * (tl.load(base + 2 * h + 1, cache_modifier=".cg") * inv)
            tl.store(row + cw, nw * y, mask=wm)
            tl.store(base + 2 * h, even * cos - odd * sin)
            tl.store(base + 2 * h + 1, odd * cos + even * sin)


# channels per program: a decode step emits one window per compressor, and one program per window read its
# whole [slots, 2 x width] tile through a single SM. H200, flash:q2 at 4K, step replayed (the HCA emit, 128 slots,
# is on its layer's path): 32 channels 6.57 / 6.58 ms, 16 channels 6.58 / 6.58, 64 channels 6.65 / 6.66, 128
# channels 6.73 / 6.76
EMIT_CHANNELS = 32


def _kernels() -> Any:
    return module_for_current_mode(__name__, __file__, _DEFINED_INTERPRETED)


_COUNTERS: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters [n] for the emit kernel, kept between calls (each call leaves them at zero), so a step
    needs no fill launch per compressor; one set per stream, so emits on parallel branches of a captured step
    (`ds4x.kernels.branches`) do not share them."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, n, stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def supported(proj: torch.Tensor, rope_half: int) -> bool:
    """Triton present, a CUDA ring (or the interpreter), and a power-of-two count of rotated pairs."""
    return (HAVE_TRITON and (proj.is_cuda or interpret_mode()) and rope_half > 0
            and rope_half & (rope_half - 1) == 0)


def emit_windows_fused(proj: torch.Tensor, windows: torch.Tensor, last: torch.Tensor, ape: torch.Tensor,
                       norm: torch.Tensor, inv_freq: torch.Tensor, magnitude: float, ratio: int, overlap: bool,
                       width: int, eps: float) -> torch.Tensor:
    """Compressed rows [n, width] float32 (pooled, normalised, RoPE at each window's first token) of ``windows``
    [n] from the projection ring ``proj`` [capacity, 2 * kv] float32, using positions up to ``last`` (a device
    scalar: positions after it, in a window still open, take no part). A batch of rings ``proj`` [n, capacity,
    2 * kv] with ``last`` [n] (a batched decode step): window i from ring i, up to position last[i]."""
    n = windows.shape[0]
    batched = proj.dim() == 3
    if batched and (proj.shape[0] != n or last.numel() != n):
        raise ValueError(f"emit_windows_fused: a batch of {proj.shape[0]} rings takes one window and one last "
                         f"position per ring, got {n} and {last.numel()}")
    out = torch.empty(n, width, dtype=torch.float32, device=proj.device)
    if n:
        nslot = ratio * (2 if overlap else 1)
        block_w = triton.next_power_of_2(width)
        block_c = min(block_w, EMIT_CHANNELS)
        ncb = block_w // block_c
        block_s = max(1, min(triton.next_power_of_2(nslot), 4096 // block_c))
        parts = torch.empty(n, ncb, dtype=torch.float32, device=proj.device)
        arrived = _arrival_counters(proj.device, n)
        _kernels()._emit_kernel[(n, ncb)](
            proj, proj.shape[-2], proj.stride(0) if batched else 0, windows.contiguous(), last.reshape(-1).contiguous(),
            1 if batched else 0, ape.contiguous(), norm.contiguous(),
            inv_freq.float().contiguous(), out, parts, arrived, float(magnitude), float(eps), RATIO=ratio,
            OVERLAP=overlap, WIDTH=width, ROPE_HALF=inv_freq.shape[0], BLOCK_C=block_c, NCB=ncb, BLOCK_S=block_s,
            BLOCK_W=block_w, num_warps=4, **launch_options(proj.device, "compressor"))
    return out
