"""Anthropic's Messages API as a translation onto the one chat pipeline, as vLLM's
server does it (vllm/entrypoints/anthropic/serving.py): a Messages body becomes a
chat body, checked by chat's own rules; a chat result becomes a message; chat's
stream deltas become Anthropic's stream events. Pure: no I/O, no clock."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from services.gateway.errors import ApiError, invalid
from services.gateway.fields import MAX_MESSAGES

ROLES = ("user", "assistant", "system")
CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # tool_choice.type -> chat's ("tool": named)
# vLLM's fields beside Anthropic's: handed to chat, which takes or refuses them as it does its own.
VLLM_FIELDS = ("cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "chat_template_kwargs",
               "watermarking")
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request hash: dropped, or no prefix would ever match
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}
SKIPPED_BLOCKS = ("redacted_thinking", "tool_reference")  # opaque, or expanded elsewhere: accepted, not rendered


# The Messages API's fields, as /openapi.json and the API reference show them; a field
# not here is ignored, as vLLM's server ignores it. What becomes chat's is checked as chat's.
_BLOCKS = {"type": "array", "items": {"type": "object", "required": ["type"]}}
FIELDS: dict[str, dict[str, Any]] = {
    "model": {"type": "string"},
    "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": {
        "type": "object", "required": ["role", "content"], "properties": {
            "role": {"enum": list(ROLES)}, "content": {"oneOf": [{"type": "string"}, _BLOCKS]}}},
        "description": "text, tool_use, tool_result and thinking blocks"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "system": {"oneOf": [{"type": "string"}, _BLOCKS], "description": "text blocks, joined"},
    "stop_sequences": {"type": "array", "items": {"type": "string"}, "description": "chat's stop"},
    "stream": {"type": "boolean"},
    "temperature": {"type": "number"}, "top_p": {"type": "number"}, "top_k": {"type": "integer"},
    "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"]},
              "description": "as chat's functions"},
    "tool_choice": {"type": "object", "description": "auto, any (chat's required), tool (named), none"},
    "output_config": {"type": "object", "description": "format: a JSON schema, as chat's response_format"},
    "thinking": {"type": "object", "description": "only {type: disabled}: no reasoning parser runs"},
    "metadata": {"type": "object", "description": "accepted, unused"},
    "cache_salt": {"type": "string", "description": "vLLM's: splits the caller's tenant's cache"},
}


def error_body(e: ApiError) -> bytes:
    """An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""
    kind = ERROR_TYPES.get(e.status, "api_error")
    message = e.message.encode("utf-8", "replace").decode("utf-8")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


class Renders(Protocol):
    def chat_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...


def system_first(tokenizer: Renders) -> bool:
    """Whether the model's chat template takes a system prompt only first (it refuses
    a later one, as Qwen's do): then Messages' inline system prompts join the first,
    decided as vLLM decides it, by rendering the same probe."""
    probe = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
    try:
        tokenizer.chat_text(probe, add_generation_prompt=False)
    except Exception:  # the template's own refusal, whatever its type
        return True
    return False


# --- requests -----------------------------------------------------------------
def chat_body(body: dict[str, Any], merge_system: bool, count_only: bool = False) -> dict[str, Any]:
    """A Messages (or count_tokens) body as the chat body vLLM's server makes of it.
    Anthropic's own fields are checked here; what becomes chat's is checked as chat's."""
    _required(body, ("model", "messages") if count_only else ("model", "messages", "max_tokens"))
    chat: dict[str, Any] = {"model": body["model"], "messages": _messages(body, merge_system)}
    _thinking(body.get("thinking"))
    _output_config(body.get("output_config"), chat)
    _tools(body, chat)
    chat |= {name: body[name] for name in VLLM_FIELDS if body.get(name) is not None}
    return chat if count_only else chat | _sampling(body)


def _messages(body: dict[str, Any], merge_system: bool) -> list[dict[str, Any]]:
    """The system prompt, then each message as the chat messages it becomes."""
    system, messages = _system(body.get("system")), _list(body, "messages", 1, MAX_MESSAGES)
    if merge_system:  # a template that wants the system prompt first: inline ones join it
        system += "".join(t for m in messages if isinstance(m, dict) and m.get("role") == "system"
                          for t in [_system_text(m.get("content"))] if t)
    out = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(messages):
        out += _message(m, i, merge_system)
    return out


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    if not _is_int(body["max_tokens"]) or body["max_tokens"] <= 0:
        raise invalid("max_tokens must be a positive integer", "max_tokens")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise invalid("stream must be a boolean", "stream")
    out = {"max_tokens": body["max_tokens"], "stop": body.get("stop_sequences"), "temperature": body.get("temperature"),
           "top_p": body.get("top_p"), "top_k": body.get("top_k")}
    return out | ({"stream": body["stream"]} if body.get("stream") is not None else {})


def _required(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if body.get(name) is None:
            raise invalid(f"{name}: field required", name)
    if not isinstance(body["model"], str) or not body["model"]:
        raise invalid("model: a model name is required", "model")


def _list(body: dict[str, Any], name: str, least: int, most: int) -> list[Any]:
    v = body.get(name)
    if not isinstance(v, list) or not least <= len(v) <= most:
        raise invalid(f"{name}: must be a list of {least} to {most} items", name)
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _system(system: Any) -> str:
    """The top-level system prompt: a string, or its text blocks joined."""
    if system is None:
        return ""
    text = _system_text(system)
    if text is None and not isinstance(system, (str, list)):
        raise invalid("system: must be a string or a list of text blocks", "system")
    return text or ""


def _system_text(content: Any) -> str | None:
    """A system prompt's text, Claude Code's billing header dropped (None: nothing)."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    if not isinstance(content, list):
        return None
    parts = [_block(b, "system").get("text") or "" for b in content]
    return "".join(p for p in parts if p and not p.startswith(BILLING_HEADER)) or None


def _block(b: Any, param: str) -> dict[str, Any]:
    """A content block, its fields' types checked."""
    if not isinstance(b, dict) or not isinstance(b.get("type"), str):
        raise invalid(f"{param}: each content block must be an object with a 'type'", param)
    kind = b["type"]
    checks: dict[str, tuple[tuple[str, type | tuple[type, ...]], ...]] = {
        "text": (("text", str),), "thinking": (("thinking", str),),
        "tool_use": (("id", str), ("name", str), ("input", dict)),
        "tool_result": (("tool_use_id", str),),
    }
    if kind not in checks and kind not in SKIPPED_BLOCKS:
        what = ("images are not supported by this text-only model" if kind == "image"
                else f"unsupported block type '{kind[:64]}'")
        raise invalid(f"{param}: {what}", param)
    for name, kinds in checks.get(kind, ()):
        if not isinstance(b.get(name), kinds):
            raise invalid(f"{param}: a {kind} block needs '{name}'", param)
    if kind == "tool_result" and not isinstance(b.get("content", ""), (str, list)):
        raise invalid(f"{param}: a tool_result's content must be a string or a list of blocks", param)
    return b


def _message(m: Any, i: int, merge_system: bool) -> list[dict[str, Any]]:
    """One Anthropic message as the chat messages it becomes (a user's tool results
    become tool messages; a system message joins the first one when merged)."""
    param = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise invalid(f"{param}: role must be one of {', '.join(ROLES)}", param)
    role, content = m["role"], m.get("content")
    if role == "system":
        text = None if merge_system else _system_text(content)
        return [{"role": "system", "content": text}] if text else []
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{param}: content must be a string or a list of content blocks", param)
    return _blocks(role, [_block(b, f"{param}.content") for b in content])


def _blocks(role: str, blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: dict[str, Any] = {"role": role}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    results: list[dict[str, Any]] = []
    for b in blocks:
        kind = b["type"]
        if kind == "text" and b["text"]:
            texts.append(b["text"])
        elif kind == "thinking":
            reasoning.append(b["thinking"])
        elif kind == "tool_use":
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"])}})  # vLLM's spacing
        elif kind == "tool_result":
            _tool_result(b, role, texts, results)
    if reasoning:
        out["reasoning"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    if texts:
        out["content"] = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
    keep = not (role == "user" and "content" not in out)  # a user turn of tool results alone is only those
    return results + [out] if keep else results


def _tool_result(b: dict[str, Any], role: str, texts: list[str], results: list[dict[str, Any]]) -> None:
    """A user's tool result is a tool message; an assistant's, text (vLLM's rule)."""
    if role == "user":
        results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": _result_text(b.get("content"))})
    else:
        texts.append(f"Tool result: {b.get('content') or ''}")  # vLLM writes Python's str of it


def _result_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return content or ""


def _thinking(thinking: Any) -> None:
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise invalid("thinking: type must be one of enabled, disabled, adaptive", "thinking")
    if thinking["type"] != "disabled":
        raise invalid("thinking: this server runs no reasoning parser; only {'type': 'disabled'} is supported",
                      "thinking")


def _output_config(config: Any, chat: dict[str, Any]) -> None:
    """output_config.format's JSON schema as chat's response_format, as vLLM maps it."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise invalid("output_config: must be an object", "output_config")
    if config.get("effort") is not None:
        raise invalid("output_config.effort: this server runs no reasoning parser", "output_config")
    fmt = config.get("format")
    if fmt is None:
        return
    if not (isinstance(fmt, dict) and fmt.get("type", "json_schema") == "json_schema"
            and isinstance(fmt.get("schema"), dict)):
        raise invalid("output_config.format: must be {'type': 'json_schema', 'schema': {...}}", "output_config")
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": fmt["schema"]}}


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """tools as chat's functions; tool_choice as chat's (auto once tools are given)."""
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in (*CHOICES, "tool"):
            raise invalid("tool_choice: type must be one of auto, any, tool, none", "tool_choice")
        if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
            raise invalid("tool_choice.name is required when type is 'tool'", "tool_choice")
        chat["tool_choice"] = CHOICES.get(choice["type"]) or {"type": "function", "function": {"name": choice["name"]}}
        chat["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use")
    if body.get("tools") is None:
        return
    chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(_list(body, "tools", 0, 1 << 10))]
    chat.setdefault("tool_choice", "auto")


def _tool(t: Any, param: str) -> dict[str, Any]:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
        raise invalid(f"{param}: a tool needs a 'name' and an 'input_schema' object", param)
    schema = {"type": "object", **t["input_schema"]}  # vLLM's default type
    function = {"name": t["name"], "description": t.get("description"), "parameters": schema}
    if t.get("strict") is not None:
        function["strict"] = t["strict"]
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


# --- responses ------------------------------------------------------------------
def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's usage: input_tokens are those not read from the cache."""
    return {"input_tokens": max(0, prompt_tokens - cached_tokens), "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens}


def stop_reason(finish: str | None, stop_sequence: str | None, tool_used: bool,
                tool_complete: bool) -> tuple[str | None, str | None]:
    """A chat finish reason as Anthropic's (stop_reason, stop_sequence), by vLLM's rules:
    max_tokens always wins; a stop string wins unless the tool calls are complete."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if stop_sequence is not None:
        return "stop_sequence", stop_sequence
    return ("tool_use" if finish == "tool_calls" or tool_used else "end_turn"), None


def message(chat: dict[str, Any], message_id: str, stop_sequence: str | None, usage_: dict[str, int]) -> dict[str, Any]:
    """A whole chat completion (one choice) as an Anthropic message."""
    choice = chat["choices"][0]
    said, calls = choice["message"], choice["message"].get("tool_calls") or []
    reason, sequence = stop_reason(choice["finish_reason"], stop_sequence, bool(calls), bool(calls))
    content: list[dict[str, Any]] = [{"type": "text", "text": said["content"]}] if said.get("content") else []
    content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": orjson.loads(c["function"]["arguments"])} for c in calls]
    out = {"id": message_id, "type": "message", "role": "assistant",
           "content": content or [{"type": "text", "text": ""}], "model": chat["model"], "stop_reason": reason, "stop_sequence": sequence, "usage": usage_}
    return {k: v for k, v in out.items() if v is not None}  # as vLLM's exclude_none


def sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


@dataclass
class Events:
    """Chat stream deltas in, Anthropic stream events out (each as SSE bytes), with
    vLLM's block rules: a text or tool_use block opens on its first delta and closes
    when another begins; text arriving inside a tool call is held and sent as a text
    block after it."""

    message_id: str
    model: str
    usage: dict[str, int]  # message_start's
    index: int = 0  # the next block's
    block: str | None = None  # the open block's type
    tool_id: str | None = None  # the open tool_use block's call id
    held: list[str] = field(default_factory=list)
    tool_ids: dict[int, str] = field(default_factory=dict)  # chat's call index -> its id
    tool_used: bool = False
    last_args: list[str] = field(default_factory=list)  # the latest call's arguments, to tell it complete

    def start(self) -> bytes:
        message = {"id": self.message_id, "type": "message", "role": "assistant", "content": [], "model": self.model,
                   "stop_reason": None, "stop_sequence": None, "usage": self.usage}
        return sse("message_start", {"type": "message_start", "message": message})

    def failed(self, e: ApiError) -> bytes:
        return error_event(e)

    def delta(self, delta: dict[str, Any]) -> bytes:
        """One chat delta (`{"content": ...}` or `{"tool_calls": [...]}`) as events."""
        out = b""
        if delta.get("content"):
            out += self._text(delta["content"])
        for call in delta.get("tool_calls") or ():
            out += self._call(call)
        return out

    def end(self, finish: str | None, stop_sequence: str | None, usage_: dict[str, int]) -> bytes:
        complete = self.tool_used and _is_json("".join(self.last_args))
        reason, sequence = stop_reason(finish or "stop", stop_sequence, self.tool_used, complete)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage_}
        return self._flush() + sse("message_delta", delta) + sse("message_stop", {"type": "message_stop"})

    def _text(self, text: str) -> bytes:
        if self.block == "tool_use":
            self.held.append(text)
            return b""
        out = b"" if self.block == "text" else self._flush() + self._open({"type": "text", "text": ""})
        return out + self._delta({"type": "text_delta", "text": text})

    def _call(self, call: dict[str, Any]) -> bytes:
        out = b""
        function = call.get("function") or {}
        if call.get("id") is not None:
            self.tool_ids[call["index"]] = call["id"]
            if self.tool_id != call["id"] and function.get("name") is not None:
                out += self._flush()
                self.tool_used, self.last_args = True, []
                out += self._open({"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}})
                self.tool_id = call["id"]
        if function.get("arguments") and self.tool_id == self.tool_ids.get(call["index"]):
            self.last_args.append(function["arguments"])
            out += self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
        return out

    def _open(self, block: dict[str, Any]) -> bytes:
        self.block = block["type"]
        return sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        out = sse("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.block, self.tool_id, self.index = None, None, self.index + 1
        return out

    def _flush(self) -> bytes:
        """Closes the open block; text held during a tool call follows as its own block."""
        held, self.held = "".join(self.held), []
        out = self._close()
        if held:
            out += self._open({"type": "text", "text": ""}) + self._delta({"type": "text_delta", "text": held})
            out += self._close()
        return out


def error_event(e: ApiError) -> bytes:
    """An error after the stream's headers: Anthropic's `error` event."""
    return b"event: error\ndata: " + error_body(e) + b"\n\n"


def _is_json(text: str) -> bool:
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True

