"""The API edge against the gateway's app alone (a fake pipeline makes the tokens):
strict fields, vLLM's limits, bad encodings and headers, the server's own
low-level errors, /openapi.json, the API key's sources, and the property that no
generated request gets a 5xx or a non-JSON error."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings

from services.gateway.access import Access
from services.gateway import edge, server
from services.gateway.app import Gateway, parser
from services.gateway.protocol import CHAT, COMPLETION
from services.gateway.text import Tokenizer
from services.gateway.tool_parser import ToolParsing
from shared.config import ClusterConfig
from shared.liveness import Registry
from services.gateway.pipeline import Owner
from shared.messages import Sampling, TokenChunk, TokenLogprobs
from tests.gateway.edge_cases import KEY, Case, cases, check, send, tool_bodies

MODEL = Path(__file__).resolve().parents[2] / "models" / "yuebing-tiny"
pytestmark = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(), reason="no tiny model (make test writes it)")


class FakePipeline:
    """Counts letters up to max_tokens; remembers the Sampling it was handed."""

    def __init__(self) -> None:
        self.registry = Registry(timeout_s=5.0)
        self.nc = SimpleNamespace(is_connected=True)
        self.seen: list[Sampling] = []
        self.owners: list[Owner | None] = []  # whose each run was, as the gateway said
        self.sinking = False  # hand the middle chunks to the gateway's sink, when it gives one, as the inbox does
        self.sunk = 0  # chunks its sink took

    async def run(self, request_id, prompt, sampling, deadline, slo, report, owner=None, sink=None) -> AsyncIterator[TokenChunk]:
        self.seen.append(sampling)
        self.owners.append(owner)
        for i in range(sampling.max_tokens):
            last, token = i == sampling.max_tokens - 1, 97 + i % 26
            chunk = TokenChunk(request_id=request_id, seq=i, token_ids=[token], finish_reason="length" if last else None,
                               logprobs=[] if sampling.logprobs is None else [self.row(token, sampling.logprobs)])
            # Here the request waits for its next chunk with everything before it sent: the sink's moment.
            if self.sinking and sink is not None and 0 < i and not last and sink(chunk):
                self.sunk += 1
                continue
            yield chunk

    @staticmethod
    def row(token: int, top: int) -> TokenLogprobs:
        """As decode sends them: the sampled token first, then `top` alternatives."""
        alternatives = [t for t in range(65, 65 + top + 1) if t != token][:top]
        return TokenLogprobs([token, *alternatives], [-0.1, *(-1.0 - k for k in range(len(alternatives)))], 1)


class Served:
    """The app on a real port, its loop on a thread (the property test is synchronous)."""

    def __init__(self) -> None:
        self.pipeline = FakePipeline()
        config = ClusterConfig(model=str(MODEL), max_model_len=512)
        tokenizer = Tokenizer(str(MODEL))
        tools = ToolParsing("hermes", tokenizer.hf)  # every request with tools goes through vLLM's parser
        self.gateway = Gateway(config, tokenizer, self.pipeline, Access.single(KEY, metrics_require_key=True), tools=tools)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        self.url = f"http://127.0.0.1:{port}"

    async def _start(self):
        runner = server.GatewayRunner(self.gateway.app(), server.Guard(self.gateway.limits, self.gateway.metrics))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served():
    s = Served()
    yield s
    s.close()


AUTH = ((b"Authorization", b"Bearer " + KEY.encode()), (b"Content-Type", b"application/json"))


def post(served: Served, body: dict | bytes, path: str = "/v1/completions", headers=AUTH):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # orjson refuses ints beyond 64 bits
    reply = send(served.url, Case(path, raw, headers))
    check(Case(path, raw, headers), reply)
    return reply.status, (orjson.loads(reply.body) if reply.status >= 400 else reply.body)


def completion(**kw) -> dict:
    return {"model": "yuebing-tiny", "prompt": "hi", "max_tokens": 2, **kw}


def chat(**kw) -> dict:
    return {"model": "yuebing-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


@pytest.mark.parametrize("field, value", [
    ("stream", "false"), ("stream", 0), ("ignore_eos", "true"), ("return_token_ids", 1), ("seed", 2**63),
    ("seed", -(2**63) - 1), ("seed", 1.0), ("top_k", 2**31), ("top_k", -2), ("temperature", 2.01), ("top_p", 0),
    ("min_p", 1.5), ("presence_penalty", 3), ("repetition_penalty", 0), ("max_tokens", True), ("n", 17), ("n", 0), ("n", 1.0),
    ("stop", ["x" * 1025]), ("stop", ["a", "b", "c", "d", "e"]), ("logit_bias", {"x": 1}), ("logit_bias", {"300": 1}),
    ("logit_bias", {"5": True}), ("stop_token_ids", [300]), ("allowed_token_ids", []), ("bad_words", [" "]),
    ("min_tokens", 3), ("use_beam_search", True), ("logprobs", 21), ("logprobs", True), ("echo", 1), ("prompt_logprobs", 21), ("kv_transfer_params", {}),
    ("request_id", "mine"), ("priority", 1.5), ("priority", "high"), ("structured_outputs", {"json": {}}), ("unknown_field", 1),
    ("stream_options", {"include_usage": True}), ("response_format", {"type": "structural_tag"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "bogus"}}}),
    ("length_penalty", 2.0), ("suffix", "x"),
])  # fmt: skip
def test_a_bad_or_unsupported_field_is_a_400_naming_it(served, field, value):
    status, body = post(served, completion(**{field: value}))
    assert status == 400 and body["error"]["param"].startswith(field), body


@pytest.mark.parametrize("field, value", [
    ("tools", []), ("tools", [{"type": "function"}]), ("tool_choice", "auto"), ("parallel_tool_calls", 1), ("logprobs", 1),
    ("top_logprobs", 2), ("top_logprobs", 21), ("chat_template", "{{ x }}"), ("reasoning_effort", "low"), ("messages", [{"role": "user"}]),
    ("messages", [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    ("messages", [{"role": "user", "content": "x"}] * 2049), ("max_completion_tokens", "2"),
    ("continue_final_message", True),
])  # fmt: skip
def test_chat_only_fields(served, field, value):
    status, body = post(served, chat(**{field: value}), "/v1/chat/completions")
    assert status == 400 and body["error"]["param"].startswith(field.split("[")[0]), body


def test_no_ops_and_supported_fields_pass_and_reach_the_engines(served):
    body = completion(temperature=0.5, top_k=-1, seed=-(2**63), min_p=0.1, presence_penalty=0.5, frequency_penalty=-1,
                      repetition_penalty=1.2, logit_bias={"65": 150, "66": -3}, stop_token_ids=[257], min_tokens=1,
                      bad_words=["ab"], allowed_token_ids=[97, 98], use_beam_search=False, length_penalty=1, n=1,
                      echo=False, priority=0, response_format={"type": "json_object"}, user="u-1", functions=None)
    status, _ = post(served, body)
    assert status == 200
    s = served.pipeline.seen[-1]
    assert (s.top_k, s.seed, s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (
        0, -(2**63), 0.1, 0.5, -1.0, 1.2)
    assert s.logit_bias == {65: 100.0, 66: -3.0}  # clamped, as vLLM does
    assert (s.stop_token_ids, s.min_tokens, s.bad_words, s.allowed_token_ids) == ([257], 1, ["ab"], [97, 98])
    assert s.json_object and s.history_dependent


@pytest.mark.parametrize("top", [0, 2])
def test_logprobs_come_back_for_each_token(served, top):
    status, body = post(served, completion(logprobs=top))
    assert status == 200
    logprobs = orjson.loads(body)["choices"][0]["logprobs"]
    # the sampled token and the top alternatives, as vLLM answers
    assert len(logprobs["token_logprobs"]) == 2 and all(len(t) == top + 1 for t in logprobs["top_logprobs"])


def test_json_schema_passes_through(served):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    assert post(served, chat(response_format=rf), "/v1/chat/completions")[0] == 200
    assert orjson.loads(served.pipeline.seen[-1].json_schema) == schema


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", completion(max_tokens=12)),
    ("/v1/completions", completion(max_tokens=12, n=2, logprobs=2, return_token_ids=True)),
    ("/v1/completions", completion(max_tokens=12, stop=["ghi"], stream_options={"include_usage": True,
                                                                                "continuous_usage_stats": True})),
    ("/v1/chat/completions", {"model": "yuebing-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                              "n": 2, "logprobs": True, "top_logprobs": 1}),
])
def test_tokens_a_sink_takes_reach_the_client_as_the_ones_through_the_request_do(served, path, body):
    """The same SSE events, byte for byte but the ids, whether the gateway's sink takes the middle chunks."""
    def events(sinking: bool) -> bytes:
        served.pipeline.sinking = sinking
        try:
            status, raw = post(served, {**body, "stream": True}, path)
        finally:
            served.pipeline.sinking = False
        assert status == 200
        return re.sub(rb'"(id|created)":("[^"]*"|\d+)', b"", raw)

    before = served.pipeline.sunk
    assert events(True) == events(False)
    plain = "stop" not in body  # a stop string may end the text at any token: those take the request's way
    assert (served.pipeline.sunk > before) == plain


def test_stream_options_and_continuous_usage(served):
    status, body = post(served, completion(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    events = [orjson.loads(line[6:]) for line in body.split(b"\n\n") if line.startswith(b"data: {")]
    assert status == 200 and all("usage" in e for e in events)
    assert post(served, completion(stream_options={}))[0] == 200  # empty: as vLLM, allowed without stream


@pytest.mark.parametrize("raw, extra", [
    (b"\x1f\x8b\x08\x00broken", ((b"Content-Encoding", b"gzip"),)),
    (b'{"model": "yuebing-tiny", "prompt": "h\xff"}', ()),
    (b"{not json", ()),
    (b"[" * 100_000, ()),
    (b'{"model": "yuebing-tiny", "prompt": "hi", "seed": 99999999999999999999999}', ()),
])  # fmt: skip
def test_bad_encodings_are_400s(served, raw, extra):
    assert post(served, raw, headers=AUTH + extra)[0] == 400


def test_a_gzip_body_is_read(served):
    raw = gzip.compress(orjson.dumps(completion()))
    assert post(served, raw, headers=AUTH + ((b"Content-Encoding", b"gzip"),))[0] == 200


@pytest.mark.parametrize("value", [b"Bearer sesame\xff", b"\xc3\x28", b"Bearer \x80\x81", b""])
def test_an_odd_authorization_header_is_a_401(served, value):
    status, body = post(served, completion(), headers=((b"Authorization", value),))
    assert status == 401 and body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("case", [
    Case("/v1/completions", b"{}", version=b"HTTP/9.9"),
    Case("/v1/completions", b"{}", version=b"HTTP/1.1x"),
    Case("/v1/completions", b"{}", ((b"X-Odd", b"a\x01b"),)),
    Case("/v1/completions", b"{}", ((b"X-Long", b"x" * 10_000),)),
    Case("/v1/completions", b"{}", ((b"Bad Name", b"x"),)),
])  # fmt: skip
def test_the_servers_own_parser_errors_are_openai_json(served, case):
    reply = send(served.url, case)
    check(case, reply)
    assert reply.status == 400


def test_openapi_lists_every_field(served):
    reply = send(served.url, Case("/openapi.json", b"", method=b"GET"))
    doc = orjson.loads(reply.body)
    schemas = doc["components"]["schemas"]
    assert set(schemas["ChatCompletionRequest"]["properties"]) == set(CHAT) | {"messages"}
    assert set(schemas["CompletionRequest"]["properties"]) == set(COMPLETION) | {"prompt"}


def test_metrics_can_require_the_key(served):
    assert send(served.url, Case("/metrics", b"", method=b"GET")).status == 401
    assert send(served.url, Case("/metrics", b"", AUTH, method=b"GET")).status == 200


def test_every_field_vllm_implements_is_in_a_table():
    # vLLM's own request classes: a field it adds in a later version must be decided here.
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    assert set(ChatCompletionRequest.model_fields) - {"messages"} <= set(CHAT)
    assert set(CompletionRequest.model_fields) - {"prompt"} <= set(COMPLETION)


def test_the_api_key_comes_from_the_environment_or_an_owner_only_file(tmp_path, monkeypatch):
    assert "--api-key" not in parser().format_help().replace("--api-key-file", "")
    monkeypatch.delenv(edge.API_KEY_ENV, raising=False)
    path = tmp_path / "key"
    path.write_text("from-file\n")
    path.chmod(0o600)
    assert edge.load_api_key(str(path)) == "from-file"
    assert edge.load_api_key(None) is None
    monkeypatch.setenv(edge.API_KEY_ENV, "from-env")
    assert edge.load_api_key(str(path)) == "from-env"
    monkeypatch.delenv(edge.API_KEY_ENV)
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError):
        edge.load_api_key(str(path))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
def test_no_generated_request_gets_a_5xx_or_a_non_json_error(served, case):
    reply = send(served.url, case)
    event(f"status {reply.status}")  # --hypothesis-show-statistics: how many got through
    check(case, reply)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=tool_bodies())
def test_no_request_with_tools_gets_a_5xx(served, body):
    status, _ = post(served, body, "/v1/chat/completions")
    event(f"status {status}")
    assert status in (200, 400), status


def test_a_normal_request_still_succeeds_after_all_that(served):
    assert post(served, chat(), "/v1/chat/completions")[0] == 200
