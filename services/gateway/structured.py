"""`response_format`: plain text, or structured output (any JSON object, or JSON
matching a schema) that vLLM's grammar backend enforces on both engines.

The schema is checked here, with the grammar compiler vLLM itself uses (xgrammar),
so that a schema the engines would refuse is a 400 at the edge rather than a failed
prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import structlog

from services.gateway.errors import invalid
from services.gateway.fields import MAX_SCHEMA_BYTES, MAX_SCHEMA_NESTING, Spec

log = structlog.get_logger(__name__)
PARAM = "response_format"


@dataclass(frozen=True)
class ResponseFormat:
    type: str = "text"  # text | json_object | json_schema
    json_schema: str = ""  # the schema as JSON text (json_schema only)


def parse(name: str, v: Any) -> ResponseFormat:
    if not isinstance(v, dict) or not set(v) <= {"type", "json_schema"}:
        raise invalid(f"'{name}' must be an object with 'type' (and 'json_schema')", name)
    kind = v.get("type")
    if kind in ("text", "json_object") and v.get("json_schema") is None:
        return ResponseFormat(kind)
    if kind == "json_schema":
        return ResponseFormat(kind, _schema(name, v.get("json_schema")))
    if kind == "structural_tag":
        raise invalid(f"'{name}' of type 'structural_tag' is not supported by this server", name)
    raise invalid(f"'{name}.type' must be 'text', 'json_object' or 'json_schema'", name)


def _schema(name: str, spec: Any) -> str:
    if not isinstance(spec, dict) or not set(spec) <= {"name", "description", "schema", "strict"}:
        raise invalid(f"'{name}.json_schema' must be an object with 'name' and 'schema'", name)
    if not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema"), dict):
        raise invalid(f"'{name}.json_schema' needs a string 'name' and an object 'schema'", name)
    if not isinstance(spec.get("description", ""), (str, type(None))) or not isinstance(spec.get("strict", False), (bool, type(None))):
        raise invalid(f"'{name}.json_schema': 'description' must be a string and 'strict' a boolean", name)
    schema = spec["schema"]
    if depth(schema) > MAX_SCHEMA_NESTING:
        raise invalid(f"'{name}.json_schema.schema' nests deeper than {MAX_SCHEMA_NESTING} levels", name)
    text = orjson.dumps(schema).decode()
    if len(text) > MAX_SCHEMA_BYTES:
        raise invalid(f"'{name}.json_schema.schema' is larger than {MAX_SCHEMA_BYTES} bytes", name)
    _compile(name, text)
    return text


def depth(v: Any) -> int:
    """Nesting of objects and arrays, iteratively (a deep schema must not recurse)."""
    deepest, level = 0, [v]
    while level:
        deepest += 1
        level = [c for x in level if isinstance(x, (dict, list)) for c in (x.values() if isinstance(x, dict) else x)]
        if deepest > MAX_SCHEMA_NESTING:
            break
    return deepest - 1 if deepest else 0


def _compile(name: str, text: str) -> None:
    import xgrammar  # heavy: paid by the first request that asks for a schema

    try:
        xgrammar.Grammar.from_json_schema(text)
    except Exception as e:  # xgrammar raises plain RuntimeError/ValueError for any bad schema
        raise invalid(f"'{name}.json_schema.schema' is not a schema this server can enforce: {str(e)[:300]}", name) from e


SPEC = Spec(
    parse,
    {
        "type": "object",
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {
                "type": "object",
                "required": ["name", "schema"],
                "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                               "schema": {"type": "object"}, "strict": {"type": "boolean"}},
            },
        },
        "required": ["type"],
    },
    ResponseFormat(),
)
