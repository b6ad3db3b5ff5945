"""The live replay: prompts that share what the trace shares, and requests measured
as the simulator reports them (against the stand-in gateway of conftest.py)."""

import pytest

from yuebing.lab.replay import ReplayOptions, prompt_tokens, replay
from yuebing.lab.trace import TraceRequest


def test_equal_hash_ids_give_equal_token_blocks():
    a = prompt_tokens(TraceRequest(0, 300, 1, (7, 8, 9)), block_tokens=128)
    b = prompt_tokens(TraceRequest(0, 256, 1, (7, 8)), block_tokens=128)
    c = prompt_tokens(TraceRequest(0, 256, 1, (7, 5)), block_tokens=128)
    assert len(a) == 300 and len(b) == 256
    assert a[:256] == b  # shared prefix, token for token
    assert c[:128] == b[:128] and c[128:] != b[128:]
    assert all(32 <= t < 127 for t in a)


def test_the_salt_gives_fresh_prompts_with_the_same_sharing():
    r1, r2 = TraceRequest(0, 256, 1, (1, 2)), TraceRequest(0, 256, 1, (1, 3))
    assert prompt_tokens(r1, 128, salt=1) != prompt_tokens(r1, 128, salt=2)
    assert prompt_tokens(r1, 128, salt=2)[:128] == prompt_tokens(r2, 128, salt=2)[:128]


async def test_every_request_is_sent_at_its_time_and_measured(gateway):
    gateway.step_s = step = 0.01
    trace = [TraceRequest(0.0, 200, 5, (1,)), TraceRequest(100.0, 100, 3, (2,)),
             TraceRequest(50.0, 50, gateway.reject_tokens, (3,)), TraceRequest(0.0, 50, gateway.fail_tokens, (4,))]
    outcomes, wall = await replay(gateway.url, trace, ReplayOptions(block_tokens=512, progress=False, slo_ttft_ms=900))
    assert gateway.slo_ttft_seen == ["900"] * 4
    first, second, rejected, failed = outcomes  # in trace order
    assert first.completed and second.completed and wall >= 0.1 + 2 * step
    assert len(first.token_times) == 5 and first.cached_tokens == 100
    # Sent at its time (100 ms on the replay's clock, which end_s counts from), not
    # before: asyncio may wake a timer up to its clock resolution early.
    start = first.token_times[-1] - first.end_s
    assert second.sent_at - start >= 0.1 - 1e-3
    # TTFT from the trace's arrival; TBT from the gaps (at least the stand-in's step).
    assert 0 < first.ttft_s < 1.0 and 0 < second.ttft_s < 1.0
    assert first.tbt_mean_s >= 0.5 * step and first.tbt_tail_s >= first.tbt_mean_s
    assert first.end_s == pytest.approx(first.token_times[-1] - first.token_times[0] + first.ttft_s)
    assert rejected.rejected and not rejected.failed and not rejected.completed
    assert failed.failed and not failed.rejected and not failed.completed
