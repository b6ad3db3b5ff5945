"""The simulator's serving modes: colocated instances (chunked prefill mixed into the
decode batch) and conditional disaggregation (prefill on decode when the rule says
so), timed exactly on tiny cases, and prefill interference on a real trace."""

from dataclasses import replace

import pytest

from shared.predictor import Predictor
from yuebing.lab.data import CONVERSATION_TRACE
from yuebing.lab.sim import simulate
from yuebing.lab.sim_config import SimConfig
from yuebing.lab.trace import TraceRequest, load_trace

# prefill 1 ms per token; decode step 10 ms flat (no batch or context cost)
FLAT = Predictor(prefill_coef=(0.0, 1.0, 0.0, 0.0), decode_coef=(10.0, 0.0, 0.0))
H100_70B = Predictor(prefill_coef=(37.6, 0.1577, 1.108e-05, 5.0e-06), decode_coef=(53.29, 0.03495, 1.068e-04))
COLOCATED = SimConfig(prefill=1, decode=1, mode="colocated", kv_bytes_per_token=0)


def test_a_colocated_instance_prefills_and_decodes_with_no_transfer():
    trace = [TraceRequest(0.0, 1024, 11, (1, 2))]
    (o,) = simulate(trace, replace(COLOCATED, kv_bytes_per_token=131_072, layerwise=False), FLAT).outcomes
    assert o.ttft_s == pytest.approx(1.024)
    assert o.end_s == pytest.approx(1.024 + 10 * 0.010)  # no prompt tail left for decode to compute


def test_a_colocated_prefill_is_chunked_into_the_decode_batchs_steps():
    # Two instances: the first two requests go one each (least TTFT); the third, at
    # 1.5 s, finds both decoding and goes to c0, where its 1024 tokens are computed
    # 511 a step (512 less the decode's token) beside the first request's decode:
    # its step in progress ends at 1.504 s, then steps of 10 + 511, 10 + 511 and
    # 10 + 2 ms: the decode's gaps grow by what the model predicts for the chunks.
    trace = [TraceRequest(0.0, 1024, 201, (1, 2)), TraceRequest(0.0, 1024, 201, (3, 4)), TraceRequest(1500.0, 1024, 11, (5, 6))]
    run = simulate(trace, replace(COLOCATED, step_tokens=512), FLAT)
    first, second, third = run.outcomes
    assert third.ttft_s == pytest.approx(0.004 + 0.521 + 0.521 + 0.012)
    assert first.end_s == pytest.approx(1.504 + 1.054 + (200 - 48 - 3) * 0.010)
    assert second.end_s == pytest.approx(1.024 + 200 * 0.010)  # the other instance: no interference
    assert first.tbt_tail_s > 0.05 > second.tbt_tail_s
    assert run.result["mode"] == "colocated" and run.result["mode_decisions"] == {"colocated:least_delay": 3}


def test_a_step_budget_sized_to_the_tbt_slo_keeps_it():
    # step_tokens 0: each step computes what keeps 10 ms + tokens within the 100-ms SLO.
    trace = [TraceRequest(0.0, 1024, 201, (1, 2)), TraceRequest(0.0, 1024, 201, (3, 4)), TraceRequest(1500.0, 1024, 11, (5, 6))]
    run = simulate(trace, replace(COLOCATED, step_tokens=0, slo_tbt_s=0.1), FLAT)
    first, _, third = run.outcomes
    assert first.tbt_tail_s <= 0.1 + 1e-9 and first.completed and first.within_slo
    assert third.ttft_s > 1.024 + 11 * 0.010  # 90 tokens a step: 12 steps with the decode's 10 ms each


def test_conditional_mooncake_prefills_on_decode_only_unchunked_and_within_the_tbt_slo():
    # The first finds its decode idle: prefilled there (no TBT at stake). Then, with
    # one decoding: 50 tokens (a 60-ms step) stay on decode; 500 tokens (510 ms)
    # would break the 100-ms TBT; 3,000 tokens exceed the 2,048-token step.
    trace = [TraceRequest(0.0, 1024, 201, (1, 2)), TraceRequest(100.0, 50, 11, (3,)), TraceRequest(200.0, 500, 11, (5,)),
             TraceRequest(300.0, 3000, 11, (7, 8, 9, 10, 11, 12))]
    config = SimConfig(prefill=1, decode=1, mode="conditional", kv_bytes_per_token=0, layerwise=False)
    run = simulate(trace, config, FLAT)
    assert run.result["mode_decisions"] == {"local:unchunked_within_tbt": 2, "disaggregated:breaks_tbt": 1,
                                            "disaggregated:would_chunk": 1}
    assert run.result["mode"] == "conditional/mooncake"
    first, _, third, fourth = run.outcomes
    assert first.ttft_s == pytest.approx(1.024)  # on decode, in one step
    assert third.ttft_s == pytest.approx(0.5)  # on the prefill instance
    assert fourth.ttft_s == pytest.approx(0.5 + 3.0 - 0.1)  # behind it there
    assert run.result["prefill_busy_s"] == pytest.approx(3.5)  # what went remote


def test_conditional_counts_what_the_decode_holds_of_the_prompt_as_cached():
    # The first (1,536 tokens, three full blocks) is prefilled on its idle decode and
    # decodes there; the second shares those three blocks: only its last 24 tokens
    # are computed, in a 34-ms step beside the first's decode (1,560 would break the TBT).
    trace = [TraceRequest(0.0, 1536, 201, (1, 2, 3)), TraceRequest(2000.0, 1560, 11, (1, 2, 3, 9))]
    config = SimConfig(prefill=1, decode=1, mode="conditional", kv_bytes_per_token=0)
    run = simulate(trace, config, FLAT)
    assert run.result["mode_decisions"] == {"local:unchunked_within_tbt": 2}
    _, second = run.outcomes
    assert second.cached_tokens == 1536 and second.ttft_s == pytest.approx(0.034, abs=0.0101)


def test_conditional_threshold_rules_by_name():
    trace = [TraceRequest(float(i) * 1000, 400 + 200 * i, 3, (i,)) for i in range(4)]  # 400, 600, 800, 1000 tokens
    base = SimConfig(prefill=1, decode=1, mode="conditional", kv_bytes_per_token=0, local_prefill_tokens=800)
    dynamo = simulate(trace, replace(base, conditional_rule="dynamo"), FLAT).result["mode_decisions"]
    llmd = simulate(trace, replace(base, conditional_rule="llmd"), FLAT).result["mode_decisions"]
    assert dynamo == {"local:below_threshold": 2, "disaggregated:above_threshold": 2}
    assert llmd == {"local:below_threshold": 3, "disaggregated:above_threshold": 1}


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="colocated"):
        simulate([TraceRequest(0.0, 100, 2, (1,))], replace(COLOCATED, mode="mixed"), FLAT)


def test_prefill_interference_breaks_the_tbt_of_colocated_decodes_not_of_disaggregated_ones():
    # The conversation trace's first 1,500 requests on 4 GPUs (2+2 against 4 colocated,
    # vLLM's 2,048-token step), LLaMA2-70B's curves: colocated decodes share their
    # steps with prefill chunks, so their longest gaps are the mixed steps'.
    trace = load_trace(CONVERSATION_TRACE, limit=1500)
    config = SimConfig(prefill=2, decode=2, slo_tbt_s=0.2, speed=0.12)
    colocated, disaggregated = (simulate(trace, replace(config, mode=m), H100_70B).result
                                for m in ("colocated", "disaggregated"))
    assert colocated["tbt_s"]["p50"] > 2 * disaggregated["tbt_s"]["p50"], (colocated["tbt_s"], disaggregated["tbt_s"])
    assert colocated["slo_attainment"] < disaggregated["slo_attainment"]
    assert colocated["ttft_s"]["mean"] < disaggregated["ttft_s"]["mean"]  # twice the GPUs prefill there


def test_an_unchunked_colocated_prefill_stalls_the_batch_for_its_whole_prompt():
    # The paper's vLLM baseline: the third request's 1024 tokens are one step beside
    # the first request's decode (10 + 1024 ms), not chunks of 511.
    trace = [TraceRequest(0.0, 1024, 201, (1, 2)), TraceRequest(0.0, 1024, 201, (3, 4)), TraceRequest(1500.0, 1024, 11, (5, 6))]
    run = simulate(trace, replace(COLOCATED, step_tokens=512, unchunked=True), FLAT)
    first, _, third = run.outcomes
    assert third.ttft_s == pytest.approx(0.004 + 1.034)
    assert first.end_s == pytest.approx(1.504 + 1.034 + (200 - 48 - 1) * 0.010)
    assert run.result["mode"] == "colocated/unchunked"


def test_max_batch_counts_prefilling_requests_so_one_runs_at_a_time():
    # vLLM's max_num_seqs at 1 on two instances: the third request's prefill waits
    # for a first one's last token (1.024 s prefill + 10 steps of 10 ms).
    trace = [TraceRequest(0.0, 1024, 11, (1, 2)), TraceRequest(0.0, 1024, 11, (3, 4)), TraceRequest(0.0, 1024, 11, (5, 6))]
    outcomes = simulate(trace, replace(COLOCATED, unchunked=True, max_batch=1), FLAT).outcomes
    assert sorted(o.ttft_s for o in outcomes) == pytest.approx([1.024, 1.024, 1.124 + 1.024])


def test_without_prefix_caching_a_colocated_instance_recomputes_a_repeated_prompt():
    trace = [TraceRequest(0.0, 1024, 2, (1, 2)), TraceRequest(5000.0, 1024, 2, (1, 2))]
    cached, plain = (simulate(trace, replace(COLOCATED, prefix_caching=on), FLAT).outcomes[1] for on in (True, False))
    assert cached.ttft_s < 0.5 and plain.ttft_s == pytest.approx(1.024)


def test_adaptive_is_disaggregated_at_light_load_and_spills_a_prefill_queue_onto_an_idle_decode():
    # Four 1,000-token prompts at once on one prefill (1 s each): past the second,
    # each would wait more than half its 2-s TTFT SLO there (disaggregated refuses
    # the last two), so the decode, idle when they come, prefills them sooner. A
    # loose TBT SLO: the spilled prefills' 1-s steps stall what decodes there later.
    trace = [TraceRequest(0.0, 1000, 3, (k,)) for k in range(4)]
    config = SimConfig(prefill=1, decode=1, mode="adaptive", kv_bytes_per_token=0, layerwise=False, slo_ttft_s=2.0,
                       slo_tbt_s=5.0, admission="predictive")
    run = simulate(trace, config, FLAT)
    assert run.result["mode_decisions"].get("local:spilled", 0) >= 1
    assert all(o.completed for o in run.outcomes)
    fixed = simulate(trace, replace(config, mode="disaggregated"), FLAT)
    assert sum(o.within_slo for o in run.outcomes) > sum(o.within_slo for o in fixed.outcomes)
    light = simulate(trace[:1], config, FLAT)
    assert light.result["mode_decisions"].get("local:spilled", 0) == 0


def test_adaptive_mode_runs_a_pooled_fleet_and_the_other_modes_refuse_one():
    # No prefill instance: each decode instance prefills its own requests.
    trace = [TraceRequest(k * 0.5, 500, 4, (k,)) for k in range(6)]
    pooled = SimConfig(prefill=0, decode=2, mode="adaptive", kv_bytes_per_token=0, slo_ttft_s=2.0, slo_tbt_s=5.0)
    run = simulate(trace, pooled, FLAT)
    assert all(o.completed and o.within_slo for o in run.outcomes)
    assert sum(run.result["mode_decisions"].values()) == 6 and not run.result["mode_decisions"].get("disaggregated")
    for mode in ("disaggregated", "conditional"):
        with pytest.raises(ValueError, match="one prefill instance but in adaptive mode"):
            replace(pooled, mode=mode)


def test_adaptive_spills_a_long_prompt_onto_a_busy_decode_in_chunks_that_keep_its_streams_tbt():
    # One stream decoding on d0 (10-ms steps); then four 1,024-token prompts at once on
    # one prefill (1 s each). The decode engine caps a prompt's chunk at 128 tokens, so
    # the third prompt, spilled, takes eight 138-ms steps there, each within the 200-ms
    # TBT SLO; uncapped, a step would carry the whole prompt and nothing spills.
    stream = TraceRequest(0.0, 16, 400, (100,))
    trace = [stream, *(TraceRequest(100.0, 1024, 3, (k,)) for k in range(4))]
    config = SimConfig(prefill=1, decode=1, mode="adaptive", kv_bytes_per_token=0, layerwise=False, slo_ttft_s=2.5,
                       slo_tbt_s=0.2, admission="predictive", decode_chunk_tokens=128)
    run = simulate(trace, config, FLAT)
    assert run.result["mode_decisions"].get("local:spilled", 0) == 1
    assert run.outcomes[2].ttft_s == pytest.approx(8 * 0.138, abs=0.01)  # from its arrival
    assert run.outcomes[0].within_slo and run.outcomes[0].tbt_tail_s <= 0.2
    uncapped = simulate(trace, replace(config, decode_chunk_tokens=2048), FLAT)
    assert uncapped.result["mode_decisions"].get("local:spilled", 0) == 0
    assert sum(o.within_slo for o in run.outcomes) == 4 > sum(o.within_slo for o in uncapped.outcomes) == 3
