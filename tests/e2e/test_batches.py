"""Completions with a list of prompts, against `vllm serve` on the same model: each
prompt placed on its own, the choices in vLLM's order and indices (prompt k's choice
j is k * n + j), `n` and seeds included, whole and streamed, usage summed."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

PROMPTS = ["The capital of France", "Hello w", "Once upon a time"]
TOKEN_PROMPTS = [[72, 101, 108, 108, 111], [79, 110, 99, 101, 32, 117, 112]]


@pytest.fixture(scope="module")
def servers(cluster, vllm_serve, model_dir):
    from openai import OpenAI

    clients = [OpenAI(base_url=url, api_key="unused", timeout=120, max_retries=0) for url in (cluster.api, vllm_serve)]
    return clients, model_dir.name


def whole(client, model: str, prompts=PROMPTS, **fields) -> dict:
    r = client.completions.create(model=model, prompt=prompts, max_tokens=12, **fields)
    return {"choices": [(c.index, c.text, c.finish_reason) for c in r.choices],
            "usage": (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens)}


def streamed(client, model: str, **fields) -> dict:
    texts, finish, usage = {}, {}, None
    for chunk in client.completions.create(model=model, prompt=PROMPTS, max_tokens=12, stream=True,
                                           stream_options={"include_usage": True}, **fields):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens)
    return {"choices": [(i, texts[i], finish[i]) for i in sorted(texts)], "usage": usage}


@pytest.mark.parametrize("fields", [{"temperature": 0}, {"temperature": 1, "seed": 7, "n": 2}], ids=["greedy", "n2"])
def test_a_batch_is_vllms_batch(servers, fields):
    (ours, theirs), model = servers
    got, want = whole(ours, model, **fields), whole(theirs, model, **fields)
    assert got == want, (got, want)
    assert [i for i, _, _ in got["choices"]] == list(range(len(PROMPTS) * fields.get("n", 1)))


@pytest.mark.parametrize("fields", [{"temperature": 0}, {"temperature": 1, "seed": 7, "n": 2}], ids=["greedy", "n2"])
def test_a_streamed_batch_joins_to_vllms(servers, fields):
    (ours, theirs), model = servers
    got, want = streamed(ours, model, **fields), streamed(theirs, model, **fields)
    assert got == want, (got, want)
    assert got == whole(ours, model, **fields)


def test_a_batch_of_token_id_prompts_is_vllms(servers):
    (ours, theirs), model = servers
    got, want = (whole(c, model, TOKEN_PROMPTS, temperature=0, echo=True) for c in (ours, theirs))
    assert got == want and len(got["choices"]) == 2, (got, want)


def test_each_prompt_of_a_batch_runs_on_its_own(cluster, servers):
    import httpx

    (_, _), model = servers
    r = httpx.post(f"{cluster.api}/completions", json={"model": model, "prompt": PROMPTS, "max_tokens": 4,
                                                       "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    where = r.json()["yuebing"]
    assert len(where) == len(PROMPTS) and all(w["prefill_instance"] for w in where)
    bad = httpx.post(f"{cluster.api}/completions", json={"model": model, "prompt": ["ok", ""], "max_tokens": 4},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt[1]"
