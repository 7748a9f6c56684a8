"""A multi-turn chat held in one session (what ``ds4x chat`` runs).

Every turn renders the whole conversation (:func:`ds4x.runtime.chat.chat_text`), keeps the longest prefix of
those ids the session already holds and evaluates only the rest, so a turn costs its new tokens, not the history.
Where the rendering of a past turn differs from what was generated (a reply's text re-tokenized differently, the
reasoning a thinking-mode turn drops once a newer user message follows), the session rewinds to the first
difference, which is what the template asks for.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ds4x.runtime.chat import EOS, chat_text, split_reasoning, uses_chat_encoding
from ds4x.runtime.engine import GenerationStats, Session
from ds4x.runtime.sampling import SamplingParams


class Conversation:
    """Messages (OpenAI form) and the session that holds them; :meth:`reply` adds a user turn and streams the
    assistant's tokens."""

    def __init__(self, session: Session, system: str | None = None, thinking: bool = False):
        tok = session.engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a model with a tokenizer")
        self.session, self.thinking = session, thinking
        self.templated = uses_chat_encoding(tok)
        self.system = system
        self.messages: list[dict[str, Any]] = []
        self.reused = 0  # prompt tokens the last turn found already in the session
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self) -> list[int]:
        """The ids of the conversation so far, ending with the generation prompt (untemplated: a new line, so
        that the reply is the next line, as the rendering of a past turn has it)."""
        tok = self.session.engine.tokenizer
        assert tok is not None
        if self.templated:
            return tok.encode(chat_text(self.messages, self.thinking, True))
        ids = tok.encode(chat_text(self.messages, self.thinking, False) + "\n")
        return ids if tok.bos_id is None else [tok.bos_id, *ids]

    def reply(self, text: str, max_new: int, params: SamplingParams | None = None,
              stats: GenerationStats | None = None) -> Iterator[int]:
        """Add the user message ``text`` and yield the reply's token ids (EOS included when it ends one) until
        EOS, ``max_new`` tokens or the context's end. The reply joins the conversation as it stands when the
        iteration stops, so an interrupted reply is kept up to where it got."""
        self.messages.append({"role": "user", "content": text})
        ids = self.prompt_ids()
        session = self.session
        if len(ids) >= session.ctx:
            self.messages.pop()
            raise ValueError(f"the conversation ({len(ids)} tokens) no longer fits the context of {session.ctx} "
                             f"tokens; start a new one")
        held = session.tokens
        keep = 0
        for a, b in zip(held, ids, strict=False):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # at least one token to evaluate: the next logits come from it
        if keep < len(held):
            session.rewind(keep)
        self.reused = keep
        generated: list[int] = []
        # the last sampled token is never evaluated, so a full context takes ctx - len(ids) + 1 of them, as in
        # ds4x generate (and the stop says "context", not "length"); a next turn then needs /reset either way
        try:
            for token, _ in session.generate(ids[keep:], min(max_new, session.ctx - len(ids) + 1), params,
                                             stats=stats):
                generated.append(token)
                yield token
        finally:
            self.messages.append(self._assistant_message(generated))

    def _assistant_message(self, generated: list[int]) -> dict[str, Any]:
        tok = self.session.engine.tokenizer
        assert tok is not None
        text = tok.decode([t for t in generated if t not in self.session.engine.cfg.eos_token_ids])
        text = text.removesuffix(EOS)
        if self.templated and self.thinking:  # the generation prompt opened <think>: reasoning, </think>, reply
            reasoning, answer = split_reasoning(text)
            return {"role": "assistant", "content": answer, "reasoning_content": reasoning}
        return {"role": "assistant", "content": text}
