"""The fake engine (benchmarks of the control plane): vLLM's delta outputs for a
fixed token stream, every request stepping on one clock, to max_tokens."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from shared.engine.fake import FakeEngine, token_at


def params(max_tokens: int, n: int = 1, kv: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(max_tokens=max_tokens, n=n, extra_args={"kv_transfer_params": kv} if kv else None)


async def outputs(engine: FakeEngine, p: SimpleNamespace) -> list:
    return [o async for o in engine.generate({"prompt_token_ids": [1, 2]}, p, "r")]


async def test_one_token_a_step_for_each_output_until_max_tokens():
    got = await outputs(FakeEngine(0.001), params(4, n=2))
    assert [[c.token_ids for c in o.outputs] for o in got] == [[[token_at(i)]] * 2 for i in range(4)]
    assert [o.finished for o in got] == [False, False, False, True]
    assert [c.finish_reason for c in got[-1].outputs] == ["length", "length"] and got[-1].outputs[0].finished()


async def test_a_prefill_is_told_its_kv_went_nowhere():
    (only,) = await outputs(FakeEngine(0.001), params(1, kv={"kv_dest": "node-0"}))
    assert only.kv_transfer_params == {"kv_blocks": 0}


async def test_requests_step_together_on_one_clock():
    engine, loop = FakeEngine(0.02), asyncio.get_running_loop()

    async def times() -> list[float]:
        return [loop.time() async for _ in engine.generate({}, params(4), "r")]

    first = asyncio.create_task(times())
    await asyncio.sleep(0.007)  # started mid-step: its outputs still come on the batch's ticks
    late = await times()
    early = await first
    assert all(min(abs(t - e) for e in early) < 0.003 for t in late[:3])
    assert all(0.015 < b - a < 0.025 for a, b in zip(early, early[1:], strict=False))


async def test_it_takes_what_the_services_pass_vllms_engine():
    """The services' one entry into an engine (shared/engine/llm.py generate), as with vLLM's
    AsyncLLM: its arguments (priority, trace headers) reach the fake one too."""
    from shared.engine.llm import generate
    from shared.messages import Sampling

    steps = [s async for s in generate(FakeEngine(0.001), "r", [1, 2], Sampling(max_tokens=3, priority=4), 3)]
    assert len(steps) == 3
