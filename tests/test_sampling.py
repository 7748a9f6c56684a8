import pytest
import torch

from ds4x.runtime.sampling import SamplingParams, TokenHistory, adjust, sample, sample_rows


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


# ---- logit bias and penalties --------------------------------------------------------------------

LOGITS = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0])


def _history(params: SamplingParams, prompt: list[int], generated: list[int], vocab: int = 5) -> TokenHistory:
    h = TokenHistory(params, prompt, vocab, torch.device("cpu"))
    for t in generated:
        h.add(torch.tensor([t]))
    return h


@pytest.mark.parametrize(("kw", "prompt", "generated", "expected"), [
    # counts [2, 0, 1, 0, 0]: 2 - 0.5*2 - 0.25, 0.5 - 0.5*1 - 0.25; the prompt does not count
    ({"frequency_penalty": 0.5, "presence_penalty": 0.25}, [1, 4], [0, 0, 2], [0.75, -1.0, -0.25, -3.0, 1.0]),
    ({"frequency_penalty": -1.0}, [], [3, 3], [2.0, -1.0, 0.5, -1.0, 1.0]),
    # seen {0, 1, 3} (prompt and generated): positive logits divided by 2, negative ones multiplied
    ({"repetition_penalty": 2.0}, [1], [0, 3], [1.0, -2.0, 0.5, -6.0, 1.0]),
    ({"repetition_penalty": 0.5}, [0, 1], [], [4.0, -0.5, 0.5, -3.0, 1.0]),
    ({"logit_bias": ((4, -100.0), (1, 5.0))}, [0], [0], [2.0, 4.0, 0.5, -3.0, -99.0]),
    # in order: bias 2 - 3 = -1, repetition -1 x 2 = -2, then frequency and presence -2 - 1 - 0.5
    ({"logit_bias": ((0, -3.0),), "repetition_penalty": 2.0, "frequency_penalty": 1.0, "presence_penalty": 0.5},
     [0], [0], [-3.5, -1.0, 0.5, -3.0, 1.0]),
])
def test_adjust_by_hand(kw: dict, prompt: list[int], generated: list[int], expected: list[float]) -> None:
    params = SamplingParams(**kw)
    before = LOGITS.clone()
    assert adjust(LOGITS, params, _history(params, prompt, generated)).tolist() == expected
    assert torch.equal(LOGITS, before)  # the model's logits are left as they are (logprobs read them)


def test_neutral_values_skip_the_adjustment(monkeypatch: pytest.MonkeyPatch) -> None:
    import ds4x.runtime.sampling as sampling

    logits = torch.randn(300, generator=torch.Generator().manual_seed(2)) * 3
    neutral = SamplingParams(temperature=0.8, seed=1, presence_penalty=0.0, frequency_penalty=0.0,
                             repetition_penalty=1.0, logit_bias=())
    assert not neutral.adjusts and SamplingParams(logit_bias=((1, 0.0),)).adjusts
    expected = [sample(logits, SamplingParams(temperature=0.8), torch.Generator().manual_seed(1)),
                sample(logits, SamplingParams())]

    def fail(*_: object) -> None:
        raise AssertionError("adjusted with neutral parameters")

    monkeypatch.setattr(sampling, "adjust", fail)
    assert [sample(logits, neutral, torch.Generator().manual_seed(1)), sample(logits, SamplingParams())] == expected
    # an adjustment whose values change nothing leaves the logits bit-identical
    zero = SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, logit_bias=((3, 0.0),))
    monkeypatch.undo()
    assert torch.equal(adjust(logits, zero, _history(zero, [1, 2], [3, 3], vocab=300)), logits)


def test_greedy_takes_the_argmax_of_the_adjusted_logits_and_counts_its_tokens() -> None:
    logits = torch.tensor([1.0, 0.9, 0.0])
    params = SamplingParams(frequency_penalty=2.0)
    history = TokenHistory(params, [0, 1], 3, logits.device)  # the prompt does not count for frequency
    # 0; then 1 - 2 = -1 < 0.9: 1; then 0.0 is the largest; then all three seen once: 0 again
    assert [sample(logits, params, None, history) for _ in range(4)] == [0, 1, 2, 0]
    assert history.counts.tolist() == [2.0, 1.0, 1.0]
    assert sample(LOGITS, SamplingParams(logit_bias=((0, -100.0),)), None,
                  _history(SamplingParams(logit_bias=((0, -100.0),)), [], [])) == 4


def test_penalties_apply_before_temperature_and_filters() -> None:
    """A seeded draw from penalized logits is the draw from the adjusted logits with neutral parameters."""
    logits = torch.randn(200, generator=torch.Generator().manual_seed(4)) * 2
    params = SamplingParams(temperature=0.7, top_k=30, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.7,
                            logit_bias=((5, 3.0), (9, -2.0)))
    adjusted = adjust(logits, params, _history(params, [5, 6, 7], [8, 8, 9], vocab=200))
    plain = SamplingParams(temperature=0.7, top_k=30, top_p=0.9)
    # a fresh history per draw: each draw adds its token
    assert [sample(logits, params, torch.Generator().manual_seed(s), _history(params, [5, 6, 7], [8, 8, 9], 200))
            for s in range(20)] == [sample(adjusted, plain, torch.Generator().manual_seed(s)) for s in range(20)]


def test_adjustment_needs_a_history_and_the_bias_ids_in_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="TokenHistory"):
        sample(LOGITS, SamplingParams(presence_penalty=1.0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TokenHistory(SamplingParams(logit_bias=((5, 1.0),)), [], 5, LOGITS.device)


@pytest.mark.parametrize("kw", [{"presence_penalty": 2.5}, {"frequency_penalty": -2.01},
                                {"presence_penalty": float("nan")}, {"repetition_penalty": 0},
                                {"repetition_penalty": 10.5}, {"logit_bias": ((1, 101.0),)},
                                {"logit_bias": ((1, 1.0), (1, 2.0))}, {"logit_bias": ((-1, 1.0),)}])
def test_invalid_adjustments(kw: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_draw_rows_gives_each_row_its_own_draw_with_histories() -> None:
    # a batch mixing greedy, filtered and adjusted rows draws what each row draws alone, and counts each row's
    # token in its own history
    from ds4x.runtime.sampling import draw, draw_rows

    logits = torch.randn(5, 400, generator=torch.Generator().manual_seed(8)) * 2
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=30, top_p=0.8),
              SamplingParams(temperature=0.6, frequency_penalty=1.5, logit_bias=((3, 50.0),)),
              SamplingParams(repetition_penalty=2.0), SamplingParams(temperature=1.1, min_p=0.02)]

    def histories():
        return [TokenHistory(p, [1, 2], 400, torch.device("cpu")) if p.adjusts else None for p in params]

    together_h, alone_h = histories(), histories()
    for step in range(3):
        together = draw_rows(list(logits), params, [torch.Generator().manual_seed(10 * step + i) for i in range(5)],
                             together_h, together=True)
        alone = [int(draw(logits[i], params[i], torch.Generator().manual_seed(10 * step + i), alone_h[i]))
                 for i in range(5)]
        assert together.tolist() == alone
    assert torch.equal(together_h[2].counts, alone_h[2].counts) and together_h[2].counts.sum() == 3
    assert torch.equal(together_h[3].seen, alone_h[3].seen)
    with pytest.raises(ValueError, match="TokenHistory"):
        draw_rows(list(logits), params, [None] * 5)
    with pytest.raises(ValueError, match="one params"):
        draw_rows(list(logits), params[:4], [None] * 5)


def test_draw_rows_costs_the_same_operations_for_2_or_8_rows() -> None:
    # the batch goes through each stage together (as on CUDA): the tensor operations do not grow with the rows
    # (each sampled row still draws its own uniform from its generator, on the host)
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from ds4x.runtime.sampling import draw_rows

    # a row's uniform (rand, its float() read) and `row.float()` of a float32 row (no copy) are per row
    per_row = {"aten::rand", "aten::uniform_", "aten::empty", "aten::item", "aten::_local_scalar_dense", "aten::to"}

    def ops(b: int) -> Counter:
        logits = list(torch.randn(b, 300, generator=torch.Generator().manual_seed(b)))
        params = [SamplingParams(temperature=0.7, top_p=0.9) if i % 2 else SamplingParams(temperature=1.0, top_k=9)
                  for i in range(b)]
        draw_rows(logits, params, [None] * b, together=True)  # warm-up: first-call work is not the batch's
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            draw_rows(logits, params, [torch.Generator().manual_seed(i) for i in range(b)], together=True)
        return Counter(e.name for e in prof.events() if e.name not in per_row)

    two, eight = ops(2), ops(8)
    assert two == eight, {k: (two[k], eight[k]) for k in two | eight if two[k] != eight[k]}


@pytest.mark.gpu
def test_draw_rows_on_cuda_draws_what_each_row_draws_alone() -> None:
    """On CUDA the rows go through each stage together; each row's token is the one it draws alone (and the greedy
    rows' the argmax), at a 129,280-entry vocabulary."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ds4x.runtime.sampling import draw, draw_rows

    logits = torch.randn(8, 129280, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9)) * 4
    params = [SamplingParams(temperature=0.2), SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=40), SamplingParams(temperature=0.5, min_p=0.05)] * 2
    params = params[:8]
    for seed in range(20):
        gens = [torch.Generator().manual_seed(100 * seed + i) for i in range(8)]
        together = draw_rows(list(logits), params, gens).tolist()
        alone = [int(draw(logits[i], params[i], torch.Generator().manual_seed(100 * seed + i))) for i in range(8)]
        assert together == alone
        assert together[1] == int(logits[1].argmax())
