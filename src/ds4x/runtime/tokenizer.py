"""Tokenizers: a checkpoint's ``tokenizer.json`` (via the ``tokenizers`` library) or the byte tokenizer.

Streaming: generated ids are turned into text by `TextStream`, which only emits text once it is
valid UTF-8, so a character split across tokens is never shown broken.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    bos_id: int | None
    eos_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """One token per byte after a few specials: 0 <bos>, 1 <eos>, 2 <pad>, then bytes 0..255 at 3..258."""

    OFFSET = 3
    vocab_size = 259

    def __init__(self) -> None:
        self.bos_id: int | None = 0
        self.eos_ids: tuple[int, ...] = (1,)

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.OFFSET + 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: str | Path, bos_id: int | None, eos_ids: tuple[int, ...]):
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for malformed files
            raise ValueError(f"cannot read tokenizer {path}: {exc}") from None
        self.bos_id, self.eos_ids = bos_id, eos_ids

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class TextStream:
    """Incremental detokenisation: feed ids, get the newly completed text.

    Only a window is held and decoded: the ids of the last piece shown (as context) and those not shown yet,
    so a push costs the same at the 10,000th token as at the first and the stream does not grow with the
    generation (it used to keep and re-decode every id: quadratic time). The shown part's text is cut off the
    front of the window's, so a decoder that treats the first token specially (SentencePiece's leading space)
    gives the same pieces as decoding everything at once.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []  # the window: ids[:read] were shown, ids[read:] are not yet
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        return self._emit(text)

    def flush(self) -> str:
        return self._emit(self.tok.decode(self.ids))

    def _emit(self, text: str) -> str:
        shown = self.tok.decode(self.ids[: self.read]) if self.read else ""
        new = text[len(shown) :]
        # the window now starts at the piece just shown: it stays the context of the next decode
        del self.ids[: self.read]
        self.read = len(self.ids)
        return new
