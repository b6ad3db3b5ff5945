"""An engine that runs no model, for measuring the control plane alone
(`yuebing bench control-plane`, ClusterConfig.fake_engine_step_ms).

It answers `generate` the way vLLM's AsyncLLM does with delta outputs: one output
per step, every running request stepping together on one clock, as a batch does.
Its tokens are a fixed stream (the same ids for every request and every run), it
stops only at max_tokens, and it computes and saves no KV. Prefill, decode, the
gateway and the Conductor around it are the real services: what they spend per
request and per token is what the bench reads."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
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


@dataclass
class FakeEngine:
    step_s: float
    errored: bool = False
    dead_error: BaseException | None = None
    _tick: asyncio.Event | None = field(default=None, init=False, repr=False)  # the next step's

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str, priority: int = 0,
                       trace_headers: Any = None) -> AsyncIterator[Output]:
        """`params.max_tokens` tokens for each of `params.n` outputs, one a step (every
        request runs at once: `priority` orders nothing here, as vLLM's signature takes it)."""
        saves = bool((params.extra_args or {}).get("kv_transfer_params"))
        for position in range(params.max_tokens):
            await self._step()
            last = position == params.max_tokens - 1
            outputs = [Completion(i, [token_at(position)], "length" if last else None) for i in range(params.n)]
            yield Output(outputs, last, kv_transfer_params={"kv_blocks": 0} if last and saves else None)

    async def _step(self) -> None:
        """Until the next multiple of `step_s` on the loop's clock: every request running
        waits on one event, set by one timer, and wakes in the same turn of the loop, as
        one batch's outputs come. (A timer per request and step would be the fake's own
        cost, counted as the service's.)"""
        if self._tick is None or self._tick.is_set():
            loop = asyncio.get_running_loop()
            self._tick = asyncio.Event()
            loop.call_at(loop.time() + self.step_s - loop.time() % self.step_s, self._tick.set)
        await self._tick.wait()

    def shutdown(self) -> None:
        pass  # nothing runs between requests
