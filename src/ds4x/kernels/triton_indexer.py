"""Triton kernels of the decode-time indexer (imported only when a Triton path runs): scoring straight from
packed MXFP4 rows (`score_kernel`, see `ds4x.kernels.indexer`) and the exact radix top-k (`radix_kernel`, see
`ds4x.kernels.select`).
"""

import triton
import triton.language as tl

from ds4x.formats.pdl import wait_upstream


@triton.jit
def exp2_f32(e):
    """Exact 2^e as float32 for integer e in [-149, 127] (subnormals below -126)."""
    normal = ((e + 127) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(e + 149, 0), 30)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, sub)


@triton.jit
def exp2_f16(e):
    """2^e as fp16 for integer e <= 15: subnormal down to 2^-24, 0 below."""
    normal = ((tl.maximum(e, -14) + 15) << 10).to(tl.int16)
    sub = (1 << tl.minimum(tl.maximum(e + 24, 0), 15)).to(tl.int16)
    bits = tl.where(e >= -14, normal, tl.where(e >= -24, sub, 0).to(tl.int16))
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def codes_fp16(words, j: tl.constexpr, sc16):
    """Nibble ``j`` of every word (element 8w + j) as fp16: E2M1 x 2^-14 x ``sc16``."""
    c = words >> (4 * j)
    bits = ((c & 7) << 9) | ((c & 8) << 12)  # magnitude to fp16 bits 9..11, sign to bit 15
    return bits.to(tl.int16).to(tl.float16, bitcast=True) * sc16


@triton.jit
def codes_fp16_ptx(words, sc_bits):
    """The eight ``codes_fp16`` tiles at once in PTX. Per word: the fp16 high byte of each even and odd
    element by shifts/masks on all four bytes together (la, ua), then per output pair one byte permute,
    a mask and one paired fp16 multiply by the block scale."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 la, ua, lb, ub, t, s;
        shl.b32 la, $8, 4;  and.b32 la, la, 0x80808080;
        shl.b32 t, $8, 1;   and.b32 t, t, 0x0E0E0E0E;  or.b32 la, la, t;
        and.b32 ua, $8, 0x80808080;
        shr.b32 t, $8, 3;   and.b32 t, t, 0x0E0E0E0E;  or.b32 ua, ua, t;
        shl.b32 lb, $9, 4;  and.b32 lb, lb, 0x80808080;
        shl.b32 t, $9, 1;   and.b32 t, t, 0x0E0E0E0E;  or.b32 lb, lb, t;
        and.b32 ub, $9, 0x80808080;
        shr.b32 t, $9, 3;   and.b32 t, t, 0x0E0E0E0E;  or.b32 ub, ub, t;
        prmt.b32 s, $10, $11, 0x5410;
        prmt.b32 $0, la, lb, 0x4000;  and.b32 $0, $0, 0xFF00FF00;  mul.rn.f16x2 $0, $0, s;
        prmt.b32 $1, ua, ub, 0x4000;  and.b32 $1, $1, 0xFF00FF00;  mul.rn.f16x2 $1, $1, s;
        prmt.b32 $2, la, lb, 0x5010;  and.b32 $2, $2, 0xFF00FF00;  mul.rn.f16x2 $2, $2, s;
        prmt.b32 $3, ua, ub, 0x5010;  and.b32 $3, $3, 0xFF00FF00;  mul.rn.f16x2 $3, $3, s;
        prmt.b32 $4, la, lb, 0x6020;  and.b32 $4, $4, 0xFF00FF00;  mul.rn.f16x2 $4, $4, s;
        prmt.b32 $5, ua, ub, 0x6020;  and.b32 $5, $5, 0xFF00FF00;  mul.rn.f16x2 $5, $5, s;
        prmt.b32 $6, la, lb, 0x7030;  and.b32 $6, $6, 0xFF00FF00;  mul.rn.f16x2 $6, $6, s;
        prmt.b32 $7, ua, ub, 0x7030;  and.b32 $7, $7, 0xFF00FF00;  mul.rn.f16x2 $7, $7, s;
        }
        """,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
        args=[words, sc_bits],
        dtype=(tl.float16,) * 8,
        is_pure=True,
        pack=2,
    )


@triton.jit
def load_tile(tile, rows_ptr, n_rows, BLOCK_N: tl.constexpr):
    """A tile's 16 code words and its scale word per row (rows past ``n_rows`` read as zero codes)."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs_n < n_rows
    base = rows_ptr + offs_n.to(tl.int64)[:, None] * 17
    words = tl.load(base + tl.arange(0, 16)[None, :], mask=ok[:, None], other=0)
    sw = tl.load(base + 16, mask=ok[:, None], other=0x7F7F7F7F)  # [BLOCK_N, 1]: the four scale bytes
    return words, sw


@triton.jit
def first_digit(score, BITS: tl.constexpr):
    """The top BITS bits of each score's order-preserving 32-bit code (radix_kernel's digit of level 0; -0.0 taken as
    +0.0, as the select reads it). Elementwise, so Gluon kernels call it too."""
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    top = (bits >> (32 - BITS)) & ((1 << BITS) - 1)
    return tl.where(bits < 0, (1 << BITS) - 1 - top, top | (1 << (BITS - 1)))


@triton.jit
def score_tile(tile, words, sw, out_ptr, n_rows, q_op, wq, hist_ptr, BLOCK_N: tl.constexpr,
               PTX: tl.constexpr, HIST_BITS: tl.constexpr):
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    s0, s1, s2, s3 = sw & 255, (sw >> 8) & 255, (sw >> 16) & 255, (sw >> 24) & 255
    smax = tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3))
    s_b = (sw >> (8 * (tl.arange(0, 16)[None, :] // 4))) & 255  # each word's block scale
    sc16 = exp2_f16(15 - (smax - s_b))  # [BLOCK_N, 16]: each word's block scale relative to the row's
    if PTX:
        k0, k1, k2, k3, k4, k5, k6, k7 = codes_fp16_ptx(words, sc16.to(tl.int16, bitcast=True).to(tl.int32))
    else:
        k0 = codes_fp16(words, 0, sc16)
        k1 = codes_fp16(words, 1, sc16)
        k2 = codes_fp16(words, 2, sc16)
        k3 = codes_fp16(words, 3, sc16)
        k4 = codes_fp16(words, 4, sc16)
        k5 = codes_fp16(words, 5, sc16)
        k6 = codes_fp16(words, 6, sc16)
        k7 = codes_fp16(words, 7, sc16)
    acc = tl.dot(interleave8(k0, k1, k2, k3, k4, k5, k6, k7), q_op)
    # acc = (q . k) * 2^(128 - smax) * 2^(14 - e_h); both powers of two commute with the ReLU
    score = tl.sum(tl.maximum(acc, 0.0) * wq[None, :], axis=1) * exp2_f32(tl.reshape(smax, [BLOCK_N]) - 128)
    tl.store(out_ptr + offs_n, score, mask=offs_n < n_rows)
    if HIST_BITS > 0:  # the select's first digit level, counted here (see score_kernel)
        h = tl.histogram(first_digit(score, HIST_BITS), 1 << HIST_BITS, mask=offs_n < n_rows)
        tl.atomic_add(hist_ptr + tl.arange(0, 1 << HIST_BITS), h, mask=h > 0, sem="relaxed")


@triton.jit
def interleave8(t0, t1, t2, t3, t4, t5, t6, t7):
    """[M, 16] x 8 -> [M, 128]: the eight tiles side by side in each thread's registers, column 8w + p holding
    column w of tile rev3(p) (three joins put bit 0 of the tile number highest; the query operand is loaded in
    that order). Each thread's 8 values are contiguous, so the move to the tensor cores' layout stores 16 bytes at
    a time instead of one 2-byte value per tile."""
    return tl.reshape(tl.join(tl.join(tl.join(t0, t1), tl.join(t2, t3)), tl.join(tl.join(t4, t5), tl.join(t6, t7))),
                      [t0.shape[0], 128])


# Row and tile counts change from call to call (prefill chunks): not specialized, so a count that happens to be a
# multiple of 16 does not compile a second variant in the middle of a prefill
@triton.jit(do_not_specialize=["n_rows", "n_iter", "n_prog"])
def score_kernel(q_ptr, w_ptr, rows_ptr, rows_stride, out_ptr, n_rows, count_ptr, count_stride, n_iter, n_prog, scale,
                 hist_ptr, hist_stride, H: tl.constexpr, HP: tl.constexpr, BLOCK_N: tl.constexpr, PTX: tl.constexpr,
                 PERSISTENT: tl.constexpr, DEVICE_COUNT: tl.constexpr, HIST_BITS: tl.constexpr = 0):
    """Program (row tile, or persistent over them; query): the scores of rows 0 .. n_rows - 1. HIST_BITS > 0: the
    counts of their first radix digits (`first_digit`) added to the query's row of ``hist_ptr``, the select's
    level 0 done here (`ds4x.kernels.select.radix_first_level`)."""
    pid = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)  # the query (a prefill chunk has many; decode one per session)
    q_ptr += t * H * 128
    rows_ptr += t * rows_stride  # a batched decode step: each query's own store (else 0: one store)
    w_ptr += t * H
    out_ptr += t * n_rows
    hist_ptr += t * hist_stride
    if DEVICE_COUNT:  # rows in use counted on the device (CUDA graphs; per query in a prefill chunk)
        n_rows = tl.minimum(tl.load(count_ptr + t * count_stride).to(tl.int32), n_rows)
    offs_h = tl.arange(0, HP)
    h_ok = offs_h < H
    # Queries once per program: per head a power of two 2^(14 - e_h) brings max|q_h| into [2^14, 2^15).
    q_all = tl.load(q_ptr + offs_h[:, None] * 128 + tl.arange(0, 128)[None, :], mask=h_ok[:, None], other=0.0)
    qmax = tl.max(tl.abs(q_all), axis=1)
    e_h = tl.where(qmax > 0, ((qmax.to(tl.int32, bitcast=True) >> 23) & 255) - 127, 0)
    e_h = tl.minimum(tl.maximum(e_h, -110), 127)
    wq = tl.load(w_ptr + offs_h, mask=h_ok, other=0.0) * scale * exp2_f32(e_h - 14)
    q_scale = exp2_f32(14 - e_h)
    # the query operand [128, H] in the key tiles' column order (see interleave8): column 8w + p is element
    # 8w + rev3(p); fp16 is exact for MXFP4 values once scaled per head
    p = tl.arange(0, 128)
    e = (p & ~7) | ((p & 1) << 2) | (p & 2) | ((p >> 2) & 1)
    q_op = tl.load(q_ptr + offs_h[None, :] * 128 + e[:, None], mask=h_ok[None, :], other=0.0)
    q_op = (q_op * q_scale[None, :]).to(tl.float16)
    if PERSISTENT:  # grid-stride over row tiles, queries prepared once (the interpreter cannot loop to a runtime bound)
        # the next tile's words are loaded before this one is scored, so a program always has a load in flight
        words, sw = load_tile(pid, rows_ptr, n_rows, BLOCK_N)
        for it in range(0, n_iter):
            tile = pid + it * n_prog
            next_words, next_sw = load_tile(tile + n_prog, rows_ptr, n_rows, BLOCK_N)
            if tile * BLOCK_N < n_rows:
                score_tile(tile, words, sw, out_ptr, n_rows, q_op, wq, hist_ptr, BLOCK_N, PTX, HIST_BITS)
            words, sw = next_words, next_sw
    else:
        words, sw = load_tile(pid, rows_ptr, n_rows, BLOCK_N)
        score_tile(pid, words, sw, out_ptr, n_rows, q_op, wq, hist_ptr, BLOCK_N, PTX, HIST_BITS)


@triton.jit
def load_acquire(ptr):
    """The int32 at ``ptr`` by a load with acquire semantics at GPU scope (what an atomic's release published is
    visible after it). GPU only: grid barriers are crossed only by programs of one launch, never in the
    interpreter."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def grid_sync(barrier_ptr, timeouts_ptr, phase, nprog):
    """Waits until all ``nprog`` programs of the row have finished phase ``phase`` (1, 2, ...), counted at
    ``barrier_ptr`` (zero before phase 1); a wait that gives up adds 1 at ``timeouts_ptr``. One program needs only
    its own barrier."""
    tl.debug_barrier()  # this program's phase is complete
    if nprog > 1:
        target = phase * nprog
        # the arrival's own result tells the last program to arrive that it need not wait; the others wait by
        # loads (each thread its own, so no broadcast of an atomic's result behind a barrier per try)
        seen = tl.atomic_add(barrier_ptr, 1, sem="acq_rel", scope="gpu") + 1
        spins = tl.full([], 0, tl.int32)
        while (seen < target) & (spins < 4_000_000):  # bounded: a broken barrier fails the result, not the GPU
            seen = load_acquire(barrier_ptr)
            spins += 1
        if seen < target:
            tl.atomic_add(timeouts_ptr, 1)
        tl.debug_barrier()


@triton.jit
def digit_threshold(ws_ptr, level, need, h_local, BINS: tl.constexpr, LOCAL: tl.constexpr):
    """Highest digit of level ``level`` whose suffix count reaches ``need``, the count strictly above it, and its
    own count: from the row's histogram in the workspace, or (LOCAL) this program's ``h_local``."""
    b = tl.arange(0, BINS)
    if LOCAL:
        h = h_local
    else:
        h = tl.load(ws_ptr + 64 + level * BINS + b, cache_modifier=".cg")
    suffix = tl.cumsum(h, 0, reverse=True)
    t = tl.max(tl.where(suffix >= need, b, -1), 0)
    return t, tl.sum(tl.where(b > t, h, 0), 0), tl.sum(tl.where(b == t, h, 0), 0)


@triton.jit
def shared_bins_base():
    """GPU only: declares the kernel's static shared array of histogram bins (1,024 words: a region per digit level,
    zeroed once by `shared_bins_zero`; then a word that the elements not counted add to) and returns its shared
    address. Once per kernel: a second declaration would not assemble."""
    return tl.inline_asm_elementwise(".shared .align 16 .b32 ds4x_radix_bins[1025];\n\tmov.u32 $0, ds4x_radix_bins;",
                                     "=r,r", [tl.full([], 0, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def shared_bins_zero(base, WORDS: tl.constexpr):
    """Zeroes the first WORDS bins (threads holding the same bin store the same zero) and waits for every thread."""
    tl.inline_asm_elementwise("st.volatile.shared.u32 [$1], 0;\n\tmov.u32 $0, 0;", "=r,r",
                              [base + 4 * tl.arange(0, WORDS)], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def shared_histogram(base, level: tl.constexpr, digit, mask, BINS: tl.constexpr):
    """tl.histogram(digit, BINS, mask=mask) by one shared-memory atomic increment per element into level ``level``'s
    zeroed region of the bins at ``base`` (the elements not counted into word 1,024, never read; no branch per
    element), which sm_90 aggregates over a warp's equal addresses (ATOMS.POPC.INC), where tl.histogram spends
    warp-wide ballots and popcounts on every element. A region per level, never written again, so the counts are
    read after one barrier and need no zeroing after. ``digit`` must not be replicated over threads (at least one
    element a thread): each copy would be counted."""
    tl.inline_asm_elementwise("red.shared.add.u32 [$1], 1;\n\tmov.u32 $0, 0;", "=r,r",
                              [base + 4 * tl.where(mask, level * BINS + digit, 1024)], dtype=tl.int32, is_pure=False,
                              pack=1)
    tl.debug_barrier()
    return tl.inline_asm_elementwise("ld.volatile.shared.u32 $0, [$1];", "=r,r",
                                     [base + 4 * (level * BINS + tl.arange(0, BINS))], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit
def digit_histogram(ws_ptr, barrier_ptr, level: tl.constexpr, digit, mask, phase, nprog, SYNC: tl.constexpr,
                    BINS: tl.constexpr, bins_base, SHARED_BINS: tl.constexpr, LOCAL: tl.constexpr):
    """This program's histogram of one digit level, added to the row's (unless LOCAL: the program's own is the
    row's), then (SYNC) waits for every program's at grid barrier ``phase``. SHARED_BINS: counted by shared-memory
    atomics into the bins at ``bins_base`` (`shared_histogram`), else by tl.histogram."""
    if SHARED_BINS:
        h = shared_histogram(bins_base, level, digit, mask, BINS)
    else:
        h = tl.histogram(digit, BINS, mask=mask)
    if not LOCAL:
        tl.atomic_add(ws_ptr + 64 + level * BINS + tl.arange(0, BINS), h, mask=h > 0, sem="relaxed")
        if SYNC:
            grid_sync(barrier_ptr, ws_ptr + 2, phase, nprog)
    return h


@triton.jit
def radix_kernel(scores_ptr, n, n_visible, count_ptr, kk, nprog, ws_ptr, index_ptr, valid_ptr, pad,
                 TILE: tl.constexpr, KP: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
                 DEVICE_COUNT: tl.constexpr, WS: tl.constexpr, MAX_PROGRAMS: tl.constexpr, PDL: tl.constexpr = False,
                 SHARED_BINS: tl.constexpr = False, LOCAL: tl.constexpr = False):
    """Phases FIRST..LAST of the multi-program exact top-k of a row of scores: phases 0 .. 32 / BITS - 1 each add
    the histogram of one more BITS-bit digit of the order-preserving codes (among the rows matching the k-th
    code's digits so far), the next counts each program's rows above and equal to the k-th code, the last lists the
    selection. The phases of one launch meet at grid barriers. Once the rows matching the digits so far are exactly
    the ones still needed, the remaining digit levels are skipped (all of those rows are selected). SHARED_BINS
    (GPU only): each program counts its histograms by shared-memory atomics (`shared_histogram`). LOCAL: one
    program per row, all phases in one launch (FIRST 0, LAST the listing), with no workspace (its histograms and
    counts stay its own)."""
    wait_upstream(PDL, RELEASE=LOCAL)  # (programs that meet at grid barriers release their dependents as they exit)
    LEVELS: tl.constexpr = 32 // BITS
    BINS: tl.constexpr = 1 << BITS
    bins_base = 0
    if SHARED_BINS:
        if FIRST < LEVELS:
            bins_base = shared_bins_base()
            shared_bins_zero(bins_base, LEVELS * BINS)
    pid = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)  # the row of scores (a batched decode step: one per session)
    scores_ptr += r * n
    ws_ptr += r * WS  # each row its own workspace: its barriers count its own programs
    index_ptr += r * kk
    valid_ptr += r * kk
    gt_counts = ws_ptr + 64 + 1024  # per program: its rows above the k-th code, then those equal to it
    eq_counts = gt_counts + MAX_PROGRAMS
    # the grid barriers count in word 0 or 1 by the parity of the fused launches so far (word 3); program 0 of
    # each zeroes the other word at its end, the launch before's counter, which nothing reads any more
    FUSED: tl.constexpr = FIRST < LAST and not LOCAL
    launches = tl.zeros([], tl.int32)
    barrier_ptr = ws_ptr
    if FUSED:
        launches = tl.load(ws_ptr + 3, cache_modifier=".cg")
        barrier_ptr = ws_ptr + (launches & 1)
    if DEVICE_COUNT:  # visible rows counted on the device (CUDA graphs); the grid covers all n scores
        n_visible = tl.load(count_ptr + r).to(tl.int32)
    n_visible = tl.minimum(n_visible, n)
    need = tl.minimum(n_visible, kk)  # kk = min(k, n)
    rows = pid * TILE + tl.arange(0, TILE)
    vis = rows < n_visible
    s = tl.load(scores_ptr + rows, mask=vis, other=0.0) + 0.0  # -0.0 -> +0.0 (they compare equal)
    bits = s.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    u = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)  # order-preserving code
    # phases 0 .. LEVELS - 1: the histogram of one more digit among the rows that match the k-th code's digits so
    # far (a later launch re-derives the earlier digits from the histograms in the workspace)
    match = vis
    h = tl.zeros([BINS], tl.int32)  # LOCAL: the last level's histogram
    kth = tl.zeros([], tl.int64)
    above = tl.zeros([], tl.int32)  # rows whose code is above the k-th code's digits so far
    known = tl.zeros([], tl.int32)  # bits of the k-th code settled (the top ones)
    done = known != 0  # the rows matching the settled bits are exactly the ones still needed
    barriers = tl.zeros([], tl.int32)  # grid barriers passed
    for level in tl.static_range(LEVELS):
        if LAST >= level:
            if level > 0:
                if not done:
                    t, a, c = digit_threshold(ws_ptr, level - 1, need - above, h, BINS, LOCAL)
                    kth = kth | (t.to(tl.int64) << (32 - BITS * level))
                    above += a
                    known = BITS * level
                    match = match & (digit == t)  # noqa: F821 - the previous level's digit
                    done = c == need - above
            digit = ((u >> (32 - BITS * (level + 1))) & (BINS - 1)).to(tl.int32)
            if FIRST <= level:
                if not done:
                    h = digit_histogram(ws_ptr, barrier_ptr, level, digit, match, barriers + 1, nprog, LAST > level,
                                        BINS, bins_base, SHARED_BINS, LOCAL)
                    barriers += 1
    # phase LEVELS: the k-th code (its settled bits); each program counts its rows above it and equal to it
    if LAST >= LEVELS:
        if not done:
            t, a, c = digit_threshold(ws_ptr, LEVELS - 1, need - above, h, BINS, LOCAL)
            kth = kth | t.to(tl.int64)
            above += a
            known = 32
        ties_taken = need - above  # rows equal to the k-th code (in its settled bits) that are selected
        low = 32 - known
        gt = vis & ((u >> low) > (kth >> low))
        eq = vis & ((u >> low) == (kth >> low))
        both = gt.to(tl.int32) + (eq.to(tl.int32) << 16)  # both counts in one scan (a program has < 2^16 rows)
        # a program's own ranks before the listing's grid barrier when both phases share the launch: the scan then
        # runs while the other programs arrive, not after
        SCAN_FIRST: tl.constexpr = FIRST <= LEVELS and LAST > LEVELS and not LOCAL
        if SCAN_FIRST:
            excl = tl.cumsum(both, 0) - both
        if FIRST <= LEVELS:
            total = tl.sum(both, 0)
            if not LOCAL:
                tl.store(gt_counts + pid, total & 0xFFFF)
                tl.store(eq_counts + pid, total >> 16)
                if LAST > LEVELS:
                    grid_sync(barrier_ptr, ws_ptr + 2, barriers + 1, nprog)
    # phase LEVELS + 1: the selected rows in ascending row order (programs in order, rows in order in a program)
    if LAST == LEVELS + 1:
        if LOCAL:  # the only program
            gt_before, eq_before = 0, 0
            mine, mine_eq = total & 0xFFFF, total >> 16  # noqa: F821 - counted in the phase above (same launch)
        else:
            p = tl.arange(0, MAX_PROGRAMS)
            before = p < pid
            gt_before = tl.sum(tl.load(gt_counts + p, mask=before, other=0, cache_modifier=".cg"), 0)
            eq_before = tl.sum(tl.load(eq_counts + p, mask=before, other=0, cache_modifier=".cg"), 0)
            mine = tl.load(gt_counts + pid, cache_modifier=".cg")
            mine_eq = tl.load(eq_counts + pid, cache_modifier=".cg")
        if (mine > 0) | ((mine_eq > 0) & (eq_before < ties_taken)):  # most programs select nothing
            if not SCAN_FIRST:
                excl = tl.cumsum(both, 0) - both
            tie_rank = eq_before + (excl >> 16)
            sel = gt | (eq & (tie_rank < ties_taken))
            slot = gt_before + (excl & 0xFFFF) + tl.minimum(tie_rank, ties_taken)
            sel = sel & (slot < kk)  # (always, when the counts are the scores'; never a write past the row)
            tl.store(index_ptr + slot, rows.to(tl.int64), mask=sel)
            tl.store(valid_ptr + slot, sel.to(tl.int8), mask=sel)
        if pid == 0:  # slots no visible row fills: index `pad`, not valid
            rest = need + tl.arange(0, KP)
            tl.store(index_ptr + rest, tl.full([KP], pad, tl.int64), mask=rest < kk)
            tl.store(valid_ptr + rest, tl.zeros([KP], tl.int8), mask=rest < kk)
        # program 0 leaves the histograms and the next launch's barrier counter zeroed by plain stores, with no
        # atomic to wait for: every program has read the histograms before the last barrier, and the next launch
        # sees this one's writes. (Unfused phases re-read the histograms in each launch; the host zeroes them.)
        # Against the last program found by one more acq_rel atomic_add (49f3d87; H100, 3b3356a,
        # scripts/compressed_kernels_ab.py --parts select,pair, us): 262,144 scores 13.1, 13.0 -> 12.2, 12.1;
        # 32,768 10.2, 10.2 -> 9.3, 9.5; 8 x 32,768 14.8 -> 13.7; scoring + top-512 at 1M 28.3 -> 27.5
        if FUSED:
            if pid == 0:
                tl.store(ws_ptr + 64 + tl.arange(0, 1024), tl.zeros([1024], tl.int32))
                tl.store(ws_ptr + 1 - (launches & 1), 0)
                tl.store(ws_ptr + 3, launches + 1)


@triton.jit
def radix_small_kernel(scores_ptr, n, n_visible, count_ptr, kk, index_ptr, valid_ptr, pad, TILE: tl.constexpr,
                       KP: tl.constexpr, BITS: tl.constexpr, DEVICE_COUNT: tl.constexpr, PACKED: tl.constexpr,
                       PDL: tl.constexpr = False):
    # One program per row of scores holds all of them: the k-th largest order-preserving code is built BITS bits
    # at a time from the top (the largest candidate that at least `need` codes reach), then the selection is
    # listed as radix_kernel lists it. No grid barriers: a few short reductions per row.
    wait_upstream(PDL, RELEASE=True)
    r = tl.program_id(0).to(tl.int64)
    scores_ptr += r * n
    index_ptr += r * kk
    valid_ptr += r * kk
    if DEVICE_COUNT:
        n_visible = tl.load(count_ptr + r).to(tl.int32)
    n_visible = tl.minimum(n_visible, n)
    need = tl.minimum(n_visible, kk)
    rows = tl.arange(0, TILE)
    vis = rows < n_visible
    s = tl.load(scores_ptr + rows, mask=vis, other=0.0) + 0.0  # -0.0 -> +0.0
    b = s.to(tl.int32, bitcast=True)
    key = b ^ ((b >> 31) & 0x7FFFFFFF)  # signed order-preserving code: radix_kernel's u - 2**31
    kth = tl.full([], 0, tl.int64)  # in u = key + 2**31 terms, built from the top bit down
    if PACKED:
        # the counts of the 2**BITS - 1 candidates above the prefix, each in a field of F bits of one int64, so that
        # a step is one scalar reduction (a reduction of a [C] vector of counts costs several barriers more)
        F: tl.constexpr = TILE.bit_length()
        for step in tl.static_range(32 // BITS):
            packed = tl.zeros_like(key).to(tl.int64)
            for c in tl.static_range(1, 1 << BITS):
                cand = ((kth | (c << (32 - BITS * (step + 1)))) - 2147483648).to(tl.int32)
                packed += (vis & (key >= cand)).to(tl.int64) << (F * (c - 1))
            total = tl.sum(packed, axis=0)
            digit = tl.full([], 0, tl.int64)
            for c in tl.static_range(1, 1 << BITS):
                digit += (((total >> (F * (c - 1))) & ((1 << F) - 1)) >= need).to(tl.int64)
            kth = kth | (digit << (32 - BITS * (step + 1)))
    else:
        c = tl.arange(0, 1 << BITS).to(tl.int64)
        for step in tl.static_range(32 // BITS):  # bits [32 - BITS * (step + 1), 32 - BITS * step) of the k-th code
            cand = ((kth | (c << (32 - BITS * (step + 1)))) - 2147483648).to(tl.int32)  # [C] candidates, signed codes
            reach = vis[None, :] & (key[None, :] >= cand[:, None])
            cnt = tl.sum(reach.to(tl.int32), axis=1)
            kth = kth | (tl.max(tl.where(cnt >= need, c, 0), axis=0) << (32 - BITS * (step + 1)))
    kth32 = (kth - 2147483648).to(tl.int32)
    gt = vis & (key > kth32)
    eq = vis & (key == kth32)
    ties_taken = need - tl.sum(gt.to(tl.int32), 0)
    eq_i = eq.to(tl.int32)
    if PACKED:
        # one scan of both counts (rows above in the low 16 bits, rows equal above them): the ties taken are the
        # first ties_taken equal rows, so a row's slot is the rows above before it plus min(equal rows, ties_taken)
        both = tl.cumsum(gt.to(tl.int32) | (eq_i << 16), 0)
        n_eq = both >> 16
        sel = gt | (eq & (n_eq - eq_i < ties_taken))
        slot = (both & 0xFFFF) + tl.minimum(n_eq, ties_taken) - sel.to(tl.int32)
    else:
        sel = gt | (eq & (tl.cumsum(eq_i, 0) - eq_i < ties_taken))
        sel_i = sel.to(tl.int32)
        slot = tl.cumsum(sel_i, 0) - sel_i
    tl.store(index_ptr + slot, rows.to(tl.int64), mask=sel)
    tl.store(valid_ptr + slot, sel.to(tl.int8), mask=sel)
    rest = need + tl.arange(0, KP)
    tl.store(index_ptr + rest, tl.full([KP], pad, tl.int64), mask=rest < kk)
    tl.store(valid_ptr + rest, tl.zeros([KP], tl.int8), mask=rest < kk)
