"""A request's n outputs at the edge: each one's text and log probabilities as its
tokens arrive, and its JSON in a whole response or in a stream's chunk, as vLLM's
OpenAI server shapes them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.gateway.logprobs import Logprobs
from services.gateway.text import TextStream
from services.gateway.tool_parser import ChoiceTools
from shared.messages import TokenChunk


@dataclass
class Choice:
    index: int
    text: TextStream
    logprobs: Logprobs | None = None
    finish: str | None = None  # its finish reason, once it has ended
    sent: int = 0  # tokens a stream has sent of it
    echoed: str | None = None  # completions' echo: the prompt's text, leading the output's (None: no echo)
    echo_sent: bool = False
    tools: ChoiceTools | None = None  # chat with tools: the text parsed into tool calls

    def echo(self, text: str, prompt: Sequence[int], positions: Sequence[Any]) -> None:
        """Completions' echo: the prompt's text (and logprobs) lead the choice's."""
        self.echoed = text
        if self.logprobs is not None:
            self.logprobs.echo(prompt, positions)

    def push(self, chunk: TokenChunk) -> str:
        """The chunk's tokens in; the text now safe to send out (the rest of it, when
        the chunk or a stop string ends the choice)."""
        before = len(self.text.token_ids)
        delta = self.text.push(chunk.token_ids)
        if self.logprobs is not None:  # those of the tokens the text took (none after a stop string)
            taken = len(self.text.token_ids) - before
            self.logprobs.push(chunk.token_ids[:taken], chunk.logprobs[:taken])
        finish = "stop" if self.text.stopped else chunk.finish_reason
        if finish is not None:
            delta += self.text.flush()
            self.finish = finish
        return delta

    def whole(self, kind: str, token_ids: bool) -> dict[str, Any]:
        """The choice in a whole response."""
        logprobs = None if self.logprobs is None else self.logprobs.new(kind)
        out: dict[str, Any] = {"index": self.index, "finish_reason": self.finish, "logprobs": logprobs}
        if kind == "chat" and self.tools is not None:
            out["message"], out["finish_reason"] = self.tools.message(self.text.text, self.text.token_ids, self.finish)
        elif kind == "chat":
            out["message"] = {"role": "assistant", "content": self.text.text}
        else:
            out["text"] = (self.echoed or "") + self.text.text
        if token_ids:
            out["token_ids"] = self.text.token_ids
        return out

    def delta(self, kind: str, text: str, token_ids: bool) -> dict[str, Any] | None:
        """The choice's part of a stream chunk since the last one (None: nothing to
        send: no text, no end, and no token a client asked to see)."""
        new = self.text.token_ids[self.sent :]
        logprobs = None if self.logprobs is None else self.logprobs.new(kind)
        self.sent = len(self.text.token_ids)
        if self.echoed is not None and not self.echo_sent:  # the first part leads with the prompt
            text, self.echo_sent = self.echoed + text, True
        message = self._message(text, new) if kind == "chat" else None
        if not ((message if kind == "chat" else text) or self.finish or token_ids or (logprobs is not None and new)):
            return None
        out: dict[str, Any] = {"index": self.index, "finish_reason": self.finish}
        if kind == "chat":
            out |= self._chat_part(message, logprobs)
        else:
            out["text"] = text
            out["logprobs"] = logprobs
        if token_ids:
            out["token_ids"] = new
        return out

    def _chat_part(self, message: dict[str, Any] | None, logprobs: Any) -> dict[str, Any]:
        part: dict[str, Any] = {"delta": message or {}}
        if self.tools is not None:
            part["finish_reason"] = self.tools.finish_reason(self.finish)
        if logprobs is not None:
            part["logprobs"] = logprobs
        return part

    def _message(self, text: str, new: Sequence[int]) -> dict[str, Any] | None:
        """A chat delta's message: the text, or what the tool parser makes of it."""
        if self.tools is None:
            return {"content": text} if text else None
        return self.tools.delta(text, new, self.finish)


def completion_tokens(choices: Sequence[Choice]) -> int:
    return sum(len(c.text.token_ids) for c in choices)


def role_chunk(index: int) -> dict[str, Any]:
    """A chat stream opens each choice with its role, as vLLM's server does."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
