"""Anthropic's Messages API through the cluster, with Anthropic's own SDK, against
`vllm serve` on the same model (greedy): the same status, text, stop reason, tool
calls, stream event names and joined deltas, and token counts; errors in Anthropic's
shape. Usage differs by design in one way: Yuebing reports the prompt tokens read
from its cache as `cache_read_input_tokens` (vLLM serve, without prompt-token
details, counts them all as input), so the sums are compared."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.ops import collapsed

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24
GREEDY = {"temperature": 0}  # Anthropic's field, which this SDK no longer names
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SYSTEM = [{"type": "text", "text": "You are a weather assistant."}]
WEATHER = {"name": "get_weather", "description": "the weather in a city today", "strict": True,
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                            "required": ["city"], "additionalProperties": False}}
REPLAY = ASK + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": "call-1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call-1", "content": "sunny, 21 C"}]},
]


@pytest.fixture(scope="module")
def servers(cluster, vllm_serve, model_dir):
    from anthropic import Anthropic

    roots = [url.removesuffix("/v1") for url in (cluster.api, vllm_serve)]
    return [Anthropic(base_url=root, api_key="unused", timeout=120, max_retries=0) for root in roots], model_dir.name


def whole(client, model: str, **fields) -> dict:
    m = client.messages.create(model=model, max_tokens=fields.pop("max_tokens", MAX_TOKENS), extra_body=GREEDY, **fields)
    blocks = [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in m.content]
    u = m.usage
    return {"blocks": blocks, "stop": (m.stop_reason, m.stop_sequence), "role": m.role, "type": m.type,
            "prompt": u.input_tokens + (u.cache_read_input_tokens or 0), "output": u.output_tokens}


def streamed(client, model: str, **fields) -> dict:
    """A stream's event names in order, and its deltas joined per block as a client joins them."""
    names, blocks, stop, usage = [], {}, None, None
    with client.messages.stream(model=model, max_tokens=fields.pop("max_tokens", MAX_TOKENS), extra_body=GREEDY,
                                **fields) as stream:
        for event in stream:
            if event.type in ("text", "input_json", "thinking", "signature"):
                continue  # the SDK's own helper events, made from content_block_delta
            names.append(event.type)
            if event.type == "content_block_start":
                b = event.content_block
                blocks[event.index] = [b.type, getattr(b, "name", None), ""]
            elif event.type == "content_block_delta":
                blocks[event.index][2] += getattr(event.delta, "text", None) or getattr(event.delta, "partial_json", "")
            elif event.type == "message_delta":
                stop, usage = (event.delta.stop_reason, event.delta.stop_sequence), event.usage
    return {"names": collapsed(names), "blocks": [tuple(blocks[i]) for i in sorted(blocks)], "stop": stop,
            "output": usage.output_tokens}


def test_a_message_is_vllms_message(servers):
    (ours, theirs), model = servers
    got, want = (whole(c, model, system=SYSTEM, messages=ASK) for c in (ours, theirs))
    assert got == want, (got, want)
    assert got["blocks"][0][0] == "text" and got["stop"] == ("max_tokens", None) and got["output"] == MAX_TOKENS


def test_a_stream_has_vllms_events_and_joins_to_the_whole_message(servers):
    (ours, theirs), model = servers
    got, want = (streamed(c, model, system=SYSTEM, messages=ASK) for c in (ours, theirs))
    assert got == want, (got, want)
    assert got["names"][:2] == ["message_start", "content_block_start"] and got["names"][-2:] == ["message_delta", "message_stop"]
    one = whole(ours, model, system=SYSTEM, messages=ASK)
    assert [(t, text) for t, _, text in got["blocks"]] == one["blocks"] and got["stop"] == one["stop"]


def test_a_stop_sequence_ends_the_message_as_in_vllm(servers):
    (ours, theirs), model = servers
    text = whole(ours, model, messages=ASK)["blocks"][0][1]
    stop = text[5:7]  # two characters the greedy output is known to reach
    got, want = (whole(c, model, messages=ASK, stop_sequences=["\x00never", stop]) for c in (ours, theirs))
    assert got == want, (got, want)
    assert got["stop"] == ("stop_sequence", stop) and got["blocks"][0][1] == text[: text.index(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_is_called_as_in_vllm(servers, stream):
    (ours, theirs), model = servers
    fields = {"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"},
              "max_tokens": 160}
    got, want = ((streamed if stream else whole)(c, model, **fields) for c in (ours, theirs))
    assert got == want, (got, want)
    assert any(b[0] == "tool_use" and b[1] == "get_weather" for b in got["blocks"]), got


def test_a_tool_result_reaches_the_template_as_in_vllm(servers):
    (ours, theirs), model = servers
    got, want = (whole(c, model, system=SYSTEM, messages=REPLAY, tools=[WEATHER]) for c in (ours, theirs))
    assert got == want, (got, want)
    assert got["prompt"] > whole(ours, model, system=SYSTEM, messages=ASK)["prompt"] + 40


def test_count_tokens_is_vllms(servers):
    (ours, theirs), model = servers
    got, want = (c.messages.count_tokens(model=model, system=SYSTEM, messages=REPLAY, tools=[WEATHER])
                 for c in (ours, theirs))
    assert got.input_tokens == want.input_tokens > 0


@pytest.mark.parametrize("body, status", [
    ({"messages": ASK}, 400),  # no max_tokens
    ({"max_tokens": 0, "messages": ASK}, 400),
    ({"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}, 400),
    ({"max_tokens": 8, "messages": ASK, "model": "no-such-model"}, 404),
    ({"max_tokens": 1 << 20, "messages": ASK}, 400),  # past the context
])
def test_errors_have_vllms_status_and_anthropics_shape(servers, model_dir, cluster, vllm_serve, body, status):
    got, want = (httpx.post(f"{url.removesuffix('/v1')}/v1/messages", json={"model": model_dir.name, **body}, timeout=60)
                 for url in (cluster.api, vllm_serve))
    assert got.status_code == want.status_code == status, (got.text, want.text)
    error = got.json()
    assert error["type"] == "error" and error["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert error["error"]["message"]
