"""Tool calling's request fields at the edge: tools, tool_choice,
parallel_tool_calls and an assistant's earlier tool calls."""

from __future__ import annotations

import pytest

from services.gateway.errors import ApiError
from services.gateway.protocol import parse_chat
from services.gateway.tools import MAX_TOOLS, ToolRequest

F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def chat(**kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def test_tool_fields_parse_as_sent():
    r = parse_chat(chat(tools=[F], tool_choice={"type": "function", "function": {"name": "f"}}, parallel_tool_calls=False))
    assert r.tools == ToolRequest((F,), {"type": "function", "function": {"name": "f"}}, False) and r.tools.asked
    assert parse_chat(chat()).tools == ToolRequest() and not ToolRequest(choice="none").asked


@pytest.mark.parametrize("body, param", [
    (chat(tools=[]), "tools"),
    (chat(tools=[F] * (MAX_TOOLS + 1)), "tools"),
    (chat(tools=[{"type": "custom", "function": {"name": "f"}}]), "tools[0]"),
    (chat(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools[0].function.parameters"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "extra": 1}}]), "tools[0].function"),
    (chat(tool_choice="any"), "tool_choice"),
    (chat(tool_choice={"type": "function", "function": {"name": "f", "x": 1}}), "tool_choice"),
    (chat(parallel_tool_calls="yes"), "parallel_tool_calls"),
])  # fmt: skip
def test_bad_tool_fields_are_400s_naming_them(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body)
    assert e.value.status == 400 and e.value.param == param


def test_a_conversation_replays_its_tool_calls_to_the_template():
    messages = [{"role": "user", "content": "weather?", "name": "ann"},
                {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "think"},
                {"role": "tool", "content": [{"type": "text", "text": "sunny"}], "tool_call_id": "call-1"}]
    user, assistant, tool = parse_chat(chat(messages=messages)).messages
    assert user == {"role": "user", "content": "weather?", "name": "ann"}
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning": "think",
                         "reasoning_content": "think"}
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call-1"}
    empty = parse_chat(chat(messages=[{"role": "assistant", "content": "x", "tool_calls": []}])).messages[0]
    assert "tool_calls" not in empty  # as vLLM drops it: the template takes the plain path


@pytest.mark.parametrize("message, param", [
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "messages[0].tool_calls"),
    ({"role": "user", "content": "x", "tool_call_id": "1"}, "messages[0].tool_call_id"),
    ({"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}, "messages[0].tool_calls[0].function"),
    ({"role": "assistant", "content": "x", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "content": "x", "tool_calls": [{**CALL, "type": "custom"}]}, "messages[0].tool_calls[0]"),
    ({"role": "assistant", "content": "x", "function_call": {"name": "f"}}, "messages[0].function_call"),
])  # fmt: skip
def test_message_fields_the_template_cannot_take_are_400s(message, param):
    with pytest.raises(ApiError) as e:
        parse_chat(chat(messages=[message]))
    assert e.value.param == param
