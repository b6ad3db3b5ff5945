"""Tool calling through the cluster, with the OpenAI SDK, against `vllm serve
--enable-auto-tool-choice --tool-call-parser hermes` on the same model: a named
tool_choice, "required" and a streamed call give the same tool calls (names and
arguments; ids are random on both), the same content and finish reasons, and a
conversation that replays earlier calls and their results reaches the model as the
same prompt (equal prompt token counts, equal greedy text)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e

MAX_TOKENS = 160  # the tiny tokenizer spends about a token a character
# A strict schema keeps a random model's arguments short: the grammar allows one key
# and two values, and then the call must close.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city today", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "system", "content": "You are a weather assistant."}, {"role": "user", "content": "Weather in Paris?"}]
REPLAY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def servers(cluster, vllm_serve, model_dir):
    from openai import OpenAI

    clients = [OpenAI(base_url=url, api_key="unused", timeout=120, max_retries=0) for url in (cluster.api, vllm_serve)]
    return clients, model_dir.name


@pytest.fixture(scope="module", autouse=True)
def no_spaces(tokenizer):
    """A random model would fill a JSON call with whitespace (the grammar allows it)
    until max_tokens: whitespace tokens are biased away, on both servers alike."""
    blank = [i for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip() and i not in tokenizer.all_special_ids]
    BIAS.update({str(i): -100 for i in blank})


BIAS: dict[str, int] = {}


def whole(client, model: str, max_tokens: int = MAX_TOKENS, **fields) -> dict:
    r = client.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens, logit_bias=BIAS, **fields)
    (choice,) = r.choices
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    return {"content": choice.message.content, "calls": calls, "finish": choice.finish_reason,
            "prompt_tokens": r.usage.prompt_tokens, "ids": [c.id for c in choice.message.tool_calls or ()]}


def streamed(client, model: str, **fields) -> dict:
    """A stream's deltas joined as a client joins them."""
    content, calls, finish, ids = "", {}, None, []
    chunks = client.chat.completions.create(model=model, temperature=0, max_tokens=MAX_TOKENS, stream=True,
                                            logit_bias=BIAS, **fields)
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or ():
            name, args = calls.get(c.index, ("", ""))
            calls[c.index] = (name + (c.function.name or ""), args + (c.function.arguments or ""))
            ids += [c.id] if c.id else []
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish, "ids": ids}


def same(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k != "ids"} == {k: v for k, v in b.items() if k != "ids"}


@pytest.mark.parametrize("choice, finish", [(NAMED, "stop"), ("required", "tool_calls")])
def test_a_forced_call_is_vllms_call(servers, choice, finish):
    (ours, theirs), model = servers
    got, want = (whole(c, model, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice) for c in (ours, theirs))
    assert same(got, want), (got, want)
    assert got["calls"] and got["calls"][0][0] == "get_weather" and got["finish"] == finish, got
    assert all(i.startswith("chatcmpl-tool-") for i in got["ids"])


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_streamed_call_joins_to_vllms_stream_and_to_the_whole_call(servers, choice):
    (ours, theirs), model = servers
    got, want = (streamed(c, model, messages=ASK, tools=[WEATHER], tool_choice=choice) for c in (ours, theirs))
    assert same(got, want), (got, want)
    assert got["calls"] and len(got["ids"]) == len(got["calls"])  # each call's id comes once
    one = whole(ours, model, messages=ASK, tools=[WEATHER], tool_choice=choice)
    # vLLM streams the arguments as the model wrote them, and re-serializes whole ones.
    assert [(n, json.loads(a)) for n, a in got["calls"]] == [(n, json.loads(a)) for n, a in one["calls"]]
    assert got["finish"] == one["finish"]


def test_parallel_tool_calls_false_is_vllms(servers):
    (ours, theirs), model = servers
    fields = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    got, want = whole(ours, model, **fields), whole(theirs, model, **fields)
    assert same(got, want) and len(got["calls"]) == 1, (got, want)


def test_a_replayed_call_and_its_result_reach_the_template_as_in_vllm(servers):
    """Auto tool choice after a tool's result: the same prompt (every message field
    rendered alike) and the same greedy answer, parsed alike."""
    (ours, theirs), model = servers
    got, want = (whole(c, model, 64, messages=REPLAY, tools=[WEATHER, CLOCK]) for c in (ours, theirs))
    assert same(got, want), (got, want)
    bare = whole(ours, model, messages=ASK)
    assert got["prompt_tokens"] > bare["prompt_tokens"] + 40  # the tools, the call and its result are all in it


def test_tool_choice_none_leaves_the_text_alone(servers):
    (ours, theirs), model = servers
    got, want = (whole(c, model, messages=ASK, tools=[WEATHER], tool_choice="none") for c in (ours, theirs))
    assert same(got, want) and got["calls"] == [] and got["content"], (got, want)
