"""An engine that runs no model, for measuring the control plane alone
(`yuebing bench control-plane`, ClusterConfig.fake_engine_step_ms).

It answers `add_request` and `generate` the way vLLM's AsyncLLM does with delta
outputs: one output per step, every running request stepping together on one clock,
as a batch does.
Its tokens are a fixed stream (the same ids for every request and every run), it
stops only at max_tokens, and it computes and saves no KV. Prefill, decode, the
gateway and the Conductor around it are the real services: what they spend per
request and per token is what the bench reads."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

# Ids every vocabulary has (in a byte-level one such as yuebing-tiny's, "a" to "z"):
# text the gateway detokenizes, as it would a model's.
TOKENS = tuple(range(97, 123))


def token_at(position: int) -> int:
    return TOKENS[position % len(TOKENS)]


@dataclass(frozen=True)
class Completion:
    """vLLM's CompletionOutput, as much of it as shared/engine/llm.py reads."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    logprobs: None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Output:
    """vLLM's RequestOutput, as much of it as shared/engine/llm.py reads."""

    outputs: list[Completion]
    finished: bool
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: None = None


class Collector:
    """vLLM's RequestOutputCollector, as much of it as shared/engine/llm.py uses: the
    engine puts each step's output (a reader may replace `put`)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.outputs: asyncio.Queue[Output] = asyncio.Queue()

    def put(self, out: Output) -> None:
        self.outputs.put_nowait(out)

    def get_nowait(self) -> Output | None:
        return None if self.outputs.empty() else self.outputs.get_nowait()


@dataclass
class Running:
    collector: Collector
    params: Any
    position: int = 0


@dataclass
class FakeEngine:
    step_s: float
    errored: bool = False
    dead_error: BaseException | None = None
    running: dict[str, Running] = field(default_factory=dict, repr=False)
    _stepping: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _ids: Iterator[int] = field(default_factory=itertools.count, init=False, repr=False)

    async def add_request(self, request_id: str, prompt: dict[str, Any], params: Any, priority: int = 0,
                          trace_headers: Any = None) -> Collector:
        """`params.max_tokens` tokens for each of `params.n` outputs, one a step, put into
        the request's collector (every request runs at once: `priority` orders nothing
        here, as vLLM's signature takes it)."""
        collector = Collector(f"{request_id}-{next(self._ids)}")  # unique, as vLLM's internal ids are
        self.running[collector.request_id] = Running(collector, params)
        if self._stepping is None or self._stepping.done():
            self._stepping = asyncio.get_running_loop().create_task(self._step(), name="fake engine")
        return collector

    async def abort(self, request_id: str, internal: bool = False) -> None:
        self.running.pop(request_id, None)

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str, priority: int = 0,
                       trace_headers: Any = None) -> AsyncIterator[Output]:
        collector = await self.add_request(request_id, prompt, params, priority, trace_headers)
        try:
            while True:
                out = await collector.outputs.get()
                yield out
                if out.finished:
                    return
        finally:
            await self.abort(collector.request_id)

    async def _step(self) -> None:
        """Every `step_s` on the loop's clock, one output for each running request, all
        in one turn of the loop, as one batch's outputs come from vLLM's output task."""
        loop = asyncio.get_running_loop()
        while self.running:
            await asyncio.sleep(self.step_s - loop.time() % self.step_s)
            for request_id, r in list(self.running.items()):
                last = r.position == r.params.max_tokens - 1
                saves = bool((r.params.extra_args or {}).get("kv_transfer_params"))
                outputs = [Completion(i, [token_at(r.position)], "length" if last else None) for i in range(r.params.n)]
                r.position += 1
                if last:
                    del self.running[request_id]
                r.collector.put(Output(outputs, last, kv_transfer_params={"kv_blocks": 0} if last and saves else None))

    def shutdown(self) -> None:
        if self._stepping is not None:
            self._stepping.cancel()
