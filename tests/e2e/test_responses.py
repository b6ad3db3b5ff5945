"""OpenAI's Responses API through the cluster, with OpenAI's SDK, against `vllm serve`
on the same model (greedy; its store on): the same status, output text, function
calls, stream event names and joined deltas, token counts and errors; a response
stored and continued by `previous_response_id`, and read back by its id."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.ops import collapsed

pytestmark = pytest.mark.e2e

MAX = 24
INSTRUCTIONS = "You are a weather assistant."
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city today", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                          "required": ["city"], "additionalProperties": False}}
NAMED = {"type": "function", "name": "get_weather"}
CALLED = [{"role": "user", "content": "Weather in Paris?"},
          {"type": "function_call", "call_id": "call-1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
          {"type": "function_call_output", "call_id": "call-1", "output": "sunny, 21 C"}]


@pytest.fixture(scope="module")
def servers(cluster, vllm_serve, model_dir):
    from openai import OpenAI

    clients = [OpenAI(base_url=url, api_key="unused", timeout=120, max_retries=0) for url in (cluster.api, vllm_serve)]
    return clients, model_dir.name


def whole(client, model: str, **fields) -> dict:
    r = client.responses.create(model=model, temperature=0, max_output_tokens=fields.pop("max_output_tokens", MAX),
                                **fields)
    items = [(i.type, i.content[0].text if i.type == "message" else (i.name, i.arguments)) for i in r.output]
    return {"items": items, "status": r.status, "text": r.output_text,
            "tokens": (r.usage.input_tokens, r.usage.output_tokens), "id": r.id}


def streamed(client, model: str, **fields) -> dict:
    names, joined, final = [], {}, None
    with client.responses.stream(model=model, temperature=0, max_output_tokens=fields.pop("max_output_tokens", MAX),
                                 **fields) as stream:
        for event in stream:
            names.append(event.type)
            if event.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
                joined[event.output_index] = joined.get(event.output_index, "") + event.delta
            if event.type == "response.completed":
                final = event.response
    assert final is not None and [e for e in names if e.endswith(".delta")], names
    return {"names": collapsed(names), "joined": [joined[i] for i in sorted(joined)], "status": final.status,
            "tokens": (final.usage.input_tokens, final.usage.output_tokens)}


def same(got: dict, want: dict) -> bool:
    return {k: v for k, v in got.items() if k != "id"} == {k: v for k, v in want.items() if k != "id"}


def test_a_response_is_vllms(servers):
    (ours, theirs), model = servers
    got, want = (whole(c, model, instructions=INSTRUCTIONS, input="Weather in Paris?") for c in (ours, theirs))
    assert same(got, want), (got, want)
    assert got["status"] == "incomplete" and got["items"][0][0] == "message" and got["id"].startswith("resp_")


def test_a_stream_has_vllms_events_and_joins_to_the_whole_response(servers):
    (ours, theirs), model = servers
    got, want = (streamed(c, model, instructions=INSTRUCTIONS, input="Weather in Paris?") for c in (ours, theirs))
    assert got == want, (got, want)
    assert got["names"][:2] == ["response.created", "response.in_progress"] and got["names"][-1] == "response.completed"
    one = whole(ours, model, instructions=INSTRUCTIONS, input="Weather in Paris?")
    assert got["joined"] == [one["text"]]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_as_in_vllm(servers, stream):
    (ours, theirs), model = servers
    fields = {"input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": NAMED, "max_output_tokens": 160}
    got, want = ((streamed if stream else whole)(c, model, **fields) for c in (ours, theirs))
    assert same(got, want), (got, want)
    if not stream:
        assert got["items"][0][0] == "function_call" and got["items"][0][1][0] == "get_weather", got


def test_a_function_calls_output_reaches_the_template_as_in_vllm(servers):
    (ours, theirs), model = servers
    got, want = (whole(c, model, instructions=INSTRUCTIONS, input=CALLED, tools=[WEATHER]) for c in (ours, theirs))
    assert same(got, want), (got, want)
    assert got["tokens"][0] > whole(ours, model, input="Weather in Paris?")["tokens"][0] + 40


def test_a_json_schema_format_is_vllms(servers):
    (ours, theirs), model = servers
    fmt = {"format": {"type": "json_schema", "name": "city", "strict": True, "schema": WEATHER["parameters"]}}
    got, want = (whole(c, model, input="A city?", text=fmt, max_output_tokens=64) for c in (ours, theirs))
    assert same(got, want), (got, want)


def test_a_stored_response_is_read_back_and_continued_as_in_vllm(servers):
    (ours, theirs), model = servers
    first = [whole(c, model, instructions=INSTRUCTIONS, input="Weather in Paris?", store=True) for c in (ours, theirs)]
    for client, one in zip((ours, theirs), first):
        assert client.responses.retrieve(one["id"]).output_text == one["text"]
    second = [whole(c, model, input="And Tokyo?", previous_response_id=one["id"]) for c, one in zip((ours, theirs), first)]
    assert same(second[0], second[1]), second
    alone = whole(ours, model, input="And Tokyo?")
    assert second[0]["tokens"][0] > alone["tokens"][0] + 20  # turn 1 and its answer lead turn 2 (its instructions do not)


@pytest.mark.parametrize("path, body, status", [
    ("/responses", {"input": "hi", "previous_response_id": "resp_0123456789abcdef0123456789abcdef"}, 404),
    ("/responses", {"input": "hi", "previous_response_id": "../../etc"}, 404),
    ("/responses", {}, 400),
])
def test_errors_have_vllms_status(cluster, vllm_serve, model_dir, path, body, status):
    got, want = (httpx.post(f"{url}{path}", json={"model": model_dir.name, **body}, timeout=60)
                 for url in (cluster.api, vllm_serve))
    assert got.status_code == want.status_code == status, (got.text, want.text)
    assert got.json()["error"]["message"]


def test_an_unknown_response_is_not_found_and_a_synchronous_one_cannot_be_cancelled(servers, cluster):
    (ours, _), model = servers
    gone = httpx.get(f"{cluster.api}/responses/resp_0123456789abcdef0123456789abcdef", timeout=10)
    assert gone.status_code == 404
    one = whole(ours, model, input="hi", max_output_tokens=2)
    cancel = httpx.post(f"{cluster.api}/responses/{one['id']}/cancel", timeout=10)
    assert cancel.status_code == 400 and "synchronous" in cancel.json()["error"]["message"]


def test_an_agents_sdk_agent_calls_its_function_tool_and_answers(cluster, model_dir):
    """The OpenAI Agents SDK's default model speaks the Responses API. The tool is forced
    (a random model would not choose it) and its result is the agent's answer (a random
    model's own answer would run to max_tokens, which the SDK refuses as incomplete)."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city today."""
        calls.append(city)
        return f"sunny in {city}"

    set_tracing_disabled(True)  # no trace export to OpenAI's servers
    client = AsyncOpenAI(base_url=cluster.api, api_key="unused", timeout=120, max_retries=0)
    agent = Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                  model=OpenAIResponsesModel(model_dir.name, client),
                  model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=200))
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=3))
    assert len(calls) == 1 and calls[0]  # a random model's city: any string the schema allows
    assert result.final_output == f"sunny in {calls[0]}"
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem"]
