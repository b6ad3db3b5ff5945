"""Sampling fields passed through to vLLM: greedy outputs of the disaggregated
cluster equal plain vLLM's token for token with each of them, both the fields that
hold for any stretch of the output (decode continues from prefill's first token)
and those that depend on the output's own history (decode runs the whole output:
Sampling.history_dependent)."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.e2e

PROMPT = "Once upon a time, in a kingdom by the sea,"
MAX_TOKENS = 24


def _cluster(cluster, ids: list[int], **fields) -> dict:
    body = {"model": "yuebing-tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            **fields}
    r = httpx.post(f"{cluster.api}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _reference(reference, ids: list[int], **fields) -> list[int]:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    if fields.pop("response_format", None):
        fields["structured_outputs"] = StructuredOutputsParams(json_object=True)
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **fields)
    out = reference.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT, add_special_tokens=True)


@pytest.fixture(scope="module")
def plain(reference, prompt_ids) -> list[int]:
    return _reference(reference, prompt_ids, ignore_eos=True)


def _cases(plain: list[int], tokenizer) -> dict[str, dict]:
    """Each field at a value that changes the plain greedy output (the stop and
    min_tokens cases use tokens the output itself has)."""
    return {
        "repetition_penalty": {"repetition_penalty": 1.8, "ignore_eos": True},
        "presence_penalty": {"presence_penalty": 1.5, "ignore_eos": True},
        "frequency_penalty": {"frequency_penalty": 1.9, "ignore_eos": True},
        "logit_bias": {"logit_bias": {str(plain[2]): -100, str(plain[5]): 8}, "ignore_eos": True},
        "stop_token_ids": {"stop_token_ids": [plain[4]]},
        "min_tokens": {"stop_token_ids": [plain[1]], "min_tokens": 5},
        "min_tokens_first": {"stop_token_ids": [plain[0]], "min_tokens": 1},
        "bad_words": {"bad_words": [tokenizer.decode([plain[2]]).strip() or "e"], "ignore_eos": True},
        "json_object": {"response_format": {"type": "json_object"}},
    }


@pytest.mark.parametrize("case", ["repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
                                  "stop_token_ids", "min_tokens", "min_tokens_first", "bad_words", "json_object"])
def test_greedy_output_equals_plain_vllm_with(case, cluster, reference, tokenizer, prompt_ids, plain):
    fields = _cases(plain, tokenizer)[case]
    got = _cluster(cluster, prompt_ids, **json.loads(json.dumps(fields)))
    want = _reference(reference, prompt_ids, **fields)
    assert got["token_ids"] == want, case
    if case != "json_object":
        assert want != plain[: len(want)] or len(want) != len(plain), f"{case} did not change the output: a weak test"


def test_a_history_dependent_stream_sends_each_token_once(cluster, prompt_ids):
    fields = {"presence_penalty": 1.5, "ignore_eos": True}
    full = _cluster(cluster, prompt_ids, **fields)
    body = {"model": "yuebing-tiny", "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "return_token_ids": True, **fields}
    with httpx.stream("POST", f"{cluster.api}/completions", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [t for e in events for t in e["choices"][0]["token_ids"]]
    assert streamed == full["token_ids"] and len(streamed) == MAX_TOKENS
    assert "".join(e["choices"][0]["text"] for e in events) == full["text"]
