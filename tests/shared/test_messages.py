import pytest

from shared.messages import (
    SCHEMA_VERSION,
    Heartbeat,
    MessageError,
    Placement,
    PrefillRequest,
    Sampling,
    decode,
    encode,
    prefill_subject,
)


def test_round_trip_keeps_every_field():
    placement = Placement(conductor="c0", prefill_id="p0", decode_id="d0", decode_node="n1", kv_blocks=1, pull_from="n2", pull_blocks=1)
    req = PrefillRequest(
        request_id="r1", prompt_token_ids=[1, 2, 3], block_hashes=["ab"], sampling=Sampling(max_tokens=5, temperature=0.0),
        deadline=1.5, placement=placement,
    )
    assert decode(encode(req), PrefillRequest) == req


def test_every_message_says_its_schema_version():
    hb = Heartbeat(instance_id="p0", role="prefill", node="n0", pid=1, seq=1, sent_at=0.0)
    assert b'"v":%d' % SCHEMA_VERSION in encode(hb)
    assert f"v{SCHEMA_VERSION}" in prefill_subject("p0")


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        b'{"instance_id": "p0"}',  # missing fields
        b'{"v": 1, "instance_id": "p0", "role": "janitor", "node": "n", "pid": 1, "seq": 1, "sent_at": 0}',
        b'{"v": 99, "instance_id": "p0", "role": "prefill", "node": "n", "pid": 1, "seq": 1, "sent_at": 0}',
    ],
)
def test_malformed_messages_raise_message_error(raw):
    with pytest.raises(MessageError):
        decode(raw, Heartbeat)
