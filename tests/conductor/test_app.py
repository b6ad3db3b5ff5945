"""The live Conductor's logic without NATS: heartbeats, schedule requests, events."""

import asyncio
import time

import msgspec
import pytest

from services.conductor.app import Conductor, Wiring
from shared.config import ClusterConfig
from shared.messages import BookDigest, Heartbeat, RequestUpdate, ScheduleRequest
from shared.tenants import Tenant, Tenants


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
    # Prefill streams every prompt block, its tail too, to the decode instance's node.
    assert (placement.prefill_id, placement.decode_id, placement.decode_node) == ("p0", "d0", "node-1")
    assert placement.kv_blocks == 3
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


def test_a_draining_instance_gets_nothing_new_and_is_not_forgotten():
    c = conductor((("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")), policy="round_robin")
    c.on_heartbeat(msgspec.structs.replace(hb("p1", "prefill"), seq=2, draining=True), now=0.1)
    c.on_heartbeat(msgspec.structs.replace(hb("d1", "decode"), seq=2, draining=True), now=0.1)
    placed = [c.schedule(ask(f"r{i}", [f"h{i}"]), now=0.2).placement for i in range(6)]
    assert {(p.prefill_id, p.decode_id) for p in placed} == {("p0", "d0")}
    assert "p1" in c.registry.latest and "d1" in c.registry.latest  # alive: its books stay until it ends
    only_draining = conductor((("p0", "prefill"), ("d0", "decode")))
    only_draining.on_heartbeat(msgspec.structs.replace(hb("d0", "decode"), seq=2, draining=True), now=0.1)
    reply = only_draining.schedule(ask("r", ["a"]), now=0.2)
    assert reply.accepted and reply.placement.decode_id != "d0"  # the prefill instance decodes meanwhile


def test_a_stall_of_the_conductor_s_own_loop_drops_no_instance_whose_heartbeat_waits_unread():
    c = conductor()
    c.heard(0.0)
    # Its loop blocks for 3 s (a liveness timeout is 2 s); the first message read after
    # is p0's heartbeat, while p1's and d0's, sent meanwhile, are still queued.
    c.heard(3.0)
    c.on_heartbeat(hb("p0", "prefill"), now=3.0)
    assert sorted(c.registry.latest) == ["d0", "p0", "p1"]
    assert c.schedule(ask("r1", ["a"]), now=3.0).accepted
    # Silence heard while listening still counts: ticks up to 5.5 s, and only p0 beats.
    for i in range(1, 11):
        c.heard(3.0 + 0.25 * i)
    c.on_heartbeat(hb("p0", "prefill"), now=5.5)
    assert sorted(c.registry.latest) == ["p0"]


def test_decode_refusal_counts_as_wasted_prefill_and_frees_the_books():
    c = conductor()
    assert c.schedule(ask("r1", ["a"]), now=0.0).accepted
    c.on_update(RequestUpdate(request_id="r1", kind="prefill_done", instance_id="p0"), now=0.1)
    c.on_update(RequestUpdate(request_id="r1", kind="decode_refused", instance_id="d0"), now=0.2)
    assert c.counts["wasted_prefill"] == 1
    assert all(not load.items for load in c.state.decode_loads(now=0.2))


def test_a_decode_engine_reporting_a_full_kv_cache_gets_no_new_request():
    c = conductor(admission="predictive", mode="disaggregated")
    full = Heartbeat(instance_id="d0", role="decode", node="node-0", pid=1, seq=2, sent_at=0.0, kv_usage=0.99)
    c.on_heartbeat(full, now=0.5)
    reply = c.schedule(ask("r1", ["a"]), now=0.6)
    assert not reply.accepted and reply.rejection == "overloaded" and "room" in reply.reason
    c.on_heartbeat(hb("d0", "decode"), now=0.7)  # usage back to 0
    assert c.schedule(ask("r2", ["a"]), now=0.8).accepted


def test_adaptive_spills_what_disaggregation_would_refuse_onto_an_engine_that_can_serve_it():
    c = conductor(admission="predictive")  # adaptive: the default mode
    full = Heartbeat(instance_id="d0", role="decode", node="node-0", pid=1, seq=2, sent_at=0.0, kv_usage=0.99)
    c.on_heartbeat(full, now=0.5)
    reply = c.schedule(ask("r1", ["a"]), now=0.6)  # no decode room: a prefill engine runs both phases
    assert reply.accepted and reply.placement.local_prefill and reply.placement.decode_id in ("p0", "p1")
    assert (reply.mode.mode, reply.mode.rule, reply.mode.reason) == ("local", "adaptive", "spilled")
    assert "room" in reply.mode.detail and c.stats(now=0.6).modes == {"local:spilled": 1}


def test_a_role_with_no_live_instance_is_served_by_the_other_and_the_record_says_why():
    pooled = conductor((("d0", "decode"), ("d1", "decode")))  # launched with no prefill instance
    reply = pooled.schedule(ask("r1", ["a"]), now=0.1)
    assert reply.accepted and reply.placement.local_prefill and reply.placement.decode_id in ("d0", "d1")
    assert (reply.mode.rule, reply.mode.reason) == ("pooled", "no_prefill_instance")
    c = conductor((("p0", "prefill"), ("d0", "decode")))
    c.on_heartbeat(hb("d0", "decode"), now=2.5)  # p0 silent past the liveness timeout: it died
    reply = c.schedule(ask("r2", ["b"]), now=2.6)
    assert reply.accepted and reply.placement.decode_id == "d0"
    assert (reply.mode.rule, reply.mode.reason) == ("fallback", "no_prefill_live")


def test_adaptive_spills_a_prompt_the_prefill_queue_would_keep_past_its_ttft_onto_the_decode():
    c = conductor(roster=(("p0", "prefill"), ("d0", "decode")), admission="predictive", slo_ttft_ms=2000.0)
    queued = [c.schedule(ask(f"q{n}", [f"{n}-{k}" for k in range(14)]), now=0.0) for n in range(20)]
    spilled = [r for r in queued if r.accepted and r.placement.local_prefill]
    assert spilled and all(r.placement.decode_id == "d0" and r.mode.reason == "spilled" for r in spilled)
    assert "prefill queue" in spilled[0].mode.detail and queued[0].placement.prefill_id == "p0"  # disaggregated first
    off = conductor(roster=(("p0", "prefill"), ("d0", "decode")), admission="predictive", slo_ttft_ms=2000.0,
                    mode="disaggregated")
    refused = [off.schedule(ask(f"q{n}", [f"{n}-{k}" for k in range(14)]), now=0.0) for n in range(20)]
    assert sum(not r.accepted for r in refused) >= len(spilled)


def test_a_decode_that_reports_running_slow_is_judged_at_its_pace():
    c = conductor(admission="predictive", slo_tbt_ms=50.0, mode="disaggregated")
    assert c.schedule(ask("r1", ["a"]), now=0.1).accepted
    c.on_update(RequestUpdate(request_id="r1", kind="finished"), now=0.2)
    slow = Heartbeat(instance_id="d0", role="decode", node="node-0", pid=1, seq=2, sent_at=0.0, slowdown=1000.0)
    c.on_heartbeat(slow, now=0.3)
    reply = c.schedule(ask("r2", ["a"]), now=0.4)
    assert not reply.accepted and "TBT" in reply.reason
    assert c.stats(now=0.4).slowdown == {"p0": 1.0, "p1": 1.0, "d0": 100.0}  # clamped to what is plausible
    off = conductor(admission="predictive", slo_tbt_ms=50.0, calibrate_time_model=False, mode="disaggregated")
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


def test_an_engine_decoding_is_counted_with_the_decode_chunk_cap_whatever_role_it_launched_in():
    c = conductor((("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")), decode_chunk_tokens=256)
    c.roles.assigned["p1"] = "decode"  # moved by the planner: its decode requests carry the cap
    c.state.add_instance("decode", "p1")
    view = c.view_now(0.1)
    assert {x.instance_id: x.decode_chunk_tokens for x in view.decodes} == {"p1": 256, "d0": 256}
    alone = conductor((("p0", "prefill"),), decode_chunk_tokens=256)  # no decode: prefill instances decode too
    assert [x.decode_chunk_tokens for x in alone._hosts("decode", alone.view_now(0.1), 0.1)] == [256]
    colocated = conductor((("d0", "decode"),), mode="colocated", decode_chunk_tokens=256)
    assert [x.decode_chunk_tokens for x in colocated.view_now(0.1).decodes] == [0]  # vLLM's own chunking


class Digests:
    """A NATS client that keeps the digests published."""

    def __init__(self) -> None:
        self.sent: list[BookDigest] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append(msgspec.json.decode(payload, type=BookDigest))


def test_the_digest_leaves_with_a_handler_an_interval_on_and_by_the_timer_only_when_quiet():
    async def run() -> None:
        nc = Digests()
        c = conductor(conductors=2, conductor_sync_ms=20.0)
        wiring = Wiring(c, nc)
        now = time.monotonic()
        for iid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
            c.on_heartbeat(hb(iid, role), now)  # on the wall clock the wiring runs on
        wiring._set_timer(now, now)  # as start() does: the first beat at once
        await asyncio.sleep(0.005)
        assert len(nc.sent) == 1 and not nc.sent[0].bookings
        assert c.schedule(ask("r1", ["h1"]), time.monotonic()).accepted
        await wiring.sync(time.monotonic(), wiring.sync_s)  # its handler, within the interval: not yet
        assert len(nc.sent) == 1
        await asyncio.sleep(0.06)  # then quiet: the timer sends it, two intervals after the last
        assert [b.request_id for b in nc.sent[1].bookings] == ["r1"]
        c.on_update(RequestUpdate(request_id="r1", kind="finished"), time.monotonic())
        await asyncio.sleep(0.025)
        await wiring.sync(time.monotonic(), wiring.sync_s)  # a handler an interval on sends it
        assert len(nc.sent) == 3 and [u.request_id for u in nc.sent[2].updates] == ["r1"]
        await wiring.close()

    asyncio.run(run())


def test_the_planners_turns_log_each_change_of_the_move_it_wants():
    from structlog.testing import capture_logs

    c = conductor((("p0", "prefill"), ("d0", "decode")), planner=True, mode="disaggregated")
    with capture_logs() as logs:
        c.plan(1.0)  # no arrivals yet: no move wanted, as before the first turn
        c.plan(2.0)
    assert [e for e in logs if e["event"] == "planner wants"] == []
    c.roles.planner.wanted = "decode"  # as a turn that wanted a decode instance more leaves it
    with capture_logs() as logs:
        c.plan(3.0)
        c.plan(4.0)
    wants = [e for e in logs if e["event"] == "planner wants"]
    assert len(wants) == 1 and wants[0]["role"] == "no move" and wants[0]["confirm"] == 2


def tenant_ask(rid: str, tenant: str, avoid: tuple[str, ...] = ()) -> ScheduleRequest:
    return msgspec.structs.replace(ask(rid, ["a"]), tenant=tenant, avoid=list(avoid))


def test_a_tenant_past_its_requests_quota_gets_a_quota_refusal_and_the_others_are_served():
    tenants = Tenants({"acme": Tenant("acme", requests_per_minute=2), "beta": Tenant("beta")}, open=False)
    c = Conductor(config(policy="cache_aware"), tenants=tenants)
    for iid, role in (("p0", "prefill"), ("d0", "decode")):
        c.on_heartbeat(hb(iid, role), now=0.0)
    first = c.schedule(tenant_ask("r1", "acme"), now=0.0)
    assert first.accepted and [(q.name, q.limit, q.remaining) for q in first.limits] == [("requests", 2, 1)]
    assert c.schedule(tenant_ask("r2", "acme"), now=1.0).accepted
    assert c.schedule(tenant_ask("r2b", "acme", avoid=("p9",)), now=1.5).accepted  # a retry: counted once
    over = c.schedule(tenant_ask("r3", "acme"), now=2.0)
    assert (over.accepted, over.rejection, over.quota, over.retry_after_s) == (False, "quota", "requests", 58.0)
    assert over.limits[0].remaining == 0
    assert c.schedule(tenant_ask("r4", "beta"), now=2.0).accepted and c.rejections == {"quota": 1}
    for iid, role in (("p0", "prefill"), ("d0", "decode")):
        c.on_heartbeat(hb(iid, role), now=60.0)
    assert c.schedule(tenant_ask("r5", "acme"), now=60.5).accepted  # r1 left the minute


def test_a_peers_admissions_count_against_the_tenant_here():
    tenants = Tenants({"acme": Tenant("acme", requests_per_minute=2)}, open=False)
    here, there = (Conductor(config(policy="cache_aware", conductors=2), name, tenants=tenants)
                   for name in ("conductor", "conductor-1"))
    for c in (here, there):
        for iid, role in (("p0", "prefill"), ("d0", "decode")):
            c.on_heartbeat(hb(iid, role), now=0.0)
    assert there.schedule(tenant_ask("t1", "acme"), now=0.0).accepted
    assert there.schedule(tenant_ask("t2", "acme"), now=0.0).accepted
    here.on_digest(there.digest.take(0.1), now=0.1)
    assert here.schedule(tenant_ask("h1", "acme"), now=0.2).rejection == "quota"


def test_once_loaded_a_flooding_tenant_is_held_to_its_share_and_sheddable_goes_first():
    tenants = Tenants({"flood": Tenant("flood"), "steady": Tenant("steady"),
                       "spare": Tenant("spare", priority="sheddable")}, open=False)
    c = Conductor(config(policy="cache_aware"), tenants=tenants)
    for iid, role in (("p0", "prefill"), ("d0", "decode")):
        c.on_heartbeat(hb(iid, role), now=0.0)

    def loaded(rid: str, tenant: str) -> ScheduleRequest:  # its TTFT SLO far below any prediction: past the mark
        return msgspec.structs.replace(ask(rid, ["a"], slo_ttft_ms=0.001), tenant=tenant)

    assert all(c.schedule(loaded(f"f{i}", "flood"), now=0.0).accepted for i in range(4))  # alone: all its own
    assert c.schedule(loaded("s1", "steady"), now=0.0).accepted  # below its share
    refused = c.schedule(loaded("f5", "flood"), now=0.0)
    assert (refused.rejection, c.rejections) == ("overloaded", {"fair_share": 1})
    assert c.schedule(loaded("x1", "spare"), now=0.0).rejection == "overloaded"
    assert c.rejections == {"fair_share": 1, "shed_class": 1}
    assert c.schedule(ask("f6", ["a"]), now=0.0).accepted  # not loaded: everybody's (the default tenant)


def test_a_tenant_held_to_its_share_does_not_get_in_as_a_spill_onto_the_decode():
    tenants = Tenants({"flood": Tenant("flood"), "steady": Tenant("steady")}, open=False)
    c = Conductor(config(policy="cache_aware", admission="predictive"), tenants=tenants)  # adaptive: it spills
    full = Heartbeat(instance_id="d0", role="decode", node="node-0", pid=1, seq=2, sent_at=0.0, kv_usage=0.99)
    for iid, role in (("p0", "prefill"), ("d0", "decode")):
        c.on_heartbeat(hb(iid, role), now=0.0)
    c.on_heartbeat(full, now=0.5)  # disaggregation refuses everything: only a spill could take it

    def loaded(rid: str, tenant: str) -> ScheduleRequest:
        # a spill's predicted TTFT is about 17 ms: within a 50 ms SLO, past the mark
        return msgspec.structs.replace(ask(rid, ["a"], slo_ttft_ms=50.0), tenant=tenant)

    assert c.schedule(loaded("s1", "steady"), now=0.6).placement.local_prefill  # alone: its own, spilled
    assert c.schedule(loaded("f1", "flood"), now=0.6).accepted  # below its share of the minute's tokens
    assert c.schedule(loaded("f2", "flood"), now=0.6).accepted  # at it (as much as steady)
    spilled = c.schedule(loaded("f3", "flood"), now=0.6)
    assert not spilled.accepted and c.rejections.get("fair_share") == 1, spilled


def test_with_no_tenants_file_the_conductor_books_nothing_against_quotas():
    c = conductor()
    assert c.schedule(ask("r1", ["a"]), now=0.1).accepted
    assert c.quotas.usage == {} and c.quotas.deadlines == []


@pytest.mark.parametrize("mode", ["disaggregated", "conditional"])
def test_a_disaggregated_placement_records_its_predictions_in_its_serving_mode(mode):
    # 20 blocks: more than a step computes, so conditional's rule keeps it disaggregated too.
    reply = conductor(mode=mode).schedule(ask("r1", [f"h{i}" for i in range(20)]), now=0.0)
    assert reply.accepted and reply.mode.mode == "disaggregated"
    assert reply.mode.predicted_ttft_ms == round(reply.predicted_ttft_ms, 1) > 0
    assert reply.mode.predicted_tbt_ms == round(reply.predicted_tbt_ms, 1) > 0
