"""The tokenizer stored in a ds4 GGUF (``tokenizer.ggml.tokens`` / ``merges``: byte-level BPE).

The pre-tokenizer split changes the tokens, so it must be the one the model was trained with. It is
chosen from the file's metadata, in this order:

- ``ds4x.tokenizer.pre_tokenizer``: the ``pre_tokenizer`` of the ``tokenizer.json`` that ``ds4x convert``
  read, stored verbatim (JSON) and run by the ``tokenizers`` library, so ids are exactly the source's;
- ``tokenizer.ggml.pre``: ``joyai-llm`` (what DeepSeek-V4 GGUFs declare) or ``deepseek-v3`` is DeepSeek-V3/V4's
  ``tokenizer.json`` split (three regex ``Split``s, then ``ByteLevel``), ``gpt-2`` the GPT-2 ``ByteLevel`` regex;
- ``ds4`` (the default of the constructor): antirez/ds4's hand-written split (:func:`ds4_split`), which
  equals DeepSeek-V4's regexes on ASCII text but not always elsewhere (a space before CJK, non-ASCII
  punctuation, digits and spaces, runs of control characters).

Every piece then goes through the ``tokenizers`` library's BPE model with the byte-level alphabet.
Special tokens are recognised in the text as ``tokenizer.json`` recognises its added tokens: the
tokens typed control / user-defined in ``tokenizer.ggml.token_type`` (without types: ds4's BOS, EOS,
User, Assistant, think, /think, DSML, as ds4 does for rendered chat prompts). Decoding follows ds4: a
token holding the fullwidth bar ``｜`` is literal text, any other maps its characters back to bytes.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from ds4x.runtime.tokenizer import BYTE_OF
from ds4x.weights.pretokenizers import PRE_TOKENIZERS, normalizer_from_json, pre_tokenizer_from_json

log = logging.getLogger(__name__)

SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<think>", "</think>", "｜DSML｜",
)
_BAR = "｜"  # U+FF5C: marks ds4's literal special tokens
_CONTROL, _USER_DEFINED = 3, 4  # gguf TokenType values of tokenizer.json's added tokens

DS4_PRE = "ds4"  # antirez/ds4's hand-written split (ds4_split)


# ---- ds4's pre-tokenizer split ------------------------------------------------------------------

_DIGIT = frozenset(b"0123456789")
_ALPHA = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_SPACE = frozenset(b" \t\n\r\v\f")
_NEWLINE = frozenset(b"\n\r")
_PUNCT = frozenset([*range(0x21, 0x30), *range(0x3A, 0x41), *range(0x5B, 0x61), *range(0x7B, 0x7F)])


def _char_len(c: int) -> int:
    if c < 0x80:
        return 1
    if c & 0xE0 == 0xC0:
        return 2
    if c & 0xF0 == 0xE0:
        return 3
    if c & 0xF8 == 0xF0:
        return 4
    return 1


def ds4_split(text: str) -> list[str]:
    """Pre-tokenize like ds4 (``bpe_tokenize_text``): digits in runs of at most 3; CJK / kana runs;
    a punctuation byte glued to the ASCII letters after it; letter runs (every non-ASCII character
    counts as a letter) with at most one leading non-letter; a space glued to the punctuation run
    after it; punctuation runs with their trailing newlines; whitespace up to the last newline, or
    all but one space before a word; anything else one character at a time."""
    b = text.encode("utf-8")
    n = len(b)

    def nxt(p: int) -> int:
        k = _char_len(b[p])
        return p + (k if p + k <= n else 1)

    def letter(p: int) -> bool:
        c = b[p]
        return c in _ALPHA if c < 0x80 else True

    def cjk(p: int) -> bool:
        c = b[p]
        if c < 0x80:
            return False
        k = _char_len(c)
        if p + k > n:
            k = 1
        if k == 1:
            cp = c
        elif k == 2:
            cp = (c & 0x1F) << 6 | (b[p + 1] & 0x3F)
        elif k == 3:
            cp = (c & 0x0F) << 12 | (b[p + 1] & 0x3F) << 6 | (b[p + 2] & 0x3F)
        else:
            cp = (c & 0x07) << 18 | (b[p + 1] & 0x3F) << 12 | (b[p + 2] & 0x3F) << 6 | (b[p + 3] & 0x3F)
        return 0x4E00 <= cp <= 0x9FA5 or 0x3040 <= cp <= 0x30FF

    def letters(p: int) -> int:
        while p < n and letter(p):
            p = nxt(p)
        return p

    out: list[str] = []
    pos = 0
    while pos < n:
        start, c = pos, b[pos]
        if c in _DIGIT:
            while pos < n and b[pos] in _DIGIT and pos - start < 3:
                pos += 1
        elif cjk(pos):
            pos = nxt(pos)
            while pos < n and cjk(pos):
                pos = nxt(pos)
        elif c in _PUNCT and pos + 1 < n and b[pos + 1] in _ALPHA:
            pos += 1
            while pos < n and b[pos] in _ALPHA:
                pos += 1
        elif letter(pos):
            pos = letters(pos)
        elif c not in _NEWLINE and c not in _PUNCT and pos + 1 < n and letter(pos + 1):
            pos = letters(pos + 1)
        elif c == 0x20 and pos + 1 < n and b[pos + 1] in _PUNCT:
            pos += 1
            while pos < n and b[pos] in _PUNCT:
                pos += 1
            while pos < n and b[pos] in _NEWLINE:
                pos += 1
        elif c in _PUNCT:
            while pos < n and b[pos] in _PUNCT:
                pos += 1
            while pos < n and b[pos] in _NEWLINE:
                pos += 1
        elif c in _SPACE:
            p, last_nl = pos, 0
            while p < n and b[p] in _SPACE:
                p += 1
                if b[p - 1] in _NEWLINE:
                    last_nl = p
            if last_nl:
                pos = last_nl
            elif p < n and p > pos + 1 and (letter(p) or b[p] in _PUNCT):
                pos = p - 1  # one space joins the word or punctuation after it
            else:
                pos = p
        else:
            pos = nxt(pos)
        if pos == start:
            pos = nxt(pos)
        out.append(b[start:pos].decode("utf-8", errors="surrogateescape"))
    return out


# ---- tokenizer ---------------------------------------------------------------------------------

class GGUFTokenizer:
    """Byte-level BPE from GGUF token and merge lists (interface of runtime.tokenizer.Tokenizer).

    ``pre`` names the split (:data:`PRE_TOKENIZERS` or ``"ds4"``, antirez/ds4's); ``pre_tokenizer`` (a
    ``tokenizer.json`` ``pre_tokenizer``, dict or JSON text) overrides it. ``normalizer`` likewise, and
    ``ignore_merges`` is the BPE model's flag. With ``token_types`` (gguf TokenType per token) the special
    tokens are those typed control or user-defined, else ds4's :data:`SPECIAL_TOKENS`.
    """

    def __init__(self, tokens: list[str], merges: list[str], bos_id: int | None = None,
                 eos_ids: tuple[int, ...] | None = None, *, pre: str = DS4_PRE,
                 pre_tokenizer: str | dict[str, Any] | None = None, normalizer: str | dict[str, Any] | None = None,
                 ignore_merges: bool = False, token_types: list[int] | None = None):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        if not tokens:
            raise ValueError("GGUF tokenizer: 'tokenizer.ggml.tokens' is empty")
        self.tokens = list(tokens)
        vocab: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            vocab.setdefault(t, i)  # duplicates: ds4's table keeps the first
        pairs = []
        dropped = 0
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep or a + b not in vocab or a not in vocab or b not in vocab:
                dropped += 1  # ds4 would never produce such a symbol either
                continue
            pairs.append((a, b))
        if dropped:
            log.warning("GGUF tokenizer: ignored %d merges whose parts or result are not in the vocabulary", dropped)
        model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=ignore_merges)
        tok = Tokenizer(model)
        if pre_tokenizer is not None:
            self.pre = "tokenizer.json"
            tok.pre_tokenizer = pre_tokenizer_from_json(pre_tokenizer)
        elif pre == DS4_PRE:
            self.pre = pre
            # pieces are already split (ds4_split); ByteLevel only maps bytes to its alphabet
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        elif pre in PRE_TOKENIZERS:
            self.pre = pre
            tok.pre_tokenizer = pre_tokenizer_from_json(PRE_TOKENIZERS[pre])
        else:
            raise ValueError(f"GGUF tokenizer: unknown pre-tokenizer 'tokenizer.ggml.pre' = {pre!r} (known: "
                             f"{', '.join(PRE_TOKENIZERS)}; ds4x convert stores others as "
                             f"'ds4x.tokenizer.pre_tokenizer')")
        if normalizer is not None:
            tok.normalizer = normalizer_from_json(normalizer)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        self._vocab = vocab
        if token_types is not None:
            self.specials = {t: i for i, t in enumerate(self.tokens)
                             if i < len(token_types) and token_types[i] in (_CONTROL, _USER_DEFINED) and t}
        else:
            self.specials = {s: vocab[s] for s in SPECIAL_TOKENS if s in vocab}
        # leftmost, then longest, as tokenizer.json matches its added tokens
        self._special_re = (re.compile("|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True)))
                            if self.specials else None)
        self._bytes = [self._token_bytes(t) for t in self.tokens]
        self.bos_id: int | None = bos_id if bos_id is not None else vocab.get(SPECIAL_TOKENS[0])
        if eos_ids is None:
            eos = vocab.get(SPECIAL_TOKENS[1])
            eos_ids = () if eos is None else (eos,)
        self.eos_ids: tuple[int, ...] = tuple(eos_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @staticmethod
    def _token_bytes(t: str) -> bytes:
        if _BAR in t:
            return t.encode("utf-8")
        return bytes(BYTE_OF[ch] for ch in t if ch in BYTE_OF)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> GGUFTokenizer:
        """From the metadata dict of :func:`ds4x.weights.gguf.load_gguf`."""
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = meta.get("tokenizer.ggml.merges")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ValueError("GGUF metadata key 'tokenizer.ggml.tokens' is missing or not a string array")
        if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
            raise ValueError("GGUF metadata key 'tokenizer.ggml.merges' is missing or not a string array")
        model = meta.get("tokenizer.ggml.model", "gpt2")
        if model != "gpt2":
            raise ValueError(f"GGUF metadata key 'tokenizer.ggml.model' is {model!r}; only byte-level BPE ('gpt2') "
                             f"is supported")
        pre_json = meta.get("ds4x.tokenizer.pre_tokenizer")
        pre = meta.get("tokenizer.ggml.pre")
        if pre is not None and not isinstance(pre, str):
            raise ValueError(f"GGUF metadata key 'tokenizer.ggml.pre' must be a string, got {pre!r:.80}")
        if pre_json is None and pre is None:
            log.warning("GGUF tokenizer: no 'tokenizer.ggml.pre'; splitting text as DeepSeek-V4 does (joyai-llm)")
        elif pre_json is None and pre not in PRE_TOKENIZERS and pre != DS4_PRE:
            # ds4 never reads this key, and writers put generic names here ("default" where llama.cpp does not
            # know the tokenizer): the file still loads, split as a DeepSeek-V4 GGUF is
            log.warning("GGUF tokenizer: unknown 'tokenizer.ggml.pre' = %r; splitting text as DeepSeek-V4 does "
                        "(joyai-llm)", pre)
            pre = None
        types = meta.get("tokenizer.ggml.token_type")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(tokens, merges, bos if isinstance(bos, int) else None,
                   (eos,) if isinstance(eos, int) else None, pre="joyai-llm" if pre is None else str(pre),
                   pre_tokenizer=pre_json, normalizer=meta.get("ds4x.tokenizer.normalizer"),
                   ignore_merges=bool(meta.get("ds4x.tokenizer.ignore_merges", False)),
                   token_types=types if isinstance(types, list) and len(types) == len(tokens) else None)

    @classmethod
    def from_gguf(cls, path: str | Path) -> GGUFTokenizer:
        from ds4x.weights.gguf import open_gguf, read_metadata

        return cls.from_metadata(read_metadata(open_gguf(path)))

    # ---- encode / decode ----------------------------------------------------------------------
    def encode_plain(self, text: str) -> list[int]:
        """BPE of ``text`` with no special-token recognition (ds4's ``bpe_tokenize_text`` for the ds4 split)."""
        if not text:
            return []
        if self.pre == DS4_PRE:
            return self._tok.encode(ds4_split(text), is_pretokenized=True, add_special_tokens=False).ids
        text.encode("utf-8")  # a lone surrogate is a UnicodeEncodeError here, as in ds4_split
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        """Special tokens in ``text`` become their ids; the spans between are BPE-encoded."""
        if self._special_re is None:
            return self.encode_plain(text)
        ids: list[int] = []
        span = 0
        for m in self._special_re.finditer(text):
            ids += self.encode_plain(text[span:m.start()])
            ids.append(self.specials[m.group()])
            span = m.end()
        ids += self.encode_plain(text[span:])
        return ids

    def token_bytes(self, token: int) -> bytes:
        return self._bytes[token] if 0 <= token < len(self._bytes) else b""

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
