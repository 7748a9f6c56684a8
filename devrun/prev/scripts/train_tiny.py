#!/usr/bin/env python3
"""Train the embedded default model: a small DeepSeek-V4 with every feature, on Python sources.

Architecture (``--preset default``, 10.9M parameters): 6 layers: 2 sliding-window layers, then CSA
(ratio 4, Lightning indexer with index_topk 64, below the 128+ compressed rows of any training context)
and HCA (ratio 16) alternating; the first 2 MoE layers hash-routed, the rest score-routed; 8 routed experts
top-2 plus the shared expert; mHC with hc_mult 4; YaRN on the compressed layers. head_dim 128 = 64 nope + 64
RoPE and index_head_dim 128, so ds4x's native cache applies.

Data: the Python sources of this machine's standard library and installed packages
(``sysconfig.get_paths()`` and ``site.getsitepackages()``). A file is held out when
``int(sha1(relative path).hexdigest()[:8], 16) % 50 == 0`` (2%, the relative path taken from its library
root, e.g. ``json/decoder.py``); training files whose content equals a held-out file are dropped too.
A byte-level BPE tokenizer (``tokenizers``; <bos>=0, <eos>=1, <pad>=2) is trained on training text.
Documents are ``<bos> file <eos>``; a share of every batch is a synthetic long-context retrieval task
(``key = value`` lines planted through code at every depth, then each asked in shuffled order by repeating
the fact line's prefix ``key =`` at the start of a line, answered by `` value``; the answers weigh more in
the loss). The fact format comes from ``ds4x.runtime.quality``, which the recall gate uses too. Time-based
phases: first short sequences (512 tokens) dense in facts, then 2048, 4096 and 8192 tokens.

Training uses transformers' ``DeepseekV4ForCausalLM`` with three additions: an exact but memory-light
attention (the sliding window evaluated block-wise instead of a dense S x S matrix), a KL loss that trains
the Lightning indexer towards the main attention's distribution over compressed rows (its inputs detached,
as in DeepSeek-V3.2), and auxiliary-loss-free expert balancing (score-correction bias updates).

The schedule is driven by wall time (``--wall-budget``), so the run ends on time on any device; the
checkpoint (ds4x ``save_checkpoint``, transformers naming, bf16 with fp32 norms/mHC/sinks, sharded) is
rewritten every ``--save-every`` seconds into ``--out``, with tokenizer.json, heldout.txt and train_log.json.

    PYTHONPATH=src python scripts/train_tiny.py --out /tmp/tiny_v4                       # GPU
    PYTHONPATH=src python scripts/train_tiny.py --preset debug --device cpu --threads 1 --wall-budget 90 \\
        --max-train-mb 2 --vocab 1024 --phases 0.3:128:8:0.8,1:256:2 --out /tmp/dbg      # CPU smoke run

``--init DIR`` continues from a ds4x model directory (its config, weights and tokenizer) instead of starting
over; docs/TRAINING.md gives the two commands behind the shipped model (from scratch, then continued).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import math
import os
import random
import site
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ds4x.config import CSA, HCA, SLIDING, ModelConfig, YarnScaling
from ds4x.runtime import quality as Q
from ds4x.weights.checkpoint import load_checkpoint, save_checkpoint

SPECIALS = ["<bos>", "<eos>", "<pad>"]
BOS, EOS = 0, 1
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# ---- model ----------------------------------------------------------------------------------------

def model_config(preset: str, vocab: int) -> ModelConfig:
    def kinds(ratios: tuple[int, ...]) -> tuple[str, ...]:
        return tuple(SLIDING if r == 0 else CSA if r == 4 else HCA for r in ratios)

    if preset == "default":
        ratios = (0, 0, 4, 16, 4, 16)
        return ModelConfig(
            vocab_size=vocab, hidden_size=256, num_layers=len(ratios), num_heads=8, head_dim=128, rope_head_dim=64,
            q_lora_rank=128, o_groups=4, o_lora_rank=64, n_routed_experts=8, n_shared_experts=1,
            n_experts_per_tok=2, moe_intermediate_size=128, attn_kinds=kinds(ratios), compress_ratios=ratios,
            mlp_hash=(True, True, False, False, False, False), sliding_window=128, index_n_heads=16,
            index_head_dim=128, index_topk=64, hc_mult=4, hc_sinkhorn_iters=20,
            compress_rope_scaling=YarnScaling(4.0, 4096, 32.0, 1.0), max_position_embeddings=16384,
            bos_token_id=BOS, eos_token_ids=(EOS,),
        )
    if preset == "debug":
        ratios = (0, 4, 16, 4)
        return ModelConfig(
            vocab_size=vocab, hidden_size=64, num_layers=len(ratios), num_heads=2, head_dim=128, rope_head_dim=64,
            q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4, n_shared_experts=1,
            n_experts_per_tok=2, moe_intermediate_size=32, attn_kinds=kinds(ratios), compress_ratios=ratios,
            mlp_hash=(True, False, False, False), sliding_window=64, index_n_heads=16, index_head_dim=128,
            index_topk=8, hc_mult=4, hc_sinkhorn_iters=20, compress_rope_scaling=YarnScaling(4.0, 256, 32.0, 1.0),
            max_position_embeddings=1024, bos_token_id=BOS, eos_token_ids=(EOS,),
        )
    raise ValueError(f"unknown preset {preset!r}")


class Patches:
    """Memory-light exact attention, the indexer's KL loss, expert-load counting (see the module doc)."""

    def __init__(self) -> None:
        import transformers.models.deepseek_v4.modeling_deepseek_v4 as mod

        self.mod = mod
        self.fast = True
        self.kl_terms: list[torch.Tensor] = []
        self._orig_eager = mod.eager_attention_forward
        orig_indexer = mod.DeepseekV4Indexer.forward
        patches = self

        def scorer_forward(self, q, compressed_kv, hidden_states):  # noqa: ANN001
            # transformers' math with einsum: its broadcasting matmul copies the keys once per query
            scores = torch.einsum("bshd,btd->bsht", q.float(), compressed_kv.float()).relu()
            weights = self.weights_proj(hidden_states).float() * (self.weights_scaling * self.softmax_scale)
            out = torch.einsum("bsht,bsh->bst", scores, weights)
            self._last_scores = out if torch.is_grad_enabled() else None
            return out

        def indexer_forward(self, hidden_states, q_residual, *args, **kwargs):  # noqa: ANN001
            # the top-k output carries no gradient; its own loss must not reach the main model
            return orig_indexer(self, hidden_states.detach(), q_residual.detach(), *args, **kwargs)

        def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):  # noqa: ANN001
            if not patches.fast or not isinstance(attention_mask, torch.Tensor) or key.shape[2] < query.shape[2]:
                return patches._orig_eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
            return patches.attention(module, query, key, attention_mask, scaling)

        mod.DeepseekV4IndexerScorer.forward = scorer_forward
        mod.DeepseekV4Indexer.forward = indexer_forward
        mod.eager_attention_forward = attention

    def attention(self, module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor,
                  scaling: float) -> tuple[torch.Tensor, None]:
        """Exact V4 attention without cache: sliding window block-wise, compressed rows dense + given bias."""
        B, H, S, D = query.shape
        T = key.shape[2] - S
        W = module.sliding_window
        k = key[:, 0]
        kr, kc = k[:, :S], k[:, S:]
        pad = (-S) % W
        nb = (S + pad) // W
        qb = F.pad(query, (0, 0, 0, pad)).view(B, H, nb, W, D)
        kb = F.pad(kr, (0, 0, W, pad)).unfold(1, 2 * W, W).transpose(-1, -2)  # [B, nb, 2W, D]: blocks i-1, i
        acc = torch.float64 if query.dtype == torch.float64 else torch.float32
        lr = torch.einsum("bhnqd,bnkd->bhnqk", qb, kb).to(acc) * scaling
        a = torch.arange(W, device=query.device)
        c = torch.arange(2 * W, device=query.device)
        dist = a[:, None] + W - c[None, :]  # query position - key position
        vis = ((dist >= 0) & (dist < W)).expand(nb, W, 2 * W).clone()
        vis[0] &= c[None, :] >= W  # no keys before position 0
        lr = lr.masked_fill(~vis, float("-inf")).reshape(B, H, nb * W, 2 * W)[:, :, :S]
        parts = [lr]
        if T > 0:
            lc = torch.einsum("bhsd,btd->bhst", query, kc).to(acc) * scaling + mask[:, :, :, S:].to(acc)
            parts.append(lc)
        parts.append(module.sinks.to(acc).view(1, H, 1, 1).expand(B, H, S, 1))
        probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
        pr = F.pad(probs[..., : 2 * W], (0, 0, 0, pad)).view(B, H, nb, W, 2 * W)
        out = torch.einsum("bhnqk,bnkd->bhnqd", pr.to(kb.dtype), kb).reshape(B, H, nb * W, D)[:, :, :S]
        if T > 0:
            out = out + torch.einsum("bhst,btd->bhsd", probs[..., 2 * W : 2 * W + T].to(kc.dtype), kc)
            if module.layer_type == "compressed_sparse_attention" and torch.is_grad_enabled():
                self._indexer_kl(module, query, kc, scaling)
        return out.transpose(1, 2).contiguous(), None

    def _indexer_kl(self, module, query: torch.Tensor, kc: torch.Tensor, scaling: float) -> None:
        scorer = module.compressor.indexer.scorer
        scores = getattr(scorer, "_last_scores", None)
        scorer._last_scores = None
        B, H, S, _ = query.shape
        T = kc.shape[1]
        if scores is None or scores.shape[-1] != T:
            return
        ratio = module.compressor.compress_rate
        pos = torch.arange(S, device=query.device)
        vis = torch.arange(T, device=query.device)[None, :] < ((pos + 1) // ratio)[:, None]  # [S, T]
        has = vis.any(-1)
        if not bool(has.any()):
            return
        with torch.no_grad():
            tl = torch.einsum("bhsd,btd->bhst", query, kc).float() * scaling
            target = torch.softmax(tl.masked_fill(~vis, float("-inf")), dim=-1).nan_to_num(0.0).mean(1)
        logq = torch.log_softmax(scores.float().masked_fill(~(vis | ~has[:, None]), float("-inf")), dim=-1)
        logq = torch.where(vis, logq, torch.zeros_like(logq))
        kl = (torch.xlogy(target, target) - target * logq).sum(-1)  # [B, S]
        self.kl_terms.append(kl.sum() / (B * has.sum()))


def load_init(path: Path, seed: int) -> tuple[ModelConfig, torch.nn.Module, dict]:
    """(config, training model holding the weights of the ds4x model directory ``path``, its provenance)."""
    from ds4x.weights.checkpoint import to_hf_names

    cfg, weights = load_checkpoint(path, dtype=torch.float32)
    model = build_model(cfg, seed)
    # strict: every parameter and buffer (hash tables, expert biases) must come from the checkpoint
    model.load_state_dict(to_hf_names(weights), strict=True)
    info: dict = {"path": str(path), "sha1": hashlib.sha1(b"".join(
        f.read_bytes() for f in sorted(path.glob("*.safetensors")))).hexdigest()}
    log_file = path / "train_log.json"
    if log_file.exists():
        prev = json.loads(log_file.read_text())
        info.update({k: prev.get(k) for k in ("command", "steps", "tokens", "init")})
    return cfg, model, info


def build_model(cfg: ModelConfig, seed: int):  # noqa: ANN201
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    hf_cfg = DeepseekV4Config(**cfg.to_hf_dict())
    hf_cfg.use_cache = False
    model = DeepseekV4ForCausalLM(hf_cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):  # a fixed random token -> distinct experts table
                table = torch.rand(buf.shape[0], cfg.n_routed_experts, generator=g).argsort(dim=-1)
                buf.copy_(table[:, : buf.shape[1]])
    return model


# ---- data -----------------------------------------------------------------------------------------

def is_heldout(rel: str, modulus: int = 50) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % modulus == 0


def source_roots() -> list[str]:
    paths = sysconfig.get_paths()
    cands = [paths.get("stdlib"), paths.get("purelib"), paths.get("platlib")]
    with contextlib.suppress(Exception):
        cands += site.getsitepackages()
    roots: list[str] = []
    for p in cands:
        if p and os.path.isdir(p) and os.path.realpath(p) not in roots:
            roots.append(os.path.realpath(p))
    return roots


def list_sources(roots: list[str]) -> dict[str, tuple[str, int]]:
    """relative path -> (absolute path, size) for every .py file of 200 B..150 KB under the roots."""
    rootset = set(roots)
    found: dict[str, tuple[str, int]] = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and os.path.join(dirpath, d) not in rootset)
            for f in sorted(filenames):
                if not f.endswith(".py"):
                    continue
                full = os.path.join(dirpath, f)
                try:
                    size = os.path.getsize(full)
                except OSError:
                    continue
                if 200 <= size <= 150_000:
                    found.setdefault(os.path.relpath(full, root).replace(os.sep, "/"), (full, size))
    return found


def read_source(path: str) -> str | None:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if "\x00" in text or max(map(len, text.splitlines() or [""])) > 400:
        return None  # binary-ish or minified / generated tables
    return text


def collect(max_train_bytes: int, seed: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]], dict]:
    roots = source_roots()
    found = list_sources(roots)
    order = sorted(found, key=lambda r: hashlib.sha1(f"{seed}:{r}".encode()).hexdigest())
    heldout, held_hashes = [], set()
    for rel in sorted(r for r in found if is_heldout(r)):
        text = read_source(found[rel][0])
        if text is not None:
            h = hashlib.sha1(text.encode()).hexdigest()
            if h not in held_hashes:
                held_hashes.add(h)
                heldout.append((rel, text))
    train, seen, size, dropped = [], set(held_hashes), 0, 0
    for rel in order:
        if is_heldout(rel):
            continue
        if size >= max_train_bytes:
            break
        text = read_source(found[rel][0])
        if text is None:
            continue
        h = hashlib.sha1(text.encode()).hexdigest()
        if h in seen:
            dropped += 1
            continue
        seen.add(h)
        train.append((rel, text))
        size += len(text.encode())
    stats = {"roots": roots, "files_found": len(found), "train_files": len(train), "train_bytes": size,
             "heldout_files": len(heldout), "heldout_bytes": sum(len(t.encode()) for _, t in heldout),
             "duplicates_dropped": dropped}
    return train, heldout, stats


def train_tokenizer(texts: list[str], vocab: int):  # noqa: ANN201
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    assert tok.token_to_id("<bos>") == BOS and tok.token_to_id("<eos>") == EOS
    return tok


def encode_docs(tok, texts: list[str]) -> np.ndarray:  # noqa: ANN001
    out: list[np.ndarray] = []
    for i in range(0, len(texts), 2000):
        for enc in tok.encode_batch(texts[i : i + 2000], add_special_tokens=False):
            out.append(np.array([BOS, *enc.ids, EOS], dtype=np.int32))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)


class Batcher:
    """Batches of plain code windows and synthetic retrieval documents (token level)."""

    def __init__(self, stream: np.ndarray, tok, seed: int, answer_weight: float, max_facts: int):  # noqa: ANN001
        self.stream, self.tok = stream, tok
        self.rng = np.random.default_rng(seed)
        self.prng = random.Random(seed)
        self.answer_weight, self.max_facts = answer_weight, max_facts
        vocab = tok.get_vocab_size()
        self.ends_nl = np.zeros(vocab, dtype=bool)
        for i in range(vocab):
            if tok.decode([i]).endswith("\n"):
                self.ends_nl[i] = True
        self.nl = tok.encode("\n", add_special_tokens=False).ids

    def enc(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False).ids

    def window(self, n: int) -> np.ndarray:
        start = int(self.rng.integers(0, len(self.stream) - n))
        return self.stream[start : start + n]

    def retrieval(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``n`` tokens: <bos>, code with facts planted after line ends, then every fact asked in turn.

        A question is the fact line's prefix at the start of a line (`quality.fact_question`); its answer
        is the rest of that line (value and newline), weighted ``answer_weight`` in the loss. The third
        array holds, for each answer token, how far back (in tokens) the fact line it copies starts, and -1
        elsewhere: answers within the sliding window need no compressed attention, the others do.
        """
        n_facts = int(self.rng.integers(2, self.max_facts + 1))
        while True:
            facts = Q.distinct_facts(self.prng, n_facts)
            lines = {k: self.enc(Q.fact_line(k, v)) for k, v in facts}
            qs: list[int] = []
            qw: list[float] = []
            asked: list[tuple[str, int, int]] = []  # (key, offset in qs, answer length)
            for k, _ in self.prng.sample(facts, len(facts)):
                q = self.enc(Q.fact_question(k))
                assert lines[k][: len(q)] == q, "the question must repeat the fact line's tokens"
                asked.append((k, len(qs), len(lines[k]) - len(q)))
                qs += lines[k]
                qw += [1.0] * len(q) + [self.answer_weight] * (len(lines[k]) - len(q))
            fill = n - 1 - len(self.nl) - sum(map(len, lines.values())) - len(qs)
            if fill >= n // 4 or n_facts == 1:
                break
            n_facts -= 1
        filler = self.window(max(fill, 1))
        # insertion points, all at line starts (the question repeats a fact's tokens only there): right after
        # <bos> or after a token that ends a line; short windows may have fewer than facts, then facts stack
        c = np.concatenate([[0], np.nonzero(self.ends_nl[filler[:-1]])[0] + 1])
        # one fact per equal slice of the insertion points, so every depth is covered
        bounds = [len(c) * i // n_facts for i in range(n_facts + 1)]
        picks = [int(self.rng.choice(c[lo : max(hi, lo + 1)])) for lo, hi in itertools.pairwise(bounds)]
        ids, prev, at = [BOS], 0, {}
        for p, (k, line) in zip(picks, lines.items(), strict=True):
            ids += filler[prev:p].tolist()
            at[k] = len(ids)
            ids += line
            prev = p
        ids += filler[prev:].tolist() + self.nl
        q0 = len(ids)
        ids += qs
        w = [1.0] * q0 + qw
        dist = np.full(len(ids), -1, dtype=np.int64)
        for k, off, n_ans in asked:
            end = q0 + off + len(lines[k])
            dist[end - n_ans : end] = q0 + off - at[k]
        return np.array(ids[:n], dtype=np.int64), np.array(w[:n], dtype=np.float32), dist[:n]

    def batch(self, b: int, s: int, retrieval_frac: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [b, s+1], per-target weights [b, s] and per-target fact distances [b, s] (-1: not an answer);
        a share ``retrieval_frac`` of the rows is retrieval."""
        ids, ws, ds = [], [], []
        for _ in range(b):
            if self.rng.random() < retrieval_frac:
                x, w, d = self.retrieval(s + 1)
            else:
                x, w = self.window(s + 1).astype(np.int64), np.ones(s + 1, dtype=np.float32)
                d = np.full(s + 1, -1, dtype=np.int64)
            ids.append(x)
            ws.append(w[1:])  # target t is token t+1: its weight and distance
            ds.append(d[1:])
        return torch.from_numpy(np.stack(ids)), torch.from_numpy(np.stack(ws)), torch.from_numpy(np.stack(ds))


# ---- training -------------------------------------------------------------------------------------

def parse_phases(text: str, retrieval_frac: float) -> list[tuple[float, int, int, float]]:
    """'0.2:512:64:0.7,1:2048:16' -> [(end fraction, seq, batch, retrieval share), ...]; a phase without
    the fourth field uses ``retrieval_frac``."""
    out = []
    for part in text.split(","):
        f, s, b, *r = part.split(":")
        out.append((float(f), int(s), int(b), float(r[0]) if r else retrieval_frac))
    return out


def lm_loss(model, ids: torch.Tensor, weights: torch.Tensor, amp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """(weighted mean NLL, per-target NLL, per-target argmax hit)."""
    with amp():
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    nll = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view_as(weights)
    hit = logits.argmax(-1) == ids[:, 1:]
    return (nll * weights).sum() / weights.sum(), nll.detach(), hit


def answers(hit: torch.Tensor, dist: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(whole answer right, fact distance) per answer of a batch: an answer is a run of answer targets
    (``dist >= 0``), right when every one of its tokens is the argmax."""
    h, d = hit.cpu().numpy(), dist.cpu().numpy()
    ok, far = [], []
    for row in range(d.shape[0]):
        idx = np.nonzero(d[row] >= 0)[0]
        for g in np.split(idx, np.nonzero(np.diff(idx) > 1)[0] + 1) if len(idx) else []:
            ok.append(bool(h[row, g].all()))
            far.append(int(d[row, g[0]]))
    return np.array(ok, dtype=bool), np.array(far, dtype=np.int64)


def answer_stats(ok: np.ndarray, dist: np.ndarray, window: int) -> dict:
    """Whole answers right, split by whether the fact lies within the sliding window (None: no such answer)."""
    near = dist < window
    return {"answers_near": round(float(ok[near].mean()), 3) if near.any() else None,
            "answers_far": round(float(ok[~near].mean()), 3) if (~near).any() else None,
            "n_near": int(near.sum()), "n_far": int((~near).sum())}


@torch.no_grad()
def evaluate(model, heldout: np.ndarray, batcher_eval: Batcher, amp, dev, lengths: list[int]) -> dict:  # noqa: ANN001
    model.eval()
    out: dict = {}
    s = min(2048, max(len(heldout) // 8 - 1, 16))
    n = max(1, min(8, len(heldout) // (s + 1)))
    x = torch.from_numpy(heldout[: n * (s + 1)].astype(np.int64).reshape(n, s + 1)).to(dev)
    _, nll, _ = lm_loss(model, x, torch.ones(n, s, device=dev), amp)
    out["heldout_loss"] = float(nll.mean())
    for length in lengths:
        ok = []
        for _ in range(2):
            x, w, dist = batcher_eval.batch(2, length, 1.0)
            _, _, hit = lm_loss(model, x.to(dev), w.to(dev), amp)
            ok.append(answers(hit, dist)[0])
        out[f"recall_tf_{length}"] = float(np.concatenate(ok).mean())
    model.train()
    return out


def export(model, cfg: ModelConfig, tok, out: Path, train_log: dict, shard_bytes: int) -> None:  # noqa: ANN001
    """Write config.json + sharded safetensors (via ds4x's loader and writer), tokenizer.json, train_log.json."""
    from safetensors.torch import save_file

    state = {k: v.detach().float().cpu() if v.is_floating_point() else v.detach().cpu()
             for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
        save_file({k: v.contiguous() for k, v in state.items()}, str(Path(tmp) / "model.safetensors"))
        cfg2, weights = load_checkpoint(tmp, dtype=torch.bfloat16)
    assert cfg2 == cfg
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*.safetensors*"):
        f.unlink()
    save_checkpoint(cfg, weights, out, naming="hf", shard_bytes=shard_bytes)
    tok.save(str(out / "tokenizer.json"))
    (out / "train_log.json").write_text(json.dumps(train_log, indent=1) + "\n")


def pick_experts_impl(model, batcher: Batcher, s: int, b: int, amp, dev) -> tuple[str, dict]:  # noqa: ANN001
    timings: dict[str, float] = {}
    if dev.type != "cuda" or not hasattr(model, "set_experts_implementation"):
        return "eager", timings
    x, w, _ = batcher.batch(b, s, 0.0)
    x, w = x.to(dev), w.to(dev)
    for impl in ("grouped_mm", "eager"):
        try:
            model.set_experts_implementation(impl)
            for i in range(3):
                if i == 1:
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                loss, _, _ = lm_loss(model, x, w, amp)
                loss.backward()
            torch.cuda.synchronize()
            timings[impl] = (time.perf_counter() - t) / 2
        except Exception as exc:  # an implementation this torch/transformers pair lacks
            timings[impl] = float("inf")
            log(f"experts implementation {impl} failed: {type(exc).__name__}: {str(exc)[:200]}")
        model.zero_grad(set_to_none=True)
    best = min(timings, key=timings.get)
    model.set_experts_implementation(best)
    return best, timings


def ds4x_eval(path: Path, device: str, deadline: float, lengths: list[int]) -> dict:
    """The quality gates of ds4x.runtime.quality on the exported checkpoint, as far as ``deadline`` allows."""
    from ds4x.runtime.engine import Engine

    res: dict = {"device": device}
    try:
        engine = Engine.load(str(path), device=device, dtype="float32")
        text = Q.heldout_text(path / "heldout.txt")
        for mode in ("float", "native"):
            if time.time() > deadline:
                break
            window = min(2048, engine.cfg.max_position_embeddings - 1)
            r = Q.perplexity(engine, text, window=window, cache=mode, max_tokens=4 * window)
            res[f"ppl_{mode}"] = r.ppl
            res["ppl_tokens"] = r.tokens
        ids = engine.tokenizer.encode(text)[:8192]
        res["unigram_ppl"] = Q.unigram_perplexity(ids, engine.cfg.vocab_size)
        for n_ctx in lengths:
            for mode in ("float", "native"):
                if time.time() > deadline:
                    break
                r = Q.recall(engine, text, n_ctx, n_prompts=2, n_facts=10, cache=mode, seed=1)
                res[f"recall_{n_ctx}_{mode}"] = f"{r.correct}/{r.asked}"
                log(f"ds4x recall {n_ctx} {mode}: {r.correct}/{r.asked} misses {r.misses[:3]}")
    except Exception as exc:  # the training result stands without these numbers
        res["error"] = f"{type(exc).__name__}: {exc}"
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to (re)write")
    ap.add_argument("--preset", default="default", choices=["default", "debug"])
    ap.add_argument("--init", help="continue from this ds4x model directory (its config, weights and tokenizer; "
                                   "--preset and --vocab are then ignored)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--wall-budget", type=float, default=500.0, help="seconds from start to the final save")
    ap.add_argument("--reserve", type=float, default=45.0, help="seconds kept for the final eval and save")
    ap.add_argument("--save-every", type=float, default=100.0)
    ap.add_argument("--max-train-mb", type=float, default=150.0)
    ap.add_argument("--tokenizer-mb", type=float, default=24.0)
    ap.add_argument("--phases", default="0.15:512:64:0.75,0.45:2048:16,0.7:4096:8,1:8192:4",
                    help="end fraction of the time:sequence length:batch[:retrieval share], comma-separated")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--retrieval-frac", type=float, default=0.5, help="retrieval share of phases that name none")
    ap.add_argument("--max-facts", type=int, default=16, help="facts per retrieval document: 2 to this")
    ap.add_argument("--answer-weight", type=float, default=4.0)
    ap.add_argument("--bias-speed", type=float, default=1e-3, help="expert score-correction bias update")
    ap.add_argument("--shard-mib", type=float, default=10.0)
    ap.add_argument("--heldout-sample-kb", type=float, default=150.0)
    ap.add_argument("--eval-budget", type=float, default=50.0, help="seconds for ds4x's quality gates at the end")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    out = Path(args.out)
    phases = parse_phases(args.phases, args.retrieval_frac)
    torch.manual_seed(args.seed)
    if args.threads > 0:  # on a shared CPU, more threads than free cores make every op many times slower
        torch.set_num_threads(args.threads)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def amp():  # noqa: ANN202
        if dev.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    import tokenizers
    import transformers

    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
                "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None}
    log(f"versions {versions}")

    train_docs, held_docs, data_stats = collect(int(args.max_train_mb * 2**20), args.seed)
    log(f"data {json.dumps({k: v for k, v in data_stats.items() if k != 'roots'})} roots {data_stats['roots']}")
    if args.init:  # continued training keeps the tokenizer the weights were trained with
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(args.init) / "tokenizer.json"))
        log(f"tokenizer: vocab {tok.get_vocab_size()} from {args.init}")
    else:
        tok_texts, size = [], 0
        for _, t in train_docs:
            if size >= args.tokenizer_mb * 2**20:
                break
            tok_texts.append(t)
            size += len(t)
        tok = train_tokenizer(tok_texts, args.vocab)
        log(f"tokenizer: vocab {tok.get_vocab_size()} trained on {size / 2**20:.1f} MiB")
    vocab = tok.get_vocab_size()
    stream = encode_docs(tok, [t for _, t in train_docs])
    held_for_eval, size = [], 0
    for _, t in held_docs:  # enough held-out text for the evaluations during training
        if size < 8 * 2**20:
            held_for_eval.append(t)
            size += len(t)
    held_stream = encode_docs(tok, held_for_eval)
    data_stats.update(train_tokens=int(len(stream)), heldout_tokens=int(len(held_stream)),
                      bytes_per_token=data_stats["train_bytes"] / max(len(stream), 1))
    log(f"tokens: train {len(stream):,}, held-out {len(held_stream):,}")

    # the held-out sample shipped with the model: whole held-out files (<= 24 KB each), by path
    sample, sample_bytes = [], 0
    for _rel, text in sorted(held_docs):
        if len(text.encode()) <= 24_000 and sample_bytes < args.heldout_sample_kb * 1000:
            sample.append(text if text.endswith("\n") else text + "\n")
            sample_bytes += len(text.encode()) + 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "heldout.txt").write_text("\n\n".join(sample), encoding="utf-8")

    patches = Patches()
    init_info = None
    if args.init:
        cfg, model, init_info = load_init(Path(args.init), args.seed)
        model.to(dev)
        log(f"initialised from {json.dumps(init_info)}")
    else:
        cfg = model_config(args.preset, vocab)
        model = build_model(cfg, args.seed).to(dev)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters, {cfg.layer_summary()}")
    routers = [m for m in model.modules() if isinstance(m, patches.mod.DeepseekV4TopKRouter)]

    def count_load(router, inputs, output) -> None:  # noqa: ANN001
        router._load.add_(torch.bincount(output[2].flatten(), minlength=cfg.n_routed_experts).float())

    for r in routers:
        r.register_buffer("_load", torch.zeros(cfg.n_routed_experts, device=dev), persistent=False)
        r.register_forward_hook(count_load)

    batcher = Batcher(stream, tok, args.seed, args.answer_weight, args.max_facts)
    eval_batcher = Batcher(held_stream if len(held_stream) > 20_000 else stream, tok, args.seed + 1,
                           args.answer_weight, args.max_facts)
    impl, impl_timings = pick_experts_impl(model, batcher, phases[0][1], phases[0][2], amp, dev)
    log(f"experts implementation: {impl} {impl_timings}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "hc" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "hc" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if dev.type == "cuda" else {}))

    train_log: dict = {
        "command": "PYTHONPATH=src python scripts/train_tiny.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "versions": versions, "data": data_stats, "experts_implementation": impl, "experts_timings": impl_timings,
        "heldout_rule": "a file is held out when int(sha1(path relative to its library root).hexdigest()[:8], 16) "
                        "% 50 == 0; training files whose content equals a held-out file are dropped; "
                        "heldout.txt holds whole held-out files of <= 24 KB, sorted by path, joined by a blank line",
        "params": n_params, "config": cfg.to_hf_dict(), "phases": phases, "lr": args.lr,
        "retrieval_frac": args.retrieval_frac, "answer_weight": args.answer_weight, "max_facts": args.max_facts,
        "warmup": args.warmup, "init": init_info, "loss_curve": [], "evals": [],
    }
    lengths = sorted({p[1] for p in phases})
    if args.init:  # where training starts: comparable with the last evaluation in the init model's log
        ev = evaluate(model, held_stream, eval_batcher, amp, dev, lengths)
        ev.update(step=0, time_s=0.0)
        train_log["evals"].append(ev)
        log(f"eval {json.dumps(ev)}")
    t_start = time.time()
    t_end = T0 + args.wall_budget - args.reserve
    span = max(t_end - t_start, 1.0)
    step, tokens_seen, last_save = 0, 0, time.time()
    batch_scale = {i: 1.0 for i in range(len(phases))}
    while True:
        now = time.time()
        frac = (now - t_start) / span
        if frac >= 1.0:
            break
        ph = next(i for i, p in enumerate(phases) if frac < p[0] or i == len(phases) - 1)
        _, seq, bsz, rfrac = phases[ph]
        bsz = max(1, int(bsz * batch_scale[ph]))
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        x, w, dist = batcher.batch(bsz, seq, rfrac)
        x, w = x.to(dev, non_blocking=True), w.to(dev, non_blocking=True)
        try:
            patches.kl_terms.clear()
            loss, nll, hit = lm_loss(model, x, w, amp)
            kl = torch.stack(patches.kl_terms).mean() if patches.kl_terms else torch.zeros((), device=dev)
            (loss + kl).backward()
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            patches.kl_terms.clear()
            torch.cuda.empty_cache()
            batch_scale[ph] /= 2
            log(f"out of memory at batch {bsz} x {seq}: halving")
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for r in routers:
                r.e_score_correction_bias.add_(args.bias_speed * torch.sign(r._load.mean() - r._load))
                r._load.zero_()
        step += 1
        tokens_seen += bsz * seq
        if step % args.log_every == 0:
            ans = dist.to(dev) >= 0
            entry = {"step": step, "time_s": round(time.time() - t_start, 1), "tokens": tokens_seen, "seq": seq,
                     "batch": bsz, "lr": lr, "loss": round(float(loss.detach()), 4),
                     "text_loss": round(float(nll[~ans].mean()), 4),
                     "indexer_kl": round(float(kl.detach()), 4),
                     "answer_acc": round(float(hit[ans].float().mean()), 3) if bool(ans.any()) else None,
                     **answer_stats(*answers(hit, dist), cfg.sliding_window)}
            train_log["loss_curve"].append(entry)
            log(json.dumps(entry))
        if time.time() - last_save > args.save_every:
            ev = evaluate(model, held_stream, eval_batcher, amp, dev, lengths)
            ev.update(step=step, time_s=round(time.time() - t_start, 1))
            train_log["evals"].append(ev)
            log(f"eval {json.dumps(ev)}")
            train_log.update(steps=step, tokens=tokens_seen, train_seconds=round(time.time() - t_start, 1))
            export(model, cfg, tok, out, train_log, int(args.shard_mib * 2**20))
            last_save = time.time()

    ev = evaluate(model, held_stream, eval_batcher, amp, dev, lengths)
    ev.update(step=step, time_s=round(time.time() - t_start, 1))
    train_log["evals"].append(ev)
    train_log.update(steps=step, tokens=tokens_seen, train_seconds=round(time.time() - t_start, 1),
                     total_seconds=round(time.time() - T0, 1))
    export(model, cfg, tok, out, train_log, int(args.shard_mib * 2**20))
    if args.eval_budget > 0:
        del opt
        model.cpu()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        lens = [n for n in (2048, 8192) if n <= cfg.max_position_embeddings] or [256]  # 256: the debug preset
        train_log["ds4x_eval"] = ds4x_eval(out, str(dev), time.time() + args.eval_budget, lens)
        log(f"ds4x eval {json.dumps(train_log['ds4x_eval'])}")
        (out / "train_log.json").write_text(json.dumps(train_log, indent=1) + "\n")
    files = {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    log(f"saved {files}")
    summary = {"ds4x": train_log.get("ds4x_eval"), "steps": step, "tokens": tokens_seen,
               "train_s": train_log["train_seconds"],
               "total_s": round(time.time() - T0, 1), "first_loss": train_log["loss_curve"][0]["loss"]
               if train_log["loss_curve"] else None, **ev}
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
