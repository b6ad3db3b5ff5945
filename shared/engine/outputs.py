"""Decode's streams read from the engine core's outputs themselves.

vLLM's AsyncLLM turns each output of the engine core into a RequestOutput (with a
CompletionOutput inside) and hands it to the request's collector, for a server that
wants text, logprobs and its own stop strings. A decode stream wants none of that:
the gateway detokenizes, and only the new token ids go on. So, for a request with one
output and no logprobs, the decode service takes the engine core's output before
AsyncLLM's output processor: a Step straight from its token ids. vLLM's own books
stay as they are for every request (its per-token statistics, behind the vllm:*
metrics, its finished requests, aborts and the engine's death, which reaches each
request's collector); any other request goes through the processor whole.

This reads three private methods of vLLM's OutputProcessor (the statistics of an
output and of a finished request, and the request's removal): the pinned vLLM's,
checked by the suite's decode tests on the real engine."""

from __future__ import annotations

from typing import Any

from shared.engine.llm import Run, Step


class LeanOutputs:
    """Takes the outputs of the runs it serves out of `engine`'s output processor."""

    def __init__(self, engine: Any) -> None:
        self.processor = engine.output_processor
        self.processed = self.processor.process_outputs  # vLLM's own, for every other output
        self.runs: dict[str, Run] = {}  # the engine's request id → its run
        self.processor.process_outputs = self.process_outputs

    def add(self, run: Run) -> None:
        """Serve `run` here if it can be: one output, no logprobs, no vLLM span of its own."""
        p = run.params
        if p.n == 1 and p.logprobs is None and p.prompt_logprobs is None and not self.processor.tracing_enabled:
            self.runs[run.request_id] = run

    def drop(self, run: Run) -> None:
        """`run` is over (or given up): its late outputs, if any, are vLLM's to drop."""
        self.runs.pop(run.request_id, None)

    def process_outputs(self, outputs: list[Any], engine_core_timestamp: float | None = None,
                        iteration_stats: Any = None, weight_version: str | None = None) -> Any:
        """vLLM's OutputProcessor.process_outputs, less the outputs taken here."""
        if self.runs:
            outputs = [o for o in outputs if not self._took(o, engine_core_timestamp, iteration_stats)]
        return self.processed(outputs, engine_core_timestamp, iteration_stats, weight_version=weight_version)

    def _took(self, out: Any, timestamp: float | None, iteration_stats: Any) -> bool:
        run = self.runs.get(out.request_id)
        if run is None:
            return False
        state = self.processor.request_states.get(out.request_id)
        if state is None:  # aborted meanwhile
            del self.runs[out.request_id]
            return True
        self.processor._update_stats_from_output(state, out, timestamp, iteration_stats)
        if state.is_prefilling:  # its first output: what its prompt found cached (or loaded)
            if out.prefill_stats is not None:
                state.num_cached_tokens = out.prefill_stats.num_cached_tokens
            if state.remote_prefill_cached_tokens is not None:
                state.num_cached_tokens = state.remote_prefill_cached_tokens
            state.is_prefilling = False
        finish = out.finish_reason
        if out.new_token_ids or finish is not None:
            run.take(Step(token_ids=out.new_token_ids, finish_reason=None if finish is None else str(finish),
                          num_cached_tokens=state.num_cached_tokens,
                          kv_transfer_params=out.kv_transfer_params if finish is not None else None))
        if finish is not None:
            del self.runs[out.request_id]
            self.processor._finish_request(state)
            self.processor._update_stats_from_finished(state, finish, iteration_stats)
            run.finish()
        return True
