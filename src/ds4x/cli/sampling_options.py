"""The sampling options ``ds4x generate`` and ``ds4x chat`` share, and the SamplingParams they make."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line starts without importing torch
    from ds4x.runtime.sampling import SamplingParams


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x top probability")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token generated so far, in [-2, 2] (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from a generated token's logit once per occurrence, in [-2, 2] (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides the positive logits (multiplies the negative ones) of the tokens in the context or "
                        "generated, in (0, 10] (1 = off)")
    p.add_argument("--logit-bias", metavar="ID=BIAS,...", default=None,
                   help="add BIAS in [-100, 100] to token ID's logit, e.g. 5=-100,7=2.5")


def parse_bias(text: str) -> tuple[tuple[int, float], ...]:
    """``--logit-bias``: comma-separated ID=BIAS pairs."""
    try:
        pairs = [item.split("=") for item in text.replace(" ", "").split(",") if item]
        return tuple((int(t), float(b)) for t, b in pairs)
    except ValueError:
        raise ValueError(f"--logit-bias must be comma-separated ID=BIAS pairs, got {text!r}") from None


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The options above as SamplingParams (which checks their ranges)."""
    from ds4x.runtime.sampling import SamplingParams

    # torch's generators take 64-bit seeds: a larger --seed failed after the model loaded and the prompt ran, with
    # torch's "Overflow when unpacking long long"
    if args.seed is not None and not -(2**63) <= args.seed < 2**64:
        raise ValueError(f"--seed must be a 64-bit integer, got {args.seed}")
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=args.seed, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                          logit_bias=parse_bias(args.logit_bias) if args.logit_bias is not None else ())
