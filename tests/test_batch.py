"""Batched steps over sessions of different lengths (runtime/batch.py) against stepping each session alone."""

from __future__ import annotations

import pytest
import torch

from ds4x.model.activations import sigmoid, silu, softplus
from ds4x.runtime.batch import DecodeSlots, step_sessions
from ds4x.runtime.engine import Engine, Session

TEXTS = ["def fib(n):", "import numpy as np\n", "The quick brown fox", "class Stack:\n    def push(self, x):",
         "Hello"]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load("default", device="cpu")


def _pairs(engine: Engine, cache: str, n: int) -> tuple[list, list, list[int]]:
    """Two identical sets of sessions holding prompts of different lengths, and each one's greedy next token."""
    alone = [engine.new_session(ctx=512, cache=cache, prefill_chunk=64, announce=False) for _ in range(n)]
    batch = [engine.new_session(ctx=512, cache=cache, prefill_chunk=64, announce=False) for _ in range(n)]
    for text, a, b in zip(TEXTS, alone, batch, strict=False):
        ids = engine.tokenizer.encode(text)
        a.prefill(ids)
        b.prefill(ids)
    return alone, batch, [int(a.logits.argmax()) for a in alone]


@pytest.mark.parametrize("cache", ["float", "native", "packed"])
def test_rowwise_batched_step_is_bit_identical_to_stepping_alone(engine: Engine, cache: str) -> None:
    alone, batch, tokens = _pairs(engine, cache, 5)
    want = [a.step(t) for a, t in zip(alone, tokens, strict=True)]
    got = step_sessions([(s, [t]) for s, t in zip(batch, tokens, strict=True)], rowwise=True)
    for w, g, a, b in zip(want, got, alone, batch, strict=True):
        assert torch.equal(w, g)
        assert b.tokens == a.tokens and b.cache.length == a.cache.length


def test_plain_batched_step_within_tolerance(engine: Engine) -> None:
    """Without row-wise products the matmuls see B rows instead of 1, so the last float bits may differ
    (float cache; measured up to 7e-7 of the largest logit over 64 steps of 8 sessions)."""
    alone, batch, tokens = _pairs(engine, "float", 5)
    want = [a.step(t) for a, t in zip(alone, tokens, strict=True)]
    got = step_sessions([(s, [t]) for s, t in zip(batch, tokens, strict=True)])
    for w, g in zip(want, got, strict=True):
        assert float((w - g).abs().max() / w.abs().max()) < 1e-5


def test_prefill_chunks_and_decode_rows_share_a_call(engine: Engine) -> None:
    """A prompt chunk of one session and decode rows of others in one call: each gets what it gets alone."""
    alone, batch, tokens = _pairs(engine, "packed", 3)
    chunk = engine.tokenizer.encode(" and then some more text")
    items = [(alone[0], chunk), (alone[1], [tokens[1]]), (alone[2], [tokens[2]])]
    want = [step_sessions([item], rowwise=True)[0] for item in items]
    got = step_sessions([(b, ids) for b, (_, ids) in zip(batch, items, strict=True)], rowwise=True)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


def test_greedy_64_steps_batched_equals_alone(engine: Engine) -> None:
    alone, batch, tokens = _pairs(engine, "packed", 3)
    ta, tb = list(tokens), list(tokens)
    for _ in range(64):
        ta = [int(a.step(t).argmax()) for a, t in zip(alone, ta, strict=True)]
        tb = [int(x.argmax()) for x in step_sessions([(s, [t]) for s, t in zip(batch, tb, strict=True)],
                                                     rowwise=True)]
        assert ta == tb
    assert [a.tokens for a in alone] == [b.tokens for b in batch]


def test_batch_errors(engine: Engine) -> None:
    s = engine.new_session(ctx=16, cache="packed", prefill_chunk=8, announce=False)
    other = engine.new_session(ctx=16, cache="packed", prefill_chunk=8, announce=False)
    with pytest.raises(ValueError, match="at least one session"):
        step_sessions([])
    with pytest.raises(ValueError, match="at least one token"):
        step_sessions([(s, [5]), (other, [])])
    with pytest.raises(ValueError, match="twice"):
        step_sessions([(s, [5]), (s, [6])])
    with pytest.raises(ValueError, match="vocabulary"):
        step_sessions([(s, [5]), (other, [10**6])])
    with pytest.raises(ValueError, match="prefill chunk"):
        step_sessions([(s, list(range(5, 15)))])
    step_sessions([(s, list(range(5, 13)))])
    step_sessions([(s, [5, 6, 7, 8])])
    with pytest.raises(ValueError, match="context"):
        step_sessions([(other, [5]), (s, list(range(5, 13)))])
    # nothing was evaluated by the refused calls
    assert other.cache.length == 0 and len(s.tokens) == s.cache.length == 12


def test_decode_slots_step_sessions_of_a_pool_like_stepping_them_alone(engine: Engine) -> None:
    """Sessions in a pool of decode slots (the server's CUDA path, stepped eagerly here) decode exactly as alone,
    while free and prompt-reading slots inside the stepped range are stepped with throwaway rows. A token may come
    as a device tensor (one the host has not read): the same step, and the session's ids are left to the caller."""
    pool = DecodeSlots(engine, 512, "packed", 64, capacity=6, rowwise=True)
    assert pool.sizes == [1, 2, 4, 6]
    alone = [engine.new_session(ctx=512, cache="packed", prefill_chunk=64, announce=False) for _ in range(3)]
    slotted = [Session(engine, pool.acquire(), 64) for _ in range(4)]
    assert [pool.slot_of[id(s.cache)] for s in slotted] == [0, 1, 2, 3]
    pool.release(slotted[1].cache)  # a free slot inside the stepped range
    reading = slotted[3]  # a slot whose session is still reading its prompt (one chunk so far)
    prompt = engine.tokenizer.encode("x = [i * i for i in range(10)]\n" * 6)
    reading.prefill(prompt[:40])
    held, n_read = {k: v.clone() for k, v in reading.cache.state().items()}, reading.cache.length
    assert n_read > 16
    stepping = [slotted[0], slotted[2]]
    for text, a, b in zip(TEXTS, alone, stepping, strict=False):
        ids = engine.tokenizer.encode(text)
        a.prefill(ids)
        b.prefill(ids)
    ta = tb = [int(a.logits.argmax()) for a in alone[:2]]
    held_ids = len(stepping[1].tokens)
    for _ in range(24):
        ta = [int(a.step(t).argmax()) for a, t in zip(alone, ta, strict=False)]
        given = [tb[0], torch.tensor([tb[1]])]  # the second session's token as a device tensor
        tb = [int(x.argmax()) for x in pool.decode(list(zip(stepping, given, strict=True)))]
        assert ta == tb
    assert len(stepping[0].tokens) == stepping[0].cache.length
    assert len(stepping[1].tokens) == held_ids and stepping[1].cache.length == held_ids + 24
    assert set(pool.steps) == {4}  # the highest stepping slot is 2: a step over the first four
    assert reading.cache.length == n_read and all(torch.equal(held[k], v) for k, v in reading.cache.state().items())
    # and what was written past its length does not change the rest of its prompt
    whole = engine.new_session(ctx=512, cache="packed", prefill_chunk=64, announce=False)
    whole.prefill(prompt[:40])
    assert torch.equal(whole.prefill(prompt[40:]), reading.prefill(prompt[40:]))
    assert pool.acquire() is slotted[1].cache and slotted[1].cache.length == 0  # lowest free first, reset
    pool.acquire()
    pool.acquire()
    with pytest.raises(ValueError, match="all 6 decode slots"):
        pool.acquire()
    with pytest.raises(ValueError, match="twice"):
        pool.decode([(stepping[0], 1), (stepping[0], 2)])
    with pytest.raises(ValueError, match="vocabulary"):
        pool.decode([(stepping[0], 10**6)])
    with pytest.raises(ValueError, match="one id"):
        pool.decode([(stepping[0], torch.tensor([1, 2]))])


def test_decode_slots_warm_up_makes_every_step_and_leaves_the_pool_as_new(engine: Engine) -> None:
    """Warming up makes the step of every batch size (on CUDA: compiled and captured) and frees every slot; the
    sessions decoded afterwards get the bits of a pool never warmed up."""
    warm = DecodeSlots(engine, 512, "packed", 64, capacity=6, rowwise=True)
    done: list[int] = []
    warm.warm_up(done.append)
    assert done == [1, 2, 4, 6] and set(warm.steps) == {1, 2, 4, 6} and warm.free == list(range(6))
    cold = DecodeSlots(engine, 512, "packed", 64, capacity=6, rowwise=True)
    pairs = [(Session(engine, warm.acquire(), 64), Session(engine, cold.acquire(), 64)) for _ in range(3)]
    assert all(w.cache.length == 0 for w, _ in pairs)
    for text, (w, c) in zip(TEXTS, pairs, strict=False):
        ids = engine.tokenizer.encode(text)
        assert torch.equal(w.prefill(ids), c.prefill(ids))
    tokens = [int(c.logits.argmax()) for _, c in pairs]
    for _ in range(8):
        got = warm.decode([(w, t) for (w, _), t in zip(pairs, tokens, strict=True)])
        want = cold.decode([(c, t) for (_, c), t in zip(pairs, tokens, strict=True)])
        assert all(torch.equal(g, x) for g, x in zip(got, want, strict=True))
        tokens = [int(x.argmax()) for x in want]
    with pytest.raises(RuntimeError, match="every decode slot free"):
        warm.warm_up()


def _three_prefilled_twice(engine: Engine, pool: DecodeSlots) -> tuple[list[Session], list[Session]]:
    """Three sessions of their own and three of the pool, each pair prefilled with one of the texts."""
    alone = [engine.new_session(ctx=512, cache="packed", prefill_chunk=64, announce=False) for _ in range(3)]
    slotted = [Session(engine, pool.acquire(), 64) for _ in range(3)]
    for text, a, b in zip(TEXTS, alone, slotted, strict=False):
        ids = engine.tokenizer.encode(text)
        a.prefill(ids)
        b.prefill(ids)
    return alone, slotted


@pytest.mark.gpu
def test_decode_slots_on_cuda_replay_graphs_near_sessions_alone() -> None:
    """The server's CUDA path: pool sessions decode from one captured step per batch size. Fed the same tokens,
    each one's logits stay near those of decoding it alone (batched products differ in the last float bits, which
    an E4M3 rounding of a stored row can enlarge), across CSA/HCA window closes and a session leaving and joining."""
    engine = Engine.load("default", device="cuda")
    pool = DecodeSlots(engine, 512, "packed", 64, capacity=4)
    alone, slotted = _three_prefilled_twice(engine, pool)
    worst, agree, steps = 0.0, 0, 0
    for i in range(40):
        if i == 20:  # the second session leaves; a newcomer takes its slot, prefilled like a fresh one alone
            pool.release(slotted[1].cache)
            slotted[1] = Session(engine, pool.acquire(), 64)
            alone[1] = engine.new_session(ctx=512, cache="packed", prefill_chunk=64, announce=False)
            ids = engine.tokenizer.encode(TEXTS[3])
            alone[1].prefill(ids)
            slotted[1].prefill(ids)
        tokens = [int(a.logits.argmax()) for a in alone]
        want = torch.stack([a.step(t) for a, t in zip(alone, tokens, strict=True)])
        got = torch.stack(pool.decode(list(zip(slotted, tokens, strict=True))))
        worst = max(worst, float((want - got).abs().max() / want.abs().max()))
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        steps += len(tokens)
    assert set(pool.steps) == {4} and pool.steps[4].graph is not None
    assert worst < 2e-2 and agree >= 0.95 * steps, (worst, agree, steps)


@pytest.mark.gpu
def test_decode_slots_on_cuda_queue_steps_on_device_tokens() -> None:
    """The server's overlapped reads: steps fed the argmax of the last logits as device tensors, queued back to
    back with no read by the host in between (the host's inputs of one step must not be overwritten before its
    copy ran), give the logits of steps fed the same tokens as host ids."""
    engine = Engine.load("default", device="cuda")
    pools = [DecodeSlots(engine, 512, "packed", 64, capacity=4) for _ in range(2)]
    ahead, fed = (_three_prefilled_twice(engine, pool)[1] for pool in pools)
    tokens = [s.logits.argmax().reshape(1) for s in ahead]
    used, queued = [], []
    for _ in range(16):
        used.append(tokens)
        logits = pools[0].decode(list(zip(ahead, tokens, strict=True)))
        queued.append(torch.stack(logits))
        tokens = [x.argmax().reshape(1) for x in logits]  # never read here: the next step waits on the device
    assert all(len(s.tokens) + 16 == s.cache.length for s in ahead)  # the ids are the caller's to append
    for step, ids in zip(queued, used, strict=True):
        want = torch.stack(pools[1].decode(list(zip(fed, [int(t) for t in ids], strict=True))))
        assert float((want - step).abs().max() / want.abs().max()) < 1e-5
    assert pools[0].steps[4].graph is not None and pools[1].steps[4].graph is not None


def test_step_spans_are_the_ladder_below_the_context() -> None:
    from ds4x.runtime.decode_graph import step_spans

    assert step_spans(1024, (0, 4, 8), (256, 128, 4096, 256)) == [128, 256, None]
    assert step_spans(1024, (0, 4, 8), ()) == [None]
    assert step_spans(128, (4,), (128,)) == [None]  # a span of the whole context is the step without one
    with pytest.raises(ValueError, match="multiples of every compression ratio"):
        step_spans(1024, (4, 128), (200,))


def test_captured_step_runs_the_smallest_span_above_its_positions(engine: Engine, monkeypatch) -> None:
    """With POSITION_SPANS each step runs within `position_span` of the smallest span above every position it
    writes (idle occupied slots included), and without a span once a position reaches the last."""
    from ds4x.model import attention
    from ds4x.runtime import decode_graph

    monkeypatch.setattr(decode_graph, "POSITION_SPANS", (64, 32))
    pool = DecodeSlots(engine, 512, "packed", 64, capacity=2)
    seen = []
    step = engine.model.decode_step

    def recorded(*args, **kw):
        seen.append(attention._SPAN.get())
        return step(*args, **kw)

    monkeypatch.setattr(engine.model, "decode_step", recorded)
    idle, a = (Session(engine, pool.acquire(), 64) for _ in range(2))
    idle.prefill(list(range(3, 53)))  # 50 tokens in slot 0, not stepping: its position counts all the same
    a.prefill(list(range(3, 23)))  # 20 tokens in slot 1
    for _ in range(50):  # a writes positions 20 .. 69
        pool.decode([(a, int(a.logits.argmax()))])
    assert seen == [64] * 44 + [None] * 6
    assert pool.steps[2].spans == [32, 64, None] and pool.steps[2].span is None


def test_warm_up_makes_each_spans_step(engine: Engine, monkeypatch) -> None:
    """With position spans the warm-up runs every batch size's step once per span, at the span's first position,
    and leaves every slot free. The ladder is the one of the pool's making (a later change of the setting leaves
    it)."""
    from ds4x.model import attention
    from ds4x.runtime import decode_graph

    monkeypatch.setattr(decode_graph, "POSITION_SPANS", (64, 128))
    pool = DecodeSlots(engine, 512, "packed", 64, capacity=3)
    monkeypatch.setattr(decode_graph, "POSITION_SPANS", ())
    seen = []
    step = engine.model.decode_step

    def recorded(tokens, positions, caches):
        seen.append((len(caches), attention._SPAN.get(), positions.tolist()))
        return step(tokens, positions, caches)

    monkeypatch.setattr(engine.model, "decode_step", recorded)
    pool.warm_up()
    assert seen == [(b, span, [start] * b) for b in (1, 2, 3) for span, start in ((64, 0), (128, 64), (None, 128))]
    assert pool.free == [0, 1, 2] and pool.acquire().length == 0  # a slot is reset as it is taken


@pytest.mark.gpu
def test_decode_within_position_spans_matches_the_step_without(monkeypatch) -> None:
    """POSITION_SPANS on the GPU: sessions decoding across a span (HCA offered, and CSA scoring and selecting, only
    the compressed rows below it) give the bits of the sessions of a pool without spans, a graph captured per span.
    Bits, because at this size each split is one block with or without the span (the splits past it only add
    zero-weight states to the merge), the indexer's scores are per row and the selection is exact and in row
    order."""
    from ds4x.runtime import decode_graph

    engine = Engine.load("default", device="cuda")
    pools = []
    for spans in ((), (256,)):  # the pool fixes its ladder when it is made
        monkeypatch.setattr(decode_graph, "POSITION_SPANS", spans)
        pools.append(DecodeSlots(engine, 1024, "packed", 64, capacity=4))
    whole, spanned = (_three_prefilled_twice(engine, pool)[1] for pool in pools)
    prompt = engine.tokenizer.encode("x = [i * i for i in range(10)]\n" * 20)[:200]
    for s in (*whole, *spanned):
        s.prefill(prompt)
    for i in range(96):  # every session crosses position 256
        tokens = [int(s.logits.argmax()) for s in whole]
        want = torch.stack(pools[0].decode(list(zip(whole, tokens, strict=True))))
        got = torch.stack(pools[1].decode(list(zip(spanned, tokens, strict=True))))
        assert torch.equal(got, want), (i, [s.cache.length for s in spanned])
    assert set(pools[1].steps[4].captured) == {256, None} and set(pools[0].steps[4].captured) == {None}


def test_activations_do_not_depend_on_the_tensor_size() -> None:
    """torch's CPU sigmoid/silu/softplus take other approximations on SIMD tails; ours must not."""
    x = torch.randn(37, 24) * 6
    for f in (sigmoid, silu, softplus):
        whole = f(x)
        assert torch.equal(whole, torch.cat([f(x[i : i + 1]) for i in range(x.shape[0])]))
        assert torch.equal(whole[5, 3], f(x[5, 3]))
    assert torch.allclose(sigmoid(x), torch.sigmoid(x), rtol=1e-6, atol=1e-7)
    assert torch.allclose(silu(x), torch.nn.functional.silu(x), rtol=1e-6, atol=1e-6)
    assert torch.allclose(softplus(x), torch.nn.functional.softplus(x), rtol=1e-6, atol=1e-6)
    assert softplus(torch.tensor([100.0, -100.0])).tolist() == [100.0, pytest.approx(3.7e-44, abs=1e-43)]


@pytest.mark.parametrize("emit", ["fused", "torch"])
def test_pool_decode_on_the_triton_path_runs_each_cache_kernel_once_and_matches_sessions_alone(monkeypatch,
                                                                                             emit) -> None:
    """The GPU decode branch in the Triton interpreter: a step over caches 0..3 of a pool reads their stores as one
    batch of rings (each cache kernel once per layer for all four: row writes, emit, indexer, top-k, attention),
    and every session's logits are the bits of stepping it alone (each a batch of one), a free slot included.
    ``emit``: the fused compressor kernel, or the torch emit over each ring of the batch (its fallback)."""
    import ds4x.model.attention as attention

    if torch.cuda.is_available():
        pytest.skip("covered by the gpu tests")
    monkeypatch.setattr(attention, "use_triton", lambda device: True)
    if emit == "torch":
        monkeypatch.setattr(attention.compressor, "supported", lambda proj, rope_half: False)
    batch_sizes = []
    decode_triton = attention._decode_triton

    def counting(st, packed, pos, *args):
        batch_sizes.append(pos.shape[0])
        return decode_triton(st, packed, pos, *args)

    monkeypatch.setattr(attention, "_decode_triton", counting)
    engine = Engine.load("tiny", device="cpu")
    pool = DecodeSlots(engine, 128, "packed", 32, capacity=4, rowwise=True)
    alone = [engine.new_session(ctx=128, cache="packed", prefill_chunk=32, prefill_mode="reference", announce=False)
             for _ in range(3)]
    slotted = [Session(engine, pool.acquire(), 32, "reference") for _ in range(4)]
    pool.release(slotted[2].cache)  # a free slot inside the stepped range
    stepping = [slotted[0], slotted[1], slotted[3]]
    g = torch.Generator().manual_seed(3)
    for n, a, b in zip((37, 5, 61), alone, stepping, strict=True):
        ids = torch.randint(3, 259, (n,), generator=g).tolist()
        a.prefill(ids)
        b.prefill(ids)
    tokens = [int(a.logits.argmax()) for a in alone]
    batch_sizes.clear()
    for _ in range(4):  # positions 37-40, 5-8, 61-64: every session closes a CSA and an HCA window (ratios 4, 8)
        want = [a.step(t) for a, t in zip(alone, tokens, strict=True)]
        got = pool.decode(list(zip(stepping, tokens, strict=True)))
        assert all(torch.equal(x, y) for x, y in zip(want, got, strict=True))
        tokens = [int(x.argmax()) for x in want]
    n_layers = engine.cfg.num_layers
    assert batch_sizes == ([1] * 3 * n_layers + [4] * n_layers) * 4
