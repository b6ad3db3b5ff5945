"""Anthropic's Messages API as the chat pipeline's: requests translated into chat
bodies as vLLM's server translates them, and chat results and deltas into messages
and stream events."""

import orjson
import pytest

from services.gateway import anthropic
from services.gateway.errors import ApiError

ASK = [{"role": "user", "content": "hi"}]


def chat(**body):
    return anthropic.chat_body({"model": "m", "max_tokens": 8, "messages": ASK, **body}, merge_system=False)


def test_the_system_prompt_leads_and_its_blocks_join_without_claude_codes_billing_header():
    system = [{"type": "text", "text": "x-anthropic-billing-header: cch=1"}, {"type": "text", "text": "Be"},
              {"type": "text", "text": " brief."}]
    assert chat(system=system)["messages"] == [{"role": "system", "content": "Be brief."}, *ASK]
    assert chat(system="Be brief.")["messages"][0] == {"role": "system", "content": "Be brief."}


def test_inline_system_messages_stay_in_place_or_join_the_first_when_the_template_wants_it():
    messages = [*ASK, {"role": "system", "content": "Now French."}, {"role": "user", "content": "bonjour"}]
    kept = chat(system="S.", messages=messages)["messages"]
    assert [m["role"] for m in kept] == ["system", "user", "system", "user"]
    merged = anthropic.chat_body({"model": "m", "max_tokens": 8, "system": "S.", "messages": messages}, merge_system=True)
    assert merged["messages"] == [{"role": "system", "content": "S.Now French."}, *ASK, {"role": "user", "content": "bonjour"}]


def test_tool_use_and_tool_result_blocks_become_chats_calls_and_tool_messages():
    messages = [
        *ASK,
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "c1", "name": "f", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "and?"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c2", "content": "rain"}]},
    ]
    out = chat(messages=messages)["messages"]
    assert out[1] == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}]}
    assert out[2:] == [{"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "and?"},
                       {"role": "tool", "tool_call_id": "c2", "content": "rain"}]  # a user turn of results alone is only those


def test_tools_choices_and_sampling_map_to_chats_fields():
    tool = {"name": "f", "description": "d", "input_schema": {"properties": {}}}
    body = chat(tools=[tool], tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["x"],
                temperature=0, top_k=5, stream=True, metadata={"user_id": "u"}, cache_salt="s" * 8)
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "description": "d",
                                                               "parameters": {"type": "object", "properties": {}}}}]
    assert (body["tool_choice"], body["parallel_tool_calls"]) == ("required", False)
    assert (body["stop"], body["temperature"], body["top_k"], body["stream"], body["cache_salt"]) == (["x"], 0, 5, True, "s" * 8)
    assert "metadata" not in body  # Anthropic's own, with nothing to do here
    assert chat(tools=[tool])["tool_choice"] == "auto"
    named = chat(tools=[tool], tool_choice={"type": "tool", "name": "f"})["tool_choice"]
    assert named == {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize("body, words", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "text-only"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "c"}]}]}, "needs 'name'"),
    ({"messages": [{"role": "user", "content": 7}]}, "content"),
    ({"system": 7}, "system"),
    ({"tool_choice": {"type": "tool"}}, "name is required"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "reasoning"),
    ({"stream": "yes"}, "stream"),
    ({"model": ""}, "model"),
])
def test_a_bad_body_is_a_400_that_says_why(body, words):
    with pytest.raises(ApiError) as e:
        chat(**body)
    assert e.value.status == 400 and words in e.value.message


def test_count_tokens_needs_no_max_tokens():
    body = anthropic.chat_body({"model": "m", "messages": ASK}, merge_system=False, count_only=True)
    assert body == {"model": "m", "messages": ASK}


@pytest.mark.parametrize("finish, sequence, used, complete, want", [
    ("length", "x", True, True, ("max_tokens", None)),
    ("stop", "x", False, False, ("stop_sequence", "x")),
    ("stop", "x", True, True, ("tool_use", None)),  # complete calls win over a stop string
    ("stop", None, True, False, ("tool_use", None)),  # a named call: chat says stop
    ("tool_calls", None, True, True, ("tool_use", None)),
    ("stop", None, False, False, ("end_turn", None)),
    ("abort", None, False, False, (None, None)),
])
def test_stop_reasons_follow_vllms_rules(finish, sequence, used, complete, want):
    assert anthropic.stop_reason(finish, sequence, used, complete) == want


def test_a_whole_chat_completion_becomes_a_message():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    completion = {"model": "m", "choices": [{"finish_reason": "tool_calls",
                                             "message": {"role": "assistant", "content": "ok", "tool_calls": [call]}}]}
    usage = anthropic.usage(10, 3, 4)
    assert usage == {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4}
    m = anthropic.message(completion, "msg_1", None, usage)
    assert m == {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "stop_reason": "tool_use",
                 "content": [{"type": "text", "text": "ok"}, {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}],
                 "usage": usage}  # stop_sequence None is left out, as vLLM's exclude_none
    empty = {"model": "m", "choices": [{"finish_reason": "length", "message": {"role": "assistant", "content": ""}}]}
    assert anthropic.message(empty, "msg_2", None, usage)["content"] == [{"type": "text", "text": ""}]


def events(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for part in data.decode().split("\n\n"):
        if part:
            name, body = part.split("\n")
            out.append((name.removeprefix("event: "), orjson.loads(body.removeprefix("data: "))))
    return out


def test_stream_deltas_open_and_close_blocks_as_vllm_does():
    usage = anthropic.usage(5, 0, 0)
    e = anthropic.Events("msg_1", "m", usage)
    data = e.start() + e.delta({"content": "Hi"}) + e.delta({"content": " there"})
    data += e.delta({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]})
    data += e.delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]})
    data += e.delta({"content": "(held)"})  # text inside a call follows it as a block of its own
    data += e.delta({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]})
    data += e.end("tool_calls", None, anthropic.usage(5, 7, 0))
    got = events(data)
    assert [n for n, _ in got] == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                                   "content_block_stop", "content_block_start", "content_block_delta",
                                   "content_block_delta", "content_block_stop", "content_block_start",
                                   "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(n == body["type"] for n, body in got)
    assert got[0][1]["message"]["usage"] == usage and got[0][1]["message"]["content"] == []
    assert got[5][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert [b["index"] for _, b in got if "index" in b] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert got[10][1]["delta"] == {"type": "text_delta", "text": "(held)"}
    assert got[12][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_a_stream_cut_inside_a_call_is_not_tool_use():
    e = anthropic.Events("msg_1", "m", anthropic.usage(1, 0, 0))
    e.delta({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a": '}}]})
    (delta,) = [b for n, b in events(e.end("length", None, anthropic.usage(1, 1, 0))) if n == "message_delta"]
    assert delta["delta"]["stop_reason"] == "max_tokens"


def test_errors_take_anthropics_types_by_status():
    assert orjson.loads(anthropic.error_body(ApiError(429, "slow down", "requests"))) == {
        "type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    assert orjson.loads(anthropic.error_body(ApiError(500, "bug")))["error"]["type"] == "api_error"
    assert anthropic.error_event(ApiError(503, "x")).startswith(b"event: error\ndata: ")
