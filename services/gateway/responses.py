"""OpenAI's Responses API as a translation onto the one chat pipeline, as vLLM's server
does it for models without Harmony (vllm/entrypoints/openai/responses/): a request's
instructions, earlier turns and input items become chat messages, checked by chat's
own rules; a chat result becomes a response's output items; chat's stream deltas
become the Responses stream events. Pure: ids and times come in from the caller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from services.gateway.errors import ApiError, invalid
from services.gateway.fields import MAX_MESSAGES

INPUT_ROLES = ("user", "system", "developer", "assistant")
TOOL_CHOICES = ("auto", "none", "required")
TRUNCATIONS = ("disabled", "auto")
# vLLM's fields beside OpenAI's: handed to chat, which takes or refuses them as it does its own.
VLLM_FIELDS = ("cache_salt", "top_k", "min_p", "repetition_penalty", "seed", "stop", "priority")
ITEM_KEYS = ("type", "id", "status")  # an input message item's own keys, not the chat message's


# The Responses API's fields, as /openapi.json and the API reference show them; a field
# not here is ignored, as vLLM's server ignores it. What becomes chat's is checked as chat's.
FIELDS: dict[str, dict[str, Any]] = {
    "model": {"type": "string"},
    "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}],
              "description": "text, or message, function_call and function_call_output items"},
    "instructions": {"type": "string", "description": "a system prompt for this turn only"},
    "max_output_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number"}, "top_p": {"type": "number"},
    "tools": {"type": "array", "items": {"type": "object"}, "description": "function tools, as chat's"},
    "tool_choice": {"description": "auto, none, required, or {type: function, name}"},
    "parallel_tool_calls": {"type": "boolean"},
    "text": {"type": "object", "description": "format: text, json_schema or json_object"},
    "stream": {"type": "boolean"},
    "store": {"type": "boolean", "description": "keep it for previous_response_id and GET (default true)"},
    "previous_response_id": {"type": "string", "description": "continue the caller's own stored response"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "metadata": {"type": "object"}, "user": {"type": "string"},
    "cache_salt": {"type": "string", "description": "vLLM's: splits the caller's tenant's cache"},
}


def not_found(response_id: str) -> ApiError:
    """vLLM's answer for an id it does not hold (another tenant's is one of those)."""
    return ApiError(404, f"Response with id '{response_id[:64]}' not found.", "invalid_request_error",
                    param="response_id")


# --- requests -----------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """A Responses request: its chat body, and what its response echoes back."""

    chat: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation it rendered: kept with it, for a later turn
    echo: dict[str, Any]  # the request's fields a response repeats
    store: bool


def parse(body: dict[str, Any], history: list[dict[str, Any]] | None, previous_output: list[dict[str, Any]]) -> Request:
    """A Responses body as chat's, after `history` (an earlier turn's messages) and
    `previous_output` (that turn's output items: its text, as vLLM carries it on)."""
    for name in ("model", "input"):
        if body.get(name) is None:
            raise invalid(f"'{name}' is required", name)
    _refused(body)
    messages = _system(body.get("instructions"))
    messages += [m for m in history or () if m.get("role") != "system"]  # instructions never carry over
    messages += [{"role": "assistant", "content": part["text"]} for item in previous_output
                 if item.get("type") == "message" for part in item.get("content", ()) if "text" in part]
    messages += _input(body["input"])
    if len(messages) > MAX_MESSAGES:
        raise invalid(f"a conversation of at most {MAX_MESSAGES} messages", "input")
    chat: dict[str, Any] = {"model": body["model"], "messages": messages, "max_tokens": body.get("max_output_tokens"),
                            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                            "stream": body.get("stream"), "user": body.get("user"),
                            # vLLM tokenizes a Responses prompt with the tokenizer's special tokens (its
                            # TokenizeParams' default), where chat adds none: the same prompt as vLLM's
                            "add_special_tokens": True}
    chat |= _tools(body) | _format(body.get("text")) | _logprobs(body)
    chat |= {name: body[name] for name in VLLM_FIELDS if body.get(name) is not None}
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise invalid("'store' must be a boolean", "store")
    return Request(chat, messages, _echo(body), store)


def _refused(body: dict[str, Any]) -> None:
    if body.get("background"):
        raise invalid("background responses are not supported", "background")
    if body.get("reasoning") is not None:
        raise invalid("'reasoning' is not supported: this server runs no reasoning parser", "reasoning")
    if body.get("truncation") not in (None, *TRUNCATIONS):
        raise invalid("'truncation' must be 'disabled' or 'auto'", "truncation")
    if body.get("conversation") is not None:
        raise invalid("'conversation' is not supported; use previous_response_id", "conversation")


def _system(instructions: Any) -> list[dict[str, Any]]:
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise invalid("'instructions' must be a string", "instructions")
    return [{"role": "system", "content": instructions}] if instructions else []


def _input(value: Any) -> list[dict[str, Any]]:
    """Input text, or items, as chat messages (vLLM's construct_chat_messages_with_tool_call)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise invalid("'input' must be a string or a list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise invalid(f"input[{i}] must be an object", f"input[{i}]")
        if (message := _item(item, messages[-1] if messages else None, f"input[{i}]")) is not None:
            messages.append(message)
    return messages


def _item(item: dict[str, Any], last: dict[str, Any] | None, param: str) -> dict[str, Any] | None:
    """One input item as a chat message, or None when it joined `last` (an assistant's
    text, tool calls and reasoning are one message)."""
    kind = item.get("type", "message")
    assistant = last if last is not None and last.get("role") == "assistant" else None
    if kind == "function_call":
        return _call(item, assistant, param)
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": _output(item, param)}
    if kind == "reasoning":
        parts = item.get("content") or item.get("summary") or ()
        text = next((p.get("text", "") for p in parts if isinstance(p, dict)), "")
        return _join(assistant, "reasoning", text)
    if kind == "message" and item.get("role") in INPUT_ROLES:
        if item["role"] == "assistant":
            return _join(assistant, "content", _assistant_text(item.get("content"), param))
        return {"role": item["role"], "content": _content(item.get("content"), param),
                **{k: v for k, v in item.items() if k not in (*ITEM_KEYS, "role", "content")}}
    raise invalid(f"Unsupported input item type: {str(kind)[:64]}", param)


def _call(item: dict[str, Any], assistant: dict[str, Any] | None, param: str) -> dict[str, Any] | None:
    """A function call: one more of the assistant turn's calls, or a turn of its own."""
    call = {"id": _string(item, "call_id", param), "type": "function",
            "function": {"name": _string(item, "name", param), "arguments": _string(item, "arguments", param)}}
    if assistant is not None:
        assistant.setdefault("tool_calls", []).append(call)
        return None
    return {"role": "assistant", "tool_calls": [call]}


def _join(assistant: dict[str, Any] | None, key: str, value: str) -> dict[str, Any] | None:
    if assistant is not None and assistant.get(key) is None:
        assistant[key] = value
        return None
    return {"role": "assistant", key: value}


def _string(item: dict[str, Any], key: str, param: str) -> str:
    if not isinstance(item.get(key), str):
        raise invalid(f"{param}.{key} must be a string", f"{param}.{key}")
    return item[key]


def _output(item: dict[str, Any], param: str) -> str:
    out = item.get("output")
    if isinstance(out, list):  # output parts: their text
        return "".join(p.get("text", "") for p in out if isinstance(p, dict))
    if not isinstance(out, str):
        raise invalid(f"{param}.output must be a string", f"{param}.output")
    return out


def _content(content: Any, param: str) -> str | list[dict[str, str]]:
    """A message's content: text, or input_text parts as chat's text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{param}.content must be a string or a list of parts", f"{param}.content")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise invalid(f"{param}.content: only text parts are supported by this text-only model", f"{param}.content")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _assistant_text(content: Any, param: str) -> str:
    """An assistant item's text: its first part's, as vLLM takes it."""
    if isinstance(content, list) and content and isinstance(content[0], dict):
        return _string(content[0], "text", f"{param}.content[0]")
    if isinstance(content, str):
        return content
    raise invalid(f"{param}.content must be a string or a list of parts", f"{param}.content")


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """Function tools and tool_choice as chat's."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("'tools' must be a list", "tools")
        out["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid("tool_choice must be auto, none, required or {'type': 'function', 'name': ...}",
                          "tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        out["tool_choice"] = choice  # chat's own check
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def _tool(t: Any, param: str) -> dict[str, Any]:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else None
        raise invalid(f"{param}: only function tools are supported (not {str(kind)[:64]})", param)
    function = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
    return {"type": "function", "function": function}


def _format(text: Any) -> dict[str, Any]:
    """text.format as chat's response_format."""
    if text is None:
        return {}
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_schema", "json_object"):
        raise invalid("text.format must be text, json_schema or json_object", "text")
    if fmt["type"] == "json_object":
        return {"response_format": {"type": "json_object"}}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


def _logprobs(body: dict[str, Any]) -> dict[str, Any]:
    top = body.get("top_logprobs")
    return {} if top is None else {"logprobs": True, "top_logprobs": top}


def _echo(body: dict[str, Any]) -> dict[str, Any]:
    return {"instructions": body.get("instructions"), "metadata": body.get("metadata"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "previous_response_id": body.get("previous_response_id"),
            "text": body.get("text") or {"format": {"type": "text"}}, "truncation": body.get("truncation", "disabled"),
            "user": body.get("user"), "top_logprobs": body.get("top_logprobs"), "background": False, "reasoning": None,
            "service_tier": body.get("service_tier", "auto")}


# --- responses ----------------------------------------------------------------------
def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


@dataclass(frozen=True)
class Envelope:
    """What every form of one response shares."""

    response_id: str
    model: str
    created_at: int
    echo: dict[str, Any]
    max_output_tokens: int
    temperature: float
    top_p: float

    def response(self, status: str, output: list[dict[str, Any]], usage_: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.response_id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": status, "output": output, "usage": usage_, "error": None, "incomplete_details": incomplete,
                "max_output_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                **self.echo}


def status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def output_items(message: dict[str, Any], new_id: Any) -> list[dict[str, Any]]:
    """A chat completion's message as output items (vLLM's build_response_output_items)."""
    out = []
    if message.get("content"):
        out.append({"id": f"msg_{new_id()}", "type": "message", "role": "assistant", "status": "completed",
                    "content": [_text_part(message["content"])]})
    for call in message.get("tool_calls") or ():
        out.append({"id": f"fc_{new_id()}", "type": "function_call", "status": "completed", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": call["function"]["arguments"]})
    return out


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class Events:
    """Chat stream deltas in, the Responses stream's events out (SSE bytes), numbered,
    with vLLM's states: a text message or a function call opens on its first delta
    and closes, with its done events, when another begins or the stream ends."""

    envelope: Envelope
    new_id: Any  # () -> a fresh id's suffix
    sequence: int = 0
    index: int = 0  # the open item's output index
    state: str = ""  # "" | "content" | "call"
    item: dict[str, Any] = field(default_factory=dict)  # the open item
    text: str = ""  # the open item's text or arguments so far
    call_index: int | None = None  # the open call's index in chat's deltas
    output: list[dict[str, Any]] = field(default_factory=list)  # the items closed so far

    def start(self) -> bytes:
        initial = self.envelope.response("in_progress", [], None)
        return self._event("response.created", response=initial) + self._event("response.in_progress", response=initial)

    def delta(self, delta: dict[str, Any]) -> bytes:
        """One chat delta (`{"content": ...}` and/or `{"tool_calls": [...]}`) as events."""
        out = b""
        if delta.get("content"):
            if self.state != "content":
                out += self._close() + self._open_content()
            self.text += delta["content"]
            out += self._event("response.output_text.delta", content_index=0, output_index=self.index,
                               item_id=self.item["id"], delta=delta["content"], logprobs=[])
        for call in delta.get("tool_calls") or ():
            if call.get("function") is None:
                continue
            if self.state != "call" or (call.get("index") is not None and call["index"] != self.call_index):
                out += self._close() + self._open_call(call)
            if args := call["function"].get("arguments"):
                self.text += args
                out += self._event("response.function_call_arguments.delta", output_index=self.index,
                                   item_id=self.item["id"], delta=args)
        return out

    def end(self, finish: str | None, usage_: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """The closing events, and the whole response they end with."""
        out = self._close()
        response = self.envelope.response(status(finish), self.output, usage_)
        return out + self._event("response.completed", response=response), response

    def failed(self, e: ApiError) -> bytes:
        """An error after the stream began: vLLM's `error` event."""
        return self._event("error", code=e.code or e.type, message=e.message, param=e.param)

    def _open_content(self) -> bytes:
        self.state, self.text = "content", ""
        self.item = {"id": f"msg_{self.new_id()}", "type": "message", "role": "assistant", "content": [],
                     "status": "in_progress"}
        return (self._event("response.output_item.added", output_index=self.index, item=self.item)
                + self._event("response.content_part.added", output_index=self.index, item_id=self.item["id"],
                              content_index=0, part=_text_part("")))

    def _open_call(self, call: dict[str, Any]) -> bytes:
        self.state, self.text, self.call_index = "call", "", call.get("index")
        self.item = {"id": f"fc_{self.new_id()}", "type": "function_call",
                     "call_id": call.get("id") or f"call_{self.new_id()}",
                     "name": call["function"].get("name") or "", "arguments": "", "status": "in_progress"}
        return self._event("response.output_item.added", output_index=self.index, item=self.item)

    def _close(self) -> bytes:
        if not self.state:
            return b""
        i, item_id = self.index, self.item["id"]
        if self.state == "content":
            part = _text_part(self.text)
            done = {**self.item, "content": [part], "status": "completed"}
            out = (self._event("response.output_text.done", output_index=i, content_index=0, text=self.text,
                               logprobs=[], item_id=item_id)
                   + self._event("response.content_part.done", item_id=item_id, output_index=i, content_index=0,
                                 part=part))
        else:
            done = {**self.item, "arguments": self.text, "status": "completed"}
            out = self._event("response.function_call_arguments.done", output_index=i, item_id=item_id,
                              arguments=self.text, name=self.item["name"])
        self.output.append(done)
        self.state, self.index = "", self.index + 1
        return out + self._event("response.output_item.done", output_index=i, item=done)

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
