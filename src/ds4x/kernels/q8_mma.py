"""Q8_0 products of a few activation rows on the int8 tensor cores of Hopper (Gluon ``mma.sync``). UNMEASURED.

``y[t, n] = sum_k x[t, k] * W[n, k]`` for a handful of tokens (a batched decode step: 2-32 sessions' rows against
one dense Q8_0 weight) with ``W`` a 2-D Q8_0 :class:`~ds4x.formats.ggml_tensor.GGMLTensor` in the ``split`` row
layout (a row's K code bytes, then its K / 32 fp16 block scales). The dp4a token tile of
:mod:`ds4x.kernels.quant_matmul` is instruction-bound (~2.1 TB/s on an H200); here one ``mma.sync`` m16n8k32
(s8 x s8 -> s32) per Q8_0 block gives 16 rows x 8 tokens of exact block dot products, so the integer work leaves
the ALUs and the weight should stream once at close to copy bandwidth. Written and compiled for sm_90 only: no
part of it has run on a GPU yet (``scripts/q8_mma_probe.py`` measures it, ``tests/test_q8_mma.py`` checks it).

Math (``q8_mma_reference`` spells it out in torch): x is quantized per 32 values (one Q8_0 block) by
``quantize_activations_32``: ``amax`` of the block, ``inv = 127 / amax`` (0 for an all-zero block), codes
``round_half_even(x * inv)`` (float32 product; |code| <= 127 since amax * inv rounds to 127), scale
``amax / 127``. Per (token t, row n) and block b in order: ``dot = sum_j w_code * x_code`` (exact int32),
``acc += (d_w[n, b] * s_x[t, b]) * float(dot)`` in float32 (products and sums rounded separately: the kernel is
compiled without FMA contraction so that it gives the reference's bits). With split-K (see below) each of the
``split`` contiguous K slices is summed that way and the slices' sums are added in slice order. A token's result
depends only on its own row, the weight and ``split`` (chosen from the weight's shape), never on the other tokens.

Kernel (``_q8_mma_kernel``): a program owns ``BN = 16 * num_warps`` weight rows (a warp's 16 rows are the MMA's
M; weights are the A operand), ``BT`` in {8, 16, 32} tokens (the MMA's N, 1-4 n8 tiles; tokens past T repeat
the last one and are not stored) and one K slice, walked in stages of ``KB`` blocks (``STEP = 32 * KB`` bytes of
each row). A stage's weight codes (16-byte ``cp.async``, each warp copying its own rows), their fp16 scales (one
8-byte copy a row), the tokens' codes and scales land in shared memory ``STAGES - 1`` stages ahead; rows of codes
are swizzled in 16-byte chunks (row r's chunk c at c ^ (r % 8)) so that ``ldmatrix`` and the copies are free of
bank conflicts. One CTA barrier per stage orders "stage landed" and "slot free for reuse".

Offline sm_90 build (``scripts/kernel_sass.py q8_mma``, Triton 3.6, 4 warps, 3 stages) per stage of 4 blocks and
warp: BT = 16: 8 ``IMMA.16832.S8.S8`` (the .SAT form Triton emits; block dots cannot overflow), 8 ``LDSM``, 7
``LDGSTS``, 32 I2FP + 64 FMUL + 32 FADD, 280 instructions, 74 registers, 33 KB shared; BT = 32: 16 IMMA, 424
instructions, 96 registers (128 with split-K), 40 KB; no spills. The loop has two CTA barriers: the one above, and
one the compiler's barrier analysis adds between a stage's copies and the reads of another slot of the same buffer
(it cannot tell slots apart); per-slot allocations with the loop unrolled by STAGES would drop it.

Split-K: the narrow shapes (wq_a has 1024 rows: 16 programs of 64 rows) cannot keep enough bytes in flight, so K
is cut into ``split`` slices (``q8_mma_config``: a function of N, K and groups only, so batch invariance holds).
Each program writes its float32 partial tile to a workspace and takes a ticket from a per-tile counter; the last
of a tile's programs sums the partials in slice order, stores y and resets the counter (a fixed order: the same
bits whichever program arrives last). The counters are runs of a per-device ring zeroed once (`_counters`: each
call takes the next run, so concurrent launches do not share counters); the first call on a device should not be
inside a CUDA graph capture (the ring would be allocated in the graph's pool).

Grouped products (``groups`` G, the attention output's wo_a): x ``[T, G, K]`` against W ``[G * N, K]``, group g's
rows with ``x[:, g]``, y ``[T, G * N]`` (the layout of ``quant_grouped_linear``).
"""

from __future__ import annotations

import torch

from ds4x.formats.ggml import GGMLQuantizationType
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.formats.triton_mode import HAVE_TRITON, tl, triton

__all__ = ["HAVE_GLUON", "q8_mma_config", "q8_mma_linear", "q8_mma_reference", "quantize_activations_32",
           "quantize_activations_32_reference", "serves"]

BLOCK = 32  # Q8_0 block: weights per scale, and the MMA's K
KB = 4  # blocks per pipeline stage (128 code bytes of each row)
STAGES = 3
NUM_WARPS = 4
TARGET_PROGRAMS = 264  # two programs of 4 warps per SM on an H200 (132 SMs): enough bytes in flight
MIN_STAGES_PER_SLICE = 4  # split-K keeps each slice at least this many stages long
MAX_SPLIT = 16
ROW_ALIGN_K = 256  # the kernel's K: split rows (K + K / 16 bytes) of a multiple of 16 bytes, for 16-byte copies

try:  # Gluon is experimental in Triton 3.x
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    HAVE_GLUON = HAVE_TRITON
except Exception:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False


if HAVE_TRITON:

    @triton.jit
    def _quantize_32_kernel(x_ptr, q_ptr, s_ptr, nb, stride_x, B: tl.constexpr):
        # program (block range, row): B blocks of 32 values of one row of x -> int8 codes and float32 scales
        row = tl.program_id(1).to(tl.int64)
        b = tl.program_id(0) * B + tl.arange(0, B)
        mask = b < nb
        off = 32 * b[:, None] + tl.arange(0, 32)[None, :]
        v = tl.load(x_ptr + row * stride_x + off, mask=mask[:, None], other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v), axis=1)
        # IEEE divisions (a plain `/` compiles to the approximate div.full.f32)
        inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.where(amax > 0, amax, 1.0)),
                       0.0)
        # adding 1.5 * 2**23 rounds the float32 product half to even (as torch.round) into the low mantissa bits;
        # it must not fuse into an FMA with the product, hence enable_fp_fusion=False at the launch
        q = (v * inv[:, None] + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
        tl.store(q_ptr + row * (nb * 32) + off, q.to(tl.int8), mask=mask[:, None])
        tl.store(s_ptr + row * nb + b, tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), mask=mask)


if HAVE_GLUON:

    @gluon.constexpr_function
    def _copy_layout(rows, step, num_warps):
        # [rows, step] int8 tiles copied 16 bytes a thread; with rows == 16 * num_warps each warp copies the 16
        # rows its MMAs read
        tpw_k = min(32, step // 16)
        tpw_r = 32 // tpw_k
        spt_r = max(1, rows // (tpw_r * num_warps))
        return gl.BlockedLayout([spt_r, 16], [tpw_r, tpw_k], [num_warps, 1], [1, 0])

    @gluon.constexpr_function
    def _codes_smem(step):
        # 16-byte chunks XOR-swizzled by row over 128-byte lines: ldmatrix's 8 rows x 16 bytes hit 32 banks
        return gl.SwizzledSharedLayout(16, max(1, 128 // step), 8, [1, 0])

    @gluon.jit
    def _issue_stage(w_smem, ws_smem, x_smem, xs_smem, slot, step, w_rows, ws_rows, x_rows, xs_rows, kc_w, kc_x,
                     K, KB: gl.constexpr):
        # cp.async of stage `step` (KB blocks) into slot `slot`: weight codes [BN, STEP], weight scales [BN] (4
        # fp16 as one int64), token codes [BT, STEP], token scales [KB * BT] (block-major: one copy, so the
        # compiler puts no barrier between per-block copies into one buffer)
        STEP: gl.constexpr = 32 * KB
        async_copy.async_copy_global_to_shared(w_smem.index(slot), w_rows + step * STEP + kc_w)
        scale_p = (ws_rows + K + step * (2 * KB)).to(gl.pointer_type(gl.int64), bitcast=True)
        async_copy.async_copy_global_to_shared(ws_smem.index(slot), scale_p)
        async_copy.async_copy_global_to_shared(x_smem.index(slot), x_rows + step * STEP + kc_x)
        async_copy.async_copy_global_to_shared(xs_smem.index(slot), xs_rows + step * KB)

    @gluon.jit
    def _q8_mma_kernel(xq_ptr, xs_ptr, w_ptr, y_ptr, part_ptr, count_ptr, N, K, row_bytes, n_tok, groups, stride_y,
                       BT: gl.constexpr, KB: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                       num_warps: gl.constexpr):
        # program (row tile x K slice, token tile, group); see the module docstring
        BN: gl.constexpr = 16 * num_warps
        STEP: gl.constexpr = 32 * KB
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, 8])
        A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
        ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
        COLS: gl.constexpr = gl.SliceLayout(0, MMA)
        LW: gl.constexpr = _copy_layout(BN, STEP, num_warps)
        LX: gl.constexpr = _copy_layout(BT, STEP, num_warps)
        LWS: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        SH_CODES: gl.constexpr = _codes_smem(STEP)
        SH_FLAT1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

        pid = gl.program_id(0)
        tile = pid // SPLIT
        part = pid % SPLIT
        pid_t = gl.program_id(1)
        g = gl.program_id(2)
        row0 = tile * BN
        t0 = pid_t * BT
        nb = K // 32
        steps = K // (STEP * SPLIT)  # stages per K slice (the host makes SPLIT divide K // STEP)
        first = part * steps

        # rows past N read row N - 1 and tokens past n_tok the last token: no copy needs a mask
        r_w = gl.minimum(row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LW)), N - 1)
        w_rows = w_ptr + (g * N + r_w).to(gl.int64)[:, None] * row_bytes
        kc_w = gl.arange(0, STEP, layout=gl.SliceLayout(0, LW))[None, :]
        r_s = gl.minimum(row0 + gl.arange(0, BN, layout=LWS), N - 1)
        ws_rows = w_ptr + (g * N + r_s).to(gl.int64) * row_bytes
        t_x = gl.minimum(t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, LX)), n_tok - 1)
        x_rows = xq_ptr + (t_x * groups + g).to(gl.int64)[:, None] * K
        kc_x = gl.arange(0, STEP, layout=gl.SliceLayout(0, LX))[None, :]
        e_s = gl.arange(0, KB * BT, layout=LWS)  # element e: block e // BT, token e % BT
        t_s = gl.minimum(t0 + e_s % BT, n_tok - 1)
        xs_rows = xs_ptr + (t_s * groups + g).to(gl.int64) * nb + e_s // BT

        w_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BN, STEP], SH_CODES)
        x_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BT, STEP], SH_CODES)
        ws_smem = gl.allocate_shared_memory(gl.int64, [STAGES, BN], SH_FLAT1)
        xs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, KB * BT], SH_FLAT1)

        for p in gl.static_range(STAGES - 1):
            if p < steps:
                _issue_stage(w_smem, ws_smem, x_smem, xs_smem, p, first + p, w_rows, ws_rows, x_rows, xs_rows, kc_w,
                             kc_x, K, KB)
            async_copy.commit_group()

        zero = gl.zeros([BN, BT], gl.int32, layout=MMA)
        acc = gl.zeros([BN, BT], gl.float32, layout=MMA)
        for i in range(steps):
            # stage i has landed for every thread, and every warp is done with the slot that stage i + STAGES - 1
            # overwrites (it held stage i - 1)
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            nxt = i + STAGES - 1
            if nxt < steps:
                _issue_stage(w_smem, ws_smem, x_smem, xs_smem, nxt % STAGES, first + nxt, w_rows, ws_rows, x_rows,
                             xs_rows, kc_w, kc_x, K, KB)
            async_copy.commit_group()

            slot = i % STAGES
            w_s = w_smem.index(slot)
            x_s = x_smem.index(slot)
            d4 = ws_smem.index(slot).load(ROWS)  # the row's KB fp16 scales of this stage
            for j in gl.static_range(KB):
                a = w_s.slice(32 * j, 32, dim=1).load(A_OP)
                b = x_s.slice(32 * j, 32, dim=1).permute((1, 0)).load(B_OP)
                dot = mma_v2(a, b, zero)
                d = ((d4 >> (16 * j)) & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
                s = xs_smem.index(slot).slice(j * BT, BT).load(COLS)
                acc = acc + (d[:, None] * s[None, :]) * dot.to(gl.float32)
        async_copy.wait_group(0)

        rows = row0 + gl.arange(0, BN, layout=ROWS)[:, None]
        toks = t0 + gl.arange(0, BT, layout=COLS)[None, :]
        mask = (rows < N) & (toks < n_tok)
        out_off = toks.to(gl.int64) * stride_y + g * N + rows
        if SPLIT == 1:
            gl.store(y_ptr + out_off, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            # partial tile of slice `part` at part_ptr[part, t, g N + n]; the last program of the tile sums them
            # to_tensor: Triton passes an int argument equal to 1 (n_tok of one token) as a constexpr int
            slice_elems = gl.to_tensor(n_tok).to(gl.int64) * stride_y
            gl.store(part_ptr + part * slice_elems + out_off, acc, mask=mask)
            gl.thread_barrier()  # every thread's partial is written before the ticket publishes them
            counter = count_ptr + (g * gl.num_programs(1) + pid_t) * (gl.num_programs(0) // SPLIT) + tile
            ticket = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT - 1:
                total = gl.load(part_ptr + out_off, mask=mask, other=0.0, cache_modifier=".cg")
                for q in gl.static_range(1, SPLIT):
                    total = total + gl.load(part_ptr + q * slice_elems + out_off, mask=mask, other=0.0,
                                            cache_modifier=".cg")
                gl.store(y_ptr + out_off, total.to(y_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


# ---- host side ---------------------------------------------------------------------------------------------------


def quantize_activations_32_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch form of ``quantize_activations_32`` (the same float32 operations, hence the same bits)."""
    t, k = x.shape
    v = x.float().reshape(t, k // BLOCK, BLOCK)
    amax = v.abs().amax(dim=-1)
    # tensor / tensor divisions: `127.0 / amax` would be reciprocal(amax) * 127 in torch (two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, torch.ones_like(amax)),
                      torch.zeros_like(amax))
    codes = torch.round(v * inv[..., None]).to(torch.int8).reshape(t, k)
    return codes, amax / torch.full_like(amax, 127.0)


def quantize_activations_32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[T, K]`` (float32 / bf16 / fp16, K a multiple of 32) -> int8 codes ``[T, K]`` and float32 scales
    ``[T, K // 32]``, one per 32 values: ``x ~ scale * code`` (see the module docstring). A Triton launch (the
    interpreter runs it on CPU tensors under TRITON_INTERPRET=1)."""
    if not HAVE_TRITON:
        raise RuntimeError("quantize_activations_32 needs Triton")
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"quantize_activations_32 needs x [T, K] with K a multiple of 32, got {list(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_activations_32 needs float32 / bf16 / fp16 x, got {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    t, k = x.shape
    nb = k // BLOCK
    codes = torch.empty(t, k, dtype=torch.int8, device=x.device)
    scales = torch.empty(t, nb, dtype=torch.float32, device=x.device)
    if t:
        b = min(32, triton.next_power_of_2(nb))
        _quantize_32_kernel[(triton.cdiv(nb, b), t)](x, codes, scales, nb, x.stride(0), B=b, num_warps=4,
                                                      enable_fp_fusion=False)
    return codes, scales


def q8_mma_config(n: int, k: int, groups: int = 1) -> int:
    """The split-K factor for ``groups`` row blocks of N rows and K columns: the largest power of two up to
    ``MAX_SPLIT`` that keeps the programs within ``TARGET_PROGRAMS`` and every slice ``MIN_STAGES_PER_SLICE``
    stages long. A function of the weight's shape only, so a token's bits do not depend on the batch."""
    tiles = -(-n // (16 * NUM_WARPS)) * groups
    stages = k // (BLOCK * KB)
    split = 1
    while (split * 2 <= MAX_SPLIT and tiles * split * 2 <= TARGET_PROGRAMS and stages % (split * 2) == 0
           and stages // (split * 2) >= MIN_STAGES_PER_SLICE):
        split *= 2
    return split


def _check_weight(w: GGMLTensor, groups: int) -> tuple[int, int]:
    if not isinstance(w, GGMLTensor) or w.qtype != GGMLQuantizationType.Q8_0:
        raise ValueError(f"q8_mma needs a Q8_0 GGMLTensor, got {w!r}")
    if w.layout != "split":
        raise ValueError("q8_mma needs the split row layout (GGMLTensor.split())")
    if w.ndim != 2:
        raise ValueError(f"q8_mma needs a 2-D weight, got shape {list(w.shape)}")
    rows, k = w.shape
    if groups < 1 or rows % groups:
        raise ValueError(f"{groups} groups do not divide the weight's {rows} rows")
    if k % (BLOCK * KB):
        raise ValueError(f"q8_mma needs K a multiple of {BLOCK * KB} (whole stages), got {k}")
    return rows // groups, k


def _check_x(x: torch.Tensor, k: int, groups: int) -> int:
    want = "[T, K]" if groups == 1 else "[T, groups, K]"
    shape_ok = (x.dim() == 2 and groups == 1) or (x.dim() == 3 and x.shape[1] == groups)
    if not shape_ok or x.shape[-1] != k:
        raise ValueError(f"q8_mma needs x {want} with K = {k}, groups = {groups}; got {list(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q8_mma needs float32 / bf16 / fp16 x, got {x.dtype}")
    if x.shape[0] < 1:
        raise ValueError("q8_mma needs at least one token")
    return x.shape[0]


def q8_mma_reference(x: torch.Tensor, w: GGMLTensor, groups: int = 1, split: int | None = None) -> torch.Tensor:
    """The kernel's math in torch on any device (readable, slow): x quantized per 32 values, exact integer block
    dot products, ``(d_w * s_x) * dot`` added in float32 in block order within each of ``split`` K slices
    (default ``q8_mma_config``), the slices' sums added in order; cast to x's dtype. x ``[T, K]`` or
    ``[T, groups, K]``; returns ``[T, groups * N]``."""
    n, k = _check_weight(w, groups)
    t = _check_x(x, k, groups)
    split = q8_mma_config(n, k, groups) if split is None else split
    nb = k // BLOCK
    xq, xs = quantize_activations_32_reference(x.reshape(t * groups, k))
    xs = xs.reshape(t, groups, 1, nb)
    raw = w.raw.reshape(groups, n, -1)
    wq = raw[..., :k].view(torch.int8).reshape(groups, n, nb, BLOCK)
    wd = raw[..., k:].contiguous().view(torch.float16).float().reshape(1, groups, n, nb)
    # integer block dots in float64 (exact in any order: |dot| <= 32 * 127 * 128 < 2**24), then float32
    dots = torch.einsum("tgbj,gnbj->tgnb", xq.reshape(t, groups, nb, BLOCK).double(), wq.double()).float()
    terms = (wd * xs) * dots  # [T, G, N, nb] float32
    per = nb // split
    total = None
    for s in range(split):
        acc = torch.zeros(t, groups, n, dtype=torch.float32, device=terms.device)
        for b in range(s * per, (s + 1) * per):
            acc = acc + terms[..., b]
        total = acc if total is None else total + acc
    return total.reshape(t, groups * n).to(x.dtype)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_NEXT_COUNTER: dict[torch.device, int] = {}
_COUNTER_SLOTS = 1 << 20


def _counters(device: torch.device, need: int) -> torch.Tensor:
    """``need`` split-K tile counters, all zero when the launch starts (its last program of each tile resets its
    counter). Each call takes the next run of a per-device ring, so launches that can run at once (a decode step's
    CUDA-graph branches, other streams) count in distinct slots unless ~1M slots of calls lie between them."""
    if need > _COUNTER_SLOTS:
        raise ValueError(f"q8_mma: {need} split-K tiles exceed the counter buffer ({_COUNTER_SLOTS})")
    buf = _COUNTERS.get(device)
    if buf is None:
        if torch.cuda.is_current_stream_capturing():
            # zeros made inside a capture are set only when the graph replays: an eager call before that would
            # read garbage counters (a failed capture falls back to eager decoding: runtime.decode_graph)
            raise RuntimeError("q8_mma: the split-K counters are allocated by the first eager call, not in a capture")
        buf = _COUNTERS[device] = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
    start = _NEXT_COUNTER.get(device, 0)
    if start + need > _COUNTER_SLOTS:
        start = 0
    _NEXT_COUNTER[device] = start + need
    return buf[start:start + need]


def serves(w: GGMLTensor, groups: int = 1) -> bool:
    """Whether ``q8_mma_linear`` can multiply by ``w`` here: a 2-D split Q8_0 weight on an sm_90 device, K a
    multiple of 256 (rows of K + K / 16 bytes, a multiple of 16), its bytes 16-byte aligned, Gluon present."""
    return (HAVE_GLUON and isinstance(w, GGMLTensor) and w.qtype == GGMLQuantizationType.Q8_0
            and w.layout == "split" and w.ndim == 2 and w.is_cuda and w.shape[0] % groups == 0
            and w.shape[1] % ROW_ALIGN_K == 0 and w.raw.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(w.device)[0] == 9)


def q8_mma_linear(x: torch.Tensor, w: GGMLTensor, groups: int = 1, split: int | None = None,
                  num_warps: int = NUM_WARPS, stages: int = STAGES) -> torch.Tensor:
    """``y = x @ W.T`` on sm_90 int8 tensor cores (see the module docstring): x ``[T, K]`` (or ``[T, groups, K]``)
    in float32 / bf16 / fp16 on CUDA, W a 2-D split-layout Q8_0 GGMLTensor ``[groups * N, K]`` with K a multiple
    of 256. Returns ``[T, groups * N]`` in x's dtype, the bits of ``q8_mma_reference`` with the same ``split``.
    ``split`` (default ``q8_mma_config``; must divide K / 128, the stages), ``num_warps`` (rows per program = 16 x
    that) and ``stages`` are tuning knobs for the probe. The weight is read once per 32 tokens."""
    n, k = _check_weight(w, groups)
    t = _check_x(x, k, groups)
    if k % ROW_ALIGN_K:
        raise ValueError(f"q8_mma_linear needs K a multiple of {ROW_ALIGN_K} (rows of K + K / 16 bytes copied 16 bytes "
                         f"at a time), got {k}")
    if w.raw.data_ptr() % 16:  # the 16-byte cp.async of codes; an unaligned base does not even compile
        raise ValueError("q8_mma_linear needs the weight's bytes 16-byte aligned")
    if not HAVE_GLUON:
        raise RuntimeError("q8_mma_linear needs Triton's Gluon")
    if not (x.is_cuda and w.is_cuda and x.device == w.device):
        raise ValueError(f"q8_mma_linear needs x and W on one CUDA device, got {x.device} and {w.device}")
    if torch.cuda.get_device_capability(x.device)[0] != 9:
        raise ValueError("q8_mma_linear is written for sm_90 (Hopper)")
    split = q8_mma_config(n, k, groups) if split is None else split
    if split < 1 or (k // (BLOCK * KB)) % split:
        raise ValueError(f"split {split} must divide K / {BLOCK * KB} = {k // (BLOCK * KB)}")
    if stages < 2:
        raise ValueError("q8_mma_linear needs at least 2 stages")
    xq, xs = quantize_activations_32(x.reshape(t * groups, k))
    bt = 8 if t <= 8 else 16 if t <= 16 else 32
    tiles = -(-n // (16 * num_warps))
    grid = (tiles * split, -(-t // bt), groups)
    y = torch.empty(t, groups * n, dtype=x.dtype, device=x.device)
    if split == 1:
        part = count = y
    else:
        part = torch.empty(split, t, groups * n, dtype=torch.float32, device=x.device)
        count = _counters(x.device, tiles * grid[1] * groups)
    _q8_mma_kernel[grid](xq, xs, w.raw, y, part, count, n, k, w.row_bytes, t, groups, groups * n, BT=bt, KB=KB,
                         STAGES=stages, SPLIT=split, num_warps=num_warps, enable_fp_fusion=False)
    return y
