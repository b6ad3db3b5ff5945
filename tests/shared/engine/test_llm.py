"""shared/engine/llm.py: what the engines send back of a token's log probabilities, and a
request's steps handed on as the engine's output task produces them."""

import pytest
from vllm.logprobs import Logprob

from shared.engine.fake import FakeEngine, token_at
from shared.engine.llm import Run, running, token_logprobs
from shared.messages import Sampling


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


# --- a request's steps handed on by the engine's output task (decode's streams) ----------
async def test_running_hands_each_step_on_in_order_and_ends_with_the_request():
    engine, steps = FakeEngine(0.001), []
    async with running(engine, "r", [1, 2], Sampling(max_tokens=3), 3, steps.append) as run:
        await run.wait()
    assert [s.token_ids for s in steps] == [[token_at(i)] for i in range(3)]
    assert [s.finish_reason for s in steps] == [None, None, "length"]
    assert not engine.running


async def test_leaving_a_run_before_its_end_aborts_it_in_the_engine():
    engine, steps = FakeEngine(0.001), []
    async with running(engine, "r", [1], Sampling(max_tokens=1000), 1000, steps.append) as run:
        await run.started
    assert not engine.running and len(steps) < 1000


async def test_an_error_put_by_the_engine_ends_the_run_with_it():
    run = Run(params=None, on_step=lambda step: None)
    run.put(RuntimeError("engine core died"))
    assert run.started.done()
    with pytest.raises(RuntimeError, match="engine core died"):
        await run.wait()


async def test_a_failing_consumer_fails_its_own_run_not_the_engines_output_task():
    def broken(step):
        raise ValueError("no room")

    engine = FakeEngine(0.001)
    async with running(engine, "r", [1], Sampling(max_tokens=5), 5, broken) as run:
        with pytest.raises(ValueError, match="no room"):
            await run.wait()
    assert not engine.running
