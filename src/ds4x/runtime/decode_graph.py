"""A session's decode step as a CUDA graph: one replay per token instead of thousands of kernel launches.

`Transformer.decode_step` reads its position and token from device tensors and sizes everything by the
cache's capacities, so the step is captured once per session (the graph holds the cache's buffers) and
replayed at every later position. The first step runs eagerly (it compiles the Triton kernels and is the
real step for that position), then the capture is taken; capturing runs nothing, so no state moves twice.
``DS4X_CUDA_GRAPHS=0`` keeps every step eager. A capture that fails is reported once and the session
continues eagerly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from ds4x.kernels.dispatch import use_triton
from ds4x.model.cache import ModelCache
from ds4x.model.transformer import Transformer

log = logging.getLogger(__name__)

Decoder = Callable[[int], torch.Tensor]  # token -> next-token logits [V] (advances the cache)


def graphs_enabled(device: torch.device, cache_mode: str) -> bool:
    """Whether decode steps on ``device`` with a ``cache_mode`` cache are captured as CUDA graphs."""
    return (os.environ.get("DS4X_CUDA_GRAPHS", "1") != "0" and use_triton(device)
            and cache_mode in ("native", "packed"))


class GraphDecoder:
    """Decodes one token at a time for one cache, replaying a captured step."""

    def __init__(self, model: Transformer, cache: ModelCache):
        self.model, self.cache = model, cache
        self.tokens = torch.zeros(1, dtype=torch.long, device=model.device)
        self.positions = torch.zeros(1, dtype=torch.long, device=model.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output buffer [1, V]
        self.eager = False  # set when a capture failed

    def __call__(self, token: int) -> torch.Tensor:
        self.cache.check_room(1)
        self.tokens.fill_(token)
        self.positions.fill_(self.cache.length)
        if self.eager:
            out = self.model.decode_step(self.tokens, self.positions, [self.cache])[0]
        elif self.graph is None:
            out = self._first_step()
        else:
            self.graph.replay()
            assert self.logits is not None
            out = self.logits[0].clone()  # the buffer is overwritten by the next replay
        self.cache.length += 1
        return out

    def _first_step(self) -> torch.Tensor:
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):  # eager, off the default stream as capture requires
            out = self.model.decode_step(self.tokens, self.positions, [self.cache])[0]
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.logits = self.model.decode_step(self.tokens, self.positions, [self.cache])
        except RuntimeError as e:  # an op that syncs with the host, or no room for the graph
            first: BaseException = e
            while first.__context__ is not None:  # the op that broke the capture, not the end-of-capture error
                first = first.__context__
            log.warning("decode step could not be captured as a CUDA graph (%s); decoding eagerly",
                        str(first).splitlines()[0] if str(first) else type(first).__name__)
            self.eager, self.logits = True, None
            return out
        self.graph = graph
        return out


def make_decoder(model: Transformer, cache: ModelCache) -> Decoder:
    """The decode step for ``cache``: a CUDA graph where `graphs_enabled`, else the eager forward."""
    if graphs_enabled(model.device, cache.mode):
        return GraphDecoder(model, cache)
    return lambda token: model.forward(torch.tensor([token], dtype=torch.long), cache)
