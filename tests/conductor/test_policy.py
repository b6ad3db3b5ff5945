"""Each policy's defining behaviour, on constructed states."""

from dataclasses import replace

import pytest

from services.conductor.cpp import PipelineGroup
from services.conductor.policy import (
    PREFILL_POLICIES,
    Decision,
    DecodeDecision,
    DecodeItem,
    DecodeLoad,
    Params,
    PrefillLoad,
    Rejection,
    Request,
    Scheduler,
    pace_of,
)
from shared.calibration import length_class
from shared.predictor import Predictor

BS = 128
# prefill(n, p) = 1 ms + 0.01 ms·n (no attention terms: easy arithmetic); step = 5 ms + 1 ms·batch
PRED = Predictor(prefill_coef=(1.0, 0.01, 0.0, 0.0), decode_coef=(5.0, 1.0, 0.0), kv_bytes_per_token=1000, transfer_bytes_per_s=1e9)


def req(prompt_len=8192, slo_ttft_s=10.0, slo_tbt_s=1.0) -> Request:
    return Request("r", prompt_len, prompt_len // BS, 100, slo_ttft_s, slo_tbt_s)


def sched(policy="cache_aware", admission="none", **params) -> Scheduler:
    return Scheduler(policy, admission, PRED, Params(block_size=BS, **params))


def p(iid, queue_s=0.0, prefix=0, active=0, hit=0.0, window=0.0) -> PrefillLoad:
    return PrefillLoad(iid, queue_s, active, prefix, hit, window)


IDLE_DECODE = [DecodeLoad("d0", ())]


def prefill_of(s: Scheduler, r: Request, loads) -> str:
    out = s.schedule(r, loads, IDLE_DECODE, now=0.0)
    assert isinstance(out, Decision), out
    return out.prefill.instance_id


@pytest.mark.parametrize("policy", ["cache_aware", "kvcentric"])
def test_long_prefix_with_deep_queue_loses_exactly_when_queue_exceeds_the_saving(policy):
    r = req(8192)
    prefix = 48  # 6144 tokens cached on "holder"
    saved = PRED.prefill_s(8192, 0) - PRED.prefill_s(8192 - prefix * BS, prefix * BS)
    no_pulls = Predictor(PRED.prefill_coef, PRED.decode_coef, kv_bytes_per_token=1000, transfer_bytes_per_s=1.0)
    s = Scheduler(policy, "none", no_pulls, Params(block_size=BS))  # compare the two plain options
    assert prefill_of(s, r, [p("holder", queue_s=saved * 0.99, prefix=prefix), p("idle")]) == "holder"
    assert prefill_of(s, r, [p("holder", queue_s=saved * 1.01, prefix=prefix), p("idle")]) == "idle"


def test_kvcentric_pulls_when_transfer_beats_recompute_and_not_otherwise():
    r = req(8192)
    loads = [p("holder", queue_s=100.0, prefix=60), p("other")]
    fast = Scheduler("kvcentric", "none", PRED, Params(block_size=BS))
    out = fast.schedule(r, loads, IDLE_DECODE, now=0.0)
    assert out.prefill.instance_id == "other" and out.prefill.pull_from == "holder" and out.prefill.pull_blocks == 60
    # 60 blocks · 128 tokens · 1000 B at 1 MB/s ≈ 7.7 s, far more than recomputing them (≈ 77 ms).
    slow_pred = Predictor(PRED.prefill_coef, PRED.decode_coef, kv_bytes_per_token=1000, transfer_bytes_per_s=1e6)
    slow = Scheduler("kvcentric", "none", slow_pred, Params(block_size=BS))
    out = slow.schedule(r, loads, IDLE_DECODE, now=0.0)
    assert out.prefill.instance_id == "other" and out.prefill.pull_from == "" and out.prefill.cached_blocks == 0


def test_kvcentric_pulls_only_past_the_balancing_threshold():
    r = req(8192)
    loads = [p("holder", queue_s=100.0, prefix=60), p("other", prefix=40)]  # ratio 1.5
    out = sched("kvcentric", balance_threshold=2.0).schedule(r, loads, IDLE_DECODE, now=0.0)
    assert out.prefill.pull_from == ""
    out = sched("kvcentric", balance_threshold=1.2).schedule(r, loads, IDLE_DECODE, now=0.0)
    assert out.prefill.pull_from == "holder" and out.prefill.pull_blocks == 20


def test_preble_exploits_when_matched_exceeds_missed_and_explores_otherwise():
    # 40 of 64 blocks matched on "holder" (heavily loaded): matched > missed → exploit.
    r = req(8192)
    loads = [p("holder", prefix=40, window=50.0), p("light", window=40.0)]
    assert prefill_of(sched("preble"), r, loads) == "holder"
    # 20 of 64 matched: explore → the cheaper of load + prefill of the missed tokens.
    loads = [p("holder", prefix=20, window=50.0), p("light", window=40.0)]
    assert prefill_of(sched("preble"), r, loads) == "light"


def test_preble_explores_to_a_cache_heavy_instance_and_rebalances():
    r = req(8192)
    loads = [p("a", window=10.0), p("b", window=12.0, hit=0.8)]
    assert prefill_of(sched("preble"), r, loads) == "b"  # hit ratio ≥ 0.7 takes it
    loads = [p("a", prefix=40, window=30.0), p("b", window=10.0)]  # exploit picks a, but 30 ≥ 1.5·10
    assert prefill_of(sched("preble"), r, loads) == "b"


def test_overlap_load_weighs_blocks_to_prefill_against_active_blocks():
    r = req(8192)  # 64 blocks
    loads = [p("cached", prefix=32, active=40), p("empty", active=0)]
    assert prefill_of(sched("overlap_load", overlap_weight=1.0), r, loads) == "empty"  # 32+40 > 64
    assert prefill_of(sched("overlap_load", overlap_weight=2.0), r, loads) == "cached"  # 64+40 < 128


def test_baselines():
    r = req(1024)
    loads = [p("a", queue_s=3.0), p("b", queue_s=1.0), p("c", queue_s=2.0)]
    assert prefill_of(sched("least_loaded"), r, loads) == "b"
    rr = sched("round_robin")
    assert [prefill_of(rr, r, loads) for _ in range(4)] == ["a", "b", "c", "a"]
    assert {prefill_of(sched("random"), r, loads) for _ in range(30)} <= {"a", "b", "c"}
    assert set(PREFILL_POLICIES) == {"random", "round_robin", "least_loaded", "overlap_load", "cache_aware", "kvcentric", "preble"}


def busy(n: int, start: float, end: float) -> tuple[DecodeItem, ...]:
    return tuple(DecodeItem(start, end, 1000) for _ in range(n))


def test_decode_choice_is_the_lowest_predicted_tbt():
    decodes = [DecodeLoad("d0", busy(8, 0.0, 50.0)), DecodeLoad("d1", busy(2, 0.0, 50.0))]
    out = sched().schedule(req(1024), [p("a")], decodes, now=0.0)
    assert out.decode_id == "d1" and out.tbt_s == pytest.approx(PRED.decode_step_s(3, 3 * 1000))


def test_predictive_accepts_when_decode_load_drains_before_prefill_ends():
    # Decode is full now (30 running: TBT 36 ms > 20 ms) but they all end at t=1 s;
    # this request's prefill ends after its 2 s queue.
    r = req(1024, slo_ttft_s=10.0, slo_tbt_s=0.020)
    prefills = [p("a", queue_s=2.0)]
    decodes = [DecodeLoad("d0", busy(30, 0.0, 1.0))]
    assert isinstance(sched(admission="early_reject").schedule(r, prefills, decodes, now=0.0), Rejection)
    assert isinstance(sched(admission="predictive").schedule(r, prefills, decodes, now=0.0), Decision)


def test_predictive_refuses_when_decode_load_will_have_grown():
    # Decode is idle now, but 30 requests finish prefill at t=1 s and will be decoding at t=2 s.
    r = req(1024, slo_ttft_s=10.0, slo_tbt_s=0.020)
    prefills = [p("a", queue_s=2.0)]
    decodes = [DecodeLoad("d0", busy(30, 1.0, 50.0))]
    assert isinstance(sched(admission="early_reject").schedule(r, prefills, decodes, now=0.0), Decision)
    out = sched(admission="predictive").schedule(r, prefills, decodes, now=0.0)
    assert isinstance(out, Rejection) and out.kind == "overloaded" and "TBT" in out.reason


def test_early_rejection_judges_the_decode_the_request_would_go_to():
    # d0 is full now but drains at 1 s; d1 is idle now but fills at 1 s. The request
    # (prefill ends at 2 s) would go to d0: early rejection judges d0 now, not the
    # idle-for-now d1 it would never use.
    r = req(1024, slo_ttft_s=10.0, slo_tbt_s=0.020)
    decodes = [DecodeLoad("d0", busy(30, 0.0, 1.0)), DecodeLoad("d1", busy(30, 1.0, 50.0))]
    out = sched(admission="early_reject").schedule(r, [p("a", queue_s=2.0)], decodes, now=0.0)
    assert isinstance(out, Rejection) and "d0" in out.reason
    assert sched(admission="predictive").schedule(r, [p("a", queue_s=2.0)], decodes, now=0.0).decode_id == "d0"


def test_admission_rejects_a_predicted_ttft_beyond_the_slo_with_a_retry_hint():
    r = req(1024, slo_ttft_s=1.0)
    out = sched(admission="early_reject").schedule(r, [p("a", queue_s=5.0)], IDLE_DECODE, now=0.0)
    assert isinstance(out, Rejection) and "TTFT" in out.reason and out.retry_after_s == pytest.approx(4.0, abs=0.1)
    assert isinstance(sched(admission="none").schedule(r, [p("a", queue_s=5.0)], IDLE_DECODE, now=0.0), Decision)


def test_no_instances_is_unavailable_and_names_are_checked():
    out = sched().schedule(req(), [], IDLE_DECODE, now=0.0)
    assert isinstance(out, Rejection) and out.kind == "unavailable"
    with pytest.raises(ValueError, match="kvcentric"):
        sched("clairvoyant")
    with pytest.raises(ValueError, match="predictive"):
        sched(admission="maybe")


def test_decode_load_peaks_where_requests_join_and_capacity_is_a_hard_limit():
    load = DecodeLoad("d0", (DecodeItem(0.0, 5.0, 100), DecodeItem(2.0, 8.0, 100), DecodeItem(6.0, 9.0, 100)), capacity=2)
    assert load.at(1.0) == (1, 100) and load.peak(1.0, 7.0) == (2, 200)
    # A request decoding over [1, 11) would make three at t=2: no room, wherever it looks.
    r = req(1024)
    s = Scheduler("cache_aware", "predictive", PRED, Params(block_size=BS, decode_time_s=10.0))
    out = s.schedule(r, [p("a", queue_s=1.0)], [load], now=0.0)
    assert isinstance(out, Rejection) and "room" in out.reason
    # With t_d short enough to finish before the next join, it fits.
    s = Scheduler("cache_aware", "predictive", PRED, Params(block_size=BS, decode_time_s=0.5))
    assert isinstance(s.schedule(r, [p("a", queue_s=1.0)], [load], now=0.0), Decision)


def test_pool_pull_names_the_node_with_the_longest_prefix_beyond_the_chosen():
    from services.conductor.policy import pool_pull

    assert pool_pull("n0", 2, {"n0": 2, "n1": 5, "n2": 5}) == ("n1", 5)
    assert pool_pull("n0", 5, {"n0": 5, "n1": 5}) == ("", 0)
    assert pool_pull("n0", 6, {"n0": 1, "n1": 5}) == ("", 0)  # its engine cache already has more


# --- retries: instances that failed a request are avoided ---------------------
@pytest.mark.parametrize("policy", sorted(PREFILL_POLICIES))
def test_every_policy_avoids_the_instances_that_failed_the_request(policy):
    r = replace(req(8192), avoid=frozenset({"holder", "d0"}))
    # The avoided prefill holds the whole prompt and is idle; the avoided decode is idle.
    loads = [p("holder", prefix=64), p("other", queue_s=5.0)]
    decodes = [DecodeLoad("d0", ()), DecodeLoad("d1", (DecodeItem(0.0, 100.0, 4000),))]
    out = sched(policy).schedule(r, loads, decodes, now=0.0)
    assert isinstance(out, Decision), out
    assert (out.prefill.instance_id, out.decode_id) == ("other", "d1")


def test_a_request_avoiding_every_instance_is_unavailable():
    r = replace(req(), avoid=frozenset({"p0"}))
    out = sched().schedule(r, [p("p0")], IDLE_DECODE, now=0.0)
    assert isinstance(out, Rejection) and out.kind == "unavailable"


def test_a_decode_alone_goes_to_the_least_loaded_one_not_avoided_with_room():
    busy = DecodeLoad("d1", (DecodeItem(0.0, 100.0, 4000),))
    s = sched(admission="predictive")  # a decode alone is not judged against SLOs: it was admitted
    r = replace(req(slo_tbt_s=1e-6), avoid=frozenset({"d0"}))
    out = s.place_decode(r, [DecodeLoad("d0", ()), busy, DecodeLoad("d2", ())], now=0.0)
    assert out == DecodeDecision("d2", PRED.decode_step_s(1, 8192))
    assert s.place_decode(r, [DecodeLoad("d0", ()), busy], now=0.0).decode_id == "d1"
    none_left = s.place_decode(r, [DecodeLoad("d0", ())], now=0.0)
    assert isinstance(none_left, Rejection) and none_left.kind == "unavailable"
    full = s.place_decode(r, [DecodeLoad("d1", busy.items, capacity=1)], now=0.0)
    assert isinstance(full, Rejection) and full.kind == "overloaded"


def test_an_instance_running_slower_than_its_profile_is_predicted_slower():
    # Both SLOs met at the profile's pace, both missed at three times it.
    r = req(1024, slo_ttft_s=0.025, slo_tbt_s=0.010)
    out = sched(admission="predictive").schedule(r, [p("a", queue_s=0.005)], [DecodeLoad("d0", ())], now=0.0)
    assert isinstance(out, Decision) and out.prefill.ttft_s == pytest.approx(0.005 + PRED.prefill_s(1024))
    slow_prefill = [replace(p("a", queue_s=0.005), slowdown=3.0)]
    out = sched(admission="predictive").schedule(r, slow_prefill, [DecodeLoad("d0", ())], now=0.0)
    assert isinstance(out, Rejection) and "TTFT" in out.reason
    slow_decode = [DecodeLoad("d0", (), slowdown=3.0)]
    out = sched(admission="predictive").schedule(r, [p("a", queue_s=0.005)], slow_decode, now=0.0)
    assert isinstance(out, Rejection) and "TBT" in out.reason


def test_a_prediction_takes_the_pace_of_work_as_long_as_it():
    # Short work runs 3x its profile on a, work of 10 ms and longer 1.1x (and any
    # longer than seen, the last entry): a 1,024-token prompt (11 ms) is predicted at 1.1x.
    paces = (3.0,) * length_class(0.01) + (1.1,)
    a = replace(p("a"), slowdown=3.0, paces=paces)
    out = sched(admission="predictive").schedule(req(1024, slo_ttft_s=0.02), [a], IDLE_DECODE, now=0.0)
    assert isinstance(out, Decision) and out.prefill.ttft_s == pytest.approx(1.1 * PRED.prefill_s(1024))
    assert pace_of(a, 0.001) == 3.0 and pace_of(a, 100.0) == 1.1


def test_cache_aware_prefers_the_instance_that_runs_faster_now():
    loads = [replace(p("a", queue_s=0.01), slowdown=4.0), p("b", queue_s=0.03)]
    assert prefill_of(sched(), req(1024), loads) == "b"
    assert prefill_of(sched(), req(1024), [replace(loads[0], slowdown=1.0), loads[1]]) == "a"


GROUP = PipelineGroup(stages=2, chunk_tokens=1024)


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware", "kvcentric"])
def test_a_cpp_group_takes_a_long_uncached_prompt_whatever_the_policy(policy):
    """8,192 tokens: 83 ms on one instance; through 2 stages, 8 chunks of 1,024 and one
    of fill, each stage step its 1 ms plus half a chunk's 10.24 ms."""
    out = sched(policy).schedule(req(8192), [p("s0"), replace(p("g0"), group=GROUP)], IDLE_DECODE, now=0.0)
    assert isinstance(out, Decision) and out.prefill.instance_id == "g0"
    assert out.route is not None and out.route.key == "cpp:faster"
    assert out.prefill.ttft_s == pytest.approx(9 * (0.001 + 0.01024 / 2))


def test_a_short_prompt_or_a_busy_group_leaves_the_prompt_on_a_single_instance():
    s = sched()
    short = s.schedule(req(100), [p("s0"), replace(p("g0"), group=GROUP)], IDLE_DECODE, now=0.0)
    busy = s.schedule(req(8192), [p("s0"), replace(p("g0", queue_s=0.05), group=GROUP)], IDLE_DECODE, now=0.0)
    assert (short.prefill.instance_id, short.route.key) == ("s0", "single:short_input")
    assert (busy.prefill.instance_id, busy.route.key) == ("s0", "single:group_slower_now")
    assert "g0" in busy.route.detail and "s0" in busy.route.detail  # the compared figures


def test_without_single_instances_the_policy_chooses_among_groups():
    out = sched("round_robin").schedule(req(100), [replace(p("g0"), group=GROUP)], IDLE_DECODE, now=0.0)
    assert out.prefill.instance_id == "g0" and out.route is None
