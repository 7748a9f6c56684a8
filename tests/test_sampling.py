import pytest
import torch

from ds4x.runtime.sampling import SamplingParams, sample, sample_rows


def test_greedy_takes_lowest_index_among_ties():
    logits = torch.tensor([0.0, 3.0, 3.0, 1.0])
    assert sample(logits, SamplingParams()) == 1


def test_seeded_sampling_is_reproducible_and_respects_filters():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, top_k=5, seed=3)
    a = [sample(logits, p, torch.Generator().manual_seed(3)) for _ in range(3)]
    b = [sample(logits, p, torch.Generator().manual_seed(3)) for _ in range(3)]
    assert a == b
    top5 = set(torch.topk(logits, 5).indices.tolist())
    g = torch.Generator().manual_seed(1)
    assert all(sample(logits, p, g) in top5 for _ in range(200))


def test_top_p_and_min_p_cut_the_tail():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    seen = {sample(logits, SamplingParams(temperature=1.0, top_p=0.75), g) for _ in range(300)}
    assert seen == {0, 1}
    seen = {sample(logits, SamplingParams(temperature=1.0, min_p=0.2), g) for _ in range(300)}
    assert seen == {0, 1, 2}


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"min_p": 2}, {"top_k": -1},
                                {"temperature": float("nan")}])
def test_invalid_parameters(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_draws_follow_the_distribution_and_skip_tokens_without_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    logits = torch.log(probs)  # -inf where there is no mass
    g = torch.Generator().manual_seed(5)
    n = 6000
    counts = torch.bincount(torch.tensor([sample(logits, SamplingParams(temperature=1.0), g) for _ in range(n)]),
                            minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    for i in (1, 3, 4):  # within 5 standard deviations of the expected count
        sd = (n * probs[i] * (1 - probs[i])) ** 0.5
        assert abs(counts[i] - n * probs[i]) < 5 * sd


def test_rows_sampled_together_are_the_rows_sampled_alone():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(6)) * 3
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.2, top_k=20),
              SamplingParams(temperature=0.5, min_p=0.05)]
    together = sample_rows(list(logits), params, [torch.Generator().manual_seed(i) for i in range(4)])
    alone = [sample(logits[i], params[i], torch.Generator().manual_seed(i)) for i in range(4)]
    assert together == alone and together[0] == int(logits[0].argmax())
