"""Next-token sampling: logit bias and penalties, then greedy or temperature, top-k, top-p, min-p, seeded.

Order (`draw`): the logits are first adjusted (`adjust`: ``logit_bias`` added, then vLLM's
``repetition_penalty`` over the prompt and generated tokens, then OpenAI's ``frequency_penalty`` and
``presence_penalty`` over the generated ones), then greedy takes the argmax or the temperature, top-k, top-p
and min-p filters shape the distribution the token is drawn from. The adjustment needs the tokens seen so far:
a request keeps them in a :class:`TokenHistory` on the logits' device. With every adjustment neutral there is
no history and the logits are used as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # a temperature under this decodes greedily


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    presence_penalty: float = 0.0  # 0 = off; [-2, 2]
    frequency_penalty: float = 0.0  # 0 = off; [-2, 2]
    repetition_penalty: float = 1.0  # 1 = off; (0, 10]
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); ids distinct

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.temperature == self.temperature) or self.temperature > 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:  # also refuses NaN
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(t < 0 for t in ids):
            raise ValueError("logit_bias needs distinct non-negative token ids")
        bad = [b for _, b in self.logit_bias if not -100 <= b <= 100]
        if bad:
            raise ValueError(f"a logit_bias value must be in [-100, 100], got {bad[0]}")

    @property
    def greedy(self) -> bool:
        # a temperature this small is greedy in all but name, and dividing float32 logits by it overflows (1e-300
        # is 0 in float32): inf - inf in the softmax, NaN probabilities, a token id past the vocabulary. vLLM
        # draws greedily below the same bound (its _SAMPLING_EPS)
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts(self) -> bool:
        """Whether the logits are adjusted before sampling (a bias or a penalty is not neutral)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1)


class TokenHistory:
    """What the logit adjustment of one generation needs, kept on the logits' device and updated per token
    (no rebuild from a list of ids each step): the generated tokens' counts (frequency and presence penalties),
    the tokens seen in the prompt or generated (repetition penalty) and the bias as (ids, values) tensors. Each
    is held only where its parameter is not neutral."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], vocab_size: int, device: torch.device):
        bad = [t for t, _ in params.logit_bias if t >= vocab_size]
        if bad:  # an index past the end would be a device-side assert on CUDA
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        self.counts = (torch.zeros(vocab_size, device=device)
                       if params.frequency_penalty or params.presence_penalty else None)
        self.seen: torch.Tensor | None = None
        if params.repetition_penalty != 1:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if prompt:
                self.seen[torch.tensor(list(prompt), device=device)] = True
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            self.bias = (torch.tensor(ids, device=device), torch.tensor(values, dtype=torch.float32, device=device))
        self._one = torch.ones(1, device=device)

    def add(self, token: torch.Tensor) -> None:
        """Count a generated token (a tensor [1] on the device, not read back)."""
        if self.counts is not None:
            self.counts.index_add_(0, token, self._one)
        if self.seen is not None:
            self.seen.index_fill_(0, token, True)


def adjust(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """Float logits [V] with the bias and penalties applied (a new tensor; ``logits`` is left as it is):

    1. ``logit_bias`` added (vLLM applies it before the penalties too);
    2. ``repetition_penalty`` r on every token of the prompt or generated so far: a positive logit divided by
       r, a negative one multiplied (vLLM's, after CTRL);
    3. ``logit -= frequency_penalty x count + presence_penalty x (count > 0)`` over the generated tokens'
       counts (OpenAI's formula).
    """
    row = logits.float().clone()
    if history.bias is not None:
        row.index_add_(0, *history.bias)
    if history.seen is not None:
        r = params.repetition_penalty
        row = torch.where(history.seen, torch.where(row > 0, row / r, row * r), row)
    if history.counts is not None:
        row -= params.frequency_penalty * history.counts + params.presence_penalty * (history.counts > 0)
    return row


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           history: TokenHistory | None = None) -> int:
    """One token id from float logits [V] (see `draw`)."""
    return int(draw(logits, params, generator, history))


def sample_rows(logits: Sequence[torch.Tensor], params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token id per row of logits [V], each with its own parameters and generator (`draw_rows`), reading the
    device once for all rows."""
    return draw_rows(logits, params, generators).tolist() if len(logits) else []


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
         history: TokenHistory | None = None) -> torch.Tensor:
    """The next token id for logits [V] as a tensor [1] on their device, not read back (`draw_rows` of one row).
    ``generator``: a CPU ``torch.Generator`` (None: the default one). ``history``: the generation's
    :class:`TokenHistory`, needed when ``params.adjusts``; the drawn token is added to it."""
    return draw_rows([logits], [params], [generator], [history])


def draw_rows(logits: Sequence[torch.Tensor], params: Sequence[SamplingParams],
              generators: Sequence[torch.Generator | None],
              histories: Sequence[TokenHistory | None] | None = None, together: bool | None = None) -> torch.Tensor:
    """The next token of each row of logits [V] (one device), each with its own parameters, generator and history,
    as a tensor [B] on the logits' device, not read back. With ``together`` (default: on CUDA) the rows go through
    each stage together, so a batched decode step samples its B requests in a fixed number of launches, not B times
    as many; else one at a time. Each row's operations are row-wise, so a row draws what it would draw alone
    (on CUDA up to the last bits of its cumulative sums, whose kernel for one row differs from the one for several:
    a token could differ only where a uniform falls within those bits of a boundary).

    Order: the bias and penalties (`adjust`, per row where a row has them), then temperature, then top-k, top-p
    (smallest set whose mass reaches p) and min-p (drop tokens below min_p x the top probability), draw; greedy is
    the argmax of the adjusted logits, the lowest index among ties. The draw is by inverse CDF: one uniform from
    the row's generator against the float64 cumulative mass, on the logits' device, so a token costs one random
    number, not one per vocabulary entry (``torch.multinomial`` draws an exponential per entry on the CPU: 5 ms
    per token for a 129K vocabulary), and a seed gives the same tokens on every device for the same logits.
    """
    n = len(logits)
    histories = list(histories) if histories is not None else [None] * n
    if not n or len(params) != n or len(generators) != n or len(histories) != n:
        raise ValueError(f"draw_rows needs one params, generator and history entry per row ({n} rows)")
    for p, h in zip(params, histories, strict=True):
        if p.adjusts and h is None:
            raise ValueError("a logit bias or a penalty needs the generation's TokenHistory")
    if n > 1 and not (together if together is not None else logits[0].is_cuda):
        # on the CPU there are no launches to save, and a batch's large buffers cost more than a row's (measured,
        # 8 rows of 129,280 on one thread: 8.2 ms together, 2.7 ms one at a time); the same bits either way
        return torch.cat([draw_rows([row], [p], [g], [h])
                          for row, p, g, h in zip(logits, params, generators, histories, strict=True)])
    adjusted = [adjust(row, p, h) if p.adjusts else row.float()  # type: ignore[arg-type]
                for row, p, h in zip(logits, params, histories, strict=True)]
    rows = torch.stack(adjusted) if n > 1 else adjusted[0][None]
    dev = rows.device
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    tokens = rows.argmax(dim=-1) if len(sampled) < n else None
    if sampled:
        us = [float(torch.rand((), dtype=torch.float64, generator=generators[i])) for i in sampled]
        pick = _to_device(sampled, torch.long, dev) if len(sampled) < n else None
        cdf = _filtered_probs(rows if pick is None else rows.index_select(0, pick),
                              [params[i] for i in sampled]).double().cumsum(-1)
        # the first token whose cumulative mass passes u x total; never one without mass (its cumulative mass
        # equals its predecessor's), and at most the last one with mass should u x total round up to the total
        total = cdf[:, -1:].contiguous()
        last = torch.searchsorted(cdf, total)
        u = _to_device(us, torch.float64, dev)[:, None]
        drawn = torch.minimum(torch.searchsorted(cdf, total * u, right=True), last)[:, 0]
        tokens = drawn if tokens is None else tokens.index_copy(0, pick, drawn)
    assert tokens is not None
    for i, h in enumerate(histories):
        if h is not None:
            h.add(tokens[i : i + 1])
    return tokens


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list of numbers as a tensor on ``device``: to CUDA by an asynchronous copy from page-locked memory, so
    that the host queues the sampling behind the step without waiting for the step to end."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _row_values(params: Sequence[SamplingParams], name: str, device: torch.device) -> torch.Tensor:
    """Each row's ``name`` parameter as a float32 column [B, 1] on ``device``."""
    return _to_device([float(getattr(p, name)) for p in params], torch.float32, device)[:, None]


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The probabilities [B, V] of rows of logits [B, V] after each row's temperature, top-k, top-p and min-p (not
    renormalised); a filter no row uses costs nothing."""
    dev, vocab = logits.device, logits.shape[-1]
    scaled = logits / _row_values(params, "temperature", dev)
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        ranked = torch.topk(scaled, max(top_k), dim=-1).values
        kth = ranked.gather(1, _to_device([max(k, 1) - 1 for k in top_k], torch.long, dev)[:, None])
        kth = kth.masked_fill(_to_device(top_k, torch.long, dev)[:, None] == 0, float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    if any(p.top_p < 1.0 for p in params):
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        top_p = _to_device([p.top_p if p.top_p < 1.0 else float("inf") for p in params], torch.float32, dev)[:, None]
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(before >= top_p, 0))
    if any(p.min_p > 0 for p in params):
        probs = probs.masked_fill(probs < _row_values(params, "min_p", dev) * probs.amax(-1, keepdim=True), 0)
    return probs
