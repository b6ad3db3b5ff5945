"""Tokens ↔ text at the edge: prompts through the model's own tokenizer and chat
template, and generated tokens back to text incrementally, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

from services.gateway.errors import invalid
from services.gateway.stops import StopMatcher

# Tokens an undecodable tail (bytes that are no UTF-8 character yet) may span before
# it is released as it is. vLLM's detokenizer waits without bound, re-decoding the
# whole tail at every token: quadratic in a stuck output's length, which a client
# could force with allowed_token_ids. Past this many, the text differs from vLLM's
# (it would hold the tail to the end and drop it).
MAX_PENDING_TOKENS = 256
INVALID_PREFIX = "Invalid prefix encountered"  # tokenizers' DecodeStream error vLLM recovers from
LENGTH_SLACK = 4


class Tokenizer:
    """The model's tokenizer, loaded once from its folder (never downloaded)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer  # heavy import, paid once at start

        self.hf: Any = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        if not self.hf.is_fast:
            raise ValueError(f"{model_dir}: the tokenizer has no fast (tokenizers) version, which the gateway decodes "
                             "with as vLLM does; add its tokenizer.json")
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
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The messages (and tools) through the model's chat template, as vLLM's
        server renders them."""
        try:
            return self.hf.apply_chat_template(
                template_messages(messages), tools=tools or None, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False,
            )
        except Exception as e:  # jinja2's TemplateError, or the template's own raise_exception
            raise invalid(f"the chat template could not render these messages: {str(e)[:300]}", "messages") from e

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a chat template takes them: earlier tool calls' JSON arguments
    turned into objects by vLLM's own step (templates index into them)."""
    if not any("tool_calls" in m for m in messages):
        return list(messages)
    from vllm.renderers.chat_utils import _postprocess_messages

    out = [{**m, "tool_calls": [{**c, "function": dict(c["function"])} for c in m["tool_calls"]]}
           if "tool_calls" in m else dict(m) for m in messages]
    _postprocess_messages(out)  # type: ignore[arg-type]
    return out


class TextStream:
    """Turns a growing list of token ids into text deltas, as vLLM's detokenizer does.

    Decodes with the tokenizers library's DecodeStream primed with the prompt (vLLM's
    FastIncrementalDetokenizer): text that ends in an incomplete UTF-8 sequence is
    held until it completes, and dropped if the output ends first. A tail that could
    still become a stop string is held back too, so no stop string ever reaches the
    client (unless `include_stop`: then the output ends with it, as vLLM's
    include_stop_str_in_output).
    """

    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str] = (), include_stop: bool = False, skip_special_tokens: bool = True,
        prompt: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizer.hf._tokenizer  # the Rust tokenizer each step decodes with
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._stream = DecodeStream(ids=list(prompt), skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # tokens the stream holds: no whole character yet
        self._text = ""  # decoded so far, not all of it sent yet
        self._sent = 0
        self._matcher = StopMatcher(self.stop)
        self._scanned = 0  # characters of _text the stop matcher has seen
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (vLLM's stop_reason)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text that is now safe to send."""
        if self.stopped:
            return ""
        for token_id in token_ids:
            self.token_ids.append(token_id)
            self._text += self._step(token_id)
        return self._release(final=False)

    def _step(self, token_id: int) -> str:
        piece = self._protected_step(token_id)
        if piece is not None:
            self._pending.clear()
            return piece
        self._pending.append(token_id)
        if len(self._pending) <= MAX_PENDING_TOKENS:
            return ""
        stuck = self.tokenizer.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
        self._pending.clear()
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        return stuck

    def _protected_step(self, token_id: int) -> str | None:
        """One token through the stream decoder, recovering as vLLM's detokenizer does:
        a token id it cannot decode gives nothing, and a decoder whose prefix no longer
        decodes the same (non-monotonic UTF-8 output) starts afresh."""
        try:
            return self._stream.step(self._backend, token_id)
        except (OverflowError, TypeError):
            return None
        except Exception as e:  # tokenizers raises a plain Exception for this one
            if not str(e).startswith(INVALID_PREFIX):
                raise
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self._stream.step(self._backend, token_id)

    def flush(self) -> str:
        """At the end of generation: the text held back for stop strings (bytes that
        never became a character are dropped, as vLLM drops them)."""
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
                self.matched = self._text[match.start : match.start + match.length]
            elif not final:
                end -= self._matcher.pending()
        delta = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        if self.stopped:
            self._text = self._text[:end]
        return delta
