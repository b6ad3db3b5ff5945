"""The gateway's Sampling as the engines see it: every field reaches vLLM's
SamplingParams on both instances, min_tokens split between prefill's first token
and decode's rest, and the history-dependent rule."""

from __future__ import annotations

import pytest

from shared.engine.llm import sampling_params
from shared.messages import Sampling

FULL = Sampling(max_tokens=8, temperature=0.5, top_p=0.9, top_k=5, min_p=0.05, seed=7, ignore_eos=True,
                stop_token_ids=[3], min_tokens=3, repetition_penalty=1.3, logit_bias={65: 2.0},
                allowed_token_ids=[65, 66, 3])  # fmt: skip


def test_static_fields_pass_through_to_both_shares():
    for share, produced in ((1, 0), (7, 1)):
        p = sampling_params(FULL, share, produced=produced)
        assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.ignore_eos) == (
            share, 0.5, 0.9, 5, 0.05, 7, True)
        assert (p.stop_token_ids, p.repetition_penalty, p.logit_bias, p.allowed_token_ids) == ([3], 1.3, {65: 2.0}, [65, 66, 3])
        assert p.structured_outputs is None and not FULL.history_dependent


@pytest.mark.parametrize("min_tokens, prefill, decode", [(0, 0, 0), (1, 1, 0), (3, 1, 2), (8, 1, 7)])
def test_min_tokens_is_split_between_the_first_token_and_the_rest(min_tokens, prefill, decode):
    s = Sampling(max_tokens=8, min_tokens=min_tokens)
    assert sampling_params(s, 1, produced=0).min_tokens == prefill
    assert sampling_params(s, 7, produced=1).min_tokens == decode
    assert sampling_params(s, 8, produced=0).min_tokens == min_tokens  # history-dependent decode: the whole output


@pytest.mark.parametrize("fields", [{"presence_penalty": 0.5}, {"frequency_penalty": -0.1}, {"bad_words": ["ab"]},
                                    {"json_object": True}, {"json_schema": '{"type": "object"}'}])
def test_output_history_makes_a_request_history_dependent(fields):
    s = Sampling(max_tokens=4, **fields)
    assert s.history_dependent
    p = sampling_params(s, 4)
    assert (p.presence_penalty, p.frequency_penalty) == (s.presence_penalty, s.frequency_penalty)
    if s.json_schema:
        assert p.structured_outputs.json == s.json_schema
    if s.json_object:
        assert p.structured_outputs.json_object
