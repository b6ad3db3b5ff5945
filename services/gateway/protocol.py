"""The OpenAI wire format: request bodies parsed into typed requests (with the
errors OpenAI clients expect), and response bodies built from results."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class ApiError(Exception):
    """An error answered to the client as an OpenAI-style body."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class Options:
    """What a chat or completion request asks of generation, validated."""

    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict[str, str], ...]
    options: Options


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | tuple[int, ...]
    options: Options


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise invalid(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    return body


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    return ChatRequest(tuple(_message(m, i) for i, m in enumerate(messages)), _options(body, "max_completion_tokens"))


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("'prompt' must not be empty", "prompt")
        parsed: str | tuple[int, ...] = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        parsed = tuple(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("batched prompts are not supported; send one prompt per request", "prompt")
    else:
        raise invalid("'prompt' must be a non-empty string or a list of token ids", "prompt")
    if body.get("echo"):
        raise invalid("'echo' is not supported", "echo")
    return CompletionRequest(parsed, _options(body, None))


ROLES = ("system", "developer", "user", "assistant", "tool")


def _message(m: Any, i: int) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(f"{param} must be an object", param)
    role = m.get("role")
    if role not in ROLES:
        raise invalid(f"{param}.role must be one of {', '.join(ROLES)}", f"{param}.role")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is meaningful to this model
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{param}.content: only text parts are supported", f"{param}.content")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise invalid(f"{param}.content must be a string or a list of text parts", f"{param}.content")
    return {"role": role, "content": content}


def _options(body: dict[str, Any], max_tokens_alias: str | None) -> Options:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required", "model")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise invalid("only n=1 is supported", "n")
    if body.get("best_of") not in (None, 1):
        raise invalid("best_of is not supported", "best_of")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise invalid("logprobs are not supported", "logprobs")
    max_tokens = body.get("max_tokens")
    if max_tokens is None and max_tokens_alias:
        max_tokens = body.get(max_tokens_alias)
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens <= 0):
        raise invalid("'max_tokens' must be a positive integer", "max_tokens")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise invalid("'stream_options' must be an object", "stream_options")
    return Options(
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=_integer(body, "top_k", 0, -1),
        seed=_integer(body, "seed", None, None),
        stop=_stop(body.get("stop")),
        ignore_eos=bool(body.get("ignore_eos", False)),
        stream=bool(body.get("stream", False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        return_token_ids=bool(body.get("return_token_ids", False)),
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise invalid(f"'{name}' must be a number in [{lo:g}, {hi:g}]", name)
    return float(v)


def _integer(body: dict[str, Any], name: str, default: int | None, lo: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or (lo is not None and v < lo):
        raise invalid(f"'{name}' must be an integer" + (f" >= {lo}" if lo is not None else ""), name)
    return v if v != -1 or name != "top_k" else 0


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or len(v) > 4 or not all(isinstance(s, str) and s for s in v):
        raise invalid("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    return tuple(v)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
