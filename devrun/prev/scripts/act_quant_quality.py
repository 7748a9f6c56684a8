#!/usr/bin/env python3
"""How much int8 activations in the quantized matvec move a trained model: the GPU path that DS4X_QUANT_ACT=int8
turns on (ds4x.kernels.quant_matmul: x quantized per 8 values for Q8_0, per 16 for the 2-bit types, scale
amax / 127, round to nearest), emulated on the CPU with the embedded tiny model converted to Q8_0.

The tiny model's expert rows (128 values) are too short for the 256-value K-quant blocks, so every matrix is
Q8_0, and every Q8_0 product's activations are quantized per 8 values (the Q8_0 matvec) in one arm, per 16 (as
the IQ2_XXS / Q2_K matvec groups them) in another. The matvec serves decode-sized products only (up to 16 rows),
so the emulation touches those and the prompt is fed one token at a time. Reported per arm against float
activations on the same Q8_0 weights: teacher-forced logits over held-out text (max and RMS difference, argmax
agreement, mean negative log-likelihood) and 256 greedy tokens; for scale, the same against the float32 model
(what Q8_0 weights alone do).

    PYTHONPATH=src python scripts/act_quant_quality.py --gguf /tmp/tiny_q8.gguf
    (the file: python -m ds4x convert src/ds4x/assets/tiny_v4 /tmp/tiny_q8.gguf --mix q8)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

ARMS = ("float", "int8 per 8", "int8 per 16", "float32 weights")
MATVEC_ROWS = 16  # ds4x.kernels.quant_matmul.MATVEC_MAX_ROWS: larger products stay float on the GPU too


def int8_roundtrip(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the int8 matvec sees it: per ``group`` values along the last axis, codes round(x * 127 / amax)."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax * (1.0 / 127.0))).reshape(x.shape).to(x.dtype)


def patch_products(group: int) -> None:
    """Quantize the activations of the Q8_0 products of at most MATVEC_ROWS rows per ``group`` values before the
    reference computes them."""
    from ds4x.formats.ggml_tensor import GGMLTensor
    from ds4x.kernels import linear as L
    from ds4x.model import attention, hyper, moe, projections, transformer

    def rows(x: torch.Tensor) -> int:
        return x.numel() // x.shape[-1]

    def wrap(fn, group):
        def product(x, weight, *args):
            quantized = isinstance(weight, GGMLTensor) and weight.qtype.name == "Q8_0"
            if group and quantized and rows(x) <= MATVEC_ROWS and x.shape[-1] % group == 0:
                x = int8_roundtrip(x, group)
            return fn(x, weight, *args)
        return product

    wrapped = {name: wrap(getattr(L, name), group) for name in ("linear", "grouped_linear", "routed_linear")}
    for module in (L, attention, hyper, moe, projections, transformer):
        for name, fn in wrapped.items():
            if hasattr(module, name):
                setattr(module, name, fn)


def run(gguf: str, text: list[int], prompt: list[int], gen: int) -> tuple[torch.Tensor, list[int]]:
    from ds4x.runtime.engine import Engine
    from ds4x.runtime.sampling import SamplingParams

    engine = Engine.load(gguf, device="cpu")
    s = engine.new_session(ctx=len(text) + 1, cache="packed", prefill_chunk=1)
    logits = torch.stack([engine.model.forward(torch.tensor([t]), s.cache).float() for t in text])
    g = engine.new_session(ctx=len(prompt) + gen + 1, cache="packed", prefill_chunk=1)
    tokens = [t for t, _ in g.generate(prompt, gen, SamplingParams(), stop_ids=())]
    return logits, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True, help="the tiny model converted to Q8_0 (see above)")
    p.add_argument("--tokens", type=int, default=512, help="held-out tokens scored teacher-forced")
    p.add_argument("--gen", type=int, default=256, help="greedy tokens generated")
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm per process
    a = p.parse_args()
    from ds4x.runtime.engine import Engine
    from ds4x.runtime.quality import heldout_text

    text = Engine.load(a.gguf, device="cpu").tokenizer.encode(heldout_text())[: a.tokens]
    prompt = text[:32]
    if a.arm:  # the patches last for the process, so each arm runs in its own
        if a.arm.startswith("int8"):
            patch_products(int(a.arm.split()[-1]))
        logits, tokens = run("default" if a.arm == "float32 weights" else a.gguf, text, prompt, a.gen)
        torch.save({"logits": logits, "tokens": tokens}, sys.stdout.buffer)
        return 0
    import io
    import subprocess

    results = {}
    for arm in ARMS:
        out = subprocess.run([sys.executable, __file__, "--gguf", a.gguf, "--tokens", str(a.tokens), "--gen",
                              str(a.gen), "--arm", arm], check=True, capture_output=True).stdout
        results[arm] = torch.load(io.BytesIO(out))
    ref = results["float"]
    nll_ref = torch.nn.functional.cross_entropy(ref["logits"][:-1], torch.tensor(text[1:]))
    report = {}  # each arm against float activations on the Q8_0 weights
    for arm in ARMS[1:]:
        la, ta = results[arm]["logits"], results[arm]["tokens"]
        d = la - ref["logits"]
        same = next((i for i, (x, y) in enumerate(zip(ta, ref["tokens"], strict=True)) if x != y), len(ta))
        report[arm] = {
            "max_abs_over_max_logit": float(d.abs().max() / ref["logits"].abs().max()),
            "rms_over_rms_logit": float(d.pow(2).mean().sqrt() / ref["logits"].pow(2).mean().sqrt()),
            "argmax_agreement": float((la.argmax(-1) == ref["logits"].argmax(-1)).float().mean()),
            "nll": float(torch.nn.functional.cross_entropy(la[:-1], torch.tensor(text[1:]))),
            "nll_float": float(nll_ref),
            "greedy_identical_prefix": same,
            "greedy_equal_fraction": sum(x == y for x, y in zip(ta, ref["tokens"], strict=True)) / len(ta),
        }
    print(json.dumps({"tokens_scored": len(text), "greedy_tokens": a.gen, **report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
