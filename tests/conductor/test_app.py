"""The live Conductor's logic without NATS: heartbeats, schedule requests, events."""

import time

import msgspec
import pytest

from services.conductor.app import Conductor
from shared.config import ClusterConfig
from shared.messages import Heartbeat, RequestUpdate, ScheduleRequest


def hb(iid: str, role: str) -> Heartbeat:
    return Heartbeat(instance_id=iid, role=role, node="node-0", pid=1, seq=1, sent_at=0.0)


def ask(rid: str, hashes: list[str], slo_ttft_ms: float = 0.0) -> ScheduleRequest:
    return ScheduleRequest(
        request_id=rid, prompt_len=128 * len(hashes) + 5, block_hashes=hashes, max_tokens=16,
        deadline=time.time() + 60, slo_ttft_ms=slo_ttft_ms,
    )


def config(**kw) -> ClusterConfig:
    """A config for these tests: no admission and loose SLOs unless a test asks (the
    cluster's defaults are predictive admission with SLOs derived from the profile,
    which a service resolves at start: shared/service.py)."""
    return ClusterConfig(**{"model": "/m/tiny", "admission": "none", "slo_ttft_ms": 10_000.0, "slo_tbt_ms": 1_000.0, **kw})


def conductor(roster: tuple[tuple[str, str], ...] = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")),
              **kw) -> Conductor:
    """A Conductor that has heard each (instance, role) of `roster` at time 0."""
    c = Conductor(config(**{"policy": "cache_aware", **kw}))
    for iid, role in roster:
        c.on_heartbeat(hb(iid, role), now=0.0)
    return c


def test_cache_aware_sends_a_shared_prefix_back_to_its_holder():
    c = conductor()
    first = c.schedule(ask("r1", ["a", "b", "c", "d"]), now=0.0)
    other = c.schedule(ask("r2", ["x", "y"]), now=0.0)  # no prefix anywhere: the idle one
    for rid in ("r1", "r2"):
        c.on_update(RequestUpdate(request_id=rid, kind="finished"), now=0.3)
    again = c.schedule(ask("r3", ["a", "b", "c", "d", "e"]), now=0.4)
    assert first.accepted and again.accepted
    assert again.placement.prefill_id == first.placement.prefill_id != other.placement.prefill_id
    assert again.predicted_ttft_ms < first.predicted_ttft_ms  # four blocks are cached


def test_the_reply_carries_the_whole_placement_the_gateway_executes():
    c = Conductor(config(policy="round_robin", block_size=128))
    c.on_heartbeat(Heartbeat(instance_id="p0", role="prefill", node="node-0", pid=1, seq=1, sent_at=0.0), now=0.0)
    c.on_heartbeat(Heartbeat(instance_id="d0", role="decode", node="node-1", pid=1, seq=1, sent_at=0.0), now=0.0)
    placement = c.schedule(ask("r1", ["a", "b"]), now=0.0).placement
    # Prefill streams every full prompt block to the decode instance's node.
    assert (placement.prefill_id, placement.decode_id, placement.decode_node) == ("p0", "d0", "node-1")
    assert placement.kv_blocks == 2
    one_token = ScheduleRequest(request_id="r2", prompt_len=300, block_hashes=["a", "b"], max_tokens=1,
                                deadline=time.time() + 60)
    alone = c.schedule(one_token, now=0.0).placement
    assert (alone.decode_node, alone.kv_blocks) == ("", 0)  # no decode runs: nothing to send


def test_admission_rejects_with_retry_after_and_dead_instances_are_unavailable():
    c = conductor(admission="early_reject")
    replies = [c.schedule(ask(f"r{i}", [f"h{i}-{j}" for j in range(20)], slo_ttft_ms=500), now=0.0) for i in range(30)]
    rejected = [r for r in replies if not r.accepted]
    assert rejected and all(r.rejection == "overloaded" and r.retry_after_s > 0 for r in rejected)
    late = c.schedule(ask("late", ["z"]), now=10.0)  # no heartbeat for 10 s: everyone is gone
    assert not late.accepted and late.rejection == "unavailable"


def test_decode_refusal_counts_as_wasted_prefill_and_frees_the_books():
    c = conductor()
    assert c.schedule(ask("r1", ["a"]), now=0.0).accepted
    c.on_update(RequestUpdate(request_id="r1", kind="prefill_done", instance_id="p0"), now=0.1)
    c.on_update(RequestUpdate(request_id="r1", kind="decode_refused", instance_id="d0"), now=0.2)
    assert c.counts["wasted_prefill"] == 1
    assert all(not load.items for load in c.state.decode_loads(now=0.2))


def test_a_decode_engine_reporting_a_full_kv_cache_gets_no_new_request():
    c = conductor(admission="predictive")
    full = Heartbeat(instance_id="d0", role="decode", node="node-0", pid=1, seq=2, sent_at=0.0, kv_usage=0.99)
    c.on_heartbeat(full, now=0.5)
    reply = c.schedule(ask("r1", ["a"]), now=0.6)
    assert not reply.accepted and reply.rejection == "overloaded" and "room" in reply.reason
    c.on_heartbeat(hb("d0", "decode"), now=0.7)  # usage back to 0
    assert c.schedule(ask("r2", ["a"]), now=0.8).accepted


def test_pool_index_from_kv_events_routes_and_pulls_and_forgets_a_silent_node():
    from shared.messages import KvEvent, KvSnapshot

    c = Conductor(config(policy="round_robin"))
    beats = [Heartbeat(instance_id=i, role=r, node=n, pid=1, seq=1, sent_at=0.0)
             for i, r, n in [("p0", "prefill", "node-0"), ("p1", "prefill", "node-1"), ("d0", "decode", "node-2"),
                             ("m0", "messenger", "node-0"), ("m1", "messenger", "node-1")]]
    fresh = [c.on_heartbeat(b, now=0.0) for b in beats]
    assert fresh == [False, False, False, True, True]  # messengers: their snapshots are wanted
    c.on_snapshot(KvSnapshot(node="node-1", dram=["a"], ssd=["b", "c"]))
    c.on_kv_event(KvEvent(node="node-0", kind="stored", tier="dram", hashes=["a"]))
    assert c.stats(now=0.0).pool_blocks == 3 and c.stats(now=0.0).pool_nodes == ["node-0", "node-1"]
    # Round robin picks p0 (node-0 holds 1 block); node-1 holds 3 (DRAM and SSD): pull them.
    reply = c.schedule(ask("r1", ["a", "b", "c", "d"]), now=0.0)
    placement = reply.placement
    assert placement.prefill_id == "p0" and (placement.pull_from, placement.pull_blocks) == ("node-1", 3)
    assert placement.pull_skip == 1  # node-0's pool holds "a": it does not travel again
    # The books charge p0 for that pull: 3 blocks it will not compute.
    assert c.state.prefill["p0"].outstanding["r1"].cached_tokens == 3 * 128
    # Evicted from SSD too: gone from node-1.
    c.on_kv_event(KvEvent(node="node-1", kind="evicted", tier="ssd", hashes=["b"]))
    assert c.pools.prefix_blocks(["a", "b"], ["node-1"]) == {"node-1": 1}
    # node-1's messenger goes silent: everything it held leaves the index.
    for b in beats[:4]:
        c.on_heartbeat(b, now=5.0)
    assert c.pools.prefix_blocks(["a"], ["node-1"]) == {"node-1": 0} and c.stats(now=5.0).pool_nodes == ["node-0"]
    # node-0's messenger restarts before it is missed (a new pid): its DRAM pool is new,
    # so its old blocks leave the index and its snapshot is wanted again.
    restarted = Heartbeat(instance_id="m0", role="messenger", node="node-0", pid=2, seq=1, sent_at=0.0)
    assert c.on_heartbeat(restarted, now=5.5) is True
    assert c.pools.prefix_blocks(["a"], ["node-0"]) == {"node-0": 0} and c.stats(now=5.5).pool_nodes == ["node-0"]


def test_a_just_started_conductor_waits_to_hear_the_cluster_before_calling_it_unavailable():
    c = Conductor(config(policy="cache_aware", heartbeat_interval_s=0.5))
    c.listening(now=100.0)
    assert c.hearing_instances(now=100.1)  # nothing heard yet: wait, do not refuse
    c.on_heartbeat(hb("p0", "prefill"), now=100.2)
    assert c.hearing_instances(now=100.2)  # still no decode instance
    c.on_heartbeat(hb("d0", "decode"), now=100.3)
    assert not c.hearing_instances(now=100.3)
    assert c.schedule(ask("r1", ["a"]), now=100.3).accepted
    empty = Conductor(config(policy="cache_aware", heartbeat_interval_s=0.5))
    empty.listening(now=0.0)
    assert not empty.hearing_instances(now=1.0)  # a whole round of heartbeats: nobody is there
    assert empty.schedule(ask("r2", ["a"]), now=1.0).rejection == "unavailable"


def test_a_retry_is_placed_away_from_the_instances_that_failed_it():
    c = conductor()
    first = c.schedule(ask("r1", ["a", "b"]), now=0.0).placement
    again = c.schedule(msgspec.structs.replace(ask("r1-a2", ["a", "b"]), avoid=[first.prefill_id]), now=0.1)
    assert again.accepted and again.placement.prefill_id not in ("", first.prefill_id)
    # No prefill instance left for it: its decode instance prefills it (degraded, not refused).
    degraded = c.schedule(msgspec.structs.replace(ask("r1-a3", ["a", "b"]), avoid=["p0", "p1"]), now=0.2)
    assert degraded.accepted and degraded.placement.local_prefill and degraded.placement.decode_id == "d0"
    assert (degraded.mode.rule, degraded.mode.reason) == ("fallback", "no_prefill_live")
    nowhere = c.schedule(msgspec.structs.replace(ask("r1-a4", ["a", "b"]), avoid=["p0", "p1", "d0"]), now=0.2)
    assert not nowhere.accepted and nowhere.rejection == "unavailable"


def test_a_decode_alone_is_placed_and_booked_until_its_attempt_finishes():
    c = conductor()
    c.on_heartbeat(hb("d1", "decode"), now=0.0)
    alone = msgspec.structs.replace(ask("r1-a2", ["a", "b"]), avoid=["d0"], stage="decode")
    reply = c.schedule(alone, now=0.1)
    assert reply.accepted
    assert (reply.placement.prefill_id, reply.placement.decode_id, reply.placement.decode_node) == ("", "d1", "node-0")
    assert c.counts == {"accepted": 0, "rejected": 0, "wasted_prefill": 0, "replaced_decode": 1}
    assert not any(load.active_blocks for load in c.state.prefill_loads(["a", "b"], now=0.1))  # no prefill booked
    [d1] = [x for x in c.state.decode_loads(now=0.1) if x.instance_id == "d1"]
    assert len(d1.items) == 1 and d1.items[0].start == 0.1  # decoding from now
    c.on_update(RequestUpdate(request_id="r1-a2", kind="finished"), now=0.5)
    assert all(not load.items for load in c.state.decode_loads(now=0.5))
    # No decode instance left for it: a prefill instance decodes it (degraded, not refused).
    on_prefill = c.schedule(msgspec.structs.replace(alone, request_id="r1-a3", avoid=["d0", "d1"]), now=0.6)
    assert on_prefill.accepted and on_prefill.placement.decode_id in ("p0", "p1")
    assert on_prefill.mode.reason == "no_decode_live" and c.modes["local:no_decode_live"] == 1
    none_left = c.schedule(msgspec.structs.replace(alone, request_id="r1-a4", avoid=["d0", "d1", "p0", "p1"]), now=0.6)
    assert not none_left.accepted and none_left.rejection == "unavailable"


def test_with_no_decode_live_a_prefill_instance_prefills_and_decodes():
    c = Conductor(config(policy="cache_aware"))
    for iid in ("p0", "p1"):
        c.on_heartbeat(hb(iid, "prefill"), now=0.0)
    first = c.schedule(ask("r1", ["a", "b"]), now=0.0)
    assert first.accepted and first.placement.local_prefill and first.placement.prefill_id == ""
    assert (first.mode.mode, first.mode.rule, first.mode.reason) == ("local", "fallback", "no_decode_live")
    host = first.placement.decode_id
    assert first.placement.decode_node == "node-0"
    [load] = [x for x in c.state.decode_loads(now=0.0) if x.instance_id == host]
    assert len(load.items) == 1  # booked as a decode on that prefill instance
    second = c.schedule(ask("r2", ["x", "y"]), now=0.0)
    assert second.placement.decode_id != host  # the other one: the least delay
    c.on_heartbeat(hb("d0", "decode"), now=0.5)  # a decode instance is back: disaggregated again
    back = c.schedule(ask("r3", ["c"]), now=0.5)
    assert not back.placement.local_prefill and back.placement.decode_id == "d0" and back.mode.rule == "disaggregated"
    assert c.stats(now=0.5).modes == {"local:no_decode_live": 2, "disaggregated:mode": 1}


def test_a_decode_that_reports_running_slow_is_judged_at_its_pace():
    c = conductor(admission="predictive", slo_tbt_ms=50.0)
    assert c.schedule(ask("r1", ["a"]), now=0.1).accepted
    c.on_update(RequestUpdate(request_id="r1", kind="finished"), now=0.2)
    slow = Heartbeat(instance_id="d0", role="decode", node="node-0", pid=1, seq=2, sent_at=0.0, slowdown=1000.0)
    c.on_heartbeat(slow, now=0.3)
    reply = c.schedule(ask("r2", ["a"]), now=0.4)
    assert not reply.accepted and "TBT" in reply.reason
    assert c.stats(now=0.4).slowdown == {"p0": 1.0, "p1": 1.0, "d0": 100.0}  # clamped to what is plausible
    off = conductor(admission="predictive", slo_tbt_ms=50.0, calibrate_time_model=False)
    off.on_heartbeat(slow, now=0.3)
    assert off.schedule(ask("r2", ["a"]), now=0.4).accepted


# --- serving modes (services/conductor/modes.py) --------------------------------
def moded(mode: str, prefills: tuple[str, ...] = ("p0",), decodes: tuple[str, ...] = ("d0",), **kw) -> Conductor:
    c = Conductor(config(policy="cache_aware", mode=mode, **kw))
    for iid in prefills:
        c.on_heartbeat(hb(iid, "prefill"), now=0.0)
    for iid in decodes:
        c.on_heartbeat(hb(iid, "decode"), now=0.0)
    return c


def test_every_accepted_request_says_its_mode_and_the_stats_count_them():
    c = moded("disaggregated")
    reply = c.schedule(ask("r1", ["a"]), now=0.0)
    assert (reply.mode.mode, reply.mode.reason) == ("disaggregated", "mode") and not reply.placement.local_prefill
    assert c.stats(now=0.0).modes == {"disaggregated:mode": 1}


def test_colocated_places_on_the_instance_whose_engine_holds_the_prefix_and_books_its_prefill():
    c = moded("colocated", prefills=(), decodes=("d0", "d1"))
    assert not c.hearing_instances(now=0.0)  # no prefill instance to wait for
    first = c.schedule(ask("r1", ["a", "b", "c", "d"]), now=0.0)
    placement = first.placement
    assert placement.local_prefill and placement.prefill_id == ""
    assert c.state.local_queued(placement.decode_id) == 4 * 128 + 5  # its whole prompt, until its first token
    c.on_update(RequestUpdate(request_id="r1", kind="prefill_done", instance_id=placement.decode_id), now=0.2)
    assert c.state.local_queued(placement.decode_id) == 0
    again = c.schedule(ask("r2", ["a", "b", "c", "d", "e"]), now=0.3)
    assert again.placement.decode_id == placement.decode_id  # four of its blocks are cached there
    assert again.predicted_ttft_ms < first.predicted_ttft_ms
    assert c.stats(now=0.3).modes == {"colocated:least_delay": 2}


def test_conditional_prefills_a_short_prompt_on_its_decode_and_a_long_one_on_prefill():
    c = moded("conditional", step_tokens=256)
    short = c.schedule(ask("short", ["a"]), now=0.0)  # 133 tokens: within one step's budget
    long = c.schedule(ask("long", ["w", "x", "y", "z"]), now=0.0)  # 517 tokens: would be chunked
    assert short.placement.local_prefill and (short.mode.mode, short.mode.reason) == ("local", "unchunked_within_tbt")
    assert not long.placement.local_prefill and long.placement.prefill_id == "p0"
    assert (long.mode.mode, long.mode.reason) == ("disaggregated", "would_chunk")
    assert "exceed the step budget" in long.mode.detail
    assert c.stats(now=0.0).modes == {"local:unchunked_within_tbt": 1, "disaggregated:would_chunk": 1}


def test_conditional_keeps_the_tbt_of_those_decoding_there():
    c = moded("conditional", slo_tbt_ms=5.0)  # tighter than a step with a 517-token prefill in it
    c.schedule(ask("running", ["a"]), now=0.0)
    c.on_update(RequestUpdate(request_id="running", kind="prefill_done", instance_id="d0"), now=0.05)
    reply = c.schedule(ask("r2", ["w", "x", "y", "z"]), now=0.1)
    assert (reply.mode.mode, reply.mode.reason) == ("disaggregated", "breaks_tbt")
    assert reply.mode.predicted_tbt_ms > 5.0


def test_conditional_threshold_rules_compare_uncached_tokens_with_n():
    c = moded("conditional", conditional_rule="dynamo", local_prefill_tokens=200)
    near = c.schedule(ask("r1", ["a"]), now=0.0)
    far = c.schedule(ask("r2", ["w", "x", "y", "z"]), now=0.0)
    assert (near.mode.rule, near.mode.reason, far.mode.reason) == ("dynamo", "below_threshold", "above_threshold")


def test_an_unknown_mode_or_rule_stops_the_conductor_at_start():
    with pytest.raises(ValueError, match="unknown mode"):
        Conductor(config(mode="split"))
    with pytest.raises(ValueError, match="unknown conditional rule"):
        Conductor(config(mode="conditional", conditional_rule="sglang"))


def test_a_long_prompt_goes_to_the_cpp_group_and_a_short_one_stays_on_a_single_instance():
    c = Conductor(config(policy="cache_aware", step_tokens=512))
    c.on_heartbeat(hb("p0", "prefill"), now=0.0)
    c.on_heartbeat(msgspec.structs.replace(hb("p1", "prefill"), stages=2), now=0.0)
    c.on_heartbeat(hb("d0", "decode"), now=0.0)
    long = c.schedule(ask("long", [f"l{i}" for i in range(24)]), now=0.0)
    short = c.schedule(ask("short", ["s0"]), now=0.0)
    assert (long.placement.prefill_id, long.route) == ("p1", "cpp:faster")
    assert (short.placement.prefill_id, short.route) == ("p0", "single:short_input")
    assert c.stats(now=0.0).routes == {"cpp:faster": 1, "single:short_input": 1}


def test_without_a_cpp_group_no_route_is_recorded():
    c = conductor()
    reply = c.schedule(ask("r1", [f"l{i}" for i in range(24)]), now=0.0)
    assert reply.accepted and reply.route == "" and c.stats(now=0.0).routes == {}
