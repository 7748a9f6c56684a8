"""Text from the command line or stdin, checked before a tokenizer sees it."""

from __future__ import annotations


def checked_text(text: str, what: str) -> str:
    """``text`` if it is valid Unicode, else a ValueError naming ``what``.

    Bytes that are not UTF-8 in argv (or in stdin under a C / POSIX locale) reach Python as lone surrogates
    (surrogateescape): the tokenizers library raises a bare TypeError on them and the byte tokenizer a codec error,
    so they are refused here with a message instead (as ``ds4x serve`` does for JSON's escaped surrogates).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid UTF-8 text (byte {exc.start} is not part of a character)") from None
    return text
