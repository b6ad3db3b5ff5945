"""The planner's pure policy: demand from the window's arrivals priced by the time
models, a split in proportion (decode never short), and moves with hysteresis."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.conductor.planner import Arrival, Observation, Planner, PlannerParams, demand, sized_batch
from shared.predictor import Predictor

# ms: prefill 10 + 0.02/token (linear only); decode step 10 + 0.1/sequence + 0.00002/context token
PREDICTOR = Predictor((10.0, 0.02, 0.0, 0.0), (10.0, 0.1, 0.00002))
PARAMS = PlannerParams(window_s=10.0, interval_s=1.0, confirm=2, dwell_s=5.0, move_share_per_min=0.25,
                       decode_burst_z=0.0)  # fleets of 8 here: 2 moves a minute


def roles(prefill: int, decode: int) -> dict[str, str]:
    return {**{f"p{i}": "prefill" for i in range(prefill)}, **{f"d{i}": "decode" for i in range(decode)}}


def obs(now: float, prefill: int, decode: int, prompt: int, output: int, per_s: float = 10.0, **kw) -> Observation:
    arrivals = tuple(Arrival(now - i / per_s, prompt, prompt, output) for i in range(int(PARAMS.window_s * per_s)))
    return Observation(now, roles(prefill, decode), arrivals, slo_tbt_s=0.05, **kw)  # type: ignore[arg-type]


def test_long_prompts_ask_for_prefill_and_long_outputs_for_decode():
    long_prompts = demand(obs(100.0, 4, 4, prompt=20000, output=40), PREDICTOR, PARAMS)
    long_outputs = demand(obs(100.0, 4, 4, prompt=200, output=2000), PREDICTOR, PARAMS)
    assert long_prompts.target_prefill > 4 > long_outputs.target_prefill
    assert demand(Observation(100.0, roles(4, 4), (), 0.05), PREDICTOR, PARAMS) is None  # no arrivals: no opinion


def test_a_conductor_started_within_the_window_prices_the_rate_over_what_it_saw():
    # 10 req/s for the 4 s since it started: the rate is 10, not 40 arrivals over the 10 s window.
    arrivals = tuple(Arrival(100.0 - i / 10, 20000, 20000, 40) for i in range(40))
    whole = demand(obs(100.0, 4, 4, prompt=20000, output=40), PREDICTOR, PARAMS)
    young = Observation(100.0, roles(4, 4), arrivals, slo_tbt_s=0.05, since=96.0)  # type: ignore[arg-type]
    assert demand(young, PREDICTOR, PARAMS).prefill == pytest.approx(whole.prefill)
    # Under one interval, the span is the interval: a rate over a second's arrivals is noise.
    newborn = replace(young, arrivals=arrivals[:5], since=99.5)
    assert demand(newborn, PREDICTOR, PARAMS).prefill == pytest.approx(whole.prefill / 2)


def test_decode_is_never_given_less_than_it_needs_and_each_role_keeps_one():
    d = demand(obs(100.0, 4, 4, prompt=40000, output=80), PREDICTOR, PARAMS)
    # Prefill overloaded: in proportion decode would get 1 instance of the 1.3 it needs; it gets 2.
    assert d.prefill > 8 and round(8 * d.prefill / (d.prefill + d.decode)) == 7 and d.target_prefill == 6
    both = demand(obs(100.0, 4, 4, prompt=60000, output=400), PREDICTOR, PARAMS)  # decode alone needs the fleet
    assert both.decode > 8 and 1 <= both.target_prefill == round(8 * both.prefill / (both.prefill + both.decode))


def test_prefill_short_of_the_need_serves_the_cheapest_prompts_first():
    # Half the prompts 200 tokens (4 ms beyond a step's fixed 10), half 20,000 (400 ms):
    # one instance has 0.38 of the work's time, and admission sheds long prompts first,
    # so it serves every short prompt and 18 long ones: 0.68 of the requests.
    mixed = tuple(Arrival(100.0 - i / 10, p, p, 40) for i, p in enumerate([200, 20000] * 50))
    d = demand(Observation(100.0, roles(1, 7), mixed, slo_tbt_s=0.05), PREDICTOR, PARAMS)  # type: ignore[arg-type]
    assert 1 / d.prefill == pytest.approx(0.377, abs=0.001) and d.headroom(1, 7) == pytest.approx(0.68)
    # Prompts alike: requests served in the same share as the work.
    alike = demand(obs(100.0, 1, 7, prompt=10100, output=40), PREDICTOR, PARAMS)
    assert alike.headroom(1, 7) == pytest.approx(1 / alike.prefill, abs=0.01)
    assert d.headroom(3, 5) == pytest.approx(3 / d.prefill)  # past the need: room, counted in work


def test_prefill_slower_than_its_profile_asks_for_more_prefill_instances():
    # 3 req/s of 20k-token prompts: 0.41 s each as predicted, 1.5 instances' work (at 0.8 busy).
    as_profiled = demand(obs(100.0, 2, 6, prompt=20000, output=40, per_s=3.0), PREDICTOR, PARAMS)
    slow = demand(obs(100.0, 2, 6, prompt=20000, output=40, per_s=3.0, prefill_slowdown=2.0), PREDICTOR, PARAMS)
    assert slow.prefill == pytest.approx(2 * as_profiled.prefill)
    fast = demand(obs(100.0, 2, 6, prompt=20000, output=40, per_s=3.0, prefill_slowdown=0.5), PREDICTOR, PARAMS)
    assert fast.prefill == as_profiled.prefill  # as decode's: a pace under 1 is not trusted to free instances
    # Two prefill instances serve the load as profiled; at twice the time they do not.
    planners = Planner(PREDICTOR, PARAMS), Planner(PREDICTOR, PARAMS)
    for t in (100.0, 101.0):
        kept = planners[0].decide(obs(t, 2, 6, prompt=20000, output=40, per_s=3.0))
        moved = planners[1].decide(obs(t, 2, 6, prompt=20000, output=40, per_s=3.0, prefill_slowdown=2.0))
    assert kept == [] and [m.to for m in moved] == ["prefill", "prefill"]


def test_the_batch_is_sized_to_the_tbt_slo():
    b = sized_batch(PREDICTOR, 2000, 0.03, 256)
    assert PREDICTOR.decode_step_s(b, b * 2000) <= 0.03 < PREDICTOR.decode_step_s(b + 1, (b + 1) * 2000)
    assert sized_batch(PREDICTOR, 10, 1.0, 64) == 64


def test_a_move_waits_for_its_target_to_hold_and_takes_the_least_busy_instance():
    planner = Planner(PREDICTOR, PARAMS)
    batches = {"d0": 5, "d1": 1, "d2": 3, "d3": 4}
    first = planner.decide(obs(100.0, 4, 4, prompt=20000, output=40, decode_batches=batches))
    assert first == []  # once is not yet a trend (confirm=2)
    second = planner.decide(obs(101.0, 4, 4, prompt=20000, output=40, decode_batches=batches))
    assert [m.instance_id for m in second] == ["d1", "d2"] and all(m.to == "prefill" for m in second)  # 2 a minute


def test_the_minute_budget_and_the_dwell_time_bound_moves():
    planner = Planner(PREDICTOR, PARAMS)
    for t in (100.0, 101.0):
        planner.decide(obs(t, 4, 4, prompt=20000, output=40))
    after = roles(6, 2)
    again = [planner.decide(Observation(t, after, obs(t, 6, 2, prompt=20000, output=40).arrivals, 0.05))
             for t in (102.0, 103.0, 104.0)]
    assert again == [[], [], []]  # the minute's two moves are spent
    back = Planner(PREDICTOR, PARAMS, changed_at={"p0": 100.0, "p1": 100.0})
    want_decode = [back.decide(obs(t, 2, 6, prompt=200, output=3000)) for t in (101.0, 102.0)]
    assert want_decode == [[], []]  # p0 and p1 have not dwelt 5 s in their role


def test_nothing_moves_on_a_plateau_where_every_split_serves_the_load():
    planner = Planner(PREDICTOR, PARAMS)
    light = [planner.decide(obs(100.0 + t, 4, 4, prompt=1000, output=50, per_s=1.0)) for t in range(5)]
    assert light == [[]] * 5


def test_decode_refusals_move_an_instance_to_decode_whatever_the_models_say():
    planner = Planner(PREDICTOR, PARAMS)
    moves = [planner.decide(obs(100.0 + t, 4, 4, prompt=20000, output=40, decode_refusals=50)) for t in range(2)]
    assert moves[0] == [] and [(m.to, m.instance_id) for m in moves[1]] == [("decode", "p0")]


def test_an_instance_mid_move_is_not_moved_again():
    planner = Planner(PREDICTOR, PARAMS)
    for t in (100.0, 101.0):
        out = planner.decide(obs(t, 4, 4, prompt=20000, output=40, moving=frozenset({"d0", "d1", "d2"})))
    assert [m.instance_id for m in out] == ["d3"]


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        PlannerParams(decode_utilization=0)


# Decode engines cap a prompt's chunk at 1,024 tokens (a 30 ms step beside a small batch).
ADAPTIVE = PlannerParams(window_s=10.0, interval_s=1.0, confirm=1, dwell_s=0.0, empty_prefill=True, chunk_tokens=1024)


def test_in_adaptive_mode_a_prefill_role_that_needs_under_half_an_instance_is_emptied():
    # Two instances, long outputs of short prompts: prefill needs a sliver of one.
    d = demand(obs(100.0, 1, 1, prompt=200, output=2000), PREDICTOR, ADAPTIVE)
    assert d.target_prefill == 0 and d.served(0, 2) > d.served(1, 1)
    assert Planner(PREDICTOR, ADAPTIVE).decide(obs(100.0, 1, 1, prompt=200, output=2000))[0].to == "decode"
    fixed = PlannerParams(window_s=10.0, interval_s=1.0, confirm=1, dwell_s=0.0)  # disaggregated: one of each
    assert demand(obs(100.0, 1, 1, prompt=200, output=2000), PREDICTOR, fixed).target_prefill == 1
    # Decode refusing under long prompts does not empty the prefill role: decode would
    # then prefill them all itself.
    refusing = obs(100.0, 1, 1, prompt=20000, output=40, decode_refusals=50)
    assert demand(refusing, PREDICTOR, ADAPTIVE).target_prefill == 1
    assert Planner(PREDICTOR, ADAPTIVE).decide(refusing) == []
    # Where prefill needs a sliver, refusals do not keep it either.
    sliver = obs(100.0, 1, 1, prompt=200, output=2000, decode_refusals=50)
    assert demand(sliver, PREDICTOR, ADAPTIVE).target_prefill == 0


def test_in_adaptive_mode_the_fleet_pools_where_decode_steps_leave_prefill_room():
    # Both serve the load: pooled, each engine's 10 ms decode steps leave 70 % of a
    # 45 ms step to prompt chunks, and two engines take prompts where one did.
    plateau = demand(obs(100.0, 1, 1, prompt=4000, output=400, per_s=2.0), PREDICTOR, ADAPTIVE)
    assert plateau.served(0, 2) == plateau.served(1, 1) == 1.0 and plateau.target_prefill == 0
    assert plateau.pooled_free == pytest.approx(0.72, abs=0.01)
    assert plateau.headroom(0, 2) > 1.05 * plateau.headroom(1, 1)
    assert Planner(PREDICTOR, ADAPTIVE).decide(obs(100.0, 1, 1, prompt=4000, output=400, per_s=2.0))[0].to == "decode"
    # Long prompts, light decode: two prefilling engines beat one, however overloaded.
    assert demand(obs(100.0, 0, 2, prompt=20000, output=40), PREDICTOR, ADAPTIVE).target_prefill == 0
    # A tight TBT SLO leaves a decode step little room for chunks: split again.
    tight = replace(obs(100.0, 0, 2, prompt=8000, output=100, per_s=3.0), slo_tbt_s=0.02)
    back = demand(tight, PREDICTOR, ADAPTIVE)
    assert back.pooled_free < 0.5 and back.target_prefill == 1 and back.headroom(1, 1) > back.headroom(0, 2)
    assert Planner(PREDICTOR, ADAPTIVE).decide(tight)[0].to == "prefill"


def test_a_pooled_fleet_is_priced_by_the_prompts_its_engines_would_take():
    # Pooled engines take a long prompt in capped chunks beside their decodes...
    fast = obs(100.0, 1, 1, prompt=4000, output=400, per_s=2.0)
    assert demand(fast, PREDICTOR, ADAPTIVE).pooled_share == 1.0
    # ... but on a host whose steps run 2x the profile's, a 1,024-token chunk beside a
    # batch breaks the 50 ms SLO: admission would refuse every such prompt there.
    slow = replace(fast, decode_slowdown=2.0)
    d = demand(slow, PREDICTOR, ADAPTIVE)
    assert d.pooled_share == 0.0 and d.headroom(0, 2) == 0.0 and d.target_prefill == 1
    assert Planner(PREDICTOR, ADAPTIVE).decide(slow) == []
    # Short prompts fit a step there whatever the cap: half of them, half pooled.
    mixed = replace(slow, arrivals=tuple(replace(a, uncached_tokens=200, prompt_tokens=200) if i % 2 else a
                                         for i, a in enumerate(slow.arrivals)))
    assert demand(mixed, PREDICTOR, ADAPTIVE).pooled_share == pytest.approx(0.5)
    # Where nothing decodes at once (one-token answers), a prompt is an idle engine's only work.
    alone = replace(slow, arrivals=tuple(replace(a, uncached_tokens=2000, prompt_tokens=2000, output_tokens=1)
                                         for a in slow.arrivals))
    assert demand(alone, PREDICTOR, ADAPTIVE).pooled_share == 1.0


def test_pooled_and_split_within_min_gain_of_each_other_move_nothing():
    # Pooled has 2 % more room than 1P+1D here: neither way is worth a move.
    near = obs(100.0, 1, 1, prompt=8000, output=300, per_s=2.0)
    d = demand(near, PREDICTOR, ADAPTIVE)
    assert d.target_prefill == 0 and d.headroom(1, 1) < d.headroom(0, 2) < 1.05 * d.headroom(1, 1)
    assert Planner(PREDICTOR, ADAPTIVE).decide(near) == []


def test_decode_plans_room_for_bursts_relatively_more_where_few_decode():
    bursty = replace(PARAMS, decode_burst_z=2.0)
    extra = []
    for per_s in (0.5, 20.0):  # few requests decoding at once, then many
        plain = demand(obs(100.0, 4, 4, prompt=200, output=400, per_s=per_s), PREDICTOR, PARAMS)
        room = demand(obs(100.0, 4, 4, prompt=200, output=400, per_s=per_s), PREDICTOR, bursty)
        concurrent = plain.decode * PARAMS.decode_utilization * sized_batch(PREDICTOR, 400, 0.045, PARAMS.max_batch)
        assert room.decode == pytest.approx(plain.decode * (1 + 2 / concurrent ** 0.5))
        extra.append(room.decode / plain.decode)
    assert extra[0] > 1.5 > 1.2 > extra[1]


def test_a_minute_moves_at_most_a_share_of_the_fleet():
    big = Planner(PREDICTOR, replace(PARAMS, move_share_per_min=0.5))
    moves = [big.decide(obs(t, 2, 14, prompt=40000, output=40)) for t in (100.0, 101.0)]
    assert moves[0] == [] and len(moves[1]) == 8  # half of 16 at once: a shift is followed within a minute
    with pytest.raises(ValueError):
        PlannerParams(move_share_per_min=0.0)


def test_the_last_live_instance_is_never_moved():
    # Decode missed its heartbeats under load: the planner sees a fleet of one prefill
    # instance, whose pooled target is decode. Moving it would drain the only engine
    # the Conductor can place on.
    lone = obs(100.0, 1, 0, prompt=200, output=200, per_s=1.0)
    planner = Planner(PREDICTOR, ADAPTIVE)
    d = demand(lone, PREDICTOR, ADAPTIVE)
    assert d.target_prefill == 0 and d.headroom(0, 1) > d.headroom(1, 0)  # it would gain by moving
    assert planner.decide(lone) == [] and planner.decide(replace(lone, now=101.0)) == []
    # With a second instance serving, the same demand moves it.
    pair = obs(100.0, 1, 1, prompt=200, output=200, per_s=1.0)
    assert [(m.instance_id, m.to) for m in Planner(PREDICTOR, ADAPTIVE).decide(pair)] == [("p0", "decode")]
