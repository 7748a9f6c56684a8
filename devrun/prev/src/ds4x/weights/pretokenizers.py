"""Pre-tokenizers of byte-level BPE tokenizers (``tokenizer.json`` ``pre_tokenizer`` objects) by the
``tokenizer.ggml.pre`` names GGUF files use for them.

It sits beside the GGUF writer, which names a converted tokenizer's split; the GGUF tokenizer
(``ds4x.runtime.gguf_tokenizer``) builds its split from the same table.
"""

from __future__ import annotations

import json
from typing import Any

# DeepSeek-V3 / V4 tokenizer.json: digits in groups of up to 3, then CJK / kana runs, then the general
# pattern, each an isolating regex Split (text no regex matches stays a piece of its own), then the
# byte-level mapping. llama.cpp's "deepseek-v3" and "joyai-llm" pre-types are these three regexes.
DEEPSEEK_V4_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
DEEPSEEK_V4_PRE_TOKENIZER: dict[str, Any] = {
    "type": "Sequence",
    "pretokenizers": [
        *({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
          for r in DEEPSEEK_V4_SPLITS),
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}
GPT2_PRE_TOKENIZER: dict[str, Any] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                      "use_regex": True}
# tokenizer.ggml.pre names this loader knows; the first with a given split is the one ds4x convert writes
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "joyai-llm": DEEPSEEK_V4_PRE_TOKENIZER, "deepseek-v3": DEEPSEEK_V4_PRE_TOKENIZER,
    "gpt-2": GPT2_PRE_TOKENIZER, "gpt2": GPT2_PRE_TOKENIZER,
}


def _stub(pre_tokenizer: Any = None, normalizer: Any = None) -> Any:
    """A ``tokenizers.Tokenizer`` with an empty model, to deserialise pre-tokenizer / normalizer JSON."""
    from tokenizers import Tokenizer

    data = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer, "post_processor": None, "decoder": None,
            "model": {"type": "BPE", "vocab": {}, "merges": []}}
    try:
        return Tokenizer.from_str(json.dumps(data))
    except Exception as exc:  # the library raises a bare Exception for JSON it cannot read
        raise ValueError(f"cannot build the tokenizer's pre-tokenizer / normalizer: {exc}") from None


def pre_tokenizer_from_json(pre: str | dict[str, Any]) -> Any:
    """A ``tokenizers`` pre-tokenizer from a ``tokenizer.json`` ``pre_tokenizer`` object (or its JSON text)."""
    return _stub(pre_tokenizer=json.loads(pre) if isinstance(pre, str) else pre).pre_tokenizer


def normalizer_from_json(norm: str | dict[str, Any]) -> Any:
    return _stub(normalizer=json.loads(norm) if isinstance(norm, str) else norm).normalizer


# a probe of the character classes the known splits treat differently (to name a tokenizer.json split)
_PROBE = ("Hello, world! It's  I'LL don't\n\n\tdef f(x):\n    return x**2 ;;\n>;\n  ) a  b\r\n"
          "1234567 ٣٤٥ x² ½ naïve café — 日本語テキスト 中文，標點。 a日本 ｆｕｌｌ 한국어 🙂🚨 e\u0301 "
          "a\u00a0b\u3000c \x00\x00\x01 \v\f x ~y `z` @#$%^&*()[]{}<>|\\/'\"-_+=")


def pre_tokenizer_name(pre: dict[str, Any] | None) -> str | None:
    """The ``tokenizer.ggml.pre`` name of a ``tokenizer.json`` ``pre_tokenizer``, or None if it is none of
    :data:`PRE_TOKENIZERS`: the same JSON, or the same pieces on a probe text of the classes that matter."""
    if pre is None:
        return None
    for name, known in PRE_TOKENIZERS.items():
        if pre == known:
            return name
    try:
        pieces = pre_tokenizer_from_json(pre).pre_tokenize_str(_PROBE)
    except ValueError:
        return None
    for name, known in PRE_TOKENIZERS.items():
        if pre_tokenizer_from_json(known).pre_tokenize_str(_PROBE) == pieces:
            return name
    return None
