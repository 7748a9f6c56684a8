"""Triton decode kernels (indexer scoring, top-k, attention over stored rows) against the torch reference.

On the CPU they run in the Triton interpreter (tests/conftest.py selects it) at small shapes; the `gpu`
tests run compiled at Flash shapes.
"""

from functools import partial

import pytest
import torch

from ds4x.formats import (
    hadamard128,
    mxfp4_roundtrip,
    pack_indexer_rows,
    pack_kv_rows,
    unpack_indexer_rows,
    unpack_kv_rows,
)
from ds4x.kernels.select import (
    select_topk,
    select_topk_blocked,
    select_topk_keys,
    select_topk_radix,
    select_topk_threshold,
    selection_mask,
)

pytest.importorskip("triton")


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _indexer_case(n, heads, seed, device):
    g = torch.Generator().manual_seed(seed)
    rows = pack_indexer_rows(hadamard128(torch.randn(n, 128, generator=g))).to(device)
    q = mxfp4_roundtrip(hadamard128(torch.randn(heads, 128, generator=g)), 32).to(device)
    w = torch.randn(heads, generator=g).to(device)
    return rows, q, w


def _reference_scores(q, w, rows, n):
    from ds4x.kernels.indexer import indexer_scores

    return indexer_scores(q[None].float(), w[None].float(), lambda a, b: unpack_indexer_rows(rows[a:b]), n)[0]


@pytest.mark.parametrize("n, heads, spread", [(200, 16, False), (513, 64, True)])
def test_indexer_scores_packed_and_unpacked_rows(n, heads, spread):
    from ds4x.kernels.indexer import indexer_scores_triton

    rows, q, w = _indexer_case(n, heads, 0, _device())
    if spread:  # block scales of a row far apart (the kernel rescales blocks relative to the row's largest)
        x = unpack_indexer_rows(rows.cpu())
        x[::3, 32:64] *= 2.0**-20
        x[1::3, 96:] *= 2.0**12
        x[2::7] = 0.0
        rows = pack_indexer_rows(x).to(rows.device)
    packed = indexer_scores_triton(q, w, rows, n, packed=True)
    unpacked = indexer_scores_triton(q, w, unpack_indexer_rows(rows).contiguous(), n, packed=False)
    ref = _reference_scores(q, w, rows, n)
    assert torch.equal(packed, unpacked)  # same arithmetic whatever the storage
    assert float((packed - ref).abs().max()) <= 2e-6 * float(ref.abs().max())


def test_indexer_and_radix_take_the_row_count_from_the_device():
    """CUDA graphs pass the row count as a device tensor: same scores on the counted rows, same selection."""
    from ds4x.kernels.indexer import indexer_scores_triton

    rows, q, w = _indexer_case(300, 16, 5, _device())
    for n in (0, 1, 129, 300):
        count = torch.tensor([n], device=rows.device)
        scores = indexer_scores_triton(q, w, rows, count, packed=True)
        assert scores.shape == (300,)
        if n:
            assert torch.equal(scores[:n], indexer_scores_triton(q, w, rows, n, packed=True))
        for k in (64, 512):
            for small in (True, False):
                by_device = select_topk_radix(scores, count, k, small=small)  # rows from n on are never read
                by_host = select_topk_radix(scores[:n] if n else scores[:1], n, k, small=small)
                assert torch.equal(by_device[1][: by_host[1].numel()], by_host[1])
                assert torch.equal(by_device[0][by_device[1]], by_host[0][by_host[1]])
                assert not bool(by_device[1][by_host[1].numel():].any())


def test_indexer_scores_for_a_chunk_of_queries_are_the_decode_bits():
    """T queries in one launch, each with its own row count (the rows closed by its position): the same bits per
    row as one decode call per query."""
    from ds4x.kernels.indexer import indexer_scores_triton

    dev = _device()
    rows, q, w = _indexer_case(300, 8, seed=7, device=dev)
    qs = torch.stack([q, q.flip(0), q * 0.5])
    ws = torch.stack([w, w.flip(0), w])
    counts = torch.tensor([300, 0, 129], device=dev)
    scores = indexer_scores_triton(qs, ws, rows, counts, packed=True)
    assert scores.shape == (3, 300)
    for t, n in enumerate(counts.tolist()):
        if n:
            assert torch.equal(scores[t, :n], indexer_scores_triton(qs[t], ws[t], rows, n, packed=True))
    with pytest.raises(ValueError, match="one per query"):
        indexer_scores_triton(qs, ws, rows, counts[:2], packed=True)


def test_blocked_topk_is_the_simple_topk_with_many_ties():
    g = torch.Generator().manual_seed(3)
    for n, n_vis, k in [(5000, 4800, 512), (3000, 3000, 64), (2500, 90, 512)]:
        scores = torch.randint(-4, 5, (n,), generator=g).float()
        scores[::5] = -0.0
        scores = scores.to(_device())
        vis = (torch.arange(n) < n_vis).to(_device())
        ref = selection_mask(*select_topk(scores[None], vis[None], k), n)[0]
        for fn in (select_topk_keys, select_topk_threshold, select_topk_radix, partial(select_topk_radix, small=False),
                   lambda s, v, kk: select_topk_blocked(s, v, kk, block=1024)):
            index, valid = fn(scores, n_vis, k)
            assert torch.equal(selection_mask(index[None], valid[None], n)[0], ref)


@pytest.mark.parametrize(("bits", "packed", "by_histogram"), [(8, True, False), (4, False, False), (4, True, True)])
def test_radix_select_when_the_kth_score_shares_its_high_digits(bits, packed, by_histogram, monkeypatch):
    """The k-th score found digit by digit (the multi-program select at 8 or 4 bits a level; the one-program select
    by histogram levels of that width, or with its candidates' counts packed or not): scores whose order-preserving
    codes agree in the top one, two or three bytes and differ below, exact ties at the k-th, negative scores and
    -0.0 / +0.0."""
    from ds4x.kernels import select

    monkeypatch.setattr(select, "RADIX_BITS", bits)
    monkeypatch.setattr(select, "SMALL_PACKED", packed)
    monkeypatch.setattr(select, "SMALL_BY_HISTOGRAM", by_histogram)
    monkeypatch.setattr(select, "SMALL_HISTOGRAM_BITS", bits)
    g = torch.Generator().manual_seed(6)
    base = torch.tensor(1.5).view(torch.int32)
    for low_bits in (8, 16, 24):  # codes differ only in their low 8 / 16 / 24 bits
        offsets = torch.randint(0, 1 << low_bits, (3000,), generator=g, dtype=torch.int32)
        scores = (base + offsets).view(torch.float32)
        scores[::9] = scores.sort(descending=True).values[450]  # exact ties across rank 512
        scores[1::11] = -scores[1::11]
        scores[2::13] = -0.0
        scores[3::13] = 0.0
        scores = scores.to(_device())
        for n_vis, k in [(3000, 512), (2999, 64), (700, 512)]:
            ref = selection_mask(*select_topk(scores[None], (torch.arange(3000) < n_vis).to(_device())[None], k),
                                 3000)
            for small in (True, False):
                index, valid = select_topk_radix(scores, n_vis, k, small=small)
                assert torch.equal(selection_mask(index[None], valid[None], 3000), ref), (low_bits, n_vis, k, small)


def test_radix_select_over_a_wide_store_with_few_visible_scores(monkeypatch):
    """A captured step's scores are as wide as the session's capacity while few may be visible: the multi-program
    select selects exactly the reference's rows, in row order, for each row of a batch whose counts are 0, part of
    the first tile (fewer than k), three whole tiles and part of a fourth (more than k: a real selection by a few of
    the 16 programs) and all; called twice, so the workspace it leaves must be ready for the next call."""
    from ds4x.kernels import indexer, select

    monkeypatch.setattr(indexer, "num_sms", lambda device: 132)  # tiles of 256 scores, 16 programs a row
    dev, n, k = _device(), 4096, 512
    assert select.radix_tiling(n, 5, 132) == (256, 16)
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(5, n, generator=g)
    scores[:, ::9] = 0.5  # ties across tiles
    scores = scores.to(dev)
    counts = torch.tensor([0, 300, 768, 1000, n], device=dev)
    for _ in range(2):
        index, valid = select.select_topk_radix(scores, counts, k)
        for b, c in enumerate(counts.tolist()):
            visible = (torch.arange(n) < c).to(dev)[None]
            want = selection_mask(*select_topk(scores[b][None], visible, k), n)
            assert torch.equal(selection_mask(index[b][None], valid[b][None], n), want), (b, c)
            assert int(valid[b].sum()) == min(k, c)
            got = index[b][valid[b]]
            assert torch.equal(got, got.sort().values)


def _first_digits(scores: torch.Tensor, bits: int) -> torch.Tensor:
    """Counts of the top ``bits`` bits of the scores' order-preserving codes (-0.0 as +0.0), as the select's level 0."""
    raw = (scores.float() + 0.0).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    codes = torch.where(raw >= 0x80000000, 0xFFFFFFFF - raw, raw | 0x80000000)
    return torch.bincount((codes >> (32 - bits)).cpu(), minlength=1 << bits).int()


@pytest.mark.parametrize("in_indexer", [True, False], ids=["first level in the indexer", "first level in the select"])
@pytest.mark.parametrize("queries", [1, 3])
def test_indexer_counts_the_selects_first_level(queries, in_indexer, monkeypatch):
    """``first_level`` (`radix_first_level`, FIRST_LEVEL_IN_INDEXER on): the indexer adds to each query's bins the
    first radix digits of its scored rows (those below its count; zero scores, from all-zero rows under negative
    weights, as +0.0), and the multi-program select started at its second level from them selects exactly and
    leaves them zero; off, there are no bins and the select counts all its levels. Either way `scored_topk_radix`,
    the pairing the model calls, picks the same rows. One query, and a batch of 3 each with its own store and
    count."""
    from ds4x.kernels import select
    from ds4x.kernels.indexer import indexer_scores_triton
    from ds4x.kernels.select import RADIX_BITS, radix_first_level, scored_topk_radix

    monkeypatch.setattr(select, "FIRST_LEVEL_IN_INDEXER", in_indexer)
    n, k, dev = 3000, 512, _device()
    cases = [_indexer_case(n, 16, 20 + i, dev) for i in range(queries)]
    rows = torch.stack([r for r, _, _ in cases])
    rows[0, 100:160] = 0  # zero keys: every head's product 0, so a score of -0.0 under negative weights
    q = torch.stack([c[1] for c in cases])
    w = -torch.stack([c[2] for c in cases]).abs()
    count = torch.tensor([2900, 3000, 1800][:queries], device=dev)
    bins = radix_first_level(n, queries, torch.device(dev))
    if in_indexer:
        assert bins is not None and bins.shape == (queries, 1 << RADIX_BITS) and int(bins.abs().sum()) == 0
    else:
        assert bins is None
    one = (lambda t: t[0]) if queries == 1 else (lambda t: t)  # one query: its own shapes, no batch dimension
    scores = indexer_scores_triton(one(q), one(w), one(rows), count, True, first_level=bins).reshape(queries, n)
    assert bool((scores[0, 100:160] == 0).all())  # (a sum of -0.0 products is -0.0 on the GPU's reductions)
    if bins is not None:
        for b in range(queries):
            assert torch.equal(bins[b].cpu(), _first_digits(scores[b, : int(count[b])], RADIX_BITS))
    picked, valid = select_topk_radix(one(scores), count, k, first_level_counted=in_indexer)
    if bins is not None:
        assert int(bins.abs().sum()) == 0
    picked, valid = picked.reshape(queries, -1), valid.reshape(queries, -1)
    for b in range(queries):
        visible = (torch.arange(n) < int(count[b])).to(dev)[None]
        ref = selection_mask(*select_topk(scores[b][None], visible, k), n)[0]
        assert torch.equal(selection_mask(picked[b][None], valid[b][None], n)[0], ref)
    paired = scored_topk_radix(one(q), one(w), one(rows), count, True, k)
    assert torch.equal(paired.reshape(queries, -1), torch.where(valid, picked, -1))


@pytest.mark.parametrize(("bits", "by_histogram"), [(8, True), (4, True), (2, True), (2, False)])
def test_small_rows_by_one_program(bits, by_histogram, monkeypatch):
    """Rows of up to SMALL_ROWS scores by one program, of the histogram select (``SMALL_BY_HISTOGRAM``: its own
    histograms, no workspace) or the packed-count kernel, select exactly: codes agreeing in their high bytes with
    ties at the k-th, a row count from the device (CUDA graphs), a batch of rows each its own (one empty), the
    listing in row order with padding."""
    from ds4x.kernels import select

    monkeypatch.setattr(select, "SMALL_BY_HISTOGRAM", by_histogram)
    test_radix_select_when_the_kth_score_shares_its_high_digits(bits, True, by_histogram, monkeypatch)
    test_indexer_and_radix_take_the_row_count_from_the_device()
    test_batched_decode_kernels_are_each_query_alone()
    test_radix_select_lists_the_selection_in_row_order(True)


def test_one_program_select_refuses_digit_widths_its_packed_counts_cannot_hold(monkeypatch):
    from ds4x.kernels import select

    scores = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(_device())
    monkeypatch.setattr(select, "SMALL_BY_HISTOGRAM", False)
    monkeypatch.setattr(select, "SMALL_BITS", 4)  # 15 counts of 11 bits: 165 bits
    with pytest.raises(ValueError, match="SMALL_BITS"):
        select_topk_radix(scores, 1000, 64, small=True)
    monkeypatch.setattr(select, "SMALL_PACKED", False)  # a vector of counts: any width that divides 32
    index, valid = select_topk_radix(scores, 1000, 64, small=True)
    ref = selection_mask(*select_topk(scores[None], torch.ones(1, 1000, dtype=torch.bool, device=_device()), 64), 1000)
    assert torch.equal(selection_mask(index[None], valid[None], 1000), ref)


@pytest.mark.parametrize("small", [True, False], ids=["one-program", "multi-program"])
def test_radix_select_lists_the_selection_in_row_order(small):
    g = torch.Generator().manual_seed(4)
    for n, n_vis, k in [(3000, 2999, 512), (600, 0, 16), (40, 40, 64)]:
        scores = torch.randn(n, generator=g).to(_device())
        index, valid = select_topk_radix(scores, n_vis, k, small=small)
        ref = selection_mask(*select_topk(scores[None], (torch.arange(n) < n_vis).to(_device())[None], k), n)[0]
        assert torch.equal(selection_mask(index[None], valid[None], n)[0], ref)
        assert valid.tolist() == [True] * min(k, n_vis) + [False] * (min(k, n) - min(k, n_vis))
        assert bool((index[valid].diff() > 0).all()) and bool((index[~valid] == 0).all())
        padded, valid2 = select_topk_radix(scores, n_vis, k, small=small, pad=-1)
        assert torch.equal(valid2, valid) and torch.equal(padded, torch.where(valid, index, -1))


@pytest.mark.parametrize("dim, rope, heads", [(128, 64, 16), (512, 64, 64)])
def test_attention_over_packed_rows_matches_reference(dim, rope, heads):
    from ds4x.kernels.attention import attention_decode_triton

    if dim == 512 and not torch.cuda.is_available():
        pytest.skip("Flash shapes only compiled on the GPU (too slow in the interpreter)")
    g = torch.Generator().manual_seed(1)
    dev = _device()
    x = torch.randn(300, dim, generator=g) * 3
    x[::4, 0] = 400.0  # the rest of that scale block then holds E4M3 subnormal codes
    rows = pack_kv_rows(x, rope_dim=rope).to(dev)
    q = torch.randn(heads, dim, generator=g).to(dev)
    sinks = torch.randn(heads, generator=g).to(dev)
    window = torch.arange(250, 300, device=dev)
    picked = torch.tensor([5, 17, -1, 80, 3, -1, 199], device=dev)
    plain = unpack_kv_rows(rows, rope_dim=rope)
    keys = plain[torch.cat([window, picked[picked >= 0]])]
    probs = torch.cat([q @ keys.T * dim**-0.5, sinks[:, None]], dim=1).softmax(-1)
    ref = probs[:, :-1] @ keys
    for config in (None, (16, 16, 4, 1)):  # a split per block; one split per source (an online softmax over blocks)
        out = attention_decode_triton(q, [(rows, window), (rows, picked)], sinks, dim**-0.5, dim - rope, True, config)
        out_f = attention_decode_triton(q, [(plain.contiguous(), window), (plain.contiguous(), picked)], sinks,
                                        dim**-0.5, dim - rope, False, config)
        assert torch.equal(out, out_f)
        assert float((out - ref).abs().max()) < 1e-4 * float(ref.abs().max())
    half, sources = q.bfloat16(), [(rows, window), (rows, picked)]  # a bf16 query is read as its float32 values
    assert torch.equal(attention_decode_triton(half, sources, sinks, dim**-0.5, dim - rope, True),
                       attention_decode_triton(half.float(), sources, sinks, dim**-0.5, dim - rope, True))
    # the merge launch applying the inverse RoPE: the bits of the RoPE kernel after it
    from ds4x.model.rope import apply_rope

    angles = torch.randn(1, rope // 2, generator=g).to(dev) * 3
    cos, sin = angles.cos(), angles.sin()
    plain_out = attention_decode_triton(q, sources, sinks, dim**-0.5, dim - rope, True)
    for dtype in (torch.bfloat16, torch.float32):
        fused = attention_decode_triton(q, sources, sinks, dim**-0.5, dim - rope, True,
                                        inverse_rope=(cos, sin, dtype))
        assert fused.dtype == dtype
        want = apply_rope(plain_out[None], cos, sin, inverse=True, dtype=dtype)[0]
        if dev == "cuda" or dtype == torch.float32:
            assert torch.equal(fused, want)
        else:  # the interpreter rounds float32 -> bfloat16 toward zero, the torch reference to nearest
            torch.testing.assert_close(fused.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_merge_configurations_agree(monkeypatch):
    """The merge of the splits by (splits per iteration, chunks per program): one 64-value chunk a program over
    64 splits at once, whole rows over 16 or 4 splits at a time (several iterations, the last partly empty); the
    same outputs to float rounding, with and without the inverse RoPE. Whole rows only for a batch with batch
    splits whose programs fill the waves asked (here: any), so a query alone keeps the chunks' bits."""
    from ds4x.kernels import attention as A
    from ds4x.kernels.attention import Slots, attention_decode_triton

    g = torch.Generator().manual_seed(21)
    dev = _device()
    rows = pack_kv_rows(torch.randn(400, 128, generator=g) * 2, rope_dim=64).to(dev)
    q = torch.randn(2, 16, 128, generator=g).to(dev)
    sinks = torch.randn(16, generator=g).to(dev)
    window = Slots(64, position=torch.tensor([363, 363], device=dev), ring=400)
    picks = torch.stack([torch.randperm(300, generator=g)[:90] for _ in range(2)]).to(dev)
    sources = [(rows[None].expand(2, *rows.shape), window), (rows[None].expand(2, *rows.shape), picks)]
    angles = torch.randn(2, 32, generator=g).to(dev)

    def run(**kw) -> list[torch.Tensor]:
        return [attention_decode_triton(q, sources, sinks, 128**-0.5, 64, True, (16, 16, 4, 64), **kw),
                attention_decode_triton(q, sources, sinks, 128**-0.5, 64, True, (16, 16, 4, 64),
                                        inverse_rope=(angles.cos(), angles.sin(), torch.float32), **kw)]

    monkeypatch.setattr(A, "COMBINE_ROWS_WAVES", 0)
    chunks = run()
    monkeypatch.setattr(A, "COMBINE_ROWS_WAVES", 1e-9)  # whole rows for any batch with batch splits
    assert all(torch.equal(a, b) for a, b in zip(run(), chunks, strict=True))  # no batch splits: chunks
    cut_chunks = None
    for rows_config in ((16, 8), (4, 2)):
        monkeypatch.setattr(A, "COMBINE_ROWS", rows_config)
        cut = run(batch_splits=True)
        monkeypatch.setattr(A, "COMBINE_ROWS_WAVES", 0)
        cut_chunks = run(batch_splits=True)
        monkeypatch.setattr(A, "COMBINE_ROWS_WAVES", 1e-9)
        for got, want in zip(cut, cut_chunks, strict=True):
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert cut_chunks is not None and not torch.equal(cut_chunks[0], cut_chunks[1])  # the RoPE columns rotated


def test_merge_of_many_splits_in_one_or_several_iterations(monkeypatch):
    """A query of more splits than the chunks' splits per iteration (an HCA layer at 1M has 111): up to twice as
    many are merged in one iteration, more in several, each moving the running sums to a new top; both agree with
    the float64 softmax over all rows and the sink, with the same kernel's single split (the same block products,
    no merge) and with each other to float rounding. (On the GPU the products are high + low bf16 parts: these
    scores reach ~25, so their error, not the merge's, puts single outputs 3.5e-4 off float64; 5.4e-6 over all.)"""
    from ds4x.kernels import attention as A
    from ds4x.kernels.attention import attention_decode_triton

    g = torch.Generator().manual_seed(8)
    dev = _device()
    x = torch.randn(1200, 128, generator=g) * 2
    x[600:700] *= 4  # a later split holds the largest scores: the running top moves
    rows = pack_kv_rows(x, rope_dim=64).to(dev)
    q = torch.randn(16, 128, generator=g).to(dev)
    sinks = torch.randn(16, generator=g).to(dev)
    picked = torch.arange(1200, device=dev)  # 75 blocks of 16 rows, a split each
    keys = unpack_kv_rows(rows, rope_dim=64).double()
    probs = torch.cat([q.double() @ keys.T * 128**-0.5, sinks.double()[:, None]], dim=1).softmax(-1)
    ref = (probs[:, :-1] @ keys).float()
    one = attention_decode_triton(q, [(rows, picked)], sinks, 128**-0.5, 64, True, (16, 16, 4, 1))
    outs = []
    for chunks in ((64, 1), (16, 1)):  # one iteration of 128 splits; five of 16
        monkeypatch.setattr(A, "COMBINE_CHUNKS", chunks)
        outs.append(attention_decode_triton(q, [(rows, picked)], sinks, 128**-0.5, 64, True, (16, 16, 4, 128)))
        torch.testing.assert_close(outs[-1], one, rtol=1e-5, atol=1e-5)
        err = float((outs[-1].double() - ref.double()).norm() / ref.double().norm())
        assert err < (1e-6 if dev == "cpu" else 2e-5)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("position", [3, 40, 299])
def test_attention_slots_from_the_position_match_explicit_indices(position):
    """Window-of-a-ring and closed-compressed-rows slots, derived in the kernel from the device position, give
    the same bits as the explicit index tensors they stand for (`Slots.explicit`)."""
    from ds4x.kernels.attention import Slots, attention_decode_triton

    g = torch.Generator().manual_seed(5)
    dev = _device()
    rows = pack_kv_rows(torch.randn(64, 128, generator=g) * 2, rope_dim=64).to(dev)
    q = torch.randn(16, 128, generator=g).to(dev)
    sinks = torch.randn(16, generator=g).to(dev)
    pos = torch.tensor([position], device=dev)
    window, comp = Slots(24, position=pos, ring=48), Slots(40, position=pos, ratio=8)
    assert window.explicit().tolist() == [p % 48 if p >= 0 else -1 for p in range(position - 23, position + 1)]
    assert comp.explicit().tolist() == [j if j < (position + 1) // 8 else -1 for j in range(40)]
    for config in (None, (16, 16, 4, 1)):  # one split per source: the blocks run in one program
        out = attention_decode_triton(q, [(rows, window), (rows, comp)], sinks, 128**-0.5, 64, True, config)
        ref = attention_decode_triton(q, [(rows, window.explicit()), (rows, comp.explicit())], sinks, 128**-0.5, 64,
                                      True, config)
        assert torch.equal(out, ref)
        native = attention_decode_triton(q, [(unpack_kv_rows(rows, rope_dim=64).contiguous(), window),
                                             (unpack_kv_rows(rows, rope_dim=64).contiguous(), comp)], sinks,
                                         128**-0.5, 64, False, config)
        assert torch.equal(out, native)


def test_attention_merge_leaves_empty_splits_unread():
    """The merge with SKIP_EMPTY: splits whose m is -inf (the partial pass found them empty) have their accumulator,
    never written, left unread: NaN there gives the bits of zeros there, where the merge without it reads the NaN."""
    from ds4x.kernels.triton_attention import combine_kernel

    g = torch.Generator().manual_seed(8)
    dev, n_split, hp, d = _device(), 12, 16, 128
    m = torch.randn(n_split, hp, generator=g)
    l = torch.rand(n_split, hp, generator=g) + 0.5
    acc = torch.randn(n_split, hp, d, generator=g)
    empty = torch.tensor([2, 3, 7, 11])
    m[empty], l[empty], acc[empty] = float("-inf"), 0.0, 0.0
    sinks = torch.randn(hp, generator=g)
    m, l, sinks = m.to(dev), l.to(dev), sinks.to(dev)

    def merge(acc: torch.Tensor, skip: bool) -> torch.Tensor:
        out = torch.empty(hp, d, device=dev)
        combine_kernel[(hp, 1, 1)](m, l, acc.to(dev), sinks, out, out, out, n_split, HP=hp, D=d, SB=4, N_ITER=4,
                                   ROPE=False, CB=d // 64, SKIP_EMPTY=skip)
        return out

    zeros = merge(acc, False)
    acc[empty] = float("nan")
    assert torch.equal(merge(acc, True), zeros)
    assert merge(acc, False).isnan().any()  # the case the switch exists for


@pytest.mark.parametrize("config", ["triton", "hopper"])
def test_attention_skips_the_empty_splits_of_a_wide_store(config, monkeypatch):
    """A captured step's splits cover the store's capacity: SKIP_EMPTY_SPLITS (splits past the query's closed
    compressed rows store no accumulator, which the merge leaves unread) gives the bits of the pass over every
    split, for a batch of queries whose closed rows are none, exactly one split's, one row more, and all; the
    GPU's state buffers likely (the caching allocator's choice) reusing a block just filled with NaN, so a read of
    an unwritten accumulator would show; `test_attention_merge_leaves_empty_splits_unread` is the firm check."""
    from ds4x.kernels import attention as A
    from ds4x.kernels.attention import Slots, attention_decode_triton

    dev = _device()
    if config == "hopper":
        if dev == "cpu":
            pytest.skip("the Hopper kernel needs a GPU")
        q, rows, sinks, _, _ = _hopper_attention_inputs(15, True, 8400, [0, 0, 0], 8194)
        q = torch.cat([q, q[:1]])
        rows = torch.cat([rows, rows[:1]])
        n, ratio, per_split, kernel = 8194, 128, 5 * 16, None  # 103 splits of 5 blocks
        heads, d, nope = 64, 512, 448
    else:
        g = torch.Generator().manual_seed(6)
        rows = torch.stack([pack_kv_rows(torch.randn(1100, 128, generator=g) * 2, rope_dim=64) for _ in range(4)])
        q, sinks = torch.randn(4, 16, 128, generator=g), torch.randn(16, generator=g)
        q, rows, sinks = q.to(dev), rows.to(dev), sinks.to(dev)
        n, ratio, per_split, kernel = 1024, 4, 16, (16, 16, 4, 128)  # 64 splits of one block
        heads, d, nope = 16, 128, 64
    # closed compressed rows (position + 1) // ratio: none, one split's, one more row, all
    pos = torch.tensor([ratio - 2, per_split * ratio, (per_split + 1) * ratio + 1, n * ratio + 7], device=dev)
    sources = [(rows, Slots(48, position=pos, ring=rows.shape[1])), (rows, Slots(n, position=pos, ratio=ratio))]
    outs = []
    for skip in (False, True):
        monkeypatch.setattr(A, "SKIP_EMPTY_SPLITS", skip)
        if dev != "cpu":  # freed at once: the next call's states likely reuse this block
            torch.full((4 * 128 * 64 * d + 2 * 4 * 128 * 64,), float("nan"), device=dev)
        outs.append(attention_decode_triton(q, sources, sinks, d**-0.5, nope, True, kernel))
    assert torch.equal(outs[1], outs[0])
    assert not outs[1].isnan().any()
    assert outs[1].shape == (4, heads, d)


def test_indexer_scores_a_prefix_view_of_a_batch_of_stores():
    """A decode step within a position span scores the first rows of each session's indexer store: a view
    [B, w, 68] of stores [B, cap, 68] gives the bits of the same rows copied contiguous; rows that are not each
    store's back to back are refused."""
    from ds4x.kernels.indexer import indexer_scores_triton

    dev, B, cap, w = _device(), 3, 300, 160
    stores = torch.stack([_indexer_case(cap, 16, 40 + b, dev)[0] for b in range(B)])
    q = torch.stack([_indexer_case(cap, 16, 50 + b, dev)[1] for b in range(B)])
    weights = torch.randn(B, 16, generator=torch.Generator().manual_seed(4)).to(dev)
    counts = torch.tensor([160, 0, 97], device=dev)
    view = stores[:, :w]
    assert not view.is_contiguous()
    got = indexer_scores_triton(q, weights, view, counts, packed=True)
    want = indexer_scores_triton(q, weights, view.contiguous(), counts, packed=True)
    assert got.shape == (B, w)
    for b, n in enumerate(counts.tolist()):
        assert torch.equal(got[b, :n], want[b, :n])
    with pytest.raises(ValueError, match="each store's rows contiguous"):
        indexer_scores_triton(q, weights, stores[:, ::2], counts, packed=True)


def test_batched_decode_kernels_are_each_query_alone():
    """A batched decode step (one query per session, each over its own stores): indexer scores, radix top-k and
    attention (window slots from each position, picked compressed rows) launched once for the batch give every
    query the bits of a call for it alone, packed and native."""
    from ds4x.kernels.attention import Slots, attention_decode_triton
    from ds4x.kernels.indexer import indexer_scores_triton

    g = torch.Generator().manual_seed(12)
    dev = _device()
    B, cap, heads, k = 3, 300, 16, 32
    idx_rows = torch.stack([_indexer_case(cap, heads, 20 + b, dev)[0] for b in range(B)])
    q = torch.stack([_indexer_case(cap, heads, 30 + b, dev)[1] for b in range(B)])
    w = torch.randn(B, heads, generator=g).to(dev)
    counts = torch.tensor([300, 0, 129], device=dev)
    scores = indexer_scores_triton(q, w, idx_rows, counts, packed=True)
    index, valid = select_topk_radix(scores, counts, k)
    assert index.shape == (B, k)
    for b in range(B):
        alone = indexer_scores_triton(q[b], w[b], idx_rows[b], counts[b : b + 1], packed=True)
        n = int(counts[b])
        assert torch.equal(scores[b, :n], alone[:n])
        one = select_topk_radix(alone, counts[b : b + 1], k)
        assert torch.equal(index[b], one[0]) and torch.equal(valid[b], one[1])
    with pytest.raises(ValueError, match="visible counts"):
        select_topk_radix(scores, 300, k)

    raw = torch.stack([pack_kv_rows(torch.randn(48, 128, generator=g) * 2, rope_dim=64) for _ in range(B)]).to(dev)
    comp = torch.stack([pack_kv_rows(torch.randn(cap, 128, generator=g), rope_dim=64) for _ in range(B)]).to(dev)
    qa = torch.randn(B, heads, 128, generator=g).to(dev)
    sinks = torch.randn(heads, generator=g).to(dev)
    pos = torch.tensor([5, 200, 47], device=dev)
    picked = torch.where(valid, index, -1)
    for packed in (True, False):
        store = (lambda t: t) if packed else (lambda t: unpack_kv_rows(t, rope_dim=64).contiguous())
        out = attention_decode_triton(qa, [(store(raw), Slots(24, position=pos, ring=48)), (store(comp), picked)],
                                      sinks, 128**-0.5, 64, packed)
        assert out.shape == (B, heads, 128)
        for b in range(B):
            alone = attention_decode_triton(qa[b], [(store(raw[b]), Slots(24, position=pos[b : b + 1], ring=48)),
                                                    (store(comp[b]), picked[b])], sinks, 128**-0.5, 64, packed)
            assert torch.equal(out[b], alone)
    with pytest.raises(ValueError, match="batch of 3 stores"):
        attention_decode_triton(qa, [(raw[0], Slots(24, position=pos, ring=48))], sinks, 128**-0.5, 64, True)


def test_batch_splits_cut_each_query_into_fewer_splits(monkeypatch):
    """``batch_splits``: a batch's queries get fewer splits (in the interpreter 4 multiprocessors / (B x sources):
    one per source), so each output matches the query alone to float rounding; a batch of one keeps its splits and
    bits; BATCH_SPLIT_WAVES = 0 turns the cap off. The merge launch's split count is recorded."""
    from ds4x.kernels import attention as A
    from ds4x.kernels import triton_attention
    from ds4x.kernels.attention import Slots, attention_decode_triton

    if torch.cuda.is_available():
        pytest.skip("the interpreter's 4 multiprocessors make the cap bite at this size")
    splits = []
    merge = triton_attention.combine_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                splits.append(args[7])  # n_split
                return merge[grid](*args, **kw)
            return launch

    monkeypatch.setattr(triton_attention, "combine_kernel", Recording())
    g = torch.Generator().manual_seed(13)
    B, heads, cap = 3, 16, 300
    raw = torch.stack([pack_kv_rows(torch.randn(48, 128, generator=g) * 2, rope_dim=64) for _ in range(B)])
    comp = torch.stack([pack_kv_rows(torch.randn(cap, 128, generator=g), rope_dim=64) for _ in range(B)])
    q = torch.randn(B, heads, 128, generator=g)
    sinks = torch.randn(heads, generator=g)
    pos = torch.tensor([30, 200, 47])
    picked = torch.stack([torch.randperm(cap, generator=g)[:64] for _ in range(B)])

    def run(b, **kw):
        sources = [(raw[b], Slots(24, position=pos[b], ring=48)), (comp[b], picked[b])]
        return attention_decode_triton(q[b], sources, sinks, 128**-0.5, 64, True, **kw)

    full = run(slice(None))
    cut = run(slice(None), batch_splits=True)
    torch.testing.assert_close(cut, full, rtol=1e-5, atol=1e-5)
    assert splits == [6, 2]  # window 2 + picks 4 blocks of 16 rows, then one split per source
    assert torch.equal(run(slice(0, 1), batch_splits=True), run(slice(0, 1)))
    monkeypatch.setattr(A, "BATCH_SPLIT_WAVES", 0)
    assert torch.equal(run(slice(None), batch_splits=True), full)


def _prefill_reference(q, positions, ring_rows, ring, w, sinks, scale, extra):
    """float64 softmax over each query's window slots and extra rows (``extra[t]``: row ids), with the sink."""
    out = []
    for t, pos in enumerate(positions.tolist()):
        keys = [ring_rows[p % ring] for p in range(max(0, pos - w + 1), pos + 1)] + [row for row in extra[t]]
        k = torch.stack(keys).double()
        logits = torch.cat([q[t].double() @ k.T * scale, sinks.double()[:, None]], dim=1)
        out.append(logits.softmax(-1)[:, :-1] @ k)
    return torch.stack(out)


@pytest.mark.parametrize("dim, heads", [(128, 16), (512, 20)])
def test_prefill_attention_kernel_matches_reference(dim, heads):
    """Many queries at once: each over the W ring slots ending at its position, plus per-query picked rows (CSA)
    or the compressed rows closed by its position (HCA), with the sink; TF32 products (on Hopper also the decode
    kernel run over the chunk, with decode's precision)."""
    from ds4x.kernels import attention_wgmma
    from ds4x.kernels.attention import attention_prefill_triton

    if dim == 512 and not torch.cuda.is_available():
        pytest.skip("Flash shapes only compiled on the GPU (too slow in the interpreter)")
    g = torch.Generator().manual_seed(6)
    dev = _device()
    ring, w, ratio = 48, 24, 4
    x = torch.randn(ring, dim, generator=g) * 2
    x[::5, 3] = 300.0  # E4M3 subnormal codes in that block
    ring_rows = pack_kv_rows(x, rope_dim=64).to(dev)
    comp = pack_kv_rows(torch.randn(40, dim, generator=g), rope_dim=64).to(dev)
    positions = torch.tensor([2, 30, 31, 57, 58, 90, 91], device=dev)  # a chunk wraps the ring
    q = torch.randn(len(positions), heads, dim, generator=g).bfloat16().float().to(dev)
    sinks = torch.randn(heads, generator=g).to(dev)
    plain, plain_comp = unpack_kv_rows(ring_rows.cpu(), rope_dim=64), unpack_kv_rows(comp.cpu(), rope_dim=64)
    index = torch.randint(0, 40, (len(positions), 9), generator=g)
    index[:, ::3] = -1
    cases = {
        "window": ({}, [[] for _ in positions]),
        "csa": ({"index": index.to(dev)}, [[plain_comp[i] for i in row if i >= 0] for row in index.tolist()]),
        "hca": ({"ratio": ratio, "n_rows": 20},
                [[plain_comp[j] for j in range(min(20, (p + 1) // ratio))] for p in positions.tolist()]),
    }
    for name, (kw, extra) in cases.items():
        out = attention_prefill_triton(q, positions, (ring_rows, ring, w), comp if kw else None, sinks, dim**-0.5,
                                       dim - 64, **kw, config=(16, 16, 4))
        ref = _prefill_reference(q.cpu(), positions.cpu(), plain, ring, w, sinks.cpu(), dim**-0.5, extra)
        assert float((out.cpu().double() - ref).norm() / ref.norm()) < 2e-3, name
        half = attention_prefill_triton(q.bfloat16(), positions, (ring_rows, ring, w), comp if kw else None, sinks,
                                        dim**-0.5, dim - 64, **kw, config=(16, 16, 4))
        assert half.dtype == torch.float32 and torch.equal(half, out), name  # q holds bf16 values
        if attention_wgmma.available(q, heads, dim, dim - 64):  # Hopper: the decode kernel over the chunk's queries
            wide = attention_prefill_triton(q, positions, (ring_rows, ring, w), comp if kw else None, sinks,
                                            dim**-0.5, dim - 64, **kw)
            assert float((wide.cpu().double() - ref).norm() / ref.norm()) < 1e-4, name  # decode's precision
            assert torch.equal(wide, attention_prefill_triton(q.bfloat16(), positions, (ring_rows, ring, w),
                                                              comp if kw else None, sinks, dim**-0.5, dim - 64, **kw))


@pytest.mark.gpu
def test_flash_shapes_at_1m_on_gpu():
    from ds4x.kernels.indexer import indexer_scores_triton
    from ds4x.kernels.select import radix_barrier_timeouts

    n = 262_144
    rows, q, w = _indexer_case(n, 64, 5, "cuda")
    scores = indexer_scores_triton(q, w, rows, n, packed=True)  # the Gluon kernel on Hopper
    triton_ptx = indexer_scores_triton(q, w, rows, n, packed=True, ptx=True)
    assert torch.equal(triton_ptx, indexer_scores_triton(q, w, rows, n, packed=True, ptx=False))  # PTX == arithmetic
    ref = _reference_scores(q, w, rows, n)
    for s in (scores, triton_ptx):
        assert float((s - ref).abs().max()) <= 2e-6 * float(ref.abs().max())
    b = selection_mask(*select_topk(scores[None], torch.ones(1, n, dtype=torch.bool, device="cuda"), 512), n)
    for _ in range(3):  # the fused kernel leaves its workspace clean for the next call
        for fused in (True, False):
            index, valid = select_topk_radix(scores, n, 512, fused=fused)
            assert torch.equal(selection_mask(index[None], valid[None], n), b)
            assert bool((index.diff() > 0).all())
    a = selection_mask(*[t[None] for t in select_topk_blocked(scores, n, 512)], n)
    assert torch.equal(a, b)
    ties = torch.randint(-3, 4, (n,), device="cuda").float()
    index, valid = select_topk_radix(ties, n - 5, 512)
    ref = select_topk(ties[None], (torch.arange(n, device="cuda") < n - 5)[None], 512)
    assert torch.equal(selection_mask(index[None], valid[None], n), selection_mask(*ref, n))
    assert radix_barrier_timeouts(torch.device("cuda")) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory histograms", "tl.histogram"])
def test_radix_select_is_exact_either_way_on_gpu(monkeypatch, shared):
    """The select with its histograms counted by shared-memory atomics (``SHARED_HISTOGRAM``, small rows by one
    program of it: ``SMALL_BY_HISTOGRAM``) or by tl.histogram (small rows by the packed-count kernel): Flash's 1M rows
    (three calls: the workspace left clean), exact ties, codes agreeing in their high bytes, a batch of rows with
    their own counts, no barrier timeouts; small rows up to a batched step's 8 x 8,192 scores with ties."""
    from ds4x.kernels import select

    monkeypatch.setattr(select, "SHARED_HISTOGRAM", shared)
    test_flash_shapes_at_1m_on_gpu()
    test_batched_selection_at_1m_on_gpu()
    test_radix_select_when_the_kth_score_shares_its_high_digits(8, True, shared, monkeypatch)
    test_radix_select_when_the_kth_score_shares_its_high_digits(4, False, False, monkeypatch)
    for bits in (8, 4, 2) if shared else (2,):
        test_small_rows_by_one_program(bits, shared, monkeypatch)
    monkeypatch.setattr(select, "SMALL_BY_HISTOGRAM", shared)
    g = torch.Generator(device="cuda").manual_seed(9)
    scores = torch.randint(-50, 50, (8, 8192), generator=g, device="cuda").float()
    counts = torch.tensor([8192, 8191, 5000, 512, 511, 1, 0, 4096], device="cuda")
    index, valid = select_topk_radix(scores, counts, 512)
    for b in range(8):
        ref = select_topk(scores[b : b + 1], (torch.arange(8192, device="cuda") < counts[b])[None], 512)
        assert torch.equal(selection_mask(index[b : b + 1], valid[b : b + 1], 8192), selection_mask(*ref, 8192))


@pytest.mark.gpu
def test_indexer_scores_do_not_depend_on_where_the_rows_end_on_gpu():
    """A row's score is the same whatever the row count (rows ending mid-tile; a program's next tile, loaded ahead,
    lying past the rows) and whatever the store's alignment."""
    from ds4x.kernels.indexer import indexer_scores_triton

    rows, q, w = _indexer_case(4096, 64, 11, "cuda")
    shifted = torch.empty(4097 * 68, dtype=torch.uint8, device="cuda")[4 : 4 + 4096 * 68].view(4096, 68)
    shifted.copy_(rows)
    full = indexer_scores_triton(q, w, rows, 4096, packed=True)
    ref = _reference_scores(q, w, rows, 4096)
    assert float((full - ref).abs().max()) <= 2e-6 * float(ref.abs().max())
    for n in (4096, 4000, 1000, 63, 1):
        assert torch.equal(indexer_scores_triton(q, w, rows, n, packed=True), full[:n]), n
        assert torch.equal(indexer_scores_triton(q, w, shifted, n, packed=True), full[:n]), n


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_rows, per_sm", [(64, 3), (64, 4), (128, 2)])
def test_pipelined_indexer_kernel_gives_the_one_tile_bits_on_gpu(block_rows, per_sm, fp8, monkeypatch):
    """indexer_wgmma.PIPELINED (two key tiles, each tile's product beside the next tile's decode) scores every row
    as the one-tile kernel does, bit for bit: rows ending mid-tile and past a program's last tile, a store only
    4-byte aligned, a device row count per query, block scales far from their row's (one past the E4M3 keys' reach,
    one at its edge), and a 1M CSA layer's rows; with fp16 or E4M3 operands (FP8_KEYS), each as near the float32
    reference as the other."""
    from ds4x.kernels import indexer as I
    from ds4x.kernels import indexer_wgmma
    from ds4x.kernels.indexer import indexer_scores_triton

    if not indexer_wgmma.available(torch.zeros(1, device="cuda"), 64):
        pytest.skip("needs an sm_90 GPU and Gluon")
    monkeypatch.setattr(indexer_wgmma, "FP8_KEYS", fp8)
    rows, q, w = _indexer_case(4096, 64, 12, "cuda")
    x = unpack_indexer_rows(rows)
    x[::5, 64:96] *= 2.0**-20
    x[1::5, 96:] *= 2.0**13  # the other blocks of those rows 2^13 below it: still exact as E4M3
    rows = pack_indexer_rows(x)
    shifted = torch.empty(4097 * 68, dtype=torch.uint8, device="cuda")[4 : 4 + 4096 * 68].view(4096, 68)
    shifted.copy_(rows)
    big, qb, wb = _indexer_case(262_144, 64, 13, "cuda")
    qs, ws, counts = torch.stack([q, q.flip(0)]), torch.stack([w, w.flip(0)]), torch.tensor([4096, 777], device="cuda")

    def calls():
        out = [indexer_scores_triton(q, w, store, n, packed=True) for store in (rows, shifted)
               for n in (4096, 4000, 1000, 63, 1)]
        per_query = indexer_scores_triton(qs, ws, rows, counts, packed=True)  # columns from a count on: not written
        return [*out, per_query[0], per_query[1, :777], indexer_scores_triton(qb, wb, big, 262_144, packed=True)]

    monkeypatch.setattr(indexer_wgmma, "PIPELINED", False)
    default = calls()  # one tile, 128 rows (the kernel before PIPELINED)
    monkeypatch.setattr(indexer_wgmma, "PIPELINED", True)
    monkeypatch.setattr(indexer_wgmma, "PIPELINED_BLOCK_N", block_rows)
    monkeypatch.setattr(I, "PROGRAMS_PER_SM", per_sm)
    for got, want in zip(calls(), default, strict=True):
        assert torch.equal(got, want)
    ref = _reference_scores(q, w, rows, 4096)
    assert float((default[0] - ref).abs().max()) <= 2e-6 * float(ref.abs().max())


@pytest.mark.gpu
def test_batched_decode_kernels_are_each_query_alone_on_gpu():
    """The same bits per query on the compiled kernels (tensor-core attention, PTX indexer decode)."""
    test_batched_decode_kernels_are_each_query_alone()


@pytest.mark.gpu
def test_batched_selection_at_1m_on_gpu():
    """Four sessions' 262,144-row CSA stores at once (a batched decode step at 1M): per-row bits of the indexer and
    the exact radix selection, no barrier timeouts."""
    from ds4x.kernels.indexer import indexer_scores_triton
    from ds4x.kernels.select import radix_barrier_timeouts

    n, B = 262_144, 4
    cases = [_indexer_case(n, 64, 40 + b, "cuda") for b in range(B)]
    rows, q = torch.stack([c[0] for c in cases]), torch.stack([c[1] for c in cases])
    w = torch.stack([c[2] for c in cases])
    counts = torch.tensor([n, n - 5, 1000, 0], device="cuda")
    scores = indexer_scores_triton(q, w, rows, counts, packed=True)
    index, valid = select_topk_radix(scores, counts, 512)
    for b in range(B):
        m = int(counts[b])
        if m:
            assert torch.equal(scores[b, :m], indexer_scores_triton(q[b], w[b], rows[b], m, packed=True))
        ref = select_topk(scores[b : b + 1], (torch.arange(n, device="cuda") < m)[None], 512)
        assert torch.equal(selection_mask(index[b : b + 1], valid[b : b + 1], n), selection_mask(*ref, n))
    assert radix_barrier_timeouts(torch.device("cuda")) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("query", ["float32", "bf16"])
def test_attention_over_hca_sized_rows_on_gpu(query, monkeypatch):
    """8,192 compressed rows and the window (where the Hopper kernel serves: 111 splits): packed and native rows
    give the same bits; the float64 softmax within 1e-5 with float32 partial states, within the bf16 states'
    rounding (~1e-3, `test_hopper_attention_state_in_bf16_is_one_rounding_from_float32`) by default."""
    from ds4x.kernels import attention as A
    from ds4x.kernels.attention import attention_decode_triton

    g = torch.Generator(device="cuda").manual_seed(2)
    rows = pack_kv_rows(torch.randn(8320, 512, generator=g, device="cuda") * 2)
    plain = unpack_kv_rows(rows).contiguous()
    q = torch.nn.functional.rms_norm(torch.randn(64, 512, generator=g, device="cuda"), (512,))
    if query != "float32":
        q = q.bfloat16()
    sinks = torch.randn(64, generator=g, device="cuda")
    window, comp = torch.arange(8192, 8320, device="cuda"), torch.arange(8192, device="cuda")
    q64, k64 = q.double(), plain.double()
    probs = torch.cat([q64 @ k64.T * 512**-0.5, sinks.double()[:, None]], dim=1).softmax(-1)
    ref = probs[:, :-1] @ k64
    for state_bf16, tolerance in ((None, 2**-8), (False, 1e-5)):
        monkeypatch.setattr(A, "STATE_BF16", state_bf16)
        out = attention_decode_triton(q, [(rows, window), (rows, comp)], sinks, 512**-0.5, 448, True)
        native = attention_decode_triton(q, [(plain, window), (plain, comp)], sinks, 512**-0.5, 448, False)
        assert torch.equal(out, native)
        assert float((out.double() - ref).norm() / ref.norm()) < tolerance


def _hopper_attention_inputs(seed: int, bf16: bool, n_rows: int, positions: list[int], pick_below: int):
    """Three decode queries at Flash shapes (RMS-normed, bf16 or float32), a packed store of ``n_rows`` rows per
    query, sinks, the queries' positions and 512 picks per query below ``pick_below`` with every 7th a hole;
    skips where the Hopper kernel does not run."""
    from ds4x.kernels.attention_wgmma import available

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.nn.functional.rms_norm(torch.randn(3, 64, 512, generator=g, device="cuda"), (512,))
    if bf16:
        q = q.bfloat16()
    if not available(q, 64, 512, 448):
        pytest.skip("needs an sm_90 GPU with Gluon")
    rows = torch.stack([pack_kv_rows(torch.randn(n_rows, 512, generator=g, device="cuda") * 2) for _ in range(3)])
    sinks = torch.randn(64, generator=g, device="cuda")
    picks = torch.randint(0, pick_below, (3, 512), generator=g, device="cuda")
    picks[:, ::7] = -1
    return q, rows, sinks, torch.tensor(positions, device="cuda"), picks


def _picks_and_hca_sources(rows: torch.Tensor, pos: torch.Tensor, picks: torch.Tensor) -> list[list]:
    """The two source sets the Hopper tests run over ``_hopper_attention_inputs``: the window + picks with holes
    (CSA), and the window + 8,194 closed compressed rows (HCA at 1M: 111 splits)."""
    from ds4x.kernels.attention import Slots

    window = Slots(128, position=pos, ring=rows.shape[1])
    return [[(rows, window), (rows, picks)], [(rows, window), (rows, Slots(8194, position=pos, ratio=128))]]


def _float64_attention(q: torch.Tensor, rows: torch.Tensor, seen: list[torch.Tensor], sinks: torch.Tensor
                       ) -> torch.Tensor:
    """One query's attention over the packed ``rows`` it reads (``seen``: each source's slots, -1 holes) with the
    sinks, in float64."""
    keys = unpack_kv_rows(rows).double()[torch.cat([i[i >= 0] for i in seen])]
    logits = torch.cat([q.double() @ keys.T * 512**-0.5, sinks.double()[:, None]], dim=1)
    return logits.softmax(-1)[:, :-1] @ keys


@pytest.mark.gpu
@pytest.mark.parametrize("query", ["float32", "bf16"])
def test_hopper_attention_kernel_matches_the_triton_kernel(monkeypatch, query):
    """The Gluon all-heads kernel against the Triton kernel: window + explicit picks with holes, window + closed
    compressed rows, a batch of 3 queries (each query's bits alone); float32 queries and the model's bf16 ones."""
    from ds4x.kernels import attention as A
    from ds4x.kernels.attention import Slots, attention_decode_triton

    q, rows, sinks, pos, picks = _hopper_attention_inputs(5, query != "float32", 3000, [2999, 1500, 40], 700)
    cases = [[(rows, Slots(128, position=pos, ring=3000)), (rows, picks)],
             [(rows, Slots(128, position=pos, ring=3000)), (rows, Slots(700, position=pos, ratio=4))]]
    for sources in cases:
        monkeypatch.setattr(A, "WGMMA", False)
        ref = attention_decode_triton(q, sources, sinks, 512**-0.5, 448, True)
        monkeypatch.setattr(A, "WGMMA", True)
        out = attention_decode_triton(q, sources, sinks, 512**-0.5, 448, True)
        assert float((out - ref).abs().max() / ref.abs().max()) < 1e-5
        for b in range(3):
            alone = [(r[b], s if isinstance(s, torch.Tensor) and s.dim() == 1 else
                      s[b] if isinstance(s, torch.Tensor) else Slots(s.n, position=pos[b : b + 1], ring=s.ring,
                                                                      ratio=s.ratio)) for r, s in sources]
            assert torch.equal(out[b], attention_decode_triton(q[b], alone, sinks, 512**-0.5, 448, True))


@pytest.mark.gpu
def test_hopper_attention_in_two_phases_matches_the_online_loop(monkeypatch):
    """TWO_PHASE_BLOCKS (a bf16 query's blocks: all scores first, then the products against the final maximum)
    against the online loop: window + picks with holes at one block a program and at 4, window + 8,194 closed
    compressed rows (HCA at 1M: 5 blocks a program), a batch of 3 queries (each query's bits alone), packed and
    native rows bit for bit; the float64 softmax as the reference (float32 partial states: the bf16 ones' rounding
    would hide a phase's error). TWO_PHASE_OVERLAP gives the same bits."""
    from ds4x.kernels import attention as A
    from ds4x.kernels.attention import Slots, attention_decode_triton

    monkeypatch.setattr(A, "STATE_BF16", False)

    q, rows, sinks, pos, picks = _hopper_attention_inputs(9, True, 8400, [1_048_575, 700_000, 5_000], 8194)
    picks[1, :40] = -1  # a block with no row at all
    window = Slots(128, position=pos, ring=8400)
    cases = [([(rows, window), (rows, picks)], (16, 128)), ([(rows, window), (rows, picks)], (16, 8)),
             ([(rows, window), (rows, Slots(8194, position=pos, ratio=128))], (16, 128))]
    for sources, config in cases:
        monkeypatch.setattr(A, "WGMMA_CONFIG", config)
        monkeypatch.setattr(A, "TWO_PHASE_BLOCKS", 0)
        online = attention_decode_triton(q, sources, sinks, 512**-0.5, 448, True)
        monkeypatch.setattr(A, "TWO_PHASE_BLOCKS", 5)
        monkeypatch.setattr(A, "TWO_PHASE_OVERLAP", False)
        out = attention_decode_triton(q, sources, sinks, 512**-0.5, 448, True)
        assert float((out - online).abs().max() / online.abs().max()) < 1e-5
        monkeypatch.setattr(A, "TWO_PHASE_OVERLAP", True)  # the next block decoded beside the score product
        assert torch.equal(attention_decode_triton(q, sources, sinks, 512**-0.5, 448, True), out)
        for b in range(3):
            alone = [(r[b], s[b] if isinstance(s, torch.Tensor) else
                      Slots(s.n, position=pos[b : b + 1], ring=s.ring, ratio=s.ratio)) for r, s in sources]
            assert torch.equal(out[b], attention_decode_triton(q[b], alone, sinks, 512**-0.5, 448, True))
            seen = [(s if isinstance(s, torch.Tensor) else s.explicit())[b] for _, s in sources]
            ref = _float64_attention(q[b], rows[b], seen, sinks)
            assert float((out[b].double() - ref).norm() / ref.norm()) < 1e-5
        plain = torch.stack([unpack_kv_rows(r) for r in rows])
        native = [(plain, s) for _, s in sources]
        assert torch.equal(out, attention_decode_triton(q, native, sinks, 512**-0.5, 448, False))


@pytest.mark.gpu
@pytest.mark.parametrize("query", ["float32", "bf16"])
def test_hopper_attention_state_by_tma_gives_the_same_bits(monkeypatch, query):
    """TMA_STATE (the partial states written by the TMA unit from a swizzled shared tile, the RoPE low parts added
    there instead of by global atomics) in every launch against none: the online loop (float32 query) and the two
    phases (bf16), window + picks with holes and window + 8,194 compressed rows, a batch of 3 queries, bit for bit
    (float32 states: the bf16 ones take neither path)."""
    from ds4x.kernels import attention as A
    from ds4x.kernels.attention import attention_decode_triton

    monkeypatch.setattr(A, "STATE_BF16", False)
    q, rows, sinks, pos, picks = _hopper_attention_inputs(11, query != "float32", 8400, [1_048_575, 700_000, 5_000],
                                                          8194)
    for sources in _picks_and_hca_sources(rows, pos, picks):
        monkeypatch.setattr(A, "TMA_STATE", False)
        stored = attention_decode_triton(q, sources, sinks, 512**-0.5, 448, True)
        monkeypatch.setattr(A, "TMA_STATE", True)
        assert torch.equal(attention_decode_triton(q, sources, sinks, 512**-0.5, 448, True), stored)


@pytest.mark.gpu
@pytest.mark.parametrize("query", ["float32", "bf16"])
def test_hopper_attention_state_in_bf16_is_one_rounding_from_float32(monkeypatch, query):
    """STATE_BF16 (the partial accumulators stored as bf16, the merge summing them in float32) against the float32
    states: window + picks with holes and window + 8,194 compressed rows (111 splits), a batch of 3 queries. A
    split's rounding errors (at most 2^-9 of each element, ~2^-9 / sqrt(3) rms) average like its values in the
    merge, so the outputs stay ~1e-3 from the float32 ones and from the float64 softmax; a scrambled element is
    O(1) off. The default takes bf16 states for the 111 splits only."""
    from ds4x.kernels import attention as A
    from ds4x.kernels.attention import Slots, attention_decode_triton

    q, rows, sinks, pos, picks = _hopper_attention_inputs(17, query != "float32", 8400, [1_048_575, 700_000, 5_000],
                                                          8194)
    for sources in _picks_and_hca_sources(rows, pos, picks):
        monkeypatch.setattr(A, "STATE_BF16", False)
        full = attention_decode_triton(q, sources, sinks, 512**-0.5, 448, True)
        monkeypatch.setattr(A, "STATE_BF16", True)
        half = attention_decode_triton(q, sources, sinks, 512**-0.5, 448, True)
        assert not torch.equal(half, full)  # the variant ran
        monkeypatch.setattr(A, "STATE_BF16", None)  # the default: bf16 at 64 splits or more (the compressed rows')
        assert torch.equal(attention_decode_triton(q, sources, sinks, 512**-0.5, 448, True),
                           half if isinstance(sources[1][1], Slots) else full)
        err = (half - full).abs() / full.abs().amax(-1, keepdim=True)
        assert float(err.max()) < 2**-8, float(err.max())
        for b in range(3):
            seen = [(s if isinstance(s, torch.Tensor) else s.explicit())[b] for _, s in sources]
            ref = _float64_attention(q[b], rows[b], seen, sinks)
            assert float((half[b].double() - ref).norm() / ref.norm()) < 2**-8


def test_column_parts_fill_at_most_one_wave(monkeypatch):
    """COLUMN_PARTS as a launch takes it: the largest power of two up to the setting within one program a
    multiprocessor (the window's 8 splits 4 parts, CSA's 40 at 1M 2, HCA's 111 none), off at 1, bad settings
    refused."""
    from ds4x.kernels import attention as A

    monkeypatch.setattr(A, "COLUMN_PARTS", 4)
    assert [A.column_parts(n, 132) for n in (8, 11, 33, 34, 40, 66, 67, 111, 300)] == [4, 4, 4, 2, 2, 2, 1, 1, 1]
    monkeypatch.setattr(A, "COLUMN_PARTS", 2)
    assert [A.column_parts(n, 132) for n in (8, 40, 66, 67)] == [2, 2, 2, 1]
    monkeypatch.setattr(A, "COLUMN_PARTS", 1)
    assert A.column_parts(8, 132) == 1
    for bad in (0, 3, 8):
        monkeypatch.setattr(A, "COLUMN_PARTS", bad)
        with pytest.raises(ValueError, match="COLUMN_PARTS"):
            A.column_parts(8, 132)


@pytest.mark.gpu
def test_hopper_attention_column_parts_give_the_same_bits(monkeypatch):
    """COLUMN_PARTS (a split's output product and state stores spread over 2 or 4 programs, each scoring all the
    split's rows) against one program a split: window + picks with holes for each query alone (40 splits: 2 parts
    fit 132 multiprocessors, 4 do not), window + 34 closed compressed rows for a batch of 3 (11 splits a query: 4
    parts fit), 64 and 40 heads, bit for bit; the launch's grid shows the parts taken."""
    from ds4x.kernels import attention as A
    from ds4x.kernels import attention_wgmma
    from ds4x.kernels.attention import Slots, attention_decode_triton
    from ds4x.kernels.indexer import num_sms

    q, rows, sinks, pos, picks = _hopper_attention_inputs(19, True, 8400, [1_048_575, 700_000, 5_000], 8194)
    if num_sms(q.device) < 132:
        pytest.skip("the parts chosen below assume 132 multiprocessors or more")
    kernel, grids = attention_wgmma.partial_kernel, []

    class _Spy:  # records each launch's grid
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(attention_wgmma, "partial_kernel", _Spy())
    short_pos = torch.tensor([4_400, 4_300, 4_351], device="cuda")
    cases = [([(rows[b], Slots(128, position=pos[b : b + 1], ring=8400)), (rows[b], picks[b])], qb, {2: 2, 4: 2})
             for b, qb in enumerate(q)]
    cases.append(([(rows, Slots(128, position=short_pos, ring=8400)), (rows, Slots(34, position=short_pos,
                                                                                     ratio=128))], q, {2: 2, 4: 4}))
    for heads in (64, 40):
        for sources, query, taken in cases:
            qh, sh = query[..., :heads, :].contiguous(), sinks[:heads].contiguous()
            monkeypatch.setattr(A, "COLUMN_PARTS", 1)
            whole = attention_decode_triton(qh, sources, sh, 512**-0.5, 448, True)
            assert grids[-1][1] == 1
            for parts in (2, 4):
                monkeypatch.setattr(A, "COLUMN_PARTS", parts)
                assert torch.equal(attention_decode_triton(qh, sources, sh, 512**-0.5, 448, True), whole), parts
                assert grids[-1][1] == taken[parts]


@pytest.mark.gpu
def test_hopper_attention_query_by_cp_async_gives_the_same_bits(monkeypatch):
    """QUERY_ASYNC (the two phases' bf16 query copied to shared memory by cp.async) against the query through
    registers, with and without OVERLAP: window + picks with holes and window + 8,194 compressed rows, a batch of 3
    queries, and 40 of the 64 heads (the copy masked to the query's own heads), bit for bit."""
    from ds4x.kernels import attention as A
    from ds4x.kernels.attention import attention_decode_triton

    q, rows, sinks, pos, picks = _hopper_attention_inputs(13, True, 8400, [1_048_575, 700_000, 5_000], 8194)
    for heads in (64, 40):
        qh, sh = q[:, :heads].contiguous(), sinks[:heads].contiguous()
        for sources in _picks_and_hca_sources(rows, pos, picks):
            for overlap in (False, True):
                monkeypatch.setattr(A, "TWO_PHASE_OVERLAP", overlap)
                monkeypatch.setattr(A, "QUERY_ASYNC", False)
                through_registers = attention_decode_triton(qh, sources, sh, 512**-0.5, 448, True)
                monkeypatch.setattr(A, "QUERY_ASYNC", True)
                copied = attention_decode_triton(qh, sources, sh, 512**-0.5, 448, True)
                assert torch.equal(copied, through_registers), (heads, overlap)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["native", "packed"])
def test_gpu_decode_path_matches_cpu_reference(cache):
    from ds4x.runtime.engine import Engine

    ids = torch.randint(3, 259, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    for device in ("cpu", "cuda"):
        s = Engine.load("tiny", device=device).new_session(ctx=256, cache=cache, prefill_chunk=32)
        s.prefill(ids)
        out[device] = torch.stack([s.step(t).cpu() for t in (5, 9, 17, 33)])
    rel = float((out["cuda"] - out["cpu"]).abs().max() / out["cpu"].abs().max())
    assert rel < 2e-2, rel


@pytest.mark.gpu
def test_gpu_packed_and_native_decode_are_bit_identical():
    from ds4x.runtime.engine import Engine

    engine = Engine.load("tiny", device="cuda")
    ids = torch.randint(3, 259, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = {}
    for cache in ("native", "packed"):
        s = engine.new_session(ctx=512, cache=cache, prefill_chunk=32, prefill_mode="exact")
        logits[cache] = torch.stack([s.prefill(ids), *[s.step(t) for t in (7, 8, 9)]])
    assert torch.equal(logits["native"], logits["packed"])


@pytest.mark.gpu
def test_cuda_graph_decode_is_bit_identical_to_eager(monkeypatch):
    """Replayed steps cross window closes (CSA every 4, HCA every 16 tokens) and the sliding window's wrap."""
    from ds4x.runtime.decode_graph import GraphDecoder
    from ds4x.runtime.engine import Engine

    engine = Engine.load("default", device="cuda")
    ids = torch.randint(3, 259, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    out = {}
    for graphs in ("0", "1"):
        monkeypatch.setenv("DS4X_CUDA_GRAPHS", graphs)
        s = engine.new_session(ctx=512, cache="packed", prefill_chunk=32)
        s.prefill(ids)
        out[graphs] = torch.stack([s.step(t) for t in range(5, 300, 7)])
        assert isinstance(s.decoder, GraphDecoder) == (graphs == "1")
        assert graphs == "0" or s.decoder.graph is not None
    assert torch.equal(out["0"], out["1"])


@pytest.mark.gpu
def test_cuda_graph_greedy_matches_the_cpu_reference_for_256_tokens():
    """Exact mode, float32: the GPU decode (CUDA graph, packed rows, Triton kernels) and the CPU reference path
    (native-unpacked rows, torch ops) pick the same 256 greedy tokens."""
    from ds4x.runtime.engine import Engine
    from ds4x.runtime.sampling import SamplingParams

    prompt = Engine.load("default", device="cpu").tokenizer.encode("import os\n\n\ndef list_files(path):\n")
    tokens = {}
    for device, cache in (("cpu", "native"), ("cuda", "packed")):
        s = Engine.load("default", device=device, dtype="float32").new_session(ctx=512, cache=cache,
                                                                               prefill_mode="exact")
        tokens[device] = [t for t, _ in s.generate(prompt, 256, SamplingParams(temperature=0.0), stop_ids=())]
    assert tokens["cuda"] == tokens["cpu"]


def test_reference_kernels_env_switch(monkeypatch):
    from ds4x.kernels import dispatch

    dispatch.triton_available.cache_clear()
    monkeypatch.setenv("DS4X_KERNELS", "reference")
    assert not dispatch.triton_available()
    dispatch.triton_available.cache_clear()
    assert "reference" in dispatch.describe(torch.device("cpu"), "packed")


def test_model_decode_through_the_triton_path_in_the_interpreter(monkeypatch):
    """The model's Triton decode branch (the GPU path) on the CPU interpreter: matches the reference path, and
    packed rows give the same logits as native-unpacked rows."""
    import ds4x.model.attention as attention
    from ds4x.runtime.engine import Engine

    if torch.cuda.is_available():
        pytest.skip("covered by the gpu tests")
    engine = Engine.load("tiny", device="cpu")
    ids = torch.randint(3, 259, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    out = {}
    for path in ("reference", "triton"):
        monkeypatch.setattr(attention, "use_triton", lambda device, p=path: p == "triton")
        for cache in ("native", "packed"):
            # the prefill on the reference path for both storages (the Triton prefill reads packed rows only)
            s = engine.new_session(ctx=128, cache=cache, prefill_chunk=32, prefill_mode="reference")
            s.prefill(ids)
            out[path, cache] = torch.stack([s.step(t) for t in (5, 9)])
    assert torch.equal(out["triton", "native"], out["triton", "packed"])
    ref = out["reference", "packed"]
    assert float((out["triton", "packed"] - ref).abs().max() / ref.abs().max()) < 1e-4


def test_model_prefill_through_the_triton_kernel_in_the_interpreter(monkeypatch):
    """Default-mode prefill of a packed cache with the Triton prefill attention (the GPU path) on the CPU
    interpreter: the logits of the prefill and of the decode steps after it stay close to reference-mode prefill."""
    import ds4x.model.attention as attention
    from ds4x.runtime.engine import Engine

    if torch.cuda.is_available():
        pytest.skip("covered by the gpu tests")
    engine = Engine.load("tiny", device="cpu")
    ids = torch.randint(3, 259, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    monkeypatch.setattr(attention, "use_triton", lambda device: True)
    calls = []
    monkeypatch.setattr(attention, "attention_prefill_triton",
                        lambda *a, f=attention.attention_prefill_triton, **k: calls.append(1) or f(*a, **k))
    out = {}
    for mode in ("reference", "default"):
        s = engine.new_session(ctx=128, cache="packed", prefill_chunk=32, prefill_mode=mode)
        out[mode] = torch.stack([s.prefill(ids), s.step(5), s.step(9)])
        assert bool(calls) == (mode == "default")  # reference mode keeps the torch attention
    assert calls  # the default mode took the kernel
    ref = out["reference"]
    assert float((out["default"] - ref).abs().max() / ref.abs().max()) < 1e-3


@pytest.mark.gpu
def test_gpu_prefill_default_mode_tracks_reference_mode():
    """Packed cache on the GPU, bf16 default model: default-mode prefill (Triton attention, grouped experts where
    they apply) against reference-mode prefill, logits after the prompt and greedy tokens after it."""
    from ds4x.runtime.engine import Engine
    from ds4x.runtime.sampling import SamplingParams

    engine = Engine.load("default", device="cuda")
    prompt = engine.tokenizer.encode("import os\n\n\ndef list_files(path):\n" * 8)
    logits, tokens = {}, {}
    for mode in ("reference", "default"):
        s = engine.new_session(ctx=1024, cache="packed", prefill_chunk=128, prefill_mode=mode)
        logits[mode] = s.prefill(prompt)
        tokens[mode] = [t for t, _ in s.generate([], 32, SamplingParams(temperature=0.0), stop_ids=())]
    ref = logits["reference"]
    assert float((logits["default"] - ref).abs().max() / ref.abs().max()) < 2e-2
    assert tokens["default"][:8] == tokens["reference"][:8]


@pytest.mark.gpu
def test_hopper_attention_bf16_state_by_tma_gives_the_same_bits(monkeypatch):
    """STATE_BF16_TMA (the bf16 state rounded in registers, its RoPE columns from a second accumulator of their
    products, stored by the TMA unit from a bf16 tile) against the float32 stage read back by the threads: window +
    8,194 compressed rows (111 splits, bf16 states by default) and window + picks with holes with bf16 states
    forced, a batch of 3 queries and each alone, 64 and 40 heads, bit for bit; a spy shows the TMA path taken."""
    from ds4x.kernels import attention as A
    from ds4x.kernels import attention_wgmma
    from ds4x.kernels.attention import attention_decode_triton

    q, rows, sinks, pos, picks = _hopper_attention_inputs(43, True, 8400, [1_048_575, 700_000, 5_000], 8194)
    kernel, launched = attention_wgmma.partial_kernel, []

    class _Spy:  # records each launch's (STATE_BF16, TMA_STATE)
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append((kw["STATE_BF16"], kw["TMA_STATE"]))
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(attention_wgmma, "partial_kernel", _Spy())
    monkeypatch.setattr(A, "STATE_BF16", True)
    for heads in (64, 40):
        qh, sh = q[:, :heads].contiguous(), sinks[:heads].contiguous()
        for sources in _picks_and_hca_sources(rows, pos, picks):
            monkeypatch.setattr(A, "STATE_BF16_TMA", False)
            staged = attention_decode_triton(qh, sources, sh, 512**-0.5, 448, True)
            assert launched[-1] == (True, False)
            monkeypatch.setattr(A, "STATE_BF16_TMA", True)
            assert torch.equal(attention_decode_triton(qh, sources, sh, 512**-0.5, 448, True), staged)
            assert launched[-1] == (True, True)
            for b in range(3):
                alone = [(r[b], s[b] if isinstance(s, torch.Tensor) else
                          A.Slots(s.n, position=pos[b : b + 1], ring=s.ring, ratio=s.ratio)) for r, s in sources]
                assert torch.equal(attention_decode_triton(qh[b], alone, sh, 512**-0.5, 448, True), staged[b])
