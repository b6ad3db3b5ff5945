"""OpenAI's Responses API as the chat pipeline's: requests and earlier turns translated
into chat bodies as vLLM's server translates them, and chat results and deltas into
output items and the Responses stream's events."""

import itertools

import orjson
import pytest

from services.gateway import responses
from services.gateway.errors import ApiError


def parse(body, history=None, output=()):
    return responses.parse({"model": "m", **body}, history, list(output))


def test_text_input_and_instructions_become_chat_messages():
    r = parse({"input": "hi", "instructions": "Be brief.", "max_output_tokens": 5, "temperature": 0})
    assert r.chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (r.chat["max_tokens"], r.chat["temperature"], r.store) == (5, 0, True)


def test_an_earlier_turn_leads_without_its_instructions_and_with_its_text_output():
    history = [{"role": "system", "content": "Old."}, {"role": "user", "content": "a"}]
    output = [{"type": "message", "content": [{"type": "output_text", "text": "b"}]},
              {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"}]  # calls are not carried (vLLM)
    r = parse({"input": "c", "instructions": "New."}, history, output)
    assert r.chat["messages"] == [{"role": "system", "content": "New."}, {"role": "user", "content": "a"},
                                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]


def test_items_become_messages_calls_join_the_assistant_turn_and_outputs_become_tool_messages():
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "one"}]
    messages = parse({"input": items}).chat["messages"]
    assert messages[0] == {"role": "user", "content": [{"type": "text", "text": "q"}]}
    assert messages[1]["content"] == "let me see" and [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "one"}


def test_tools_choices_and_formats_map_to_chats_fields():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}
    chat = parse({"input": "hi", "tools": [tool], "tool_choice": {"type": "function", "name": "f"}, "text": fmt,
                  "parallel_tool_calls": False, "top_logprobs": 2}).chat
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}} and chat["parallel_tool_calls"] is False
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 2)
    assert "response_format" not in parse({"input": "hi", "text": {"format": {"type": "text"}}}).chat


@pytest.mark.parametrize("body, words", [
    ({}, "'input' is required"),
    ({"input": 7}, "'input'"),
    ({"input": [{"type": "image_generation_call"}]}, "Unsupported input item type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "text parts"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "hi", "store": "yes"}, "store"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "hi", "instructions": 5}, "instructions"),
])
def test_a_bad_body_is_a_400_that_says_why(body, words):
    with pytest.raises(ApiError) as e:
        parse(body)
    assert e.value.status == 400 and words in e.value.message


def envelope():
    return responses.Envelope("resp_1", "m", 7, {"instructions": None}, 16, 0.0, 1.0)


def test_a_whole_message_becomes_output_items_and_a_response():
    ids = (str(i) for i in itertools.count())
    message = {"content": "hi", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]}
    items = responses.output_items(message, lambda: next(ids))
    assert [i["type"] for i in items] == ["message", "function_call"] and items[1]["call_id"] == "c1"
    body = envelope().response(responses.status("length"), items, responses.usage(10, 16, 4))
    assert (body["status"], body["incomplete_details"], body["object"]) == ("incomplete", {"reason": "max_output_tokens"},
                                                                            "response")
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": 4} and body["usage"]["total_tokens"] == 26


def events(data: bytes) -> list[dict]:
    return [orjson.loads(part.split(b"\ndata: ")[1]) for part in data.split(b"\n\n") if part]


def test_stream_deltas_open_and_close_items_as_vllm_does():
    ids = (str(i) for i in itertools.count())
    e = responses.Events(envelope(), lambda: next(ids))
    data = e.start() + e.delta({"content": "Hi"}) + e.delta({"content": "!"})
    data += e.delta({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a"'}}]})
    data += e.delta({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]})
    closing, response = e.end("tool_calls", responses.usage(3, 4, 0))
    got = events(data + closing)
    assert [g["type"] for g in got] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [g["sequence_number"] for g in got] == list(range(len(got)))
    assert got[6]["text"] == "Hi!" and got[12]["arguments"] == '{"a": 1}' and got[13]["output_index"] == 1
    assert response["status"] == "completed" and [i["type"] for i in response["output"]] == ["message", "function_call"]
    assert got[-1]["response"] == response


def test_a_stored_response_is_keyed_by_its_tenant_and_only_the_gateways_own_ids_are_looked_up():
    from services.gateway import response_store

    a, b = response_store.key("acme", "resp_" + "0" * 32), response_store.key("beta", "resp_" + "0" * 32)
    assert a != b and a.endswith(".resp_" + "0" * 32)
    assert not response_store.RESPONSE_ID.fullmatch("resp_../x") and not response_store.RESPONSE_ID.fullmatch("x")
