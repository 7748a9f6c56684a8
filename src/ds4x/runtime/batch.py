"""Batched steps over many sessions: each session advances by its own tokens in one model call.

A decode step is one token per session; a prefill chunk is several; both can share a call. The sessions
may hold different lengths; token-local work runs over all rows together, attention per session
(:meth:`ds4x.model.transformer.Transformer.forward_batch`). The server (:mod:`ds4x.serve.scheduler`) runs
each prompt chunk alone and the decode rows of all generating sessions together.

Batching changes the shapes of the token-local matmuls, and a matmul library picks its kernel (its reduction
order) by shape, so a session's logits can differ from stepping it alone in the last float bits; through the
native/packed cache's E4M3 and MXFP4 roundings such a difference can grow (tests/test_batch.py measures it).
With ``rowwise`` every product computes each row alone, and a batched decode step gives each session the
very logits a step of that session alone gives (on the CPU: bit-identical; the test checks it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds4x.runtime.engine import Session


def step_sessions(items: Sequence[tuple[Session, Sequence[int]]], rowwise: bool = False) -> list[torch.Tensor]:
    """Advance every session by its token ids (one model call); return each one's next-token logits [V].

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
                                        [session.cache for session, _ in items], rowwise=rowwise)
    out = []
    for (session, ids), row in zip(items, logits, strict=True):
        session.tokens.extend(ids)
        session.logits = row.clone()  # its own storage: a session outlives the batch (saved, cloned)
        out.append(session.logits)
    return out
