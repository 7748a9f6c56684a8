"""Exact top-k selection of compressed rows (DESIGN §3.3).

The k highest scores among the visible rows; ties go to the lower row index; a row a query cannot
see is never selected. Every fused or hierarchical variant must return the same set as
`select_topk`.
"""

from __future__ import annotations

import torch


def select_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices [T, min(k, N)] of the selected rows and their validity [T, min(k, N)].

    A stable descending sort keeps equal scores in index order, so its first k are exactly the set
    the tie rule defines. Fewer than k visible rows leave invalid slots (index 0, valid False).
    """
    T, n = scores.shape
    kk = min(k, n)
    if kk <= 0:
        empty = torch.zeros(T, 0, dtype=torch.long, device=scores.device)
        return empty, empty.bool()
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :kk]
    valid = visible.gather(1, order)
    return torch.where(valid, order, torch.zeros_like(order)), valid


def selection_mask(index: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
    """The selected set as a boolean mask [T, n] (for comparing selections)."""
    counts = torch.zeros(index.shape[0], n, dtype=torch.int32, device=index.device)
    return counts.scatter_add_(1, index, valid.int()) > 0  # padding slots add 0 (never unselect)


# ---- one query, many rows: composite keys ---------------------------------------------------------
# A score and its row index packed in one int64 so that a plain "largest first" order is exactly the
# selection order: higher score first, then lower index. Scores map to an order-preserving unsigned
# 32-bit code (-0.0 is canonicalised to +0.0 first, as they compare equal); the low 32 bits hold
# 0xFFFFFFFF - index.

_LOW = 0xFFFFFFFF


def composite_keys(scores: torch.Tensor, n_visible: int) -> torch.Tensor:
    """int64 keys [N] for one query's scores; rows >= n_visible get the smallest key."""
    bits = (scores.float() + 0.0).view(torch.int32).to(torch.int64) & _LOW
    ordered = torch.where(bits >= 0x80000000, _LOW - bits, bits | 0x80000000)
    idx = torch.arange(scores.shape[0], device=scores.device, dtype=torch.int64)
    keys = ((ordered - 0x80000000) << 32) | (_LOW - idx)
    return torch.where(idx < n_visible, keys, torch.full_like(keys, torch.iinfo(torch.int64).min))


def keys_to_selection(keys: torch.Tensor, n_visible: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = _LOW - (keys & _LOW)
    valid = index < n_visible
    return torch.where(valid, index, torch.zeros_like(index)), valid


def select_topk_keys(scores: torch.Tensor, n_visible: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode-time selection (rows 0..n_visible-1 visible) with one ``torch.topk`` over composite keys."""
    kk = min(k, scores.shape[0])
    keys = torch.topk(composite_keys(scores, n_visible), kk, sorted=True).values
    return keys_to_selection(keys, n_visible)


_block_kernel = None


def _build_block_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def block_topk_kernel(scores_ptr, out_ptr, n_rows, n_visible, K: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(scores_ptr + idx, mask=idx < n_rows, other=0.0) + 0.0
        bits = s.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        ordered = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)
        keys = ((ordered - 0x80000000) << 32) | (0xFFFFFFFF - idx.to(tl.int64))
        keys = tl.where(idx < n_visible, keys, -9223372036854775808)
        top = tl.sort(keys, 0, descending=True)
        pos = tl.arange(0, BLOCK)
        tl.store(out_ptr + pid * K + pos, top, mask=pos < K)

    return block_topk_kernel


def select_topk_blocked(scores: torch.Tensor, n_visible: int, k: int, block: int = 4096,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused per-block top-k (Triton: each block sorts its composite keys and keeps k) then a merge of the
    candidates; the same set as `select_topk_keys` because a row in the global top-k is in its block's top-k."""
    global _block_kernel
    if _block_kernel is None:
        _block_kernel = _build_block_kernel()
    n = scores.shape[0]
    kk = min(k, n)
    if n <= block:
        return select_topk_keys(scores, n_visible, k)
    n_blocks = -(-n // block)
    keep = min(kk, block)
    cand = torch.empty(n_blocks * keep, dtype=torch.int64, device=scores.device)
    _block_kernel[(n_blocks,)](scores.contiguous(), cand, n, n_visible, K=keep, BLOCK=block)
    keys = torch.topk(cand, kk, sorted=True).values
    return keys_to_selection(keys, n_visible)


def select_topk_threshold(scores: torch.Tensor, n_visible: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode-time selection from a float ``torch.topk``: every row above the k-th score, then the lowest-index
    rows equal to it until k are taken (exactly the tie rule), with no host synchronisation."""
    s = scores[:n_visible].float() + 0.0  # canonical zero
    kk = min(k, n_visible)
    if kk == 0:
        return select_topk_keys(scores, n_visible, k)
    kth = torch.topk(s, kk, sorted=False).values.min()
    above = s > kth
    ties = s == kth
    need = kk - above.sum()
    chosen = above | (ties & (torch.cumsum(ties.int(), 0) <= need))
    index = torch.nonzero_static(chosen, size=min(k, scores.shape[0]), fill_value=-1).squeeze(-1)
    valid = index >= 0
    return torch.where(valid, index, torch.zeros_like(index)), valid


# ---- one query, many rows: radix select on the GPU ------------------------------------------------
# The k-th largest score is found exactly by histogram levels over the RADIX_BITS-bit digits of the scores'
# order-preserving 32-bit code (a level counts only the rows whose higher digits match the k-th code's so far);
# every row above it is selected, then the lowest-index rows equal to it until k are taken. The output lists the
# selected rows in ascending index order (a prefix count over the programs places each row), so it is
# deterministic. 32 / RADIX_BITS + 2 phases: on the GPU one launch whose programs (at most one per multiprocessor,
# so all resident) meet at grid barriers; in the CPU interpreter, which runs programs one after another, one launch
# per phase. Few bins per level, because Triton's histogram costs about linearly in bins (a ballot per bit of the
# bin number, then a popcount per bin and lane): H200, 128 programs x 2,048 scores, one launch: 256 bins 3.1 us,
# 1,024 bins 8.0 us, 2,048 bins 12.0 us; a grid barrier (one per level) ~0.7 us.

# The k-th code's bucket listed and sorted once 16 bits are settled (RADIX_CANDIDATES, 256) measured slower and was
# removed (H100, e8b13f3, scripts/compressed_kernels_ab.py --parts pair, scoring + top-512 of 262,144 rows from DRAM,
# us without / with it: 30.7 / 32.6, first level in the indexer 30.1 / 32.1). So was its later form (CANDIDATES,
# 852a565..d273840, removed): the levels stopped once at most 256 rows matched the k-th code's digits so far, the
# count phase listed them (code, row) by a global atomic, and the listing ranked them pairwise, one level and one grid
# barrier fewer; the same sets, but a CSA layer's top-512 at 1M took 18.0 us against 12.5 (H100, 2b0e4dd, `ds4x
# bench frontier --weights q2 --experts 128 --contexts 1048576 --steps 50 --variant "cand: ...CANDIDATES=256"`, two
# rounds alternating; the 41 layers 1.452, 1.456 against 1.343, 1.338 ms).

# workspace (int32), one per row of scores: [0] and [1] the barrier counts of alternate fused launches, [2] barrier
# timeouts, [3] fused launches so far; from 64 the levels' histograms (at most 1,024 bins in all); from 1088 per
# program the rows above / equal to the k-th score
_MAX_PROGRAMS = 1024
_BINS_AT = 64  # the histograms' first word
_WORKSPACE = _BINS_AT + 1024 + 2 * _MAX_PROGRAMS
_MAX_TILE = 8192  # a program's scores stay in registers


_WORKSPACES: dict[tuple[torch.device, int], torch.Tensor] = {}


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index: "cuda" is the current CUDA device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _workspace(device: torch.device, rows: int) -> torch.Tensor:
    """Scratch of the radix select for ``rows`` rows of scores on ``device`` (its histograms and the next launch's
    barrier counter zero between calls; one stream at a time; one per row count, so a captured step keeps its
    own). "cuda" is the current CUDA device, so that its caller and a tensor's ``.device`` ("cuda:0") find the same
    scratch."""
    key = (_indexed(device), rows)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = torch.zeros(rows, _WORKSPACE, dtype=torch.int32, device=device)
    return _WORKSPACES[key]


def radix_barrier_timeouts(device: torch.device) -> int:
    """Grid barriers that gave up waiting since start-up (0 unless programs were not all resident)."""
    device = _indexed(device)
    return sum(int(ws[:, 2].sum()) for (dev, _), ws in _WORKSPACES.items() if dev == device)


# Rows of up to SMALL_ROWS scores (SMALL_ROWS_BATCHED when a step selects for 8 or more rows) are selected by one
# program each (SMALL_BY_HISTOGRAM below, else `radix_small_kernel`: SMALL_BITS bits of the k-th code per step;
# SMALL_WARPS warps, else 8 up to 2,048 scores and 16 above); more by the multi-program radix_kernel (RADIX_WARPS
# warps). H200, top-512, graph-replayed, us, radix_small_kernel / multi-program (87fe9ab's kernel, 4 warps): 1,024
# scores 8.4 / 11.9 (1 row), 8.4 / 12.4 (32 rows); 4,160 scores 28.2 / 12.5 (1 row); multi-program only: 32,768
# scores 13.5 (1 row), 19.7 (8 rows); 262,144 scores 21.4 (19.7 with 8 warps). Rows of 2,049 to 8,192 scores in
# steps of 8 or more sessions were measured only with the earlier multi-program kernel (then slower).
SMALL_ROWS = 2048
SMALL_ROWS_BATCHED = 8192
SMALL_BITS = 2
SMALL_WARPS: int | None = None
SMALL_PACKED = True  # a step's candidate counts packed in one int64 (one reduction); False: a vector of counts
# Small rows by one program of the histogram select (`radix_kernel` with LOCAL: SMALL_HISTOGRAM_BITS-bit levels,
# its histograms its own, on the GPU by shared-memory atomics when SHARED_HISTOGRAM); False: radix_small_kernel.
# sm_90 SASS, 1,024 scores, 8 warps: 13 barriers and 1,176 instructions at 4 bits (16 bins: the threshold's
# reductions stay inside a warp), 50 and 1,024 at 8 bits, against 52 and 2,048 for radix_small_kernel. H100
# (42a413d, scripts/compressed_kernels_ab.py), us against radix_small_kernel: 1 x 1,024 scores 3.7 / 6.4, 32 x
# 1,024 6.3 / 9.0, 8 x 8,192 12.4 / 25.5, every selection exact.
SMALL_BY_HISTOGRAM = True
SMALL_HISTOGRAM_BITS = 4
RADIX_WARPS = 4
# Bits of the k-th code the multi-program select settles per histogram level (4: 8 levels of 16 bins; 8: 4 of
# 256). H200, 262,144 scores: 8 bits 22.1 us, 4 bits 24.2 (with the early exit 19.4 / 19.3; slower at 4,160 and
# 32,768 scores either way)
RADIX_BITS = 8
# The histograms counted by one shared-memory atomic increment per score (GPU; `shared_histogram` in
# ds4x.kernels.triton_indexer) instead of tl.histogram, whose warp-wide ballots and popcounts are most of the
# multi-program kernel's instructions (sm_90 SASS, 2,048 scores a program: 6,472 instructions, VOTE 576, POPC 524;
# 3,184 with this). H100 (42a413d, scripts/compressed_kernels_ab.py), us against tl.histogram: 262,144 scores 14.9 /
# 19.3, 32,768 12.2 / 12.9, 4,160 10.5 / 11.3, 8 x 32,768 15.9 / 20.3, every selection exact.
SHARED_HISTOGRAM = True


def _check_digit_bits(name: str, bits: int) -> None:
    """The histogram select's digit width: it divides 32, and all levels' bins fit the 1,024 words of the workspace
    (and of the shared-memory bins)."""
    if 32 % bits or (32 // bits) << bits > 1024:
        raise ValueError(f"{name} must divide 32 with at most 1,024 histogram bins in all, got {bits}")


# The multi-program select's first digit level counted by the indexer kernel where it writes the scores
# (`radix_first_level`), so that the select starts at the second level, one grid barrier fewer. H100 (e8b13f3), off
# / on: scripts/compressed_kernels_ab.py --parts pair (scoring + top-512 of 262,144 rows from DRAM, every selection
# exact) 30.7 / 30.1 us; `ds4x bench frontier --weights q2 --experts 128 --contexts 1048576 --steps 50`, two
# alternating runs each: top-k 13.3, 13.3 / 12.7, 12.7 us, the 41 compressed layers' sum 1.455, 1.456 / 1.440, 1.441
# ms, their graph 1.513, 1.515 / 1.501, 1.505 ms.
FIRST_LEVEL_IN_INDEXER = True
# Not kept: only the programs whose tile holds a visible score taking part (LIVE_PROGRAMS, 1b339f7..9e32ff8,
# removed). A captured step's scores are as wide as its span, so a 1M session at a 4K position ran all 128 programs
# over 1,024 visible scores; the position spans (`ds4x.runtime.decode_graph.POSITION_SPANS`) took most of what it
# saved. H100, `scripts/batched_decode.py -m flash:q2:128 --batches 1 --capacity 1048576 --rounds 2`, replay ms
# without / with: at 4K without spans (03d142b) 6.48, 6.51 / 6.46, 6.45; at 200K with spans (754f523) 6.58, 6.59 /
# 6.57, 6.57; at 100K (b824a9c) 6.30 / 6.30; the frontier at 1M 1.343, 1.335 / 1.339, 1.339 ms (41 layers, sum)


def _multi_program(n: int, rows: int, small: bool | None) -> bool:
    """Whether `select_topk_radix` runs the multi-program select on ``rows`` rows of ``n`` scores."""
    return not ((n <= (SMALL_ROWS_BATCHED if rows >= 8 else SMALL_ROWS)) if small is None else small)


def radix_first_level(n: int, rows: int, device: torch.device) -> torch.Tensor | None:
    """The bins [rows, 2^RADIX_BITS] (int32, zero between calls) of the multi-program select's first digit level
    for ``rows`` rows of ``n`` scores, for the kernel that makes the scores to count into
    (`ds4x.kernels.indexer.indexer_scores_triton`'s ``first_level``); the select then starts at the second level
    (``first_level_counted``). None where that select would not read them (one program a row) or
    FIRST_LEVEL_IN_INDEXER is off."""
    if not FIRST_LEVEL_IN_INDEXER or not _multi_program(n, rows, None):
        return None
    return _workspace(device, rows)[:, _BINS_AT : _BINS_AT + (1 << RADIX_BITS)]


def radix_tiling(n: int, rows: int, sms: int) -> tuple[int, int]:
    """Scores per program and programs per row of the multi-program select over ``rows`` rows of ``n`` scores on
    ``sms`` multiprocessors: the rows' programs together about fill the GPU."""
    tile = min(_MAX_TILE, max(256, 1 << (-(-n * min(rows, sms) // sms) - 1).bit_length()))
    return tile, -(-n // tile)


def select_topk_radix(scores: torch.Tensor, n_visible: int | torch.Tensor, k: int, fused: bool | None = None,
                      small: bool | None = None, pad: int = 0, first_level_counted: bool = False,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode-time selection (rows 0..n_visible-1 visible) by an exact radix select in Triton; the same set as
    `select_topk_keys`, listed in ascending row order. ``n_visible`` may be an integer tensor on the device (CUDA
    graphs: the count is read when the kernel runs). Scores [B, n] (a batched decode step) with ``n_visible`` a
    device tensor [B] select per row -> [B, min(k, n)], in one launch. Up to ``SMALL_ROWS`` scores a row (see
    there; or with ``small``) one program selects each row; otherwise ``fused`` (default: on the GPU) runs the
    phases of the multi-program select (``RADIX_BITS``) in one launch with grid barriers, or one launch per
    phase. Slots no visible row fills hold index ``pad`` (-1: the attention's "no row", so the index needs no
    masking after). ``first_level_counted``: the scores' kernel counted the first digit level into
    `radix_first_level`'s bins (the multi-program select only)."""
    from ds4x.formats.pdl import launch_options
    from ds4x.kernels.indexer import num_sms
    from ds4x.kernels.triton_indexer import radix_kernel, radix_small_kernel

    batched = scores.dim() == 2
    scores2 = scores if batched else scores[None]
    B, n = scores2.shape
    count = n_visible if isinstance(n_visible, torch.Tensor) else None
    if batched and (count is None or count.numel() != B):
        raise ValueError(f"select_topk_radix: {B} rows of scores need a device tensor of {B} visible counts")
    kk = min(k, n)
    index = torch.empty(B, kk, dtype=torch.long, device=scores.device)
    valid = torch.empty(B, kk, dtype=torch.bool, device=scores.device)
    if kk == 0 or B == 0:
        return (index, valid) if batched else (index[0], valid[0])
    flat = scores2.contiguous().float()
    kp = 1 << (kk - 1).bit_length()
    multi = _multi_program(n, B, small)
    if first_level_counted and not multi:
        raise ValueError("first_level_counted: the first level is counted only for the multi-program select")
    if not multi:
        tile = max(16, 1 << (n - 1).bit_length())
        visible = n if count is not None else min(n_visible, n)
        counts = index if count is None else count  # an unread pointer without a count
        warps = SMALL_WARPS or (8 if tile <= 2048 else 16)
        if SMALL_BY_HISTOGRAM:
            # at least one score per thread: a thread holding a copy of another's score would count it again in
            # the shared-memory histogram (the scores past n are masked)
            tile = max(tile, 32 * warps)
            _check_digit_bits("SMALL_HISTOGRAM_BITS", SMALL_HISTOGRAM_BITS)
            # LOCAL reads no workspace: ``index`` is passed as an unread pointer
            radix_kernel[(1, B)](flat, n, visible, counts, kk, 1, index, index,
                                 valid.view(torch.int8), pad, TILE=tile, KP=kp, BITS=SMALL_HISTOGRAM_BITS, FIRST=0,
                                 LAST=32 // SMALL_HISTOGRAM_BITS + 1, DEVICE_COUNT=count is not None, WS=_WORKSPACE,
                                 MAX_PROGRAMS=_MAX_PROGRAMS, SHARED_BINS=scores.is_cuda and SHARED_HISTOGRAM,
                                 LOCAL=True, num_warps=warps, **launch_options(scores.device, "topk_small"))
        else:
            # packed: the 2**SMALL_BITS - 1 candidates' counts (each up to tile) in the fields of one int64
            if 32 % SMALL_BITS or (SMALL_PACKED and ((1 << SMALL_BITS) - 1) * tile.bit_length() > 64):
                raise ValueError(f"SMALL_BITS must divide 32 and, with SMALL_PACKED, leave the "
                                 f"{(1 << SMALL_BITS) - 1} counts of {tile.bit_length()} bits room in 64; got "
                                 f"{SMALL_BITS} for {tile} scores")
            radix_small_kernel[(B,)](flat, n, visible, counts, kk, index, valid.view(torch.int8), pad, TILE=tile,
                                     KP=kp, BITS=SMALL_BITS, DEVICE_COUNT=count is not None, PACKED=SMALL_PACKED,
                                     num_warps=warps, **launch_options(scores.device, "topk_small"))
        return (index, valid) if batched else (index[0], valid[0])
    fused = scores.is_cuda if fused is None else fused
    # the programs of a launch meet at grid barriers, so all must be resident: at most one per multiprocessor
    sms = num_sms(scores.device)
    tile, n_prog = radix_tiling(n, B, sms)
    if n_prog > _MAX_PROGRAMS:
        raise ValueError(f"select_topk_radix: {n} rows need {n_prog} programs (at most {_MAX_PROGRAMS})")
    per_launch = max(1, sms // n_prog)  # rows of scores per launch
    ws = _workspace(scores.device, B)
    pdl = launch_options(scores.device)
    _check_digit_bits("RADIX_BITS", RADIX_BITS)
    listing = 32 // RADIX_BITS + 1  # phases: the histogram levels, the count, the listing
    first = 1 if first_level_counted else 0
    phases = [(first, listing)] if fused else [(i, i) for i in range(first, listing + 1)]
    for r0 in range(0, B, per_launch):
        r1 = min(B, r0 + per_launch)
        counts = index[r0] if count is None else count.reshape(-1)[r0:r1]  # an unread pointer without a count
        args = (flat[r0:r1], n, n if count is not None else min(n_visible, n), counts, kk, n_prog, ws[r0:r1],
                index[r0:r1], valid[r0:r1].view(torch.int8), pad)
        for first, last in phases:
            radix_kernel[(n_prog, r1 - r0)](*args, TILE=tile, KP=kp, BITS=RADIX_BITS, FIRST=first, LAST=last,
                                            DEVICE_COUNT=count is not None, WS=_WORKSPACE,
                                            MAX_PROGRAMS=_MAX_PROGRAMS, num_warps=RADIX_WARPS,
                                            SHARED_BINS=fused and scores.is_cuda and SHARED_HISTOGRAM, **pdl)
        if not fused:  # each phase's launch re-read the histograms, so none of them could zero them
            ws[r0:r1, _BINS_AT : _BINS_AT + 1024].zero_()
    return (index, valid) if batched else (index[0], valid[0])


def scored_topk_radix(q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, n_rows: int | torch.Tensor,
                      packed: bool, k: int, pad: int = -1) -> torch.Tensor:
    """The indexer's scores of the rows (`ds4x.kernels.indexer.indexer_scores_triton`, arguments as there) and the
    rows of their top ``k`` by `select_topk_radix` (slots no row fills: ``pad``), the select's first digit level
    counted by the indexer where the select takes it (`radix_first_level`): how a decode step pairs them."""
    from ds4x.kernels.indexer import indexer_scores_triton

    width = rows.shape[-2] if isinstance(n_rows, torch.Tensor) else n_rows
    first_level = radix_first_level(width, q.shape[0] if q.dim() == 3 else 1, rows.device)
    scores = indexer_scores_triton(q, weights, rows, n_rows, packed, first_level=first_level)
    return select_topk_radix(scores, n_rows, k, pad=pad, first_level_counted=first_level is not None)[0]
