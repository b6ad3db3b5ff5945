"""The goodput bench's pure parts: attainment from outcomes, the rate search, the
trace at a rate, the table and the ratios to colocated, the servers' command lines."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from yuebing import cli
from yuebing.bench import goodput
from yuebing.bench.goodput import (
    PLAIN_VLLM,
    Attainment,
    GoodputSpec,
    ModeResult,
    Probe,
    Search,
    Slo,
    attainment,
    search,
    spread,
)
from yuebing.lab.outcome import Outcome
from yuebing.lab.trace import TraceRequest, base_rate

SLO = Slo(ttft_s=1.0, tbt_s=0.05)


def outcome(ttft: float | None = 0.5, tbt_tail: float = 0.02, rejected: bool = False, failed: bool = False) -> Outcome:
    return Outcome(0.0, 100, 10, SLO.ttft_s, SLO.tbt_s, rejected=rejected, failed=failed, ttft_s=ttft,
                   tbt_mean_s=0.001, tbt_tail_s=tbt_tail)  # the mean is not what this bench judges


def att(both: float, ttft: float | None = None, tbt: float | None = None) -> Attainment:
    return Attainment(10, both, both if ttft is None else ttft, both if tbt is None else tbt)


# --- attainment ------------------------------------------------------------------


def test_attainment_counts_every_request_sent_rejections_and_failures_as_misses():
    got = attainment([outcome(), outcome(ttft=1.5), outcome(tbt_tail=0.08), outcome(ttft=None, rejected=True),
                      outcome(ttft=None, failed=True)], SLO)
    assert got == Attainment(5, both=0.2, ttft=0.4, tbt=0.4, rejected=1, failed=1)


def test_attainment_judges_the_tail_gaps_as_the_simulator_and_meets_at_the_threshold():
    assert attainment([outcome(ttft=1.0, tbt_tail=0.05)], SLO).both == 1.0
    assert attainment([outcome(tbt_tail=0.051)], SLO).both == 0.0
    assert attainment([], SLO) == Attainment(0, 0.0, 0.0, 0.0)


def test_a_shifting_runs_good_requests_are_also_counted_by_third():
    good, late = outcome(), outcome(ttft=1.5)
    got = attainment([good, late, good, good, good, late, late], SLO, thirds=True)
    assert got.thirds == (1, 2, 1)  # 7 // 3 = 2 a third, the last third takes the rest
    assert attainment([good, late, good], SLO).thirds == ()


# --- the search ------------------------------------------------------------------


def capacity_curve(capacity: float):
    """An attainment function: everything below `capacity` req/s passes."""
    seen: list[float] = []

    def measure(rate: float) -> Attainment:
        seen.append(rate)
        return att(1.0 if rate <= capacity else 0.5)

    return measure, seen


def test_the_search_bisects_on_a_log_scale_and_keeps_the_fastest_passing_probe():
    measure, seen = capacity_curve(1.3)
    found = search(measure, 0.25, 4.0, 5, 0.9)
    assert seen[:2] == pytest.approx([1.0, 2.0])  # sqrt(0.25 * 4), then sqrt(1 * 4)
    assert len(seen) == 5 and found.capacity_rps <= 1.3
    top_fail = min(p.rate_rps for p in found.probes if p.attainment.both < 0.9)
    assert top_fail / found.capacity_rps <= (4.0 / 0.25) ** (1 / 2**5) + 1e-9  # the bracket's width
    assert found.at_capacity.rate_rps == found.capacity_rps


def test_a_search_where_nothing_passes_has_no_capacity_and_says_below_what():
    measure, seen = capacity_curve(0.0)
    found = search(measure, 0.25, 4.0, 3, 0.9)
    assert found.capacity_rps == 0.0 and found.at_capacity is None
    assert goodput.capacity_cell(found) == f"< {min(seen):.2f}"


def test_a_noisy_pass_below_a_fail_still_reports_the_fastest_pass():
    results = iter([1.0, 0.5, 0.95])  # 1.0 passes, 2.0 fails, sqrt(2) passes
    found = search(lambda rate: att(next(results)), 0.25, 4.0, 3, 0.9)
    assert found.capacity_rps == pytest.approx(math.sqrt(2))


# --- ratios and the table --------------------------------------------------------


def result(name: str, *probes: tuple[float, float]) -> ModeResult:
    return ModeResult(name, Search(tuple(Probe(r, att(a, ttft=1.0, tbt=a)) for r, a in probes), 0.9))


def test_ratios_are_to_colocateds_capacity_and_absent_without_it():
    assert goodput.ratio(2.0, 1.0) == 2.0
    assert goodput.ratio(2.0, None) is None and goodput.ratio(2.0, 0.0) is None
    results = [result("colocated", (1.0, 0.95), (2.0, 0.5)), result("disaggregated", (1.0, 1.0), (2.0, 0.92))]
    assert goodput.colocated_capacity(results) == 1.0
    assert goodput.colocated_capacity(results[1:]) is None


def test_the_table_has_a_row_per_mode_with_capacity_ratio_and_attainment_at_capacity():
    results = [result("colocated", (1.0, 0.95), (2.0, 0.5)), result("disaggregated", (1.0, 1.0), (2.0, 0.92)),
               result("conditional/mooncake", (1.0, 0.2))]
    lines = goodput.table(results).splitlines()
    assert lines[0].split()[:3] == ["mode", "capacity", "req/s"]
    colocated, disaggregated, conditional = (line.split() for line in lines[1:])
    assert colocated[:6] == ["colocated", "1.00", "1.00", "95%", "100%", "95%"]
    # No faster probe missed: the capacity may lie above the search's bound.
    assert disaggregated[:7] == ["disaggregated", "≥", "2.00", "2.00", "92%", "100%", "92%"]
    assert conditional[:4] == ["conditional/mooncake", "<", "1.00", "0.00"]
    assert "1.00: 95%, 2.00: 50%" in lines[1]


def test_where_colocated_met_the_target_nowhere_the_ratio_is_a_lower_bound():
    colocated = result("colocated", (0.5, 0.7), (1.0, 0.75)).search
    assert goodput.ratio_cell(result("disaggregated", (2.0, 0.95)).search, colocated) == "> 4.0"
    assert goodput.ratio_cell(result("conditional", (2.0, 0.5)).search, colocated) == "-"
    assert goodput.ratio_cell(result("disaggregated", (2.0, 0.95)).search, None) == "-"


def test_json_carries_each_modes_capacity_speed_ratio_and_probes(tmp_path):
    spec = GoodputSpec(modes="colocated,disaggregated")
    results = [result("colocated", (1.0, 0.95)), result("disaggregated", (1.0, 1.0), (2.0, 0.92))]
    out = json.loads(json.dumps(goodput.to_json(results, spec, base_rps=4.0)))
    assert out["trace"]["rps_at_speed_1"] == 4.0
    dis = out["modes"][1]
    assert (dis["capacity_rps"], dis["capacity_speed"], dis["ratio_to_colocated"]) == (2.0, 0.5, 2.0)
    assert dis["at_capacity"]["attainment"]["both"] == 0.92 and len(dis["probes"]) == 2


def test_the_plot_draws_a_line_per_mode(tmp_path):
    path = goodput.plot([result("colocated", (1.0, 0.95), (2.0, 0.5)), result(PLAIN_VLLM, (1.0, 1.0))], 0.9,
                        tmp_path / "goodput.png")
    assert Path(path).stat().st_size > 1000


# --- the trace at a rate ---------------------------------------------------------


def req(t_ms: float, n_in: int = 1000, n_out: int = 200) -> TraceRequest:
    return TraceRequest(t_ms, n_in, n_out, tuple(range(math.ceil(n_in / 512))))


def test_the_slice_replays_at_the_asked_rate_scaled_once_to_the_model():
    raw = [req(0), req(0), req(1000, n_in=8000), req(2000)]
    assert base_rate(raw) == 2.0
    spec = GoodputSpec(length_factor=0.25, max_model_len=1024, max_output=64)
    fast = goodput.at_rate(raw, spec, rate=4.0)
    assert [r.timestamp_ms for r in fast] == [0, 0, 500, 1000]
    assert fast[2].input_length == 1024 - 64 and fast[0].output_length == 50 and fast[2].output_length == 50
    # Scaled once: a 128-token block per hash id, enough of them for the prompt.
    assert len(fast[0].hash_ids) * 128 >= fast[0].input_length
    assert len(fast[2].hash_ids) * 128 >= fast[2].input_length


def test_spread_spaces_a_timestamps_requests_until_the_next_one():
    out = spread([req(0), req(0), req(3000), req(3000), req(3000), req(6000)])
    assert [r.timestamp_ms for r in out] == [0, 1500, 3000, 4000, 5000, 6000]
    assert [r.timestamp_ms for r in spread([req(0), req(0)])] == [0, 0]


def test_the_default_slice_is_the_conversation_traces_first_requests():
    raw = goodput.load_slice(GoodputSpec(requests=40))
    assert len(raw) == 40 and raw[0].timestamp_ms == 0 and base_rate(raw) > 0


def test_a_shifting_slice_scales_its_middle_third_only():
    steady = goodput.load_slice(GoodputSpec(requests=30, spread=False))
    shifted = goodput.load_slice(GoodputSpec(requests=30, spread=False, shift="3,0.125"))
    assert [r.timestamp_ms for r in shifted] == [r.timestamp_ms for r in steady]
    assert shifted[:10] == steady[:10] and shifted[20:] == steady[20:]
    assert all(s.input_length == round(3 * r.input_length) for s, r in zip(shifted[10:20], steady[10:20]))


def test_outer_reshapes_the_thirds_around_the_shifted_one():
    steady = goodput.load_slice(GoodputSpec(requests=30, spread=False))
    shifted = goodput.load_slice(GoodputSpec(requests=30, spread=False, shift="3,0.125", outer="1,4"))
    assert all(s.output_length == 4 * r.output_length for s, r in zip(shifted[:10] + shifted[20:],
                                                                      steady[:10] + steady[20:]))
    assert all(s.input_length == round(3 * r.input_length) for s, r in zip(shifted[10:20], steady[10:20]))


def test_warmup_requests_come_half_a_second_apart():
    assert [r.timestamp_ms for r in goodput.warmup_trace([req(0)] * 5, 3)] == [0, 500, 1000]


# --- servers and the replay over them --------------------------------------------


def test_each_modes_cluster_gets_the_mode_the_slos_and_the_same_engines():
    spec = GoodputSpec(slo_ttft_ms=2000, slo_tbt_ms=30, up_flags="--admission none")
    flags = goodput.cluster_flags(spec, Path("/m/tiny"), "conditional")
    pairs = dict(zip(flags[::2], flags[1::2]))
    assert pairs["--mode"] == "conditional" and pairs["--conditional-rule"] == "mooncake"
    assert (pairs["--slo-ttft-ms"], pairs["--slo-tbt-ms"], pairs["--admission"]) == ("2000", "30", "none")
    assert (pairs["--prefill"], pairs["--decode"], pairs["--dtype"], pairs["--max-model-len"]) == ("1", "1", "float32",
                                                                                                   "2048")
    assert "--conditional-rule" not in goodput.cluster_flags(spec, Path("/m/tiny"), "colocated")
    assert goodput.mode_name("conditional", spec) == "conditional/mooncake"


def test_the_default_mode_is_a_cluster_with_no_mode_flag():
    flags = goodput.cluster_flags(GoodputSpec(modes="default"), Path("/m/tiny"), "default")
    assert "--mode" not in flags and flags[flags.index("--prefill") + 1] == "1"
    planner = goodput.cluster_flags(GoodputSpec(modes="planner"), Path("/m/tiny"), "planner")
    assert "--mode" not in planner and "--planner" in planner
    pooled = goodput.cluster_flags(GoodputSpec(modes="pooled"), Path("/m/tiny"), "pooled")
    assert "--mode" not in pooled and (pooled[pooled.index("--prefill") + 1], pooled[pooled.index("--decode") + 1]) \
        == ("0", "2")
    traced = goodput.cluster_flags(GoodputSpec(modes="traced"), Path("/m/tiny"), "traced", "http://127.0.0.1:4318")
    assert "--mode" not in traced and traced[traced.index("--otlp-endpoint") + 1] == "http://127.0.0.1:4318"
    assert "--otlp-endpoint" not in flags  # only the traced setups send spans anywhere
    sampled = goodput.cluster_flags(GoodputSpec(modes="sampled"), Path("/m/tiny"), "sampled", "http://127.0.0.1:4318")
    assert sampled[sampled.index("--otlp-sample") + 1] == "0.1" and "--mode" not in sampled


def test_fixed_rates_are_probed_in_order_and_tabled_against_plain_vllm():
    seen: list[float] = []

    def measure(rate: float) -> Attainment:
        seen.append(rate)
        return Attainment(10, 1.0 if rate < 8 else 0.5, 1.0, 1.0)

    found = goodput.sweep(measure, (4.0, 8.0), 0.9)
    assert seen == [4.0, 8.0] and found.capacity_rps == 4.0
    plain = ModeResult(PLAIN_VLLM, Search((Probe(4.0, att(1.0)), Probe(8.0, att(0.4))), 0.9))
    lines = goodput.sweep_table([ModeResult("default", found), plain]).splitlines()
    assert lines[0].split() == ["req/s", "default", "plain", "vLLM", "×2"]
    assert lines[2].split() == ["8", "5", "(1.25×)", "4"]


def test_the_aiperf_client_leaves_room_for_the_chat_template():
    raw = [TraceRequest(0.0, 8000, 10, (1,)), TraceRequest(1000.0, 100, 10, (2,))]
    spec = GoodputSpec(client="aiperf", length_factor=1.0)
    assert goodput.at_rate(raw, spec, 1.0)[0].input_length == spec.max_model_len - spec.max_output - 64


def test_replay_over_several_servers_round_robins_in_arrival_order(monkeypatch):
    sent: dict[str, list[float]] = {}

    async def fake_replay(url, trace, options):
        sent[url] = [r.timestamp_ms for r in trace]
        return [outcome(ttft=r.timestamp_ms) for r in trace], 1.0

    monkeypatch.setattr("yuebing.lab.replay.replay", fake_replay)
    trace = [req(30), req(0), req(10), req(20)]
    out = asyncio.run(goodput.replay_over(["a", "b"], trace, goodput.replay_options(GoodputSpec(), "tiny")))
    assert sent == {"a": [0, 20], "b": [10, 30]}
    assert [o.ttft_s for o in out] == [30, 0, 10, 20]  # back in the trace's order


# --- flags -----------------------------------------------------------------------


def test_the_command_parses_its_flags_into_the_spec():
    args = cli.build_parser().parse_args(["bench", "goodput", "--modes", "disaggregated,colocated", "--probes", "2",
                                          "--slo-tbt-ms", "40", "--plain-vllm", "--up-flags", "--admission none"])
    spec = goodput_spec(args)
    assert spec.mode_list == ("disaggregated", "colocated") and spec.probes == 2 and spec.slo_tbt_ms == 40.0
    assert spec.plain_vllm and spec.up_flags == "--admission none"


def goodput_spec(args) -> GoodputSpec:
    from yuebing.flags import from_args

    return from_args(GoodputSpec, args)


@pytest.mark.parametrize("bad", [{"modes": "colocated,pd"}, {"min_rate": 2.0, "max_rate": 1.0}, {"probes": 0},
                                 {"max_output": 4096}, {"target": 1.5}, {"client": "curl"}, {"tbt_stat": "p99"},
                                 {"rates": "4,x"}, {"rates": "4,4"}, {"rates": "0"}, {"trace": "/no/such.jsonl"},
                                 {"shift": "3"}, {"shift": "3,0"}, {"shift": "a,b"},
                                 {"outer": "1,4"}, {"shift": "3,1", "outer": "1"}])
def test_the_spec_refuses_what_cannot_be_measured(bad):
    with pytest.raises(ValueError):
        GoodputSpec(**bad)


def test_the_planners_moves_are_read_from_its_conductors_log(tmp_path):
    log = tmp_path / "conductor.log"
    log.write_text('{"event":"scheduled","request_id":"r1"}\nnot json "role change"\n'
                   '{"instance_id":"prefill-0","to":"decode","reason":"needs 0.16 prefill","event":"role change",'
                   '"timestamp":"2026-11-29T01:44:38.792094Z"}\n')
    assert goodput.role_changes(log) == ["01:44:38 prefill-0 → decode (needs 0.16 prefill)"]
    assert goodput.role_changes(tmp_path / "absent.log") == []
