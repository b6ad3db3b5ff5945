"""Tokens ↔ text at the edge: prompts through the model's own tokenizer and chat
template, and generated tokens back to text incrementally, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Tokenizer:
    """The model's tokenizer, loaded once from its folder (never downloaded)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer  # heavy import, paid once at start

        self.hf: Any = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        # As vLLM's server does: render the template to text, then tokenize it without
        # adding special tokens again (the template already has them).
        text = self.hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return self.encode(text, add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=True)


class TextStream:
    """Turns a growing list of token ids into text deltas.

    Decodes only a window of recent tokens (as vLLM's incremental detokenizer does),
    holds back text that ends in an incomplete UTF-8 sequence, and holds back a tail
    that could still become a stop string, so no stop string ever reaches the client.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # decoded so far, not all of it sent yet
        self._sent = 0
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text that is now safe to send."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self.tokenizer.decode(self.token_ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever is left, incomplete characters included."""
        if not self.stopped:
            rest = self.tokenizer.decode(self.token_ids[self._prefix_offset :])
            prefix = self.tokenizer.decode(self.token_ids[self._prefix_offset : self._read_offset])
            self._text += rest[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self.token_ids)
        return self._release(final=True)

    @property
    def text(self) -> str:
        return self._text[: self._sent]

    def _release(self, final: bool) -> str:
        end = len(self._text)
        for s in self.stop:
            at = self._text.find(s, max(0, self._sent - len(s) + 1))
            if at != -1 and at < end:
                end, self.stopped = at, True
        if not self.stopped and not final and self.stop:
            end -= self._partial_stop_tail()
        delta = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        if self.stopped:
            self._text = self._text[:end]
        return delta

    def _partial_stop_tail(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return best
