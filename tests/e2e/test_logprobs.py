"""Log probabilities through the disaggregated cluster equal plain vLLM's: the first
token's computed on prefill, the rest on decode, through the OpenAI client, streamed
or whole, chat or completions, with the token strings vLLM gives. (A stream
continued on another decode keeps them exact: tests/e2e/test_migration.py.)"""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.e2e

MODEL = "yuebing-tiny"
MAX_TOKENS = 16
TOLERANCE = 1e-4


def reference_logprobs(reference, prompt: list[int], top: int, **fields) -> list[dict]:
    """Plain vLLM's greedy output with its log probabilities: per token, the dict of
    token id → Logprob (the sampled token first, then the top)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=top, **fields)
    [out] = reference.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return list(zip(out.outputs[0].token_ids, out.outputs[0].logprobs))


def test_chat_logprobs_and_top_logprobs_equal_plain_vllms(client, reference, tokenizer):
    messages = [{"role": "user", "content": "Name three colours of the sea."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = reference_logprobs(reference, tokenizer.encode(text, add_special_tokens=False), 3)
    assert len(content) == len(expected) == MAX_TOKENS
    for got, (token_id, position) in zip(content, expected):
        assert got.token == position[token_id].decoded_token
        assert got.logprob == pytest.approx(position[token_id].logprob, abs=TOLERANCE)
        top = list(position.items())[:3]  # vLLM's server: the sampled token first, then the top
        assert [t.token for t in got.top_logprobs] == [lp.decoded_token for _, lp in top]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([lp.logprob for _, lp in top], abs=TOLERANCE)


def _completion(cluster, body: dict) -> dict:
    """The completion's text and logprobs, joined over a stream's chunks when streamed."""
    if not body.get("stream"):
        r = httpx.post(f"{cluster.api}/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return {"text": choice["text"], **choice["logprobs"]}
    joined: dict = {"text": "", "text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    with httpx.stream("POST", f"{cluster.api}/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            joined["text"] += choice["text"]
            for key, values in (choice["logprobs"] or {}).items():
                joined[key] += values
    return joined


@pytest.mark.parametrize("fields", [{}, {"presence_penalty": 1.5}], ids=["continued", "history-dependent"])
def test_completions_logprobs_streamed_or_whole_equal_plain_vllms(cluster, reference, tokenizer, fields):
    prompt = tokenizer.encode("Once upon a time, in a kingdom by the sea,")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, **fields}
    whole, streamed = _completion(cluster, body), _completion(cluster, {**body, "stream": True})
    expected = reference_logprobs(reference, prompt, 2, **fields)
    assert whole["tokens"] == streamed["tokens"] == [p[t].decoded_token for t, p in expected]
    for got in (whole, streamed):
        assert got["token_logprobs"] == pytest.approx([p[t].logprob for t, p in expected], abs=TOLERANCE)
        assert got["text_offset"] == [len("".join(got["tokens"][:i])) for i in range(MAX_TOKENS)]
        assert all(len(top) <= 3 for top in got["top_logprobs"])  # the top 2 and the sampled token
    assert whole["text"] == streamed["text"]


def reference_prompt_logprobs(reference, prompt: list[int], top: int) -> list:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top, logprobs=top)
    [out] = reference.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out.prompt_logprobs


def test_an_echoed_prompts_logprobs_are_plain_vllms_as_lm_eval_asks_for_them(cluster, reference, tokenizer):
    # lm-evaluation-harness's log-likelihood request: the context and continuation as
    # one prompt, echoed, one token generated, the logprob and the top one of each.
    prompt = tokenizer.encode("The capital of France is Paris")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
            "seed": 1234}
    whole, streamed = _completion(cluster, body), _completion(cluster, {**body, "stream": True})
    expected = reference_prompt_logprobs(reference, prompt, 1)
    assert whole["tokens"] == streamed["tokens"]
    assert whole["token_logprobs"][0] is None and whole["top_logprobs"][0] is None  # nothing precedes the first
    for got in (whole, streamed):
        assert got["text"].startswith(tokenizer.decode(prompt))
        assert got["tokens"][1:len(prompt)] == [p[t].decoded_token for t, p in zip(prompt[1:], expected[1:])]
        assert got["token_logprobs"][1:len(prompt)] == pytest.approx(
            [p[t].logprob for t, p in zip(prompt[1:], expected[1:])], abs=TOLERANCE)
        assert len(got["tokens"]) == len(prompt) + 1


def test_prompt_logprobs_are_plain_vllms_in_its_own_shape(cluster, reference, tokenizer):
    messages = [{"role": "user", "content": "A short prompt, scored."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    r = httpx.post(f"{cluster.api}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()["prompt_logprobs"]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = reference_prompt_logprobs(reference, tokenizer.encode(text, add_special_tokens=False), 2)
    assert got[0] is None and len(got) == len(expected)
    for position, want in zip(got[1:], expected[1:]):
        assert list(position) == [str(t) for t in want]  # the prompt's token first, then the top two
        for t, lp in want.items():
            assert position[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=TOLERANCE)
            assert (position[str(t)]["rank"], position[str(t)]["decoded_token"]) == (lp.rank, lp.decoded_token)
