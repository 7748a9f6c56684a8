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
