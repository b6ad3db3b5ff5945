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


class Outbox:
    def __init__(self):
        self.sent = []

    def send(self, subject, chunk, channel=None):
        self.sent.append((subject, chunk) if channel is None else (subject, chunk, channel))


def test_a_requests_steps_become_numbered_chunks_on_its_stream():
    req = DecodeRequest(request_id="a1", prompt_token_ids=[1, 2], first_token_id=3, sampling=Sampling(max_tokens=4),
                        deadline=0.0, stream_subject="yb.v1.stream.g")
    outbox = Outbox()
    chunks = Chunks(req, outbox, lambda: 0.01)
    chunks.send(Step(token_ids=[4], finish_reason=None, num_cached_tokens=16))
    chunks.send(Step(token_ids=[5], finish_reason="length", num_cached_tokens=16))
    assert [(s, c.seq, c.token_ids, c.kv_loaded_tokens, c.finish_reason) for s, c in outbox.sent] == [
        ("yb.v1.stream.g", 0, [4], 16, None), ("yb.v1.stream.g", 1, [5], 0, "length")]
    assert chunks.seq == 2 and chunks.loaded_tokens == 16


class Channel:
    ready = True


def test_a_stream_keeps_to_its_channel_while_it_is_ready_and_to_nats_once_it_was_not():
    req = DecodeRequest(request_id="a1", prompt_token_ids=[1, 2], first_token_id=3, sampling=Sampling(max_tokens=9),
                        deadline=0.0, stream_subject="yb.v1.stream.g")
    channel, outbox = Channel(), Outbox()
    chunks = Chunks(req, outbox, lambda: 0.01, channel)
    chunks.send(Step(token_ids=[4], finish_reason=None, num_cached_tokens=0))
    channel.ready = False  # closed: this chunk and every later one over NATS
    chunks.send(Step(token_ids=[5], finish_reason=None, num_cached_tokens=0))
    channel.ready = True  # even if it is ready again: two ways at once could reorder the stream
    chunks.fail("stopped")
    assert [len(sent) for sent in outbox.sent] == [3, 2, 2]
    assert [c.seq for _, c, *_ in outbox.sent] == [0, 1, 2] and outbox.sent[-1][1].error == "stopped"

    connecting, outbox = Channel(), Outbox()
    connecting.ready = False  # not ready yet at the first chunk: NATS to the end
    late = Chunks(req, outbox, lambda: 0.01, connecting)
    late.send(Step(token_ids=[4], finish_reason=None, num_cached_tokens=0))
    connecting.ready = True
    late.send(Step(token_ids=[5], finish_reason=None, num_cached_tokens=0))
    assert [len(sent) for sent in outbox.sent] == [2, 2]
