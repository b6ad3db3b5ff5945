"""Decode's streams read from the engine core's outputs (shared/engine/outputs.py), on
vLLM's own output processor: the steps a stream gets, and vLLM's books kept."""

from __future__ import annotations

import time
from types import SimpleNamespace

from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
from vllm.v1.metrics.stats import IterationStats

from shared.engine.llm import Run, sampling_params
from shared.engine.outputs import LeanOutputs
from shared.messages import Sampling


def started(processor: OutputProcessor, request_id: str, sampling: Sampling, steps: list) -> Run:
    """A request as AsyncLLM.add_request registers it, its collector handed to a Run."""
    params = sampling_params(sampling, sampling.max_tokens)
    request = EngineCoreRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], mm_features=None,
                                sampling_params=params, pooling_params=None, arrival_time=time.time(),
                                lora_request=None, cache_salt=None, data_parallel_rank=None,
                                external_req_id=request_id.split("-")[0])
    collector = RequestOutputCollector(params.output_kind, request_id)
    processor.add_request(request, None, None, 0, collector)
    run = Run(params, steps.append)
    run.take_over(collector)
    return run


def engine() -> SimpleNamespace:
    return SimpleNamespace(output_processor=OutputProcessor(None, log_stats=True))


async def test_a_plain_streams_steps_come_from_the_core_outputs_and_vllm_books_it():
    e, steps = engine(), []
    lean = LeanOutputs(e)
    run = started(e.output_processor, "a-1", Sampling(max_tokens=2), steps)
    lean.add(run)
    stats = IterationStats()
    e.output_processor.process_outputs([EngineCoreOutput("a-1", [7])], time.monotonic(), stats)
    e.output_processor.process_outputs([EngineCoreOutput("a-1", [8], finish_reason=FinishReason.LENGTH)],
                                       time.monotonic(), stats)
    assert [(s.token_ids, s.finish_reason) for s in steps] == [([7], None), ([8], "length")]
    assert run.complete and not lean.runs
    assert not e.output_processor.request_states and not e.output_processor.external_req_ids
    assert stats.num_generation_tokens == 2 and len(stats.finished_requests) == 1


async def test_a_stream_with_logprobs_goes_through_vllms_processor_whole():
    e, steps = engine(), []
    lean = LeanOutputs(e)
    run = started(e.output_processor, "b-1", Sampling(max_tokens=1, logprobs=0), steps)
    lean.add(run)
    assert not lean.runs
    e.output_processor.process_outputs([EngineCoreOutput("b-1", [9], finish_reason=FinishReason.STOP)],
                                       time.monotonic(), IterationStats())
    assert [(s.token_ids, s.finish_reason) for s in steps] == [([9], "stop")] and run.complete


async def test_an_aborted_streams_late_output_is_dropped():
    e, steps = engine(), []
    lean = LeanOutputs(e)
    run = started(e.output_processor, "c-1", Sampling(max_tokens=4), steps)
    lean.add(run)
    run.end()
    e.output_processor.abort_requests(["c-1"], internal=True)
    e.output_processor.process_outputs([EngineCoreOutput("c-1", [5])], time.monotonic(), IterationStats())
    assert steps == [] and not lean.runs
