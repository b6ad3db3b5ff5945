"""Every request field the API edge knows, one table per endpoint: each field's
validator (strict JSON types, vLLM 0.32's limits) and its JSON schema, which
/openapi.json serves. A field vLLM's OpenAI server implements but Yuebing does not
is listed as refused: accepted only at its no-op value, otherwise a 400 naming it.
A field in no table is a 400 too (unless null), so nothing is silently ignored."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from services.gateway.errors import invalid
from shared.tenants import MAX_CLIENT_SALT, check_client_salt

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1  # vLLM's sampler keeps top_k in an int32 tensor
MAX_STOP_STRINGS = 4  # vLLM's VLLM_MAX_STOP_STRINGS default
MAX_STOP_CHARS = 1024  # ours: a stop string is held back while it may still match
MAX_MESSAGES = 2048  # ours: each costs chat-template work before any limit applies
MAX_TOKEN_IDS = 4096  # ours: stop_token_ids / allowed_token_ids travel in every message
MAX_BAD_WORDS = 64  # each may tokenize two ways, and vLLM takes at most 128 (VLLM_MAX_NUM_BAD_WORDS)
MAX_WORD_CHARS = 1024
MAX_USER_CHARS = 256
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_NESTING = 64  # vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING
MAX_LOGIT_BIAS = 100.0  # vLLM clamps biases to [-100, 100]
MAX_CHOICES = 16  # ours: n; each choice is a sequence in decode's batch
MAX_LOGPROBS = 20  # vLLM's max_logprobs default: the most alternatives a token's log probability comes with

Parse = Callable[[str, Any], Any]


@dataclass(frozen=True)
class Spec:
    """How one field is checked (`parse(name, value)`, never called with null) and
    described; `default` stands for a missing or null field."""

    parse: Parse
    schema: dict[str, Any]
    default: Any = None


def _same(v: Any, allowed: Any) -> bool:
    # type first: JSON true must not pass for 1, nor 1 for true
    return type(v) is type(allowed) and v == allowed


def boolean(default: bool) -> Spec:
    def parse(name: str, v: Any) -> bool:
        if not isinstance(v, bool):
            raise invalid(f"'{name}' must be a boolean (true or false)", name)
        return v

    return Spec(parse, {"type": "boolean", "default": default}, default)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(lo: int, hi: int, default: int | None = None) -> Spec:
    def parse(name: str, v: Any) -> int:
        if not is_int(v) or not lo <= v <= hi:
            raise invalid(f"'{name}' must be an integer in [{lo}, {hi}]", name)
        return v

    return Spec(parse, {"type": "integer", "minimum": lo, "maximum": hi, "default": default}, default)


def number(lo: float, hi: float, default: float | None = None, open_lo: bool = False) -> Spec:
    def parse(name: str, v: Any) -> float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or not (lo < v if open_lo else lo <= v) or not v <= hi:
            raise invalid(f"'{name}' must be a finite number in {'(' if open_lo else '['}{lo:g}, {hi:g}]", name)
        return float(v)

    bound = "exclusiveMinimum" if open_lo else "minimum"
    schema = {"type": "number", bound: lo, **({"maximum": hi} if math.isfinite(hi) else {}), "default": default}
    return Spec(parse, schema, default)


def string(max_chars: int) -> Spec:
    def parse(name: str, v: Any) -> str:
        if not isinstance(v, str) or len(v) > max_chars:
            raise invalid(f"'{name}' must be a string of at most {max_chars} characters", name)
        return v

    return Spec(parse, {"type": "string", "maxLength": max_chars})


def cache_salt() -> Spec:
    """vLLM's `cache_salt`, checked as vLLM checks it (and in its words); folded in
    under the tenant's own salt, so it splits a tenant's cache and never joins another's."""

    def parse(name: str, v: Any) -> str:
        try:
            return check_client_salt(v)
        except ValueError as e:
            raise invalid(str(e), name) from None

    return Spec(parse, {"type": "string", "minLength": 1, "maxLength": MAX_CLIENT_SALT})


def int_list(max_items: int, min_items: int = 0, default: tuple[int, ...] | None = ()) -> Spec:
    """Token ids: non-negative integers (the vocabulary bound is checked once the
    tokenizer is at hand)."""

    def parse(name: str, v: Any) -> tuple[int, ...]:
        if not isinstance(v, list) or not min_items <= len(v) <= max_items or not all(is_int(t) and 0 <= t <= INT32_MAX for t in v):
            raise invalid(f"'{name}' must be a list of {min_items} to {max_items} token ids", name)
        return tuple(v)

    items = {"type": "integer", "minimum": 0}
    return Spec(parse, {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}, default)


def str_list(max_items: int, max_chars: int) -> Spec:
    def parse(name: str, v: Any) -> tuple[str, ...]:
        if not isinstance(v, list) or len(v) > max_items or not all(isinstance(s, str) and s.strip() and len(s) <= max_chars for s in v):
            raise invalid(f"'{name}' must be a list of at most {max_items} strings, each with a non-space character "
                          f"and at most {max_chars} characters", name)
        return tuple(v)

    items = {"type": "string", "minLength": 1, "maxLength": max_chars}
    return Spec(parse, {"type": "array", "items": items, "maxItems": max_items}, ())


def refused(*noops: Any, note: str = "") -> Spec:
    """A field vLLM implements and Yuebing does not: only its no-op values pass."""

    def parse(name: str, v: Any) -> None:
        if any(_same(v, n) for n in noops):
            return None
        allowed = f" (accepted only as {', '.join(orjson.dumps(n).decode() for n in noops)})" if noops else ""
        raise invalid(f"'{name}' is not supported by this server{allowed}{note}", name)

    schema = {"description": "not supported" + note, **({"enum": list(noops)} if noops else {"type": "null"})}
    return Spec(parse, schema)


def exactly(value: Any, message: str) -> Spec:
    def parse(name: str, v: Any) -> Any:
        if not _same(v, value):
            raise invalid(message, name)
        return v

    return Spec(parse, {"enum": [value], "default": value}, value)


def _stop(name: str, v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or len(v) > MAX_STOP_STRINGS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in v):
        raise invalid(f"'{name}' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them, each at most "
                      f"{MAX_STOP_CHARS} characters", name)
    return tuple(v)


_STOP_ITEM = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
STOP = Spec(_stop, {"oneOf": [_STOP_ITEM, {"type": "array", "items": _STOP_ITEM, "maxItems": MAX_STOP_STRINGS}]}, ())
TOKEN_KEY = re.compile(r"[0-9]{1,10}")


def _logit_bias(name: str, v: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(v, dict):
        raise invalid(f"'{name}' must be an object mapping token ids to biases", name)
    out = []
    for key, bias in v.items():
        if not TOKEN_KEY.fullmatch(key):
            raise invalid(f"'{name}' keys must be token ids (decimal strings), got {key[:32]!r}", name)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise invalid(f"'{name}' values must be finite numbers", name)
        out.append((int(key), min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(bias)))))  # clamped, as vLLM does
    return tuple(sorted(out))


LOGIT_BIAS = Spec(
    _logit_bias,
    {"type": "object", "additionalProperties": {"type": "number"}, "propertyNames": {"pattern": "^[0-9]{1,10}$"},
     "description": "token id → bias, clamped to [-100, 100]"},
    (),
)


def _stream_options(name: str, v: Any) -> tuple[bool, bool]:
    if not isinstance(v, dict):
        raise invalid(f"'{name}' must be an object", name)
    for key, value in v.items():
        if key not in ("include_usage", "continuous_usage_stats"):
            raise invalid(f"'{name}.{key}' is not a known stream option", f"{name}.{key}")
        if value is not None and not isinstance(value, bool):
            raise invalid(f"'{name}.{key}' must be a boolean", f"{name}.{key}")
    return bool(v.get("include_usage")), bool(v.get("continuous_usage_stats"))


STREAM_OPTIONS = Spec(
    _stream_options,
    {"type": "object", "additionalProperties": False, "description": "only with stream=true",
     "properties": {"include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}}},
    (False, False),
)
