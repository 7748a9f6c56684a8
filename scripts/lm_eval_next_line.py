#!/usr/bin/env python3
"""A multiple-choice task for lm-eval-harness from held-out Python: which of four lines comes next?

Each document is ~400 characters of the embedded default model's held-out code (``src/ds4x/assets/tiny_v4/
heldout.txt``, never trained on) ending at a line break, the line that follows it, and three other lines of the file
of similar length (chance: 25%). The task runs against ``ds4x serve`` through lm-eval's ``local-completions`` model,
which scores each choice with a loglikelihood request (echo + logprobs; tokens from the server's ``/tokenize``):

    python scripts/lm_eval_next_line.py OUT [--docs 200 --seed 0]        # writes OUT/ds4x_next_line.yaml + data
    ds4x serve --port 8000 &
    lm_eval --model local-completions --tasks ds4x_next_line --include_path OUT \\
        --model_args model=default,base_url=http://127.0.0.1:8000/v1/completions,num_concurrent=1

``--score MODEL`` also scores the documents in this process through the engine (the same rule: the choice whose
tokens, after the context's, have the highest summed log-probability; no BOS; the context's trailing whitespace
counted with the choice, as lm-eval splits them), so that the server's figure can be checked against it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HELDOUT = Path(__file__).resolve().parents[1] / "src" / "ds4x" / "assets" / "tiny_v4" / "heldout.txt"
TASK = """task: ds4x_next_line
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def documents(n: int, seed: int, context_chars: int = 400) -> list[dict]:
    """``n`` documents: a context ending at a line break, the next line (10-80 characters, not blank) as one of four
    choices, the others distinct lines of the file within 15 characters of its length."""
    lines = HELDOUT.read_text(encoding="utf-8").splitlines(keepends=True)
    starts, at = [], 0
    for line in lines:
        starts.append(at)
        at += len(line)
    text = "".join(lines)
    rng = random.Random(seed)
    usable = [i for i, line in enumerate(lines) if 10 <= len(line.strip()) <= 80 and starts[i] >= context_chars]
    docs: list[dict] = []
    for i in rng.sample(usable, len(usable)):
        answer = lines[i]
        pool = sorted({line for line in lines if line != answer and line.strip()
                       and abs(len(line) - len(answer)) <= 15})
        if len(pool) < 3:
            continue
        choices = [answer, *rng.sample(pool, 3)]
        rng.shuffle(choices)
        context = text[starts[i] - context_chars : starts[i]]
        docs.append({"context": context, "choices": choices, "label": choices.index(answer)})
        if len(docs) == n:
            break
    return docs


def score(model: str, docs: list[dict]) -> float:
    """The accuracy of the engine on ``docs``, scored as lm-eval's loglikelihood requests are."""
    import torch

    from ds4x.runtime.engine import Engine

    engine = Engine.load(model, device="cpu")
    tok = engine.tokenizer
    right = 0
    for doc in docs:
        text = doc["context"].rstrip()  # lm-eval moves the context's trailing whitespace to the continuation
        context = tok.encode(text)
        best = []
        for choice in doc["choices"]:
            ids = tok.encode(doc["context"] + choice)
            session = engine.new_session(ctx=len(ids) + 1, cache="packed", announce=False)
            logits = engine.model.forward(torch.tensor(ids), session.cache, all_logits=True).log_softmax(-1)
            best.append(sum(logits[j - 1, ids[j]].item() for j in range(len(context), len(ids))))
        right += max(range(len(best)), key=best.__getitem__) == doc["label"]
    return right / len(docs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--docs", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--score", metavar="MODEL", default=None, help="also score the documents with the engine")
    args = p.parse_args()
    docs = documents(args.docs, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "ds4x_next_line.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    (args.out / "ds4x_next_line.yaml").write_text(TASK.format(data=data.resolve()), encoding="utf-8")
    print(f"{len(docs)} documents: {data}; task ds4x_next_line in {args.out}")
    if args.score:
        print(f"accuracy of {args.score} scored by the engine: {score(args.score, docs):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
