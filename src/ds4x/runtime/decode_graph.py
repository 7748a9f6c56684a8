"""Decode steps as CUDA graphs: one replay per step instead of thousands of kernel launches.

`Transformer.decode_step` reads its positions and tokens from device tensors and sizes everything by the
caches' capacities, so a step over a fixed list of caches is captured once (the graph holds the caches'
buffers) and replayed at every later position. With ``POSITION_SPANS`` a step is captured once per span (the
steps of a span launch the compressed layers' kernels for positions below it, `ds4x.model.attention.position_span`)
and each call replays the smallest span above its positions. The first step (of each span) runs eagerly (it
compiles the Triton kernels and is the real step for those positions), then the capture is taken; capturing runs
nothing, so no state moves twice. ``DS4X_CUDA_GRAPHS=0`` keeps every step eager. A capture that fails is
reported once and the caller continues eagerly.

:class:`GraphDecoder` decodes one session; :class:`ds4x.runtime.batch.DecodeSlots` decodes a fixed pool of
caches together (one captured step per batch size).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch

from ds4x.kernels.dispatch import use_triton
from ds4x.model.attention import position_span
from ds4x.model.cache import ModelCache
from ds4x.model.transformer import Transformer

log = logging.getLogger(__name__)

Decoder = Callable[[int], torch.Tensor]  # token -> next-token logits [V] (advances the cache)

# Position spans below the caches' context for which a step is captured on its own (each a multiple of every
# compression ratio): a step's HCA splits and CSA top-k are otherwise sized by the context, so a session opened for
# 1M tokens ran them 1M-wide at every position (H100, 03d142b, one session at a 4K position: 6.53 ms a step in a
# 1M cache against 6.04 in a 4,142-token one; docs/PROFILE.md). Each span costs one more capture per step shape
# (seconds, and the graph's memory). Empty: one step for any position. With these spans the same session runs its
# 4K position in 6.12 ms, four sessions of a 256K cache at 4K 10.67 -> 10.11 ms (H100, 754f523, skipped empty splits
# on as well); a 2-slot 1M pool's warm-up 2.2 s and +0.19 GiB of graphs against 0.6 s and +0.06 GiB without them
# (kernels already compiled)
POSITION_SPANS: tuple[int, ...] = (16384, 131072)


def step_spans(ctx: int, ratios: Sequence[int], spans: Sequence[int] | None = None) -> list[int | None]:
    """The spans a step over caches of ``ctx`` tokens is captured for, ascending: those of ``spans`` (default
    ``POSITION_SPANS``) below ``ctx``, then None (any position). Each must be a multiple of every compression
    ratio in ``ratios`` (a span's compressed rows are whole)."""
    spans = POSITION_SPANS if spans is None else spans
    bad = [s for s in spans if s <= 0 or any(r and s % r for r in ratios)]
    if bad:
        raise ValueError(f"position spans are positive multiples of every compression ratio "
                         f"{sorted(set(r for r in ratios if r))}; got {bad}")
    return [*sorted(s for s in set(spans) if s < ctx), None]


def graphs_enabled(device: torch.device, cache_mode: str) -> bool:
    """Whether decode steps on ``device`` with a ``cache_mode`` cache are captured as CUDA graphs."""
    return (os.environ.get("DS4X_CUDA_GRAPHS", "1") != "0" and use_triton(device)
            and cache_mode in ("native", "packed"))


class CapturedStep:
    """One token for each of a fixed list of caches, replayed from a CUDA graph after the first call.

    The caller chooses the positions (normally each cache's length) and advances no length here. Where
    graphs are off (`graphs_enabled`) every call runs the step eagerly.

    ``pipelined``: the caller queues a step before the previous one has run (the server's decode slots read a
    step's tokens only after queueing the next), and may give some caches' tokens as device tensors, drawn on the
    device and not read by the host yet: the step adds a device buffer holding them to the host's tokens (one more
    small kernel in the graph), and the host's inputs are copied by a launch of their own before the replay, so
    that writing the next ones waits for that copy only, not for the whole step."""

    def __init__(self, model: Transformer, caches: Sequence[ModelCache], pipelined: bool = False,
                 spans: Sequence[int | None] | None = None):
        self.model, self.caches = model, list(caches)
        n = len(self.caches)
        # the step's inputs, tokens then positions: written on the host into page-locked memory, copied to the
        # device by the step itself (the graph's first node; not pipelined), so the host does no copy call before
        # a replay (a step's time counts from the previous one's end, so every microsecond the host spends before
        # the replay is the GPU's idle time)
        cuda = model.device.type == "cuda"
        self.host_inputs = torch.zeros(2, n, dtype=torch.long, pin_memory=cuda)
        self._host_view = self.host_inputs.numpy()
        self.inputs = torch.zeros(2, n, dtype=torch.long, device=model.device)
        self.tokens, self.positions = self.inputs[0], self.inputs[1]
        # pipelined: the tokens given as device tensors, 0 elsewhere (the host's tokens are 0 where these are not)
        self.held = torch.zeros(n, dtype=torch.long, device=model.device) if pipelined else None
        self._held_set = False  # whether ``held`` has non-zero entries from the last call
        self._zero = torch.zeros(1, dtype=torch.long, device=model.device)
        # the ladder of `step_spans` (default: that of the caches' context and POSITION_SPANS now)
        self.spans = list(spans) if spans is not None else step_spans(min(c.ctx for c in self.caches),
                                                                      model.cfg.compress_ratios)
        self.span: int | None = None  # the last call's span
        # per span: its graph and the graph's output buffer [n, V]
        self.captured: dict[int | None, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # recorded after the copy that reads host_inputs: after the step, or (pipelined) after the copy's own launch
        # (CUDA only: on the CPU the copy is done when it returns)
        self._consumed = torch.cuda.Event() if cuda else None
        # eager where graphs are off, or once a capture failed
        self.eager = not all(graphs_enabled(model.device, c.mode) for c in self.caches)

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The last call's captured step (None before its capture, or eager)."""
        captured = self.captured.get(self.span)
        return captured[0] if captured is not None else None

    def _copy_inputs(self) -> None:
        self.inputs.copy_(self.host_inputs, non_blocking=True)

    def _step(self) -> torch.Tensor:
        with position_span(self.span):
            if self.held is None:
                self._copy_inputs()
                return self.model.decode_step(self.tokens, self.positions, self.caches)
            return self.model.decode_step(self.tokens + self.held, self.positions, self.caches)

    def __call__(self, tokens: Sequence[int], positions: Sequence[int],
                 held: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
        """Float32 logits [n, V], owned by the caller (the graph's buffer is copied). ``held`` (pipelined): per
        cache a one-element long tensor on the model's device to take as its token, or None to take ``tokens[i]``
        (which must be 0 where a tensor is given)."""
        if held is not None and self.held is None and any(h is not None for h in held):
            raise ValueError("this step is not pipelined: its tokens come from the host")
        if self._consumed is not None:  # the last copy must have read host_inputs (normally it has long since)
            self._consumed.synchronize()  # returns at once before the first record
        self._host_view[0] = tokens
        self._host_view[1] = positions
        top = max(positions)
        self.span = next(s for s in self.spans if s is None or top < s)
        if self.held is not None:  # launches queued behind the previous step, which read both buffers
            self._copy_inputs()
            if self._consumed is not None:
                self._consumed.record()
            if held is not None and any(h is not None for h in held):
                torch.cat([self._zero if h is None else h.reshape(1) for h in held], out=self.held)
                self._held_set = True
            elif self._held_set:
                self.held.zero_()
                self._held_set = False
        captured = self.captured.get(self.span)
        if self.eager:
            out = self._step()
        elif captured is None:
            out = self._first_step()
        else:
            captured[0].replay()
            out = captured[1].clone()  # the buffer is overwritten by the next replay
        if self._consumed is not None and self.held is None:
            self._consumed.record()
        return out

    def _first_step(self) -> torch.Tensor:
        dev = self.model.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # eager, off the default stream as capture requires
            out = self._step()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                logits = self._step()
        except RuntimeError as e:  # an op that syncs with the host, or no room for the graph
            first: BaseException = e
            while first.__context__ is not None:  # the op that broke the capture, not the end-of-capture error
                first = first.__context__
            log.warning("decode step could not be captured as a CUDA graph (%s); decoding eagerly",
                        str(first).splitlines()[0] if str(first) else type(first).__name__)
            self.eager = True
            return out
        self.captured[self.span] = graph, logits
        return out


class GraphDecoder:
    """Decodes one token at a time for one cache, replaying a captured step."""

    def __init__(self, model: Transformer, cache: ModelCache):
        self.cache = cache
        self.step = CapturedStep(model, [cache])

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        return self.step.graph

    def __call__(self, token: int) -> torch.Tensor:
        self.cache.check_room(1)
        out = self.step([token], [self.cache.length])[0]
        self.cache.length += 1
        return out


def make_decoder(model: Transformer, cache: ModelCache) -> Decoder:
    """The decode step for ``cache``: a CUDA graph where `graphs_enabled`, else the eager forward."""
    if graphs_enabled(model.device, cache.mode):
        return GraphDecoder(model, cache)
    return lambda token: model.forward(torch.tensor([token], dtype=torch.long), cache)
