"""Generated requests for the API edge's property tests (tests/gateway/test_edge.py
against the app alone, tests/e2e/test_edge_property.py against the real cluster):
bodies with random and mutated fields of every kind, odd headers, raw and gzip
bodies, and malformed HTTP, each sent over a raw socket so that nothing between the
test and the server tidies it up. `check` is the property: never a 5xx, and every
error an OpenAI-style JSON body."""

from __future__ import annotations

import gzip
import json
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import orjson
from hypothesis import strategies as st

from services.gateway.protocol import CHAT, COMPLETION

KEY = "sesame"
SMALL_MAX = st.sampled_from([1, 2, 3, 4])
# Values of every JSON type, and the edges of the limits the edge enforces.
NUMBERS = st.sampled_from([0, 1, -1, 2, 3, 0.5, -0.5, 1.5, 2.5, 100, -100, 1e308, -1e308, 2**31 - 1, 2**31, 2**63 - 1,
                           -(2**63), 2**63, 2**64 - 1, 1e-9])
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                    st.text(max_size=20), st.sampled_from(["false", "true", "1", "", "none", "text", "\x00", "\ud7ff\uffff"]))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=8)
TOKEN = st.integers(0, 300)
SCHEMAS = st.sampled_from([{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                           {"type": "bogus"}, {"type": "string", "maxLength": 3}, {}, {"type": "array", "items": {"type": "boolean"}}])
TOOL_NAMES = st.sampled_from(["f", "get_weather", "", "x" * 300, "a\nb", 'q"uote'])
TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "custom"]), "function": st.fixed_dictionaries(
    {"name": TOOL_NAMES}, optional={"parameters": SCHEMAS, "strict": st.one_of(st.booleans(), JSON),
                                    "description": st.one_of(st.text(max_size=8), JSON)})})
CALL = st.fixed_dictionaries({"id": st.text(max_size=4), "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": TOOL_NAMES, "arguments": st.one_of(st.sampled_from(['{"a": 1}', "{", "[]", ""]), JSON)})})
PLAUSIBLE = {
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=3), max_size=5), st.just("x" * 1025)),
    "logit_bias": st.dictionaries(st.one_of(TOKEN.map(str), st.text(max_size=4)), st.one_of(NUMBERS, st.text(max_size=2)),
                                  max_size=4),
    "stop_token_ids": st.lists(TOKEN, max_size=4),
    "allowed_token_ids": st.lists(TOKEN, max_size=4),
    "bad_words": st.lists(st.text(max_size=4), max_size=3),
    "stream_options": st.dictionaries(st.sampled_from(["include_usage", "continuous_usage_stats", "bogus"]), SCALARS, max_size=2),
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "structural_tag", "x"])}),
        st.fixed_dictionaries({"type": st.just("json_schema"),
                               "json_schema": st.fixed_dictionaries({"name": st.just("s"), "schema": SCHEMAS})})),
    "max_tokens": st.one_of(SMALL_MAX, st.sampled_from([0, -1, "4", 4.0, True, 2**63, 10**7])),
    "max_completion_tokens": st.one_of(SMALL_MAX, st.sampled_from([0, "2", 2**64 - 1])),
    "min_tokens": st.sampled_from([0, 1, 2, 3, 5, -1, "1"]),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]),
                                                "content": st.one_of(st.text(max_size=12), JSON)},
                                               optional={"tool_calls": st.one_of(st.lists(CALL, max_size=2), JSON),
                                                         "tool_call_id": st.one_of(st.text(max_size=4), JSON),
                                                         "name": st.text(max_size=4), "reasoning": SCALARS}), max_size=3),
    "tools": st.one_of(st.lists(TOOL, max_size=3), JSON),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "any"]),
                             st.fixed_dictionaries({"type": st.just("function"),
                                                    "function": st.fixed_dictionaries({"name": TOOL_NAMES})}), JSON),
    "parallel_tool_calls": st.one_of(st.booleans(), JSON),
    "prompt": st.one_of(st.text(max_size=12), st.lists(TOKEN, max_size=4), st.lists(st.text(max_size=3), max_size=2), JSON),
    # vLLM's rules: non-empty, at most 128 characters, none of @ / \ NUL
    "cache_salt": st.one_of(st.text(max_size=8), st.sampled_from(["", "x" * 128, "x" * 129, "a/b", "a@b", "a\\b", "n\x00",
                                                                  "\ud800", "ünï"])),
}
FIELDS = sorted(set(CHAT) | set(COMPLETION) | {"messages", "prompt", "functions", "best_of", "unknown_field"})


def _value(name: str) -> st.SearchStrategy:
    # Fields that would make generation long are only ever small (the tests must be fast).
    if name in ("max_tokens", "max_completion_tokens", "messages", "prompt"):
        return PLAUSIBLE[name]
    return st.one_of(PLAUSIBLE.get(name, JSON), JSON)


@st.composite
def tool_bodies(draw) -> dict:
    """Chat bodies about tools alone: most get through to vLLM's tool parser."""
    body: dict = {"model": "yuebing-tiny", "max_tokens": draw(SMALL_MAX), "temperature": 0,
                  "messages": [{"role": "user", "content": "hi"}], "tools": draw(st.lists(TOOL, min_size=1, max_size=3))}
    for name in draw(st.lists(st.sampled_from(["tool_choice", "parallel_tool_calls", "messages", "stream",
                                               "response_format"]), max_size=3, unique=True)):
        body[name] = draw(st.booleans() if name == "stream" else PLAUSIBLE[name])
    return body


BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=6)}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(max_size=4), "name": TOOL_NAMES,
                           "input": st.one_of(st.just({}), JSON)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.text(max_size=4),
                           "content": st.one_of(st.text(max_size=6), st.lists(JSON, max_size=2), JSON)}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "redacted_thinking", "document", ""]),
                           "thinking": st.one_of(st.text(max_size=4), JSON)}),
    JSON,
)
ANTHROPIC = {  # the Messages API's fields, plausible or not
    "system": st.one_of(st.text(max_size=8), st.lists(BLOCK, max_size=2), JSON),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]),
                                                "content": st.one_of(st.text(max_size=6), st.lists(BLOCK, max_size=3), JSON)}),
                         min_size=1, max_size=3),
    "tools": st.lists(st.fixed_dictionaries({"name": TOOL_NAMES, "input_schema": st.one_of(
        st.just({"type": "object", "properties": {}}), JSON)}), max_size=2),
    "tool_choice": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none", "tool", "x"]),
                                                    "name": st.one_of(TOOL_NAMES, JSON)}), JSON),
    "stop_sequences": st.one_of(st.lists(st.text(max_size=3), max_size=3), JSON),
    "thinking": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive", "x"])}), JSON),
    "output_config": st.one_of(st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.just("json_schema"), "schema": st.one_of(st.just({"type": "object"}), JSON)})}), JSON),
    "max_tokens": st.one_of(st.integers(-2, 4), JSON),
    "metadata": JSON, "top_k": JSON, "top_p": JSON, "temperature": JSON, "cache_salt": PLAUSIBLE["cache_salt"],
}


ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
                           "content": st.one_of(st.text(max_size=6), st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                "text": st.one_of(st.text(max_size=4), JSON)}), max_size=2), JSON)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.one_of(st.text(max_size=4), JSON),
                           "name": TOOL_NAMES, "arguments": st.one_of(st.just("{}"), JSON)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(max_size=4),
                           "output": st.one_of(st.text(max_size=6), JSON)}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call", "message", ""])}),
    JSON,
)
RESPONSES = {  # the Responses API's fields, plausible or not
    "input": st.one_of(st.text(max_size=8), st.lists(ITEM, min_size=1, max_size=3), JSON),
    "instructions": st.one_of(st.text(max_size=8), JSON),
    "tools": st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("function"), "name": TOOL_NAMES,
                                                       "parameters": st.just({"type": "object", "properties": {}})}),
                                JSON), max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "x"]),
                             st.fixed_dictionaries({"type": st.just("function"), "name": TOOL_NAMES}), JSON),
    "text": st.one_of(st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_schema", "json_object", "x"]), "schema": JSON})}), JSON),
    "previous_response_id": st.one_of(st.sampled_from(["resp_" + "0" * 32, "../x", "resp_\u0000", ""]), JSON),
    "max_output_tokens": st.one_of(st.integers(-2, 4), JSON),
    "store": JSON, "background": JSON, "reasoning": JSON, "truncation": JSON, "top_logprobs": JSON,
    "metadata": JSON, "parallel_tool_calls": JSON, "cache_salt": PLAUSIBLE["cache_salt"],
}


@st.composite
def api_bodies(draw, fields: dict, **base) -> dict:
    """Another API's bodies (Messages, Responses), their fields mutated: translated,
    then checked as chat's. `base`: a valid body's fields."""
    body: dict = {"model": "yuebing-tiny", "temperature": 0, **base}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(fields[name])
    if draw(st.booleans()):
        body["stream"] = draw(st.one_of(st.just(True), JSON))
    return body


def message_bodies() -> st.SearchStrategy:
    return SMALL_MAX.flatmap(lambda n: api_bodies(ANTHROPIC, max_tokens=n, messages=[{"role": "user", "content": "hi"}]))


def response_bodies() -> st.SearchStrategy:
    return SMALL_MAX.flatmap(lambda n: api_bodies(RESPONSES, max_output_tokens=n, input="hi"))


@st.composite
def bodies(draw) -> tuple[str, dict]:
    api = draw(st.integers(0, 5))
    if api == 0:
        return draw(st.sampled_from(["/v1/messages"] * 3 + ["/v1/messages/count_tokens"])), draw(message_bodies())
    if api == 1:
        return "/v1/responses", draw(response_bodies())
    chat = draw(st.booleans())
    body: dict = {"model": "yuebing-tiny", "max_tokens": draw(SMALL_MAX), "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[name] = draw(_value(name))
    if draw(st.booleans()) and "stream" not in body:
        body["stream"] = True
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@dataclass(frozen=True)
class Case:
    """One request as bytes on the wire."""

    path: str
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()
    method: bytes = b"POST"
    version: bytes = b"HTTP/1.1"

    def wire(self, host: str) -> bytes:
        lines = [self.method + b" " + self.path.encode() + b" " + self.version, b"Host: " + host.encode(),
                 b"Connection: close", b"Content-Length: " + str(len(self.body)).encode()]
        lines += [name + b": " + value for name, value in self.headers]
        return b"\r\n".join(lines) + b"\r\n\r\n" + self.body


HEADER_VALUES = st.one_of(st.binary(max_size=24).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
                          st.sampled_from([b"", b"Bearer " + KEY.encode(), b"Bearer " + KEY.encode() + b"\xff", b"gzip",
                                           b"br", b"deflate", b"zstd", b"\xc3\x28", b"ok-id", b"x" * 200, b"12", b"nan", b"inf", b"-5"]))
HEADER_NAMES = st.sampled_from([b"Authorization", b"x-request-id", b"x-yuebing-slo-ttft-ms", b"x-yuebing-slo-tbt-ms",
                                b"Content-Type", b"Content-Encoding", b"Accept", b"User-Agent", b"X-Odd"])


@st.composite
def headers(draw, authorized: bool) -> tuple[tuple[bytes, bytes], ...]:
    out = [(b"Content-Type", b"application/json")]
    if authorized:
        out.append((b"Authorization", b"Bearer " + KEY.encode()))
    out += draw(st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=3))
    return tuple(out)


def _encode(draw, body: dict) -> tuple[bytes, tuple[tuple[bytes, bytes], ...]]:
    raw = json.dumps(body).encode()  # not orjson: it refuses integers beyond 64 bits
    how = draw(st.sampled_from(["json", "json", "json", "gzip", "bad-gzip", "truncated", "latin1", "bytes", "nested", "nan"]))
    if how == "gzip":
        return gzip.compress(raw), ((b"Content-Encoding", b"gzip"),)
    if how == "bad-gzip":
        return b"\x1f\x8b\x08\x00garbage" + raw[:20], ((b"Content-Encoding", b"gzip"),)
    if how == "truncated":
        return raw[: draw(st.integers(0, max(0, len(raw) - 1)))], ()
    if how == "latin1":
        return raw.replace(b'"hi"', b'"h\xe9\xff"'), ()
    if how == "bytes":
        return draw(st.binary(max_size=64)), ()
    if how == "nested":
        return b"[" * 5000 + b"]" * 5000, ()
    if how == "nan":
        return raw.replace(b'"temperature":0', b'"temperature":NaN'), ()
    return raw, ()


@st.composite
def cases(draw, authorized: bool = True) -> Case:
    """A request of any kind: mostly JSON bodies with mutated fields, some with raw
    or compressed bodies, some other routes, and some malformed HTTP."""
    kind = draw(st.sampled_from(["body"] * 8 + ["route", "malformed"]))
    if kind == "malformed":
        return draw(malformed())
    if kind == "route":
        path = draw(st.sampled_from(["/v1/models", "/openapi.json", "/v1/nothing", "/metrics", "/v1/completions",
                                     "/v1/responses/resp_" + "0" * 32, "/v1/responses/..%2Fx/cancel"]))
        return Case(path, b"", draw(headers(authorized)), method=draw(st.sampled_from([b"GET", b"DELETE", b"PUT"])))
    path, body = draw(bodies())
    raw, extra = _encode(draw, body)
    return Case(path, raw, draw(headers(authorized)) + extra)


@st.composite
def malformed(draw) -> Case:
    body = json.dumps({"model": "yuebing-tiny", "prompt": "hi", "max_tokens": 1}).encode()
    how = draw(st.sampled_from(["version", "control", "long", "name", "method"]))
    if how == "version":
        return Case("/v1/completions", body, version=draw(st.sampled_from([b"HTTP/9.9", b"HTTP/1.1x", b"HTX/1.1", b"HTTP/"])))
    if how == "control":
        return Case("/v1/completions", body, ((b"X-Odd", b"a" + bytes([draw(st.sampled_from([0, 1, 8, 11, 27, 127]))]) + b"b"),))
    if how == "long":
        return Case("/v1/completions", body, ((b"X-Long", b"x" * draw(st.sampled_from([10_000, 70_000]))),))
    if how == "name":
        return Case("/v1/completions", body, ((b"Bad Name", b"x"),))
    return Case("/v1/completions", body, method=b"P\x01ST")


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def send(url: str, case: Case, timeout_s: float = 60.0) -> Reply:
    """Send the case's bytes; the reply as it came (the server closes the connection)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as s:
        s.sendall(case.wire(parts.netloc))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    fields = {k.lower(): v for k, v in fields.items()}
    if fields.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    return Reply(int(lines[0].split(" ")[1]), fields, body)


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            break
        out, data = out + rest[:n], rest[n + 2 :]
    return out


def check(case: Case, reply: Reply) -> None:
    """The property: no 5xx; every error the API's own JSON body (OpenAI's, or
    Anthropic's on the Messages API); no error inside a 200 stream."""
    assert reply.status < 500, (case, reply)
    if case.path.startswith("/v1/messages") and case.method == b"POST":
        return _check_messages(case, reply)
    if reply.status >= 400:
        assert reply.headers.get("content-type", "").startswith("application/json"), (case, reply)
        error = orjson.loads(reply.body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (case, reply)
    elif reply.headers.get("content-type", "").startswith("text/event-stream") and case.path == "/v1/responses":
        assert b"event: error" not in reply.body and b"event: response.completed" in reply.body, (case, reply)
    elif reply.headers.get("content-type", "").startswith("text/event-stream"):
        assert b'data: {"error"' not in reply.body, (case, reply)
        assert reply.body.endswith(b"data: [DONE]\n\n"), (case, reply)


def _check_messages(case: Case, reply: Reply) -> None:
    if reply.status >= 400:
        assert reply.headers.get("content-type", "").startswith("application/json"), (case, reply)
        body = orjson.loads(reply.body)
        if body.get("error", {}).get("message", "").startswith("malformed HTTP request"):
            return  # refused as HTTP, before any route was known: the server's generic body
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"], (case, reply)
    elif reply.headers.get("content-type", "").startswith("text/event-stream"):
        assert b"event: error" not in reply.body, (case, reply)
        assert reply.body.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n'), (case, reply)
