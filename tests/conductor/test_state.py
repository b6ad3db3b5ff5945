import pytest

from services.conductor.index import PrefixIndex
from services.conductor.policy import Decision, Params, PrefillChoice, Request, pace_of
from services.conductor.state import WINDOW_S, ClusterState
from shared.predictor import Predictor

PRED = Predictor(prefill_coef=(0.0, 1.0, 0.0, 0.0), decode_coef=(1.0, 1.0, 0.0))  # prefill: 1 ms per token
PARAMS = Params(block_size=4, decode_time_s=5.0)


def state() -> ClusterState:
    s = ClusterState(PRED, PARAMS, PrefixIndex(capacity_blocks=1000))
    s.add_instance("prefill", "p0")
    s.add_instance("decode", "d0")
    return s


def assign(s: ClusterState, rid: str, now: float, prompt_len: int = 1000, ttft: float = 1.0) -> None:
    req = Request(rid, prompt_len, prompt_len // 4, 10, 10.0, 1.0)
    hashes = [f"{rid}-{i}" for i in range(prompt_len // 4)]
    s.assign(req, hashes, Decision(PrefillChoice("p0", ttft, 0), "d0", 0.01), now)


def test_queue_grows_with_assignments_and_drains_with_events():
    s = state()
    assign(s, "r1", now=0.0)
    assign(s, "r2", now=0.0)
    (load,) = s.prefill_loads([], now=0.0)
    assert load.queue_s == 2.0 and load.active_blocks == 500
    s.prefill_done("r1", now=0.5)
    s.prefill_done("r2", now=0.6)
    (load,) = s.prefill_loads([], now=0.6)
    assert load.queue_s == 0.0 and load.active_blocks == 0  # idle once nothing is outstanding


def test_prompts_still_outstanding_stay_queued_after_their_predicted_end():
    # An engine slower than its time model: three 1 s prompts booked at 0, the first
    # reported done only at 4.0, though the booked queue ran out at 3.0. Until then the
    # two behind it are still ahead of a new prompt, which queues behind them.
    s = state()
    for rid in ("r1", "r2", "r3"):
        assign(s, rid, now=0.0)
    (load,) = s.prefill_loads([], now=0.5)
    assert load.queue_s == pytest.approx(2.5)  # busy until 3.0 as booked
    (load,) = s.prefill_loads([], now=4.0)
    assert load.queue_s == pytest.approx(2.0)  # not 0: r2 and r3 have not begun
    s.prefill_done("r1", now=4.0)
    (load,) = s.prefill_loads([], now=4.0)
    assert load.queue_s == pytest.approx(1.0)  # r3 behind r2
    assign(s, "r4", now=4.0)
    assert s.prefill["p0"].busy_until == pytest.approx(6.0)  # after r3's second, r4's own
    s.prefill_done("r2", now=6.0)
    s.prefill_done("r3", now=7.0)
    s.prefill_done("r4", now=8.0)
    (load,) = s.prefill_loads([], now=8.0)
    assert load.queue_s == 0.0 and s.prefill["p0"].outstanding_s == 0.0


def test_decode_items_start_at_prefill_end_and_leave_when_finished():
    s = state()
    assign(s, "r1", now=0.0, ttft=2.0)
    (dl,) = s.decode_loads(now=0.0)
    assert dl.at(1.0) == (0, 0) and dl.at(2.5)[0] == 1  # joins when its prefill is predicted to end
    s.prefill_done("r1", now=1.0)  # earlier than predicted
    (dl,) = s.decode_loads(now=1.0)
    assert dl.at(1.5)[0] == 1 and dl.at(6.5)[0] == 0  # decodes for t_d = 5 s from then
    s.finished("r1", now=3.0)
    assert s.decode_loads(now=3.0)[0].items == ()


def test_a_request_decoding_past_its_predicted_end_is_predicted_another_t_d():
    s = state()
    assign(s, "r1", now=0.0, ttft=2.0)
    s.prefill_done("r1", now=2.0)  # predicted to decode until 7 s (t_d = 5 s)
    (dl,) = s.decode_loads(now=9.0)  # still running at 9 s: no "finished" yet
    assert dl.at(9.0)[0] == 1  # early rejection sees it
    assert dl.at(13.9)[0] == 1  # predictive admission sees it hold its slot
    assert dl.at(14.0)[0] == 0  # for t_d more


def test_window_forgets_old_work_and_index_remembers_blocks():
    s = state()
    assign(s, "r1", now=0.0)
    assert s.prefill_loads([], now=1.0)[0].window_load_s == 1.0
    assert s.prefill_loads([], now=WINDOW_S + 1)[0].window_load_s == 0.0
    assert s.prefill_loads(["r1-0", "r1-1", "zz"], now=0.0)[0].prefix_blocks == 2
    s.remove_instance("p0")
    assert s.prefill_loads([], now=0.0) == []


def test_t_d_is_learned_from_completed_decodes_only():
    from dataclasses import replace

    s = ClusterState(PRED, replace(PARAMS, learn_decode_time=True), PrefixIndex(capacity_blocks=1000))
    s.add_instance("prefill", "p0")
    s.add_instance("decode", "d0")
    for i in range(100):  # decodes of 1 s against the configured 5 s
        assign(s, f"r{i}", now=10.0 * i)
        s.prefill_done(f"r{i}", now=10.0 * i + 1)
        s.finished(f"r{i}", now=10.0 * i + 2, completed=True)
    assert 1.0 < s.decode_time_s < 1.05
    assign(s, "new", now=2000.0, ttft=1.0)
    (dl,) = s.decode_loads(now=2000.0)
    assert dl.items[0].end - dl.items[0].start == pytest.approx(s.decode_time_s)  # new requests are booked for it
    learned = s.decode_time_s
    assign(s, "cut", now=3000.0)
    s.prefill_done("cut", now=3001.0)
    s.finished("cut", now=3001.1)  # cancelled or failed: says nothing of decode times
    s.finished("never", now=3002.0, completed=True)  # never seen decoding
    assert s.decode_time_s == learned
    fixed = state()  # learning off: t_d stays as configured
    assign(fixed, "r", now=0.0)
    fixed.prefill_done("r", now=1.0)
    fixed.finished("r", now=2.0, completed=True)
    assert fixed.decode_time_s == 5.0


def test_a_departed_instance_leaves_every_book_and_the_requests_only_it_held():
    s = state()
    s.add_instance("prefill", "p1")
    assign(s, "r1", now=0.0)  # on p0 and d0
    s.remove_instance("p0")
    assert "p0" not in s.prefill and s.index.used_blocks("p0") == 0
    assert "r1" in s.placed  # d0 still holds it: its finish must find it
    s.remove_instance("d0")
    assert s.placed == {} and s.decode == {}
    s.finished("r1", now=1.0)  # a late event for it is harmless


def test_prefills_slower_than_predicted_slow_the_instances_predictions_down():
    s = ClusterState(PRED, PARAMS, PrefixIndex(capacity_blocks=1000), calibration_z=0.0)
    s.add_instance("prefill", "p0")
    s.add_instance("decode", "d0")
    for i in range(20):  # predicted 0.1 s each (100 tokens, 1 ms a token), observed 0.3 s
        t = i * 0.3
        assign(s, f"r{i}", now=t, prompt_len=100)
        s.prefill_done(f"r{i}", now=t + 0.3)
    (load,) = s.prefill_loads([], now=6.0)
    assert 2.3 < load.slowdown < 3.0  # towards 3, held back a little by the prior (one request at a time)
    assert 2.3 < s.prefill_pace(6.0, ["p0", "d0"]) < 3.0  # the planner's: the prefill instances' median pace
    assert s.prefill_pace(6.0, []) == 1.0
    uncalibrated = state()
    assign(uncalibrated, "r", now=0.0, prompt_len=100)
    uncalibrated.prefill_done("r", now=0.3)
    assert uncalibrated.prefill_loads([], now=0.3)[0].slowdown == 1.0
    assert uncalibrated.prefill_pace(0.3, ["p0"]) == 1.0


def test_a_long_prompt_is_judged_by_the_long_prompts_before_it_not_by_short_ones_caught_late():
    s = ClusterState(PRED, PARAMS, PrefixIndex(capacity_blocks=1000), calibration_z=1.645)
    s.add_instance("prefill", "p0")
    s.add_instance("decode", "d0")
    for i in range(10):  # 1 s prompts on pace, and 0.1 s ones five times slower
        t = i * 2.0
        assign(s, f"l{i}", now=t, prompt_len=1000)
        s.prefill_done(f"l{i}", now=t + 1.0)
        assign(s, f"s{i}", now=t + 1.0, prompt_len=100)
        s.prefill_done(f"s{i}", now=t + 1.5)
    (load,) = s.prefill_loads([], now=20.0)
    assert pace_of(load, 2.0) == pytest.approx(1.0, abs=0.05)
    assert pace_of(load, 0.1) > 4.0
    assert load.slowdown > 4.0  # the whole's tail: the short ones'


def test_a_local_prefill_joins_its_decode_at_once_and_leaves_its_queue_at_its_first_token():
    s = state()
    req = Request("r1", 100, 25, 10, 10.0, 1.0)
    hashes = [f"r1-{i}" for i in range(25)]
    s.assign_local(req, hashes, "d0", uncached_tokens=60, ttft_s=0.5, now=0.0)
    (dl,) = s.decode_loads(now=0.0)
    assert dl.at(0.0)[0] == 1  # its prefill steps are the batch's
    assert s.local_queued("d0") == 60 and s.decode_prefix(hashes, "d0") == 25
    assert s.prefill_loads([], now=0.0)[0].queue_s == 0.0  # the prefill instance never hears of it
    s.prefill_done("r1", now=0.4)
    assert s.local_queued("d0") == 0
    s.assign_local(Request("r2", 100, 25, 10, 10.0, 1.0), hashes, "d0", 20, 0.1, now=0.5)
    s.finished("r2", now=0.6)  # failed before its first token: off the queue too
    assert s.local_queued("d0") == 0 and list(s.placed) == ["r1"]  # r1 still decodes


def test_a_cpp_group_is_booked_for_its_pipeline_time_not_a_single_instances():
    from services.conductor.cpp import PipelineGroup, pipeline_prefill_s

    s = state()
    group = PipelineGroup(stages=2, chunk_tokens=250)
    s.add_instance("prefill", "g0", group)
    req = Request("r1", 1000, 250, 10, 10.0, 1.0)
    s.assign(req, [f"h{i}" for i in range(250)], Decision(PrefillChoice("g0", 0.6, 0), "d0", 0.01), now=0.0)
    load = next(x for x in s.prefill_loads([], now=0.0) if x.instance_id == "g0")
    assert load.group == group
    assert load.queue_s == pytest.approx(pipeline_prefill_s(PRED, group, 1000)) == pytest.approx(0.625)  # not 1.0 s


def fleet(n: int) -> ClusterState:
    s = ClusterState(PRED, PARAMS, PrefixIndex(capacity_blocks=1000))
    for i in range(n):
        s.add_instance("prefill", f"p{i}")
        s.add_instance("decode", f"d{i}")
    return s


def book(s: ClusterState, rid: str, prefill_id: str, decode_id: str, now: float, prompt_len: int = 1000) -> None:
    req = Request(rid, prompt_len, prompt_len // 4, 10, 10.0, 1.0)
    s.assign(req, [f"{rid}-{i}" for i in range(prompt_len // 4)],
             Decision(PrefillChoice(prefill_id, 1.0, 0), decode_id, 0.01), now)


def test_a_shortlist_holds_the_longest_prefixes_the_emptiest_queues_and_every_group():
    from services.conductor.cpp import PipelineGroup

    s = fleet(6)
    s.add_instance("prefill", "g0", PipelineGroup(stages=2, chunk_tokens=250))
    for i in range(5):  # p0..p4 busy, p5 and g0 idle
        book(s, f"busy{i}", f"p{i}", "d0", now=0.0, prompt_len=400 * (i + 1))
    s.index.insert("p4", ["x0", "x1", "x2"])  # the longest holder, though the busiest
    s.index.insert("p3", ["x0"])
    loads = s.prefill_loads(["x0", "x1", "x2", "x3"], now=0.0, shortlist=1)
    assert [(x.instance_id, x.prefix_blocks) for x in loads] == [("g0", 0), ("p4", 3), ("p5", 0)]
    # The emptiest queue among those not skipped; a skipped holder is not held either.
    loads = s.prefill_loads(["x0"], now=0.0, shortlist=1, skip=lambda iid: iid in {"p5", "g0", "p4"})
    assert [x.instance_id for x in loads] == ["p0", "p3"]
    assert len(s.prefill_loads(["x0"], now=0.0)) == 7  # no shortlist: every instance


def test_decode_shortlist_follows_bookings_and_completions():
    s = fleet(5)
    for i in (2, 3, 4):  # busier still
        book(s, f"b{i}", "p0", f"d{i}", now=0.0, prompt_len=8000)
    book(s, "r1", "p0", "d0", now=0.0)
    book(s, "r2", "p0", "d1", now=0.0, prompt_len=4000)
    assert [x.instance_id for x in s.decode_loads(0.0, shortlist=1)] == ["d0"]
    assert [x.instance_id for x in s.decode_loads(0.0, shortlist=2)] == ["d0", "d1"]
    assert len(s.decode_loads(0.0, shortlist=3)) == 5  # more than half: every instance
    assert s.booked["d0"] == (1, 1005)
    s.finished("r1", now=1.0)
    s.prefill_done("r2", now=1.0)  # its item moves in time, not in size
    assert s.booked["d0"] == (0, 0) and s.booked["d1"] == (1, 4005)
    assert [x.instance_id for x in s.decode_loads(1.0, shortlist=2, skip=lambda iid: iid == "d0")] == ["d1", "d2"]
    s.remove_instance("d1")
    assert "d1" not in s.batches and "d1" not in s.booked


def test_queue_ranking_follows_busy_until():
    s = fleet(2)
    book(s, "r1", "p0", "d0", now=0.0)
    assert s.queues.first(2) == ["p1", "p0"] and s.queues.key("p0") == pytest.approx(1.0)
    s.finished("r1", now=0.25)  # idle now, whatever was predicted
    assert s.queues.key("p0") == pytest.approx(0.25)
    s.remove_instance("p0")
    assert list(s.queues) == ["p1"]


def test_a_decode_finished_before_its_prefill_was_reported_teaches_no_decode_time():
    s = ClusterState(PRED, Params(block_size=4, decode_time_s=5.0, learn_decode_time=True), PrefixIndex(1000))
    s.add_instance("prefill", "p0")
    s.add_instance("decode", "d0")
    assign(s, "r1", now=0.0, ttft=2.0)  # decoding predicted from 2.0 on
    s.finished("r1", now=0.5, completed=True)  # no prefill_done came: the span is not a decode's
    assert s.decode_time_s == 5.0
    assign(s, "r2", now=1.0, ttft=0.5)
    s.prefill_done("r2", now=1.5)
    s.finished("r2", now=3.5, completed=True)
    assert s.decode_time_s == pytest.approx(5.0 + 0.05 * (2.0 - 5.0))
