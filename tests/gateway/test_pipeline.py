"""The gateway's per-request plan: where KV goes, and what decode waits for."""

from services.gateway.pipeline import kv_expected, kv_plan
from shared.messages import Heartbeat

DECODE = Heartbeat(instance_id="decode-0", role="decode", node="node-1", pid=1, seq=1, sent_at=0.0)


def test_kv_goes_to_the_decode_node_and_decode_waits_for_the_full_blocks():
    assert kv_plan(DECODE, prompt_len=300, max_tokens=16, block_size=128) == ("node-1", 2)


def test_no_destination_means_no_wait():
    # Decode unknown to this gateway (no heartbeat yet): prefill sends nothing, so
    # decode must not wait kv_wait_s for blocks; a one-token request never decodes.
    assert kv_plan(None, prompt_len=300, max_tokens=16, block_size=128) == ("", 0)
    assert kv_plan(DECODE, prompt_len=300, max_tokens=1, block_size=128) == ("", 0)


def test_decode_waits_for_no_more_blocks_than_prefill_sent():
    assert kv_expected(planned=7, sent=4) == 4  # the pool had no room for the rest
    assert kv_expected(planned=7, sent=7) == 7
    assert kv_expected(planned=7, sent=-1) == 7  # prefill did not say
