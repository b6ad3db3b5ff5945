"""What the decode service measures of its own pace (a request's token gaps against
the steps the time model predicted for them), and its steps as chunks on its stream."""

import pytest

from services.decode.handler import Chunks, Pace
from shared.engine.llm import Step
from shared.messages import DecodeRequest, Sampling


def test_a_requests_pace_is_its_token_gaps_against_its_predicted_steps():
    pace = Pace()
    pace.step(1, 0.010, first=True, now=5.0)  # prompt's rest and KV load: not a decode step
    pace.step(1, 0.010, first=False, now=5.02)
    pace.step(3, 0.012, first=False, now=5.08)  # three tokens at once: three steps
    assert pace.observed_s == pytest.approx(0.08)
    assert pace.predicted_s == pytest.approx(0.010 + 3 * 0.012)


def test_a_requests_steps_become_numbered_chunks_on_its_stream():
    class Outbox:
        def __init__(self):
            self.sent = []

        def send(self, subject, chunk):
            self.sent.append((subject, chunk))

    req = DecodeRequest(request_id="a1", prompt_token_ids=[1, 2], first_token_id=3, sampling=Sampling(max_tokens=4),
                        deadline=0.0, stream_subject="yb.v1.stream.g")
    outbox = Outbox()
    chunks = Chunks(req, outbox, lambda: 0.01)
    chunks.send(Step(token_ids=[4], finish_reason=None, num_cached_tokens=16))
    chunks.send(Step(token_ids=[5], finish_reason="length", num_cached_tokens=16))
    assert [(s, c.seq, c.token_ids, c.kv_loaded_tokens, c.finish_reason) for s, c in outbox.sent] == [
        ("yb.v1.stream.g", 0, [4], 16, None), ("yb.v1.stream.g", 1, [5], 0, "length")]
    assert chunks.seq == 2 and chunks.loaded_tokens == 16
