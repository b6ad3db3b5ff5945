"""The real model `make run` serves (SmolLM2-135M-Instruct, `yuebing model fetch`)
through the disaggregated cluster, against `vllm serve` on the same folder and dtype,
greedy: a real BPE tokenizer with its special tokens, a real chat template, text of
several bytes a character. (Its chat template does not render `tools`, so the model
is never shown a tool and makes no tool calls: what a request with tools gets is
compared instead.)"""

from __future__ import annotations

import pytest

from tests.e2e.ops import client_at as client

pytestmark = pytest.mark.e2e

LOGPROB_TOLERANCE = 1e-4
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def chat(api: str, model: str, messages: list[dict], **kw):
    return client(api).chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=48, **kw)


def streamed(api: str, model: str, messages: list[dict]) -> tuple[list[str], str | None]:
    deltas, finish = [], None
    stream = client(api).chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=48,
                                                 stream=True)
    for chunk in stream:
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return deltas, finish


def test_greedy_chat_answers_paris_through_the_template_as_vllm_serve_does(real_model, real_vllm_serve, real_model_dir):
    ours, plain = (chat(api, real_model_dir.name, FRANCE) for api in (real_model.api, real_vllm_serve))
    assert "Paris" in ours.choices[0].message.content
    assert ours.choices[0].message.content == plain.choices[0].message.content
    # It ended at <|im_end|> (the template's end of turn, the model's EOS), not at max_tokens.
    assert ours.choices[0].finish_reason == plain.choices[0].finish_reason == "stop"
    assert (ours.usage.prompt_tokens, ours.usage.completion_tokens) == (
        plain.usage.prompt_tokens, plain.usage.completion_tokens)


@pytest.mark.parametrize("prompt", ["Translate to Chinese: Good morning, my friend.", "Reply with three emoji about the sea 🌊."])
def test_streamed_text_of_several_bytes_a_character_joins_to_vllms(real_model, real_vllm_serve, real_model_dir, prompt):
    messages = [{"role": "user", "content": prompt}]
    deltas, finish = streamed(real_model.api, real_model_dir.name, messages)
    plain = chat(real_vllm_serve, real_model_dir.name, messages)
    text = "".join(deltas)
    assert text == plain.choices[0].message.content and finish == plain.choices[0].finish_reason
    assert any(ord(c) > 0x2000 for c in text), text  # it answered in characters beyond one byte
    assert "\ufffd" not in text  # no delta split a character


def test_logprobs_match_vllm_serve(real_model, real_vllm_serve, real_model_dir):
    ours, plain = (chat(api, real_model_dir.name, FRANCE, logprobs=True, top_logprobs=3)
                   for api in (real_model.api, real_vllm_serve))
    got, want = ours.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert [t.token for t in got] == [t.token for t in want]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=LOGPROB_TOLERANCE)
    for g, w in zip(got, want, strict=True):
        assert [t.token for t in g.top_logprobs] == [t.token for t in w.top_logprobs]


def test_a_request_with_tools_gets_what_vllm_serve_gives(real_model, real_vllm_serve, real_model_dir):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ours, plain = (chat(api, real_model_dir.name, messages, tools=tools) for api in (real_model.api, real_vllm_serve))
    assert ours.choices[0].message.content == plain.choices[0].message.content
    assert ours.choices[0].message.tool_calls == plain.choices[0].message.tool_calls
    assert ours.choices[0].finish_reason == plain.choices[0].finish_reason
