import torch

from ds4x.kernels.select import select_topk, selection_mask


def reference_select(scores, visible, k):
    out = torch.zeros_like(visible)
    for t in range(scores.shape[0]):
        cand = [(-float(scores[t, i]), i) for i in range(scores.shape[1]) if visible[t, i]]
        for _, i in sorted(cand)[:k]:
            out[t, i] = True
    return out


def test_selection_with_many_exact_ties_matches_lower_index_rule():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (64, 300), generator=g).float()  # heavy ties
    visible = torch.rand(64, 300, generator=g) < 0.8
    for k in (1, 5, 17, 300, 400):
        index, valid = select_topk(scores, visible, k)
        assert torch.equal(selection_mask(index, valid, 300), reference_select(scores, visible, k))


def test_invisible_rows_never_selected_even_when_fewer_than_k():
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    visible = torch.tensor([[False, True, False, True]])
    index, valid = select_topk(scores, visible, 3)
    assert selection_mask(index, valid, 4).tolist() == [[False, True, False, True]]
    assert valid.tolist() == [[True, True, False]]


def test_chunk_selection_by_composite_keys_equals_the_stable_sort():
    """A prefill chunk's selection by torch.topk over composite keys (rows below each query's count visible): the
    indices, their order and validity of select_topk, with heavy ties, signed zeros and counts from 0 to all rows."""
    from ds4x.kernels.select import select_topk_keys

    g = torch.Generator().manual_seed(3)
    scores = torch.randint(-3, 4, (40, 300), generator=g).float() * 0.5
    scores[:, ::7] = -0.0
    scores[5] = torch.randn(300, generator=g)
    n_visible = torch.randint(0, 301, (40, 1), generator=g)
    n_visible[:3, 0] = torch.tensor([0, 1, 300])
    visible = torch.arange(300)[None, :] < n_visible
    for k in (1, 17, 300):
        want = select_topk(scores, visible, k)
        got = select_topk_keys(scores, n_visible, k)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), k
