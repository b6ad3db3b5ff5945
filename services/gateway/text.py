"""Tokens ↔ text at the edge: prompts through the model's own tokenizer and chat
template, and generated tokens back to text incrementally, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.gateway.errors import invalid
from services.gateway.stops import StopMatcher

# Tokens an undecodable tail (an incomplete UTF-8 sequence, skipped special tokens)
# may span before it is released as it is: a UTF-8 character is at most 4 bytes, and
# an unbounded window would make every later token re-decode all of it.
MAX_PENDING_TOKENS = 16
LENGTH_SLACK = 4


class Tokenizer:
    """The model's tokenizer, loaded once from its folder (never downloaded)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer  # heavy import, paid once at start

        self.hf: Any = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        # No token spans more characters than its longest vocabulary entry (byte-level
        # entries are one character a byte, so this bounds decoded text too).
        self.max_token_chars = max((len(t) for t in self.hf.get_vocab()), default=1)

    def too_long(self, text: str, max_tokens: int) -> int:
        """Whether `text` surely has more than `max_tokens` tokens, known without
        tokenizing it (so a many-MiB prompt costs no tokenizer time): the fewest
        tokens it can have, or 0 when it may fit. The slack covers normalizers that
        shorten text (NFKC composing a character with its accent)."""
        fewest = len(text) // (self.max_token_chars * LENGTH_SLACK)
        return fewest if fewest > max_tokens else 0

    def chat_text(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True, continue_final_message: bool = False,
    ) -> str:
        try:
            return self.hf.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False,
            )
        except Exception as e:  # jinja2's TemplateError, or the template's own raise_exception
            raise invalid(f"the chat template could not render these messages: {str(e)[:300]}", "messages") from e

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


class TextStream:
    """Turns a growing list of token ids into text deltas.

    Decodes only a window of recent tokens (as vLLM's incremental detokenizer does),
    holds back text that ends in an incomplete UTF-8 sequence, and holds back a tail
    that could still become a stop string, so no stop string ever reaches the client
    (unless `include_stop`: then the output ends with it, as vLLM's
    include_stop_str_in_output).
    """

    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str] = (), include_stop: bool = False, skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # decoded so far, not all of it sent yet
        self._sent = 0
        self._matcher = StopMatcher(self.stop)
        self._scanned = 0  # characters of _text the stop matcher has seen
        self.stopped = False

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text that is now safe to send."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset)
        stalled = len(self.token_ids) - self._read_offset > MAX_PENDING_TOKENS
        if stalled or (len(full) > len(prefix) and not full.endswith("\ufffd")):
            self._text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever is left, incomplete characters included."""
        if not self.stopped:
            rest = self._decode(self._prefix_offset)
            prefix = self._decode(self._prefix_offset, self._read_offset)
            self._text += rest[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self.token_ids)
        return self._release(final=True)

    @property
    def text(self) -> str:
        return self._text[: self._sent]

    def _release(self, final: bool) -> str:
        end = len(self._text)
        if self.stop and not self.stopped:
            match = self._matcher.feed(self._text[self._scanned :])
            self._scanned = len(self._text)
            if match is not None:
                end, self.stopped = match.start + (match.length if self.include_stop else 0), True
            elif not final:
                end -= self._matcher.pending()
        delta = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        if self.stopped:
            self._text = self._text[:end]
        return delta
