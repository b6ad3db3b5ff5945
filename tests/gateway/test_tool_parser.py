"""Tool calling through vLLM's own parser (hermes, which the tiny model's chat
template speaks): what a request's tools mean, and each choice's text parsed into
tool calls, whole and streamed, with vLLM's server's finish reasons."""

from __future__ import annotations

import json

import pytest

from services.gateway.errors import ApiError
from services.gateway.structured import ResponseFormat
from services.gateway.tool_parser import ToolParsing
from services.gateway.tools import ToolRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "today's weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT = "Let me see." + CALL


@pytest.fixture(scope="module")
def hermes(tokenizer):
    return ToolParsing("hermes", tokenizer.hf)


def use(parsing: ToolParsing, choice=None, parallel=True, tools=(WEATHER,), skip_special_tokens=True):
    return parsing.use(ToolRequest(tuple(tools), choice, parallel), skip_special_tokens, ResponseFormat())


def stream(tools, tokenizer, text: str, finish: str = "stop") -> tuple[list[dict], str | None]:
    """The text token by token through a choice's parser, as a stream sends it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = [tools.delta(tokenizer.decode([t]), [t], finish if i == len(ids) - 1 else None) for i, t in enumerate(ids)]
    return [d for d in deltas if d], tools.finish_reason(finish)


def joined(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """A stream's content and its calls' (name, arguments), joined as a client joins them."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls", ()):
            name, args = calls.get(c["index"], ("", ""))
            f = c.get("function") or {}
            calls[c["index"]] = (name + (f.get("name") or ""), args + (f.get("arguments") or ""))
    return content, [calls[i] for i in sorted(calls)]


def test_no_tools_no_tool_use(hermes):
    assert hermes.use(ToolRequest(), True, ResponseFormat()) is None
    assert hermes.use(ToolRequest(choice="none"), True, ResponseFormat()) is None


def test_auto_calls_are_parsed_whole_and_finish_as_tool_calls(hermes, tokenizer):
    u = use(hermes)
    assert u.request.tool_choice == "auto" and not u.structural_tag  # auto: no grammar, the model decides
    assert u.skip_special_tokens is False  # hermes keeps special tokens: its tags may be some
    assert u.template_tools == [WEATHER]
    message, finish = u.choice([1]).message(TEXT, tokenizer.encode(TEXT, add_special_tokens=False), "stop")
    (call,) = message["tool_calls"]
    assert message["content"] == "Let me see." and finish == "tool_calls"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")


def test_auto_without_a_call_is_plain_content(hermes):
    message, finish = use(hermes).choice([1]).message("just words", [], "length")
    assert message == {"role": "assistant", "content": "just words"} and finish == "length"


def test_a_streamed_call_joins_to_the_whole_one(hermes, tokenizer):
    deltas, finish = stream(use(hermes).choice([1]), tokenizer, TEXT)
    assert joined(deltas) == ("Let me see.", [("get_weather", '{"city": "Paris"}')])
    assert finish == "tool_calls"
    assert sum(1 for d in deltas for c in d.get("tool_calls", ()) if c.get("id")) == 1  # the id comes once


@pytest.mark.parametrize("choice, finish", [("required", "tool_calls"), (NAMED, "stop")])
def test_forced_calls_decode_under_vllms_structural_tag(hermes, tokenizer, choice, finish):
    u = use(hermes, choice)
    tag = json.loads(u.structural_tag)
    assert tag["type"] == "structural_tag" and "<tool_call>" in json.dumps(tag)
    assert u.choice([1]).message(TEXT, [], "stop")[1] == finish
    assert stream(u.choice([1]), tokenizer, TEXT)[1] == finish  # a named call ends with "stop", as in OpenAI's API


def test_none_keeps_the_text_and_the_tools_in_the_template(hermes, tokenizer):
    u = use(hermes, "none")
    assert not u.structural_tag and u.skip_special_tokens and u.template_tools == [WEATHER]
    assert u.choice([1]).message(TEXT, [], "stop") == ({"role": "assistant", "content": TEXT}, "stop")
    assert joined(stream(u.choice([1]), tokenizer, TEXT)[0]) == (TEXT, [])


def test_parallel_tool_calls_false_keeps_the_first_call(hermes, tokenizer):
    two = TEXT + CALL.replace("Paris", "Tokyo")
    assert len(use(hermes).choice([1]).message(two, [], "stop")[0]["tool_calls"]) == 2
    u = use(hermes, parallel=False)
    assert [c["function"]["arguments"] for c in u.choice([1]).message(two, [], "stop")[0]["tool_calls"]] == \
        ['{"city": "Paris"}']
    assert joined(stream(u.choice([1]), tokenizer, two)[0])[1] == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("asked, param, words", [
    (ToolRequest((), "auto"), "tool_choice", "`tools` must be set"),
    (ToolRequest((WEATHER,), {"type": "function", "function": {"name": "nope"}}), "tool_choice", "does not match"),
    (ToolRequest(({"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "bogus"}}},),
                 "required"), "tools", "not a schema"),
])  # fmt: skip
def test_vllms_rules_refuse_with_its_words(hermes, asked, param, words):
    with pytest.raises(ApiError) as e:
        hermes.use(asked, True, ResponseFormat())
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


def test_without_a_parser_only_none_passes(tokenizer):
    plain = ToolParsing("", tokenizer.hf)
    assert use(plain, "none").choice([1]) is None  # the tools reach the template; the text is left as it is
    for choice, words in [(None, '"auto" tool choice requires'), ("required", 'tool_choice="required" requires'),
                          (NAMED, 'function "get_weather" requires')]:
        with pytest.raises(ApiError, match=words):
            use(plain, choice)


def test_an_unknown_parser_is_refused_at_start(tokenizer):
    with pytest.raises(ValueError, match="nonesuch"):
        ToolParsing("nonesuch", tokenizer.hf)
