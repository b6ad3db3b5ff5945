"""Tool calling's request fields: `tools`, `tool_choice` and `parallel_tool_calls`,
and the `tool_calls` an assistant message replays, checked at the edge (strict JSON
types, bounded sizes). What they mean, vLLM decides: services/gateway/tool_parser.py
hands them to its own request model and tool parser."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from services.gateway.errors import invalid
from services.gateway.fields import MAX_SCHEMA_BYTES, MAX_SCHEMA_NESTING, Spec, boolean
from services.gateway.structured import depth

MAX_TOOLS = 128  # ours: every tool is rendered into the prompt and may enter the grammar
MAX_TOOLS_BYTES = 2 * MAX_SCHEMA_BYTES  # all the tools' JSON together
MAX_NAME_CHARS = 256
MAX_TOOL_CALLS = 128  # in one assistant message
MAX_ARGUMENTS_CHARS = 1 << 20
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    """The client's tool fields as it sent them (validated JSON)."""

    tools: tuple[dict[str, Any], ...] = ()
    choice: str | dict[str, Any] | None = None  # None: not sent (vLLM: "auto" with tools, else "none")
    parallel: bool = True

    @property
    def asked(self) -> bool:
        """Whether tool calling is in play at all (a lone parallel_tool_calls is not)."""
        return bool(self.tools) or self.choice not in (None, "none")


def _name(v: Any, param: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_NAME_CHARS or not v.isprintable():
        raise invalid(f"'{param}' must be a printable string of 1 to {MAX_NAME_CHARS} characters", param)
    return v


def _tool(v: Any, param: str) -> dict[str, Any]:
    if not isinstance(v, dict) or v.get("type", "function") != "function" or not set(v) <= {"type", "function"}:
        raise invalid(f"'{param}' must be an object {{'type': 'function', 'function': {{...}}}}", param)
    f = v.get("function")
    if not isinstance(f, dict) or not set(f) <= {"name", "description", "parameters", "strict"}:
        raise invalid(f"'{param}.function' must be an object with 'name' (and 'description', 'parameters', 'strict')",
                      f"{param}.function")
    _name(f.get("name"), f"{param}.function.name")
    if not isinstance(f.get("description", ""), (str, type(None))) or not isinstance(f.get("strict", False), (bool, type(None))):
        raise invalid(f"'{param}.function': 'description' must be a string and 'strict' a boolean", f"{param}.function")
    schema = f.get("parameters")
    if schema is not None and not isinstance(schema, dict):
        raise invalid(f"'{param}.function.parameters' must be a JSON schema object", f"{param}.function.parameters")
    if schema is not None and depth(schema) > MAX_SCHEMA_NESTING:
        raise invalid(f"'{param}.function.parameters' nests deeper than {MAX_SCHEMA_NESTING} levels",
                      f"{param}.function.parameters")
    return v


def _tools(name: str, v: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(v, list) or len(v) > MAX_TOOLS:
        raise invalid(f"'{name}' must be a list of at most {MAX_TOOLS} tools", name)
    if not v:  # vLLM's rule, and its words
        raise invalid("`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
                      name)
    tools = tuple(_tool(t, f"{name}[{i}]") for i, t in enumerate(v))
    if len(orjson.dumps(v)) > MAX_TOOLS_BYTES:
        raise invalid(f"'{name}' is larger than {MAX_TOOLS_BYTES} bytes of JSON", name)
    return tools


def _choice(name: str, v: Any) -> str | dict[str, Any]:
    if isinstance(v, str) and v in CHOICES:
        return v
    if isinstance(v, dict) and v.get("type") == "function" and set(v) == {"type", "function"}:
        f = v["function"]
        if isinstance(f, dict) and set(f) == {"name"}:
            _name(f["name"], f"{name}.function.name")
            return v
    raise invalid(f"'{name}' must be \"none\", \"auto\", \"required\" or "
                  "{'type': 'function', 'function': {'name': ...}}", name)


FUNCTION = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "maxLength": MAX_NAME_CHARS}, "description": {"type": "string"},
    "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}
TOOLS = Spec(_tools, {"type": "array", "maxItems": MAX_TOOLS, "description": "functions the model may call",
                      "items": {"type": "object", "properties": {"type": {"enum": ["function"]}, "function": FUNCTION}}})
TOOL_CHOICE = Spec(_choice, {"description": "none, auto (the default with tools), required, or a named function",
                             "oneOf": [{"enum": list(CHOICES)}, {"type": "object", "properties": {
                                 "type": {"enum": ["function"]},
                                 "function": {"type": "object", "properties": {"name": {"type": "string"}}}}}]})
PARALLEL_TOOL_CALLS = boolean(True)


def tool_calls(v: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's earlier calls, as the chat template will see them
    (vLLM then turns each call's JSON arguments into an object)."""
    if not isinstance(v, list) or len(v) > MAX_TOOL_CALLS:
        raise invalid(f"'{param}' must be a list of at most {MAX_TOOL_CALLS} tool calls", param)
    return [_call(c, f"{param}[{i}]") for i, c in enumerate(v)]


def _call(v: Any, param: str) -> dict[str, Any]:
    if not isinstance(v, dict) or v.get("type", "function") != "function" or not set(v) <= {"id", "type", "function"}:
        raise invalid(f"'{param}' must be an object {{'id': ..., 'type': 'function', 'function': {{...}}}}", param)
    if not isinstance(v.get("id", ""), str) or len(v.get("id", "")) > MAX_NAME_CHARS:
        raise invalid(f"'{param}.id' must be a string of at most {MAX_NAME_CHARS} characters", f"{param}.id")
    f = v.get("function")
    if not isinstance(f, dict) or not set(f) <= {"name", "arguments"}:
        raise invalid(f"'{param}.function' must be an object with 'name' and 'arguments'", f"{param}.function")
    arguments = f.get("arguments", "")
    if not isinstance(arguments, str) or len(arguments) > MAX_ARGUMENTS_CHARS:
        raise invalid(f"'{param}.function.arguments' must be a JSON string of at most {MAX_ARGUMENTS_CHARS} characters",
                      f"{param}.function.arguments")
    call = {"type": "function", "function": {"name": _name(f.get("name"), f"{param}.function.name"), "arguments": arguments}}
    return {"id": v["id"], **call} if "id" in v else call
