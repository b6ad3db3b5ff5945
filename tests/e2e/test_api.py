"""The OpenAI API of the real local cluster, through the official client."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Hello!",
    "Tell me a story about a mooncake that travelled across the sea.",
    "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 12,
    "日本語のテキストも大丈夫ですか？",
]


def test_lists_the_model_with_its_root_and_context(client, cluster, model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [model_dir.name]
    extra = models[0].model_extra
    assert extra["root"] == str(model_dir.resolve())
    assert extra["max_model_len"] == 1024


def _chat(client, content: str, **kw):
    return client.chat.completions.create(
        model="yuebing-tiny",
        messages=[{"role": "user", "content": content}],
        temperature=0,
        extra_body={"return_token_ids": True},
        **kw,
    )


def test_greedy_outputs_equal_plain_vllm_token_for_token(client, reference, tokenizer):
    # Concurrent requests: the instances batch them, as they would in service.
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(lambda p: _chat(client, p, max_tokens=24), PROMPTS))
    prompts = [r.model_extra["prompt_token_ids"] for r in responses]
    for text, ids in zip(PROMPTS, prompts):
        expected = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        assert ids == tokenizer.encode(expected, add_special_tokens=False)
    want = reference.greedy(prompts, max_tokens=24)
    got = [r.choices[0].model_extra["token_ids"] for r in responses]
    assert got == want
    for r, ids in zip(responses, got):
        assert r.usage.completion_tokens == len(ids)
        assert r.choices[0].message.content == tokenizer.decode(ids, skip_special_tokens=True)


def test_streaming_equals_non_streaming_and_reports_usage(client):
    full = _chat(client, PROMPTS[1], max_tokens=32)
    stream = client.chat.completions.create(
        model="yuebing-tiny",
        messages=[{"role": "user", "content": PROMPTS[1]}],
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        full.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "A long shared system prompt. " * 20
    first = _chat(client, prompt, max_tokens=4)
    second = _chat(client, prompt, max_tokens=4)
    assert first.usage.prompt_tokens > 100
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    assert second.choices[0].message.content == first.choices[0].message.content


def test_completions_endpoint_with_text_and_token_prompts(client, reference, tokenizer):
    ids = tokenizer.encode("Once upon a time", add_special_tokens=True)
    by_text = client.completions.create(model="yuebing-tiny", prompt="Once upon a time", max_tokens=16, temperature=0,
                                        extra_body={"return_token_ids": True})
    by_ids = client.completions.create(model="yuebing-tiny", prompt=ids, max_tokens=16, temperature=0)
    assert by_text.model_extra["prompt_token_ids"] == ids
    assert by_text.choices[0].model_extra["token_ids"] == reference.greedy([ids], 16)[0]
    assert by_ids.choices[0].text == by_text.choices[0].text
    streamed = client.completions.create(model="yuebing-tiny", prompt=ids, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == by_text.choices[0].text


def test_max_tokens_one_is_served_by_prefill_alone(client):
    r = _chat(client, "hi", max_tokens=1)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason in ("length", "stop")


BAD = [
    (b"{not json", 400, None),
    (b'{"model": "yuebing-tiny"}', 400, "messages"),
    (b'{"model": "yuebing-tiny", "messages": []}', 400, "messages"),
    (b'{"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    (b'{"model": "yuebing-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "yuebing-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}', 400, "max_tokens"),
    (b'{"model": "yuebing-tiny", "messages": [{"role": "user", "content": "x"}], "n": 17}', 400, "n"),
    (b'{"model": "yuebing-tiny", "messages": [{"role": "user", "content": "' + b"x" * 1100 + b'"}]}', 400, "messages"),
]


@pytest.mark.parametrize("body, status, param", BAD, ids=["json", "no-messages", "empty-messages", "unknown-model",
                                                        "max-tokens-0", "max-tokens-over-context", "n-2", "prompt-too-long"])
def test_bad_requests_get_4xx_with_an_openai_error_body(cluster, client, body, status, param):
    r = httpx.post(f"{cluster.api}/chat/completions", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param
    # ... and the cluster keeps serving.
    assert _chat(client, "still there?", max_tokens=2).usage.completion_tokens == 2


def test_health_and_metrics(cluster, client):
    _chat(client, "count me", max_tokens=3)
    health = httpx.get(f"{cluster.url}/health", timeout=10).json()
    assert health["status"] == "ok"
    assert health["instances"]["prefill"] == ["prefill-0"] and health["instances"]["decode"] == ["decode-0"]
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert 'yuebing_gateway_requests_total{endpoint="chat",status="200"}' in metrics
    assert "yuebing_gateway_ttft_seconds_bucket" in metrics


def test_stop_strings_end_the_output_before_them(client):
    full = client.completions.create(model="yuebing-tiny", prompt="Stop here:", max_tokens=32, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[10:13]
    assert len(stop) == 3
    cut = client.completions.create(model="yuebing-tiny", prompt="Stop here:", max_tokens=32, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


def _streamed_text(cluster, prompt: str, label: str) -> tuple[str, str]:
    body = {"model": "yuebing-tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{cluster.api}/completions", json=body, headers={"x-request-id": label}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == label
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: {")]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events), r.headers["x-yuebing-request-id"]


def test_clients_ids_are_labels_duplicates_never_cross_and_a_hostile_one_is_refused(cluster, client):
    # Two streams under one client id, and a hostile id beside them: each stream gets
    # its own tokens (the cluster keys requests by the gateway's own ids), the hostile
    # request a 400, and the API stays up.
    prompts = [PROMPTS[1], PROMPTS[2]]
    hostile = {"model": "yuebing-tiny", "prompt": "x", "max_tokens": 2}
    hostile_ids = ["*" + "x" * 7999, "a b", "*", ">", "yb.v1.>", "tab\there"]
    with concurrent.futures.ThreadPoolExecutor(2 + len(hostile_ids)) as pool:
        streams = [pool.submit(_streamed_text, cluster, p, "same-id") for p in prompts]
        refused = [pool.submit(httpx.post, f"{cluster.api}/completions", json=hostile, headers={"x-request-id": h},
                               timeout=60) for h in hostile_ids]
        (text_a, id_a), (text_b, id_b) = (s.result() for s in streams)
    for r in (f.result() for f in refused):
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"
    assert id_a != id_b
    for prompt, text in zip(prompts, (text_a, text_b)):
        alone = client.completions.create(model="yuebing-tiny", prompt=prompt, max_tokens=16, temperature=0)
        assert text == alone.choices[0].text
