"""Quality gates for a trained model: what packed caches, quantized weights or fast kernels may cost.

All functions run on the CPU (and on CUDA) through the public engine:

- `perplexity` / `unigram_perplexity`: held-out perplexity, and the best any unigram model could do on
  the same tokens (its own token frequencies), for scale;
- `perplexity_delta`: the relative perplexity change between two cache semantics (``float`` vs ``native``);
- `greedy_agreement`: how far two configurations (engine, cache, chunking) agree when decoding greedily;
- `weight_type_table`: perplexity change and greedy agreement of the model converted to GGUF with Q8_0 / Q4_K /
  Q2_K / IQ2_XXS routed experts, against the float checkpoint;
- `recall`: facts (``key = value`` lines) planted through a long prompt of held-out code, then asked for at
  the end by repeating the fact line's prefix on a line of its own (``key =`` -> `` value``);
- `parse_rate`: how many sampled functions (prompt ``def ``, token-healed; cut at the next statement at the
  function's own level) ``ast.parse`` accepts.

The fact format here is the one `scripts/train_tiny.py` trains on; both import it from this module.
"""

from __future__ import annotations

import ast
import math
import random
import textwrap
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ds4x.runtime.sampling import SamplingParams

if TYPE_CHECKING:  # the engine is only needed by callers; the fact format is used without it
    from ds4x.config import ModelConfig
    from ds4x.runtime.engine import Engine

# ---- the planted-fact format (shared with the training script) ----------------------------------

KEY_WORDS_A = (
    "amber", "azure", "bold", "brave", "bright", "calm", "clever", "cold", "coral", "crimson", "dark", "eager",
    "early", "fancy", "fast", "fierce", "gentle", "gold", "grand", "green", "happy", "hidden", "ivory", "jade",
    "jolly", "keen", "late", "lazy", "lemon", "little", "lucky", "magic", "mellow", "misty", "noble", "olive",
    "orange", "pale", "plain", "proud", "purple", "quick", "quiet", "rapid", "red", "rough", "royal", "rusty",
    "salty", "scarlet", "sharp", "shiny", "silent", "silver", "smooth", "snowy", "solid", "sunny", "swift",
    "tall", "tiny", "violet", "warm", "wild",
)
KEY_WORDS_B = (
    "anchor", "apple", "arrow", "badger", "banner", "beacon", "bear", "bell", "bridge", "brook", "cactus",
    "canyon", "castle", "cedar", "cloud", "comet", "crane", "dragon", "eagle", "ember", "falcon", "fern",
    "forest", "fox", "garden", "glacier", "harbor", "hawk", "island", "jaguar", "kettle", "lantern", "leaf",
    "lion", "lotus", "maple", "meadow", "meteor", "moon", "mountain", "oak", "ocean", "otter", "owl", "panda",
    "pebble", "pepper", "phoenix", "pine", "planet", "quartz", "raven", "river", "rocket", "saddle", "shadow",
    "spark", "storm", "tiger", "tower", "valley", "walrus", "willow", "wolf",
)


def fact_key(rng: random.Random) -> str:
    """A snake_case identifier such as ``misty_falcon``."""
    return f"{rng.choice(KEY_WORDS_A)}_{rng.choice(KEY_WORDS_B)}"


def fact_value(rng: random.Random) -> str:
    """A four-digit number (1000..9999)."""
    return str(rng.randint(1000, 9999))


def fact_question(key: str) -> str:
    """The question: the fact line's own prefix (``misty_falcon =``), asked at the start of a line.

    It repeats the fact's token sequence exactly, so answering is copying what followed it (an induction
    lookup); it ends before the answer's leading space, as byte-level BPE attaches that to the number.
    """
    return f"{key} ="


def fact_answer(value: str) -> str:
    return f" {value}"


def fact_line(key: str, value: str) -> str:
    """A planted fact, ``misty_falcon = 4821``: by construction the question followed by the answer."""
    return fact_question(key) + fact_answer(value) + "\n"


def distinct_facts(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """``n`` (key, value) pairs with distinct keys and distinct values."""
    keys: dict[str, str] = {}
    values: set[str] = set()
    while len(keys) < n:
        k, v = fact_key(rng), fact_value(rng)
        if k not in keys and v not in values:
            keys[k] = v
            values.add(v)
    return list(keys.items())


# ---- data -----------------------------------------------------------------------------------------

def heldout_text(path: str | Path | None = None) -> str:
    """The held-out Python sample shipped with the default model (or the file at ``path``)."""
    if path is None:
        from ds4x.assets import default_model_path

        path = default_model_path() / "heldout.txt"
    return Path(path).read_text(encoding="utf-8")


def _tokenizer(engine: Engine) -> Any:
    if engine.tokenizer is None:
        raise ValueError(f"model {engine.name} has no tokenizer; quality gates need text")
    return engine.tokenizer


def _bos(engine: Engine) -> list[int]:
    bos = engine.cfg.bos_token_id
    return [] if bos is None else [bos]


# ---- perplexity -----------------------------------------------------------------------------------

@dataclass
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood per token (nats)
    tokens: int  # predicted tokens


def token_nll(engine: Engine, ids: list[int], window: int = 1024, cache: str = "float",
              chunk: int = 512) -> torch.Tensor:
    """Negative log-likelihood of every token of ``ids`` [N], in windows of ``window`` tokens.

    Each window starts a fresh session with BOS, so its first token is predicted from BOS alone (without
    a BOS id the first token of each window is not scored).
    """
    out = []
    bos = _bos(engine)
    for start in range(0, len(ids), window):
        part = bos + ids[start : start + window]
        session = engine.new_session(ctx=len(part), cache=cache, prefill_chunk=chunk)
        logits = []
        for c in range(0, len(part), chunk):
            toks = torch.tensor(part[c : c + chunk], dtype=torch.long)
            logits.append(engine.model.forward(toks, session.cache, all_logits=True).float().cpu())
        lp = torch.cat(logits).log_softmax(dim=-1)
        targets = torch.tensor(part[1:], dtype=torch.long)
        out.append(-lp[:-1].gather(1, targets[:, None])[:, 0])
    return torch.cat(out) if out else torch.zeros(0)


def perplexity(engine: Engine, text: str, window: int = 1024, cache: str = "float",
               max_tokens: int | None = None, chunk: int = 512) -> Perplexity:
    """Perplexity of ``text`` (its first ``max_tokens`` tokens) under the model."""
    ids = _tokenizer(engine).encode(text)[:max_tokens]
    return perplexity_of_ids(engine, ids, window=window, cache=cache, chunk=chunk)


def perplexity_of_ids(engine: Engine, ids: list[int], window: int = 1024, cache: str = "float",
                      chunk: int = 512) -> Perplexity:
    """Perplexity of the token ids ``ids`` (for models whose own tokenizers would split a text differently)."""
    nll = token_nll(engine, ids, window=window, cache=cache, chunk=chunk)
    mean = float(nll.double().mean())
    return Perplexity(ppl=math.exp(mean), nll=mean, tokens=int(nll.numel()))


def unigram_perplexity(ids: list[int], vocab_size: int) -> float:
    """Perplexity of ``ids`` under their own (add-one smoothed) unigram frequencies.

    Fitted on the very tokens it scores, so no unigram model does better on them: a conservative baseline.
    """
    counts = Counter(ids)
    total = len(ids) + vocab_size
    nll = -sum(c * math.log((c + 1) / total) for c in counts.values()) / max(len(ids), 1)
    return math.exp(nll)


def perplexity_delta(engine: Engine, text: str, window: int = 1024, max_tokens: int | None = None,
                     cache_a: str = "float", cache_b: str = "native") -> dict[str, float]:
    """Perplexity under two cache semantics and the relative change ``ppl_b / ppl_a - 1``."""
    a = perplexity(engine, text, window=window, cache=cache_a, max_tokens=max_tokens)
    b = perplexity(engine, text, window=window, cache=cache_b, max_tokens=max_tokens)
    return {"ppl_" + cache_a: a.ppl, "ppl_" + cache_b: b.ppl, "rel_delta": b.ppl / a.ppl - 1.0,
            "tokens": a.tokens}


# ---- greedy agreement -----------------------------------------------------------------------------

@dataclass
class RunConfig:
    """One way of running a model: which engine, cache semantics and prefill chunk."""

    engine: Engine
    cache: str = "float"
    prefill_chunk: int = 512


def _greedy(rc: RunConfig, prompt: list[int], n: int) -> list[int]:
    session = rc.engine.new_session(ctx=len(prompt) + n + 1, cache=rc.cache, prefill_chunk=rc.prefill_chunk)
    return [t for t, _ in session.generate(prompt, n, SamplingParams(), stop_ids=())]


def greedy_agreement(a: RunConfig, b: RunConfig, prompt: list[int], n_tokens: int = 256,
                     reference: list[int] | None = None, forced_chunk: int = 1) -> dict[str, float]:
    """Compare greedy decoding of two configurations from the same prompt.

    ``common_prefix``: tokens both generate identically before the first difference (free running);
    ``teacher_forced``: the fraction of A's ``n_tokens`` tokens that B also picks when fed A's trajectory.
    ``reference``: A's greedy tokens from this prompt if already generated (comparing several B against one A
    then decodes A once). ``forced_chunk``: tokens of that trajectory B evaluates per forward pass: 1 runs B's
    decode step (the fast path on a GPU, which is what a reference-vs-fast-path check must exercise); more runs
    its prefill path in chunks of that many, much faster on a CPU, enough when only the weights differ.
    """
    ta = reference[:n_tokens] if reference is not None else _greedy(a, prompt, n_tokens)
    tb = _greedy(b, prompt, n_tokens)
    prefix = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
    session = b.engine.new_session(ctx=len(prompt) + n_tokens + 1, cache=b.cache, prefill_chunk=b.prefill_chunk)
    logits = session.prefill(prompt)
    picks = [int(logits.argmax())]
    for c in range(0, len(ta) - 1, forced_chunk):
        part = ta[c : min(c + forced_chunk, len(ta) - 1)]
        if forced_chunk == 1:
            picks.append(int(session.step(part[0]).argmax()))
        else:
            rows = b.engine.model.forward(torch.tensor(part, dtype=torch.long), session.cache, all_logits=True)
            picks.extend(rows.argmax(-1).tolist())
    agree = sum(int(p == t) for p, t in zip(picks[: len(ta)], ta, strict=True))
    return {"common_prefix": float(prefix), "teacher_forced": agree / max(len(ta), 1), "tokens": float(len(ta))}


# ---- long-context recall --------------------------------------------------------------------------

@dataclass
class RecallResult:
    ctx: int
    correct: int
    asked: int
    prompt_tokens: list[int] = field(default_factory=list)
    misses: list[tuple[str, str, str]] = field(default_factory=list)  # (key, expected, got)

    @property
    def rate(self) -> float:
        return self.correct / self.asked if self.asked else 0.0


def _plant(tokenizer: Any, lines: list[str], budget: int, facts: list[tuple[str, str]],
           rng: random.Random) -> str:
    """Filler lines (line costs encoded one by one) up to ``budget`` tokens, with the facts planted."""
    start = rng.randrange(len(lines))
    chosen: list[str] = []
    used = 0
    i = start
    while used < budget and i - start < 10 * len(lines):
        line = lines[i % len(lines)]
        i += 1
        cost = len(tokenizer.encode(line))
        if used + cost > budget:
            break
        chosen.append(line)
        used += cost
    if chosen and not chosen[-1].endswith("\n"):
        chosen[-1] += "\n"
    # insertion points: before a line that starts at column 0 (never inside an indented block's lines)
    slots = [j for j, line in enumerate(chosen) if j > 0 and line[:1] not in (" ", "\t", "\n", "")]
    slots = slots or list(range(len(chosen)))
    n = len(facts)
    picks = []
    for s in range(n):
        part = slots[len(slots) * s // n : max(len(slots) * (s + 1) // n, len(slots) * s // n + 1)]
        picks.append(rng.choice(part))
    out = list(chosen)
    for (k, v), j in sorted(zip(facts, picks, strict=True), key=lambda x: -x[1]):
        out.insert(j, fact_line(k, v))
    return "".join(out)


def recall_prompt(tokenizer: Any, filler: str, n_tokens: int, facts: list[tuple[str, str]],
                  rng: random.Random) -> str:
    """At most ``n_tokens`` (and usually within 3% of it) tokens of ``filler`` lines, from a random line on,
    with one fact line planted in each of ``len(facts)`` equal slices of it, each before a top-level line;
    ends at a line start."""
    lines = filler.splitlines(keepends=True)
    if not lines:
        raise ValueError("filler text is empty")
    state = rng.getstate()
    budget = n_tokens - sum(len(tokenizer.encode(fact_line(k, v))) for k, v in facts)
    text = _plant(tokenizer, lines, budget, facts, rng)
    for _ in range(6):  # encoding lines one by one overcounts (newlines merge with indentation): rescale
        size = len(tokenizer.encode(text))
        if 0.97 * n_tokens <= size <= n_tokens:
            break
        budget = int(budget * (n_tokens / size) * (0.99 if size > n_tokens else 1.0))
        rng.setstate(state)
        text = _plant(tokenizer, lines, budget, facts, rng)
    while len(tokenizer.encode(text)) > n_tokens:  # still too long: shrink until it fits
        budget = int(budget * 0.97)
        rng.setstate(state)
        text = _plant(tokenizer, lines, budget, facts, rng)
    return text


def recall(engine: Engine, filler: str, n_ctx: int, n_prompts: int = 2, n_facts: int = 8, cache: str = "float",
           seed: int = 0, prefill_chunk: int = 512, max_answer_tokens: int = 8) -> RecallResult:
    """Plant ``n_facts`` facts through ``n_prompts`` prompts of about ``n_ctx`` tokens; ask each at the end.

    One long prefill per prompt; every question continues from the end of the prompt (the session is
    rewound between questions). An answer counts when the greedy continuation up to the newline equals
    the planted value.
    """
    limit = engine.cfg.max_position_embeddings
    if not 0 < n_ctx <= limit:
        raise ValueError(f"recall context {n_ctx} is outside the model's context of 1..{limit} tokens")
    tok = _tokenizer(engine)
    rng = random.Random(seed)
    res = RecallResult(ctx=n_ctx, correct=0, asked=0)
    for _ in range(n_prompts):
        facts = distinct_facts(rng, n_facts)
        q_room = max(len(tok.encode(fact_question(k) + fact_answer(v))) for k, v in facts) + max_answer_tokens
        text = recall_prompt(tok, filler, n_ctx - q_room - 1, facts, rng)
        prompt = _bos(engine) + tok.encode(text)
        res.prompt_tokens.append(len(prompt))
        # at most n_ctx (the prompt leaves q_room free): the +2 slack overran a context of exactly the model's maximum
        session = engine.new_session(ctx=min(len(prompt) + q_room + 2, n_ctx), cache=cache,
                                     prefill_chunk=prefill_chunk)
        session.prefill(prompt)
        order = list(facts)
        rng.shuffle(order)
        for key, value in order:
            session.rewind(len(prompt))
            ids: list[int] = []
            for t, _ in session.generate(tok.encode(fact_question(key)), max_answer_tokens, SamplingParams(),
                                         stop_ids=()):
                ids.append(t)
                if "\n" in tok.decode(ids):
                    break
            got = tok.decode(ids).split("\n")[0].strip()
            res.asked += 1
            if got == value:
                res.correct += 1
            else:
                res.misses.append((key, value, got))
    return res


# ---- sampled function bodies ----------------------------------------------------------------------

def cut_function(text: str) -> tuple[str, bool]:
    """``text`` (a ``def ...`` and what follows) up to the next statement at the function's own level.

    The level is the one its body implies (first body line's indentation minus 4): a model trained on
    library code often writes methods, so ``def f(self):`` may be followed by an 8-space body and end at the
    next 4-space ``def``. The result is dedented so the function stands at column 0. Returns
    (source, complete): complete is False when no such next statement was generated, in which case the
    last, possibly unfinished, line is dropped.
    """
    lines = text.splitlines(keepends=True)
    body = [line for line in lines[1:] if line.strip()]
    base = max(len(body[0]) - len(body[0].lstrip()) - 4, 0) if body else 0
    cut, complete = len(lines), False
    for i, line in enumerate(lines[1:], start=1):
        stripped = line.lstrip()
        if stripped and len(line) - len(stripped) <= base and not stripped.startswith((")", "]", "}")):
            cut, complete = i, True
            break
    kept = lines[:cut]
    if not complete and len(kept) > 1 and not text.endswith("\n"):
        kept = kept[:-1]
    kept[0] = " " * base + kept[0]
    return textwrap.dedent("".join(kept)), complete


def healed_prompt(tokenizer: Any, vocab_size: int, text: str) -> tuple[list[int], torch.Tensor | None]:
    """Token healing for a prompt that ends in whitespace (``def ``): byte-level BPE attaches the space to
    the next word, so encode the prompt without it and allow as first token only those that start with it
    (and go on with a non-space character). Returns (ids, mask of allowed first tokens or None)."""
    stem = text.rstrip(" ")
    if stem == text:
        return tokenizer.encode(text), None
    tail = text[len(stem) :]
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    for i in range(vocab_size):
        piece = tokenizer.decode([i])
        allowed[i] = piece.startswith(tail) and len(piece) > len(tail) and not piece[len(tail)].isspace()
    return tokenizer.encode(stem), allowed


@dataclass
class ParseResult:
    parsed: int
    total: int
    samples: list[str] = field(default_factory=list)


def parse_rate(engine: Engine, n: int = 20, prompt: str = "def ", max_new: int = 160, temperature: float = 0.8,
               top_p: float = 0.95, seed: int = 0, cache: str = "float") -> ParseResult:
    """Sample ``n`` functions from ``prompt`` (token-healed, see `healed_prompt`); count the bodies (cut by
    `cut_function`) that ``ast.parse`` accepts. Generation stops once the function has ended."""
    from ds4x.runtime.sampling import sample

    tok = _tokenizer(engine)
    stem_ids, first_mask = healed_prompt(tok, engine.cfg.vocab_size, prompt)
    prompt_ids = _bos(engine) + stem_ids
    stem = prompt.rstrip(" ") if first_mask is not None else prompt
    res = ParseResult(parsed=0, total=n)
    for i in range(n):
        session = engine.new_session(ctx=len(prompt_ids) + max_new + 1, cache=cache)
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed + i)
        gen = torch.Generator().manual_seed(seed + i)
        logits = session.prefill(prompt_ids)
        if first_mask is not None:
            logits = logits.masked_fill(~first_mask.to(logits.device), float("-inf"))
        ids = [sample(logits, params, gen)]
        stop = set(engine.cfg.eos_token_ids) | {engine.cfg.bos_token_id}
        while len(ids) < max_new and ids[-1] not in stop and not cut_function(stem + tok.decode(ids))[1]:
            ids.append(sample(session.step(ids[-1]), params, gen))
        ids = [t for t in ids if t not in stop]
        source, _ = cut_function(stem + tok.decode(ids))
        res.samples.append(source)
        try:
            ast.parse(source)
            res.parsed += 1
        except (SyntaxError, ValueError):
            pass
    return res


# ---- GGUF weight types ----------------------------------------------------------------------------

WEIGHT_TYPES = ("Q8_0", "Q4_K", "Q2_K", "IQ2_XXS")
_ROUTED = ("experts", "experts_down")  # gguf_writer.tensor_class of the routed gate/up and down projections


@dataclass
class WeightTypeRow:
    label: str  # the requested routed-expert type, or the reference's description
    types: dict[str, str]  # tensor class (gguf_writer.tensor_class) -> GGML type(s) read back from the file
    # (empty for the reference)
    convert_args: list[str]  # the `ds4x convert SRC OUT ...` options that wrote the file (empty: reference)
    size_bytes: int
    ppl: Perplexity
    rel_delta: float  # ppl / reference ppl - 1
    greedy: dict[str, float] | None  # greedy_agreement against the reference (None for the reference)


@dataclass
class WeightTypeTable:
    source: Path  # the checkpoint directory converted
    window: int
    cache: str
    greedy_prompt: str
    greedy_tokens: int
    rows: list[WeightTypeRow]


def routed_type_args(cfg: ModelConfig, qtype: str) -> list[str]:
    """`ds4x convert` options for ``qtype`` on the routed experts over the ``q8`` mix (Q8_0 attention, shared
    expert and LM head; F16 embedding and small tensors).

    A routed class whose tensors `gguf_writer.tensor_type` refuses in ``qtype`` (rows that are not whole
    blocks: it raises for big tensors rather than falling back) keeps the mix's Q8_0.
    """
    from ds4x.weights.gguf import GGUFError
    from ds4x.weights.gguf_writer import TypePolicy, tensor_class, tensor_type
    from ds4x.weights.names import expected_shapes

    args = ["--mix", "q8"]
    for cls in _ROUTED:
        policy = TypePolicy.preset("q8").with_overrides(**{cls: qtype})
        try:
            for name, shape in expected_shapes(cfg).items():
                if tensor_class(name) == cls:
                    tensor_type(name, shape, policy)
        except GGUFError:
            continue
        args += [f"--type-{cls.replace('_', '-')}", qtype]
    return args


def gguf_types_by_class(path: str | Path) -> dict[str, str]:
    """The GGML types a GGUF file actually holds, per tensor class (``/``-joined when a class has several)."""
    from ds4x.formats.ggml import GGMLQuantizationType
    from ds4x.weights.gguf import canonical_tensor_name, open_gguf
    from ds4x.weights.gguf_writer import tensor_class

    found: dict[str, set[str]] = {}
    for t in open_gguf(path).tensors:
        canonical = canonical_tensor_name(t.name)
        cls = tensor_class(canonical) if canonical is not None else t.name
        found.setdefault(cls, set()).add(GGMLQuantizationType(int(t.tensor_type)).name)
    return {cls: "/".join(sorted(types)) for cls, types in sorted(found.items())}


def _convert(src: Path, out: Path, options: list[str]) -> None:
    """``ds4x convert SRC OUT OPTIONS -q``, through that command's own parser and code."""
    import argparse

    from ds4x.cli import convert as convert_cmd

    parser = convert_cmd.add_parser(argparse.ArgumentParser().add_subparsers())
    convert_cmd.run(parser.parse_args([str(src), str(out), *options, "-q"]))


def weight_type_table(model: str = "default", types: tuple[str, ...] = WEIGHT_TYPES, max_tokens: int = 2048,
                      window: int = 1024, n_greedy: int = 256, greedy_prompt: str = "class Config:\n",
                      cache: str = "float", device: str = "cpu",
                      log: Callable[[str], None] | None = None) -> WeightTypeTable:
    """Held-out perplexity (first ``max_tokens`` tokens of `heldout_text`) and greedy agreement of a checkpoint
    converted to GGUF with each routed-expert type.

    Each file is written by `ds4x convert` (options from `routed_type_args`) into a temporary directory and
    loaded with ``Engine.load``. Every model scores the same token ids, the reference (float checkpoint)
    tokenizer's, so that only the weights differ between rows (a converted file's tokenizer keeps the source's
    pre-tokenizer and gives the same ids; tests/test_tokenizers.py). The ``float`` cache by default, so that only the
    weights differ (the cache's own deltas are the cache report's). ``log(message)`` reports progress.
    """
    import tempfile

    from ds4x.runtime.engine import DEFAULT_MODEL, Engine

    if model == DEFAULT_MODEL:
        from ds4x.assets import default_model_path

        model = str(default_model_path())
    src = Path(model)
    if not src.is_dir():
        raise ValueError(f"the weight-type table converts a checkpoint directory; {model!r} is not one")
    ref = Engine.load(str(src), device=device)
    ids = _tokenizer(ref).encode(heldout_text())[:max_tokens]
    prompt = _bos(ref) + _tokenizer(ref).encode(greedy_prompt)
    base = perplexity_of_ids(ref, ids, window=window, cache=cache)
    ref_run = RunConfig(ref, cache)
    ref_tokens = _greedy(ref_run, prompt, n_greedy)
    ref_size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    rows = [WeightTypeRow("checkpoint (safetensors)", {}, [], ref_size, base, 0.0, None)]
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in types:
            options = routed_type_args(ref.cfg, qtype)
            path = Path(tmp) / f"{qtype}.gguf"
            _convert(src, path, options)
            engine = Engine.load(str(path), device=device)
            ppl = perplexity_of_ids(engine, ids, window=window, cache=cache)
            agree = greedy_agreement(ref_run, RunConfig(engine, cache), prompt, n_greedy, reference=ref_tokens,
                                     forced_chunk=n_greedy)
            delta = ppl.ppl / base.ppl - 1.0
            rows.append(WeightTypeRow(qtype, gguf_types_by_class(path), options, path.stat().st_size, ppl, delta,
                                      agree))
            if log is not None:
                log(f"{qtype}: ppl {ppl.ppl:.3f} ({100 * delta:+.2f}%), teacher-forced greedy "
                    f"{agree['teacher_forced']:.1%}")
    return WeightTypeTable(source=src, window=window, cache=cache, greedy_prompt=greedy_prompt,
                           greedy_tokens=n_greedy, rows=rows)
