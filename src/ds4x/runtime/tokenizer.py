"""Tokenizers: a checkpoint's ``tokenizer.json`` (via the ``tokenizers`` library) or the byte tokenizer.

Streaming: generated ids are turned into text by `TextStream`, which only emits text once it is
valid UTF-8, so a character split across tokens is never shown broken. ``token_bytes`` gives one token's own
bytes (what logprobs report), which for a byte-level BPE token may be part of a character.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    bos_id: int | None
    eos_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes: ...


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte -> the byte."""
    keep = {*range(33, 127), *range(161, 173), *range(174, 256)}
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + n)] = b
            n += 1
    return out


BYTE_OF = _byte_level_alphabet()


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

    def token_bytes(self, token: int) -> bytes:
        """The token's byte; none for the specials (they decode to no text)."""
        return bytes([token - self.OFFSET]) if self.OFFSET <= token < self.OFFSET + 256 else b""


def checked_text(text: str, what: str) -> str:
    """``text`` if it is valid Unicode, else a ValueError naming ``what``.

    A lone surrogate is no character: non-UTF-8 bytes in argv (or stdin under a C / POSIX locale) reach Python as
    such (surrogateescape), and JSON can escape one (\\udc80). The tokenizers library raises a bare TypeError on
    it and the byte tokenizer a codec error, so callers check the text before either sees it.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid UTF-8 text (byte {exc.start} is not part of a character)") from None
    return text


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: str | Path, bos_id: int | None, eos_ids: tuple[int, ...]):
        from tokenizers import Tokenizer as _Tok
        from tokenizers import decoders as _decoders

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for malformed files
            raise ValueError(f"cannot read tokenizer {path}: {exc}") from None
        self.bos_id, self.eos_ids = bos_id, eos_ids
        self._byte_level = isinstance(self._tok.decoder, _decoders.ByteLevel)

    def encode(self, text: str) -> list[int]:
        # encode_batch gives the same ids and, unlike encode, lets other threads run meanwhile (it releases the
        # GIL): a server tokenizing a long prompt off its event loop keeps streaming the other requests
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 of the token's text; for a byte-level BPE token that is part of a character (its text
        decodes to U+FFFD) its own bytes, read from the byte alphabet."""
        text = self.decode([token])
        if "\ufffd" in text and self._byte_level:
            piece = self._tok.id_to_token(token) or ""
            if all(c in BYTE_OF for c in piece):  # an added token is not in the alphabet: keep its text
                return bytes(BYTE_OF[c] for c in piece)
        return text.encode("utf-8")


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
