"""The permission table: each identity gets the subjects its code uses, no more."""

import pytest

from shared.identity import ANY_STREAM, Identity, inbox_prefix, permissions
from shared.messages import CANCEL, HEARTBEAT, SCHEDULE, decode_subject, messenger_faults_subject, prefill_subject

DECODE = Identity("decode-0", "decode")
MESSENGER = Identity("messenger-1", "messenger", node="node-1")


def test_an_instance_reads_only_its_own_subjects_and_its_own_inbox():
    """Its own prefill and decode subjects: every engine instance serves both roles
    (the Conductor's fallback and planner choose which)."""
    p = permissions(DECODE)
    assert decode_subject("decode-0") in p.subscribe and prefill_subject("decode-0") in p.subscribe
    assert CANCEL in p.subscribe and f"{inbox_prefix('decode-0')}.>" in p.subscribe
    assert not any(s.startswith(("yb.v1.conductor", "_INBOX.gateway")) for s in p.subscribe)
    assert decode_subject("decode-1") not in p.subscribe and prefill_subject("decode-1") not in p.subscribe
    assert SCHEDULE not in p.subscribe
    prefill = permissions(Identity("prefill-0", "prefill"))
    assert {decode_subject("prefill-0"), prefill_subject("prefill-0")} <= set(prefill.subscribe)


def test_engines_stream_tokens_but_cannot_schedule_or_send_prompts():
    for p in (permissions(DECODE), permissions(Identity("prefill-0", "prefill"))):
        assert ANY_STREAM in p.publish and HEARTBEAT in p.publish
        assert SCHEDULE not in p.publish and not any("prefill" in s or "decode" in s for s in p.publish)


def test_only_the_admin_can_reach_a_messengers_fault_switch():
    faults = messenger_faults_subject("node-1")
    assert faults in permissions(MESSENGER).subscribe
    for identity in (Identity("gateway", "gateway"), Identity("conductor", "conductor"), Identity("prefill-0", "prefill"),
                     DECODE, MESSENGER):
        # "yb.v1.messenger.*" matches one token: the node's control subject, not its `.faults`
        # (a gateway's ">" are under JetStream's own "$JS." and "$KV.", the Responses bucket's)
        assert not any(s == faults or (s.endswith(">") and not s.startswith("$")) for s in permissions(identity).publish)
    assert "yb.v1.>" in permissions(Identity("admin", "admin")).publish


def test_the_gateway_reaches_instances_but_answers_nothing():
    p = permissions(Identity("gateway", "gateway"))
    assert prefill_subject("*") in p.publish and SCHEDULE in p.publish and not p.allow_responses


@pytest.mark.parametrize("name, role, node", [("a b", "decode", ""), ("x", "root", ""), ("m", "messenger", "")])
def test_a_bad_identity_is_refused(name, role, node):
    with pytest.raises(ValueError):
        Identity(name, role, node)


def test_the_gateway_reaches_the_responses_bucket_and_no_other_stream():
    from shared.identity import RESPONSES_BUCKET

    js = [s for s in permissions(Identity("gateway", "gateway")).publish if s.startswith("$")]
    assert js and all(f"KV_{RESPONSES_BUCKET}" in s or s.startswith(f"$KV.{RESPONSES_BUCKET}.") for s in js)
    assert not any(s.startswith("$") for s in permissions(DECODE).publish)
