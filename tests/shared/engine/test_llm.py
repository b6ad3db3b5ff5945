"""shared/engine/llm.py: what the engines send back of a token's log probabilities."""

from vllm.logprobs import Logprob

from shared.engine.llm import token_logprobs


def test_a_position_becomes_the_samplers_row_sampled_first_then_the_top_in_rank_order():
    # vLLM's dict: the sampled token first, then the top 3 (the sampled one among them merged)
    position = {7: Logprob(-1.2, rank=2), 3: Logprob(-0.4, rank=1), 9: Logprob(-2.5, rank=3)}
    row = token_logprobs(position, 3)
    assert row.token_ids == [7, 3, 7, 9] and row.logprobs == [-1.2, -0.4, -1.2, -2.5] and row.rank == 2


def test_a_sampled_token_outside_the_top_is_only_first():
    position = {7: Logprob(-4.0, rank=5), 3: Logprob(-0.4, rank=1)}
    row = token_logprobs(position, 1)
    assert row.token_ids == [7, 3] and row.logprobs == [-4.0, -0.4] and row.rank == 5
    assert token_logprobs({7: Logprob(-4.0, rank=5)}, 0).token_ids == [7]
