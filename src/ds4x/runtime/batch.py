"""Batched steps over many sessions: each session advances by its own tokens in one model call.

A decode step is one token per session; a prefill chunk is several; both can share a call. The sessions
may hold different lengths; token-local work runs over all rows together, attention per session
(:meth:`ds4x.model.transformer.Transformer.forward_batch`). The server (:mod:`ds4x.serve.scheduler`) runs
the next prompt chunks of the requests reading their prompts in one call (one request per call when
batch-invariant) and the decode rows of all generating sessions together.

On CUDA the server decodes through :class:`DecodeSlots` instead: its sessions live in a fixed pool of caches,
so a decode step over the first b caches of the pool is captured once as a CUDA graph and replayed whatever
sessions come and go (an eager batched step launches every kernel of every layer, per session for the
attention: about 130 ms for one session of the full-size model on an H200, 11 ms replayed).

Batching changes the shapes of the token-local matmuls, and a matmul library picks its kernel (its reduction
order) by shape, so a session's logits can differ from stepping it alone in the last float bits; through the
native/packed cache's E4M3 and MXFP4 roundings such a difference can grow (tests/test_batch.py measures it).
With ``rowwise`` every product computes each row alone, and a batched decode step gives each session the
very logits a step of that session alone gives (on the CPU: bit-identical; the test checks it).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from ds4x.kernels.linear import rowwise_products
from ds4x.model.cache import CachePool, ModelCache
from ds4x.runtime.decode_graph import CapturedStep, step_spans
from ds4x.runtime.engine import Engine, Session


def step_sessions(items: Sequence[tuple[Session, Sequence[int]]], rowwise: bool = False,
                  all_logits: bool = False) -> list[torch.Tensor]:
    """Advance every session by its token ids (one model call); return each one's next-token logits [V] (with
    ``all_logits`` the logits after each of its ids [T_i, V], the last row its next-token logits).

    Each session's ids must fit its context and its cache's prefill chunk; all sessions belong to one engine.
    ``rowwise``: batch-invariant products (each row computed as in a batch of one; see
    :func:`ds4x.kernels.linear.rowwise_products`), so a session's logits do not depend on the others.
    """
    if not items:
        raise ValueError("step_sessions needs at least one session")
    engine = items[0][0].engine
    for session, ids in items:
        if session.engine is not engine:
            raise ValueError("all sessions of a batched step must belong to the same engine")
        if not ids:
            raise ValueError("every session of a batched step needs at least one token")
        session._check_ids(list(ids))
    logits = engine.model.forward_batch([torch.tensor(list(ids), dtype=torch.long) for _, ids in items],
                                        [session.cache for session, _ in items], rowwise=rowwise,
                                        all_logits=all_logits)
    rows = logits.split([len(ids) for _, ids in items]) if all_logits else logits
    out = []
    for (session, ids), row in zip(items, rows, strict=True):
        session.tokens.extend(ids)
        session.logits = (row[-1] if all_logits else row).clone()  # its own storage: a session outlives the batch
        out.append(row if all_logits else session.logits)
    return out


class DecodeSlots:
    """A pool of ``capacity`` caches of one layout whose sessions decode together from CUDA graphs.

    A decode step covers the first b caches of the pool, b the smallest batch size (powers of two, and
    ``capacity``) that holds every stepping session; one graph is captured per b on first use. Caches in that
    range whose session is not stepping are stepped too, with token 0 and their logits dropped: a free cache at
    position 0, a session reading its prompt at its own length, so the rows written lie at or past it and the
    next pass overwrites them before anything reads them (as a captured step rewrites its open compressor
    window every step). Free caches are handed out lowest first, so the sessions stay packed at the front.
    The caches are the slots of a `CachePool`, all allocated up front: the step's cache kernels (row writes,
    compressor emit, indexer scoring, top-k, attention) run once per layer for all b sessions, not once per
    session. A step may take tokens the host has not read yet, from the device (`decode`). On CUDA, Q8_0
    matrices multiply batches through dense mirrors (:func:`ds4x.kernels.quant_matmul.use_dense_mirrors`).
    ``rowwise``: batch-invariant products (see :func:`step_sessions`; for the eager step, e.g. on the CPU).
    """

    def __init__(self, engine: Engine, ctx: int, mode: str, chunk: int, capacity: int, rowwise: bool = False):
        if capacity <= 0:
            raise ValueError(f"a decode slot pool needs a positive capacity, got {capacity}")
        self.engine, self.ctx, self.mode, self.chunk, self.capacity = engine, ctx, mode, chunk, capacity
        self.rowwise = rowwise
        if engine.model.device.type == "cuda":
            from ds4x.kernels.quant_matmul import use_dense_mirrors

            use_dense_mirrors(True)
        self.sizes = sorted({*(1 << i for i in range(capacity.bit_length()) if 1 << i < capacity), capacity})
        model = engine.model
        self.caches: list[ModelCache] = CachePool(model.cfg, ctx, model.device, mode, chunk, capacity).caches
        self.slot_of: dict[int, int] = {id(c): i for i, c in enumerate(self.caches)}
        self.free: list[int] = list(range(capacity))  # sorted
        self.steps: dict[int, CapturedStep] = {}
        # fixed with the pool, so that every batch size's step and the warm-up take the same ladder
        self.spans = step_spans(ctx, model.cfg.compress_ratios)

    def acquire(self) -> ModelCache:
        """An empty cache of the pool (the lowest free one), or ValueError when all are in use."""
        if not self.free:
            raise ValueError(f"all {self.capacity} decode slots are in use")
        cache = self.caches[self.free.pop(0)]
        cache.reset()
        return cache

    def release(self, cache: ModelCache) -> None:
        """Give a cache of the pool back. Its rows stay readable until the next decode step or ``acquire``
        (a finished session can still be stored)."""
        slot = self.slot_of[id(cache)]
        if slot not in self.free:
            bisect.insort(self.free, slot)

    def owns(self, cache: ModelCache) -> bool:
        return id(cache) in self.slot_of

    def warm_up(self, progress: Callable[[int], None] | None = None) -> None:
        """Make every batch size's step now, with all slots free: a first use compiles the step's kernels for its
        shapes and captures its graph (seconds each on a large model), which a request would otherwise wait for;
        with position spans (`ds4x.runtime.decode_graph.POSITION_SPANS`) one step per span, taken at the span's
        first position. ``progress(b)`` after each size. The slots are free again afterwards, their rows dropped."""
        if len(self.free) != self.capacity:
            raise RuntimeError(f"warming up needs every decode slot free; {self.capacity - len(self.free)} in use")
        sessions = [Session(self.engine, self.acquire(), self.chunk) for _ in range(self.capacity)]
        starts = [0, *self.spans[:-1]]  # each span's first position
        try:
            for b in self.sizes:
                for start in starts:  # below the context, so it holds the step
                    for session in sessions[:b]:
                        session.cache.reset()
                        session.tokens.clear()
                        session.cache.length = start  # (rows below it as the reset left them: logits unused)
                    self.decode([(session, 1 % self.engine.cfg.vocab_size) for session in sessions[:b]])
                if progress:
                    progress(b)
        finally:
            for session in sessions:
                self.release(session.cache)

    def evaluate_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """Evaluate ``prompts`` in one model call (`step_sessions`), each in a fresh cache of the pool, and free
        those caches again: a prompt call as a server makes it, for warming up or timing (nothing is kept)."""
        caches = [self.acquire() for _ in prompts]
        try:
            sessions = [Session(self.engine, cache, self.chunk) for cache in caches]
            step_sessions(list(zip(sessions, prompts, strict=True)), rowwise=self.rowwise)
        finally:
            for cache in caches:
                self.release(cache)

    def decode(self, items: Sequence[tuple[Session, int | torch.Tensor]]) -> list[torch.Tensor]:
        """Advance each session (its cache from this pool) by one token; return each one's logits [V].

        A token is an id, or a one-element long tensor on the model's device holding one: a token drawn on the
        device that the host has not read yet, which the step takes from the device, so the host need not wait
        for it. Such a token is not appended to ``session.tokens`` (its value is not known here): the caller
        appends it once read, or gives the row back (``cache.length -= 1``) if the session ends before it."""
        if not items:
            raise ValueError("decode needs at least one session")
        slots = [self.slot_of[id(session.cache)] for session, _ in items]
        if len(set(slots)) != len(slots):
            raise ValueError("a session appears twice in one decode step")
        for session, token in items:
            if isinstance(token, torch.Tensor):
                if token.numel() != 1 or token.device != self.engine.model.device:
                    raise ValueError(f"a device token is one id on {self.engine.model.device}, got "
                                     f"{list(token.shape)} on {token.device}")
                if session.cache.length >= session.ctx:
                    raise ValueError(f"context overflow: the session holds {session.cache.length} tokens of "
                                     f"{session.ctx}")
            else:
                session._check_ids([token])
        b = next(n for n in self.sizes if n > max(slots))
        caches = self.caches[:b]
        tokens = [0] * b
        held: list[torch.Tensor | None] = [None] * b
        positions = [0 if slot in self.free else c.length for slot, c in enumerate(caches)]
        for slot, (_, token) in zip(slots, items, strict=True):
            if isinstance(token, torch.Tensor):
                held[slot] = token
            else:
                tokens[slot] = token
        for slot, cache in enumerate(caches):
            if positions[slot] >= cache.ctx:  # no row to write past a full context
                raise ValueError(f"decode slot {slot} holds a full context but is not stepping")
        step = self.steps.get(b)
        if step is None:
            step = self.steps[b] = CapturedStep(self.engine.model, caches, pipelined=True, spans=self.spans)
        with rowwise_products(self.rowwise):
            logits = step(tokens, positions, held)
        out = []
        for slot, (session, token) in zip(slots, items, strict=True):
            session.cache.length += 1
            if not isinstance(token, torch.Tensor):
                session.tokens.append(token)
            session.logits = logits[slot]
            out.append(session.logits)
        return out
