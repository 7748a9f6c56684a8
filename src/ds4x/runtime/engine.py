"""Engine (a model loaded once) and Session (one conversation: prefill, decode, sample, rewind)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ds4x.config import PRESETS, ModelConfig
from ds4x.kernels import branches
from ds4x.kernels.dispatch import describe as describe_kernels
from ds4x.kernels.linear import quant_kernel_name
from ds4x.model.cache import ModelCache, format_plan
from ds4x.model.transformer import Transformer
from ds4x.runtime.decode_graph import Decoder, graphs_enabled, make_decoder
from ds4x.runtime.sampling import SamplingParams, TokenHistory, sample
from ds4x.runtime.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from ds4x.weights.checkpoint import load_checkpoint
from ds4x.weights.synthetic import synthetic_weights
from ds4x.weights.synthetic_gguf import weight_bytes

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the embedded trained model (src/ds4x/assets/tiny_v4); "tiny" and "flash" are synthetic presets
DEFAULT_MODEL = "default"
# default: the fastest path (may reorder float reductions); exact: the decode step's reduction order, so
# prefill logits are bit-identical to token-by-token decode; reference: the plain torch path.
PREFILL_MODES = ("default", "exact", "reference")
# Presets that are synthesized in memory; Flash's 284B parameters cannot be (use a checkpoint).
_SYNTHESIZABLE = {"tiny"}
# presets whose vocabulary is part of the model (others take the byte tokenizer's)
_FIXED_VOCAB = {"flash"}


def preset_config(name: str) -> ModelConfig:
    """The config a synthetic preset runs with: its own vocabulary (flash) or the byte tokenizer's."""
    return PRESETS[name]() if name in _FIXED_VOCAB else PRESETS[name](ByteTokenizer.vocab_size)


def synthetic_quantized_spec(model: str) -> tuple[ModelConfig, str] | None:
    """The config and type mix of a synthetic quantized model named ``PRESET:POLICY[:EXPERTS]`` (e.g. ``flash:q2``;
    ``flash:q2:128`` keeps 128 of the 256 routed experts, top-6 kept, so the model fits an 80 GB GPU: 44 GiB
    against 80.8), or None when ``model`` names no preset with a mix."""
    preset, _, rest = model.partition(":")
    policy, _, experts = rest.partition(":")
    if preset not in PRESETS or not policy:
        return None
    cfg = preset_config(preset)
    if experts:
        if not experts.isdigit() or not cfg.n_experts_per_tok <= int(experts) <= cfg.n_routed_experts:
            raise ValueError(f"model {model!r}: the routed experts after the mix must be a whole number from "
                             f"{cfg.n_experts_per_tok} (the experts a token takes) to {cfg.n_routed_experts}, "
                             f"got {experts!r}")
        cfg = cfg.replace(n_routed_experts=int(experts))
    return cfg, policy


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available on this machine")
    return dev


@dataclass
class Engine:
    cfg: ModelConfig
    model: Transformer
    tokenizer: Tokenizer | None
    name: str

    @classmethod
    def load(cls, model: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "float32",
             seed: int = 0) -> Engine:
        """``default`` (the embedded trained model), a preset name (synthetic weights from ``seed``),
        ``PRESET:POLICY`` (a synthetic model in a GGUF type mix, e.g. ``flash:q2``, generated on the device),
        a checkpoint directory or a .gguf file. ``dtype`` "auto": bfloat16 on CUDA, float32 elsewhere."""
        if dtype not in (*DTYPES, "auto"):
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
        dev = resolve_device(device)
        if dtype == "auto":
            dtype = "bfloat16" if dev.type == "cuda" else "float32"
        dt = DTYPES[dtype]
        tokenizer: Tokenizer | None
        if model == DEFAULT_MODEL:
            from ds4x.assets import default_model_path

            model = str(default_model_path())
        spec = synthetic_quantized_spec(model)
        if spec is not None:
            # a SYNTHETIC quantized model (benchmarks): the GGUF blocks generated on the device
            from ds4x.weights.synthetic_gguf import synthetic_quantized_weights

            cfg, policy = spec
            log.info("synthesizing %s (%d routed experts) on %s (seed %d; random weights, outputs are noise) ...",
                     model, cfg.n_routed_experts, dev, seed)
            weights = synthetic_quantized_weights(cfg, policy, seed=seed, dtype=dt, device=dev)
            tokenizer = ByteTokenizer()
        elif model in PRESETS:
            if model not in _SYNTHESIZABLE:
                raise ValueError(
                    f"preset {model!r} is too large to synthesize in float here; load a checkpoint or GGUF, or "
                    f"use the synthetic quantized form '{model}:q2' on a GPU (`ds4x inspect {model}` shows its plan)"
                )
            cfg = preset_config(model)
            weights = synthetic_weights(cfg, seed=seed, dtype=dt, device=dev)
            tokenizer = ByteTokenizer()
        else:
            path = Path(model)
            if not path.exists():
                raise FileNotFoundError(
                    f"model {model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor an existing path"
                )
            tokenizer = None
            from ds4x.weights.gguf import is_gguf_file

            if is_gguf_file(path):
                from ds4x.runtime.gguf_tokenizer import GGUFTokenizer
                from ds4x.weights.gguf import load_gguf

                cfg, weights, meta = load_gguf(path, dtype=dt, device=dev)
                if "tokenizer.ggml.tokens" in meta:
                    tokenizer = GGUFTokenizer.from_metadata(meta)
            else:
                cfg, weights = load_checkpoint(path, dtype=dt, device=dev)
                if (path / "tokenizer.json").is_file():
                    tokenizer = HFTokenizer(path / "tokenizer.json", cfg.bos_token_id, cfg.eos_token_ids)
        transformer = Transformer(cfg, weights, dt)  # the weights in the layouts their kernels read
        attn_kernel = quant_kernel_name(weights["layers.0.attn.wq_a.weight"])
        expert_kernel = quant_kernel_name(weights[f"layers.{cfg.num_layers - 1}.ffn.experts.w1"])
        log.info("model %s: %s layers (%s), device %s, dtype %s, resident weights %.2f GiB; matmuls: attention %s, "
                 "experts %s", model, cfg.num_layers, cfg.layer_summary(), dev, dtype,
                 weight_bytes(weights) / 2**30, attn_kernel, expert_kernel)
        return cls(cfg=cfg, model=transformer, tokenizer=tokenizer, name=model)

    def new_session(self, ctx: int | None = None, cache: str = "native", prefill_chunk: int = 512,
                    prefill_mode: str = "default", announce: bool = True) -> Session:
        """A fresh conversation; ``ctx`` defaults to 4096 tokens or the model's maximum if smaller."""
        ctx = ctx if ctx is not None else min(4096, self.cfg.max_position_embeddings)
        if ctx > self.cfg.max_position_embeddings:
            raise ValueError(f"context {ctx} exceeds the model's max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill mode must be one of {PREFILL_MODES}, got {prefill_mode!r}")
        session = Session(self, self.model.new_cache(ctx, cache, prefill_chunk), prefill_chunk, prefill_mode)
        # a server makes a session per request: it announces the plan once at start-up instead
        log.log(logging.INFO if announce else logging.DEBUG, "session: ctx %d, %s cache (%s); kernels: %s", ctx,
                cache, format_plan(session.cache.plan), describe_kernels(self.model.device, cache)
                + ("; decode step: CUDA graph" + (" (independent pieces as parallel branches)"
                                                   if branches.ENABLED else "")
                   if graphs_enabled(self.model.device, cache) else ""))
        return session


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    generated: int = 0
    decode_s: float = 0.0
    stop_reason: str = ""


@dataclass
class Session:
    engine: Engine
    cache: ModelCache
    prefill_chunk: int = 512
    prefill_mode: str = "default"
    tokens: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # next-token logits after the last evaluated token
    decoder: Decoder | None = field(default=None, repr=False)  # the decode step (made on first use)

    def __post_init__(self) -> None:
        if self.prefill_chunk <= 0:
            raise ValueError(f"prefill chunk must be positive, got {self.prefill_chunk}")

    @property
    def ctx(self) -> int:
        return self.cache.ctx

    def _check_ids(self, ids: list[int]) -> None:
        vocab = self.engine.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(self.tokens) + len(ids) > self.ctx:
            raise ValueError(f"context overflow: {len(self.tokens)} held + {len(ids)} new tokens > "
                             f"context size {self.ctx}")

    def prefill(self, ids: list[int], chunk: int | None = None,
                progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Evaluate ``ids`` after what the session holds, ``chunk`` tokens at a time; return next logits.

        In ``exact`` prefill mode every token goes through the decode step (today the only way to get
        the decode step's reduction order); ``default`` runs chunks with the Triton prefill attention on a
        packed CUDA cache (TF32 products; on Hopper the decode kernel over the chunk) and ``reference`` the
        torch attention path.
        """
        if not ids:
            raise ValueError("prefill needs at least one token")
        self._check_ids(ids)
        step = 1 if self.prefill_mode == "exact" else (chunk or self.prefill_chunk)
        for start in range(0, len(ids), step):
            part = ids[start : start + step]
            if step == 1:
                self._decode(part[0])
            else:
                self.logits = self.engine.model.forward(torch.tensor(part, dtype=torch.long), self.cache,
                                                        reference=self.prefill_mode == "reference")
                self.tokens.extend(part)
            if progress:
                progress(start + len(part), len(ids))
        assert self.logits is not None
        return self.logits

    def step(self, token: int) -> torch.Tensor:
        """Decode one token; return the next logits."""
        self._check_ids([token])
        return self._decode(token)

    def _decode(self, token: int) -> torch.Tensor:
        if self.decoder is None:  # a CUDA graph on the GPU (`ds4x.runtime.decode_graph`)
            self.decoder = make_decoder(self.engine.model, self.cache)
        self.logits = self.decoder(token)
        self.tokens.append(token)
        return self.logits

    def clone(self) -> Session:
        """An independent copy: same engine and settings, a deep copy of the cache on the same device."""
        logits = None if self.logits is None else self.logits.clone()
        return replace(self, cache=self.cache.clone(), tokens=list(self.tokens), logits=logits, decoder=None)

    def rewind(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens (the next logits are recomputed)."""
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot rewind to {length}: the session holds {len(self.tokens)} tokens")
        if length == len(self.tokens):
            return
        keep = self.tokens[:length]
        target = max(length - 1, 0)
        self.logits = None
        if self.cache.can_rewind(target):
            self.cache.rewind(target)
            self.tokens = keep[:target]
        else:  # the packed cache no longer holds the rows: recompute the kept prefix
            self.cache.reset()
            self.tokens = []
            if target:
                self.prefill(keep[:target])
        if keep:
            self.step(keep[-1])

    def generate(self, prompt: list[int], max_new: int, params: SamplingParams | None = None,
                 stop_ids: tuple[int, ...] | None = None, stats: GenerationStats | None = None,
                 ) -> Iterator[tuple[int, torch.Tensor]]:
        """Prefill ``prompt`` then yield (token, logits it was drawn from) until EOS or ``max_new``. The yielded
        logits are the model's, before any logit bias or penalty; ``repetition_penalty`` counts every token the
        session held before generating (a loaded session's too) as the prompt."""
        if max_new < 0:
            raise ValueError(f"token budget must be >= 0, got {max_new}")
        params = params if params is not None else SamplingParams()
        stop = self.engine.cfg.eos_token_ids if stop_ids is None else stop_ids
        stats = stats if stats is not None else GenerationStats()
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        if gen is None and not params.greedy:
            gen = torch.Generator().manual_seed(torch.seed())
        t0 = time.perf_counter()
        logits = self.prefill(prompt) if prompt else self.logits
        if logits is None:
            raise ValueError("nothing to continue from: give a prompt")
        stats.prompt_tokens, stats.prefill_s = len(prompt), time.perf_counter() - t0
        history = (TokenHistory(params, self.tokens, self.engine.cfg.vocab_size, logits.device) if params.adjusts
                   else None)
        t0 = time.perf_counter()
        stats.stop_reason = "length"
        # counted before the yield and timed in `finally`: a consumer that stops early (Ctrl-C in ds4x chat closes
        # the generator at the yield) still gets the tokens produced and the time they took, not 0 tok/s
        try:
            for i in range(max_new):
                token = sample(logits, params, gen, history)
                stats.generated = i + 1
                yield token, logits
                if token in stop:
                    stats.stop_reason = "eos"
                    break
                if len(self.tokens) >= self.ctx:
                    stats.stop_reason = "context"
                    break
                if i + 1 < max_new:
                    logits = self.step(token)
        finally:
            stats.decode_s = time.perf_counter() - t0
