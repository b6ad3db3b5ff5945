"""n > 1 through the disaggregated cluster: the prompt prefilled once, decode sampling
the n choices with vLLM's own parallel sampling, equal to plain vLLM's with the same
seed, streamed with their indices; greedy choices refused as vLLM refuses them."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.e2e

MODEL = "yuebing-tiny"
MAX_TOKENS = 12


def reference_choices(reference, prompt: list[int], n: int, **fields) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(n=n, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)
    [out] = reference.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return [list(o.token_ids) for o in sorted(out.outputs, key=lambda o: o.index)]


def _post(cluster, body: dict) -> dict:
    r = httpx.post(f"{cluster.api}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode("The lighthouse keeper counted the ships:")


def test_greedy_choices_are_refused_as_plain_vllm_refuses_them(cluster, reference, prompt):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "n": 4}
    r = httpx.post(f"{cluster.api}/completions", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError) as plain:
        reference_choices(reference, prompt, 4, temperature=0.0)
    assert r.json()["error"]["message"] == str(plain.value)


def test_seeded_choices_equal_plain_vllms_with_the_same_seed(cluster, reference, prompt):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 1234,
            "ignore_eos": True, "n": 3, "return_token_ids": True}
    reply = _post(cluster, body)
    got = [c["token_ids"] for c in reply["choices"]]
    assert got == reference_choices(reference, prompt, 3, temperature=1.0, seed=1234)
    assert len({tuple(t) for t in got}) > 1  # sampled: the choices differ
    assert reply["usage"]["completion_tokens"] == 3 * MAX_TOKENS
    assert reply["yuebing"]["prefills"] == 1  # one prompt, prefilled once for the three


def test_streamed_choices_come_with_their_indices_and_join_to_the_whole_ones(cluster, prompt):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count the ships."}], "max_tokens": MAX_TOKENS,
            "temperature": 1.0, "seed": 7, "ignore_eos": True, "n": 2}
    whole = httpx.post(f"{cluster.api}/chat/completions", json=body, timeout=120).json()
    texts, roles, finishes = {0: "", 1: ""}, [], {}
    with httpx.stream("POST", f"{cluster.api}/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                delta = choice["delta"]
                if "role" in delta:
                    roles.append(choice["index"])
                texts[choice["index"]] += delta.get("content", "")
                if choice["finish_reason"]:
                    finishes[choice["index"]] = choice["finish_reason"]
    assert roles == [0, 1] and finishes == {0: "length", 1: "length"}
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]
