"""Serving modes (services/conductor/modes.py): the step budget, the conditional
rules' defining behaviour, and placement across colocated instances."""

import math
from dataclasses import replace

import pytest

from services.conductor.modes import (
    ColocatedChoice,
    ColocatedLoad,
    LocalPrefill,
    ModeParams,
    better_both,
    choose_mode,
    colocated_stall_s,
    colocated_ttft_s,
    place_colocated,
    step_budget,
)
from services.conductor.policy import Rejection, Request
from shared.predictor import Predictor, mixed_step_s, slo_step_tokens

# prefill: 5 ms a step + 1 ms a token; decode: 10 ms a step + 1 ms a sequence
PRED = Predictor(prefill_coef=(5.0, 1.0, 0.0, 0.0), decode_coef=(10.0, 1.0, 0.0))
BS = 512


def local(uncached: int, batch: int = 2, slo_tbt_s: float = 0.1) -> LocalPrefill:
    return LocalPrefill("d0", uncached, 0, batch, 1000 * batch, slo_tbt_s)


def test_a_step_budget_is_vllms_less_the_decodes_or_sized_to_the_tbt_slo():
    assert step_budget(PRED, 2048, 2, 2000, 0, 0.1) == 2046
    # 12 ms of decode + 1 ms a token within 100 ms: 88 tokens; at least 64 where nothing fits.
    assert step_budget(PRED, 0, 2, 2000, 0, 0.1) == slo_step_tokens(PRED, 2, 2000, 0, 0.1) == 88
    assert slo_step_tokens(PRED, 2, 2000, 0, 0.005) == 64
    assert slo_step_tokens(PRED, 2, 2000, 0, 60.0) == 8192


def test_mooncake_keeps_an_unchunked_prefill_on_decode_when_the_step_keeps_the_tbt_slo():
    params = ModeParams("mooncake", step_tokens=2048)
    choice = choose_mode(local(80), PRED, params)  # 12 + 80 ms: within 100 ms
    assert (choice.mode, choice.reason) == ("local", "unchunked_within_tbt")
    assert choice.tbt_s == pytest.approx(0.092) and choice.local
    assert choice.key == "local:unchunked_within_tbt"
    assert choice.record()["predicted_tbt_ms"] == pytest.approx(92.0)


def test_mooncake_disaggregates_what_would_break_the_tbt_of_those_decoding_there():
    choice = choose_mode(local(95), PRED, ModeParams("mooncake"))  # 12 + 95 ms > 100 ms
    assert (choice.mode, choice.reason) == ("disaggregated", "breaks_tbt")
    assert choice.tbt_s == pytest.approx(0.107)
    # With nothing decoding there no TBT is at stake.
    assert choice_on_idle(1000).mode == "local"


def choice_on_idle(uncached: int):
    return choose_mode(local(uncached, batch=0), PRED, ModeParams("mooncake"))


def test_mooncake_disaggregates_what_one_step_cannot_compute_whole():
    # The budget is the step's less a token per decoding sequence (vLLM schedules decodes first).
    params = ModeParams("mooncake", step_tokens=100)
    assert choose_mode(local(98, slo_tbt_s=1.0), PRED, params).mode == "local"
    chunked = choose_mode(local(99, slo_tbt_s=1.0), PRED, params)
    assert (chunked.mode, chunked.reason) == ("disaggregated", "would_chunk")


def test_dynamo_and_llmd_thresholds_differ_only_at_n():
    dynamo, llmd = ModeParams("dynamo", local_prefill_tokens=500), ModeParams("llmd", local_prefill_tokens=500)
    assert choose_mode(local(499, slo_tbt_s=0.0), PRED, dynamo).reason == "below_threshold"  # no TBT judged
    assert choose_mode(local(500), PRED, dynamo).mode == "disaggregated"
    assert choose_mode(local(500), PRED, llmd).mode == "local"
    assert choose_mode(local(501), PRED, llmd).reason == "above_threshold"


def test_an_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="mooncake"):
        choose_mode(local(10), PRED, ModeParams("nope"))


def req(prompt_len: int = 1024, slo_ttft_s: float = 30.0, slo_tbt_s: float = 0.1, avoid=frozenset()) -> Request:
    return Request("r", prompt_len, prompt_len // BS, 10, slo_ttft_s, slo_tbt_s, avoid)


def test_colocated_ttft_counts_the_queue_the_chunks_and_the_decodes_beside_them():
    # 1024 queued + 1024 new tokens at 511 a step (one token to the decoding sequence): 5 steps
    # of 11 ms decode each, plus 2048 ms of tokens.
    load = ColocatedLoad("c0", queued_tokens=1024, prefix_blocks=0, batch=1, ctx_tokens=0)
    assert colocated_ttft_s(load, req(), PRED, BS, 512) == pytest.approx(5 * 0.011 + 2.048)
    # Alone: the prefill's own fixed cost a step.
    idle = ColocatedLoad("c0", 0, 0, 0, 0)
    assert colocated_ttft_s(idle, req(), PRED, BS, 512) == pytest.approx(2 * 0.005 + 1.024)


def test_colocated_placement_prefers_the_cache_and_spares_running_decodes():
    busy = ColocatedLoad("c0", 0, 0, batch=20, ctx_tokens=20_000)
    idle = ColocatedLoad("c1", 0, 0, 0, 0)
    cached_busy = ColocatedLoad("c2", 0, prefix_blocks=1, batch=20, ctx_tokens=20_000)
    assert place_colocated(req(), [busy, idle], PRED, BS, 512).instance_id == "c1"  # interference
    # 128 cached tokens do not pay for stalling twenty decodes for 896 tokens' prefill.
    assert place_colocated(req(), [busy, idle, cached_busy], PRED, BS, 512).instance_id == "c1"
    cached_idle = ColocatedLoad("c3", 0, prefix_blocks=1, batch=0, ctx_tokens=0)
    choice = place_colocated(req(), [idle, cached_idle], PRED, BS, 512)
    assert isinstance(choice, ColocatedChoice) and (choice.instance_id, choice.cached_blocks) == ("c3", 1)
    choice = place_colocated(req(), [busy], PRED, BS, 512)
    assert choice.tbt_s == pytest.approx(PRED.decode_step_s(21, 20_000 + 1024))
    assert choice.mixed_tbt_s > choice.tbt_s  # a step with its prefill's chunk beside it


def test_the_fullest_step_a_prefill_puts_on_an_instance_is_its_work_up_to_a_budget():
    """A spill is judged on the steps it really adds: a short prompt's one small chunk,
    a long one's (or one behind a queue) full budget."""
    from services.conductor.modes import fullest_step_s

    load = ColocatedLoad("d0", 0, 0, batch=4, ctx_tokens=4_000)
    joined = (5, 4_000 + 256)
    assert fullest_step_s(load, req(prompt_len=256), PRED, BS, 2048) == pytest.approx(
        mixed_step_s(PRED, *joined, [(256, 0)]))
    long_prompt, behind = req(prompt_len=8_000), ColocatedLoad("d0", 4_000, 0, batch=4, ctx_tokens=4_000)
    full = mixed_step_s(PRED, 5, 4_000 + 8_000, [(2048 - 5, 0)])
    assert fullest_step_s(load, long_prompt, PRED, BS, 2048) == pytest.approx(full)
    assert fullest_step_s(behind, req(prompt_len=256), PRED, BS, 2048) == pytest.approx(
        mixed_step_s(PRED, *joined, [(2048 - 5, 0)]))
    assert fullest_step_s(load, req(prompt_len=256), PRED, BS, 2048) < full


def test_colocated_placement_queues_a_prompt_behind_another_rather_than_stall_many_decodes():
    decoding = ColocatedLoad("c0", queued_tokens=0, prefix_blocks=0, batch=8, ctx_tokens=8_000)
    prefilling = ColocatedLoad("c1", queued_tokens=512, prefix_blocks=0, batch=1, ctx_tokens=1_000)
    r = req(prompt_len=512)
    assert colocated_ttft_s(decoding, r, PRED, BS, 2048) < colocated_ttft_s(prefilling, r, PRED, BS, 2048)
    assert place_colocated(r, [decoding, prefilling], PRED, BS, 2048).instance_id == "c1"
    stalls = [colocated_stall_s(x, r, PRED, BS) for x in (decoding, prefilling)]
    assert stalls[0] == pytest.approx(8 * stalls[1])


def test_colocated_placement_skips_full_and_avoided_instances_and_admits_by_slo():
    full = ColocatedLoad("c0", 0, 0, batch=4, ctx_tokens=0, capacity=4)
    other = ColocatedLoad("c1", 10_000, 0, 0, 0)
    assert place_colocated(req(), [full, other], PRED, BS, 512).instance_id == "c1"
    assert place_colocated(req(avoid=frozenset({"c1"})), [full, other], PRED, BS, 512).kind == "unavailable"
    late = place_colocated(req(slo_ttft_s=1.0), [other], PRED, BS, 512, admission="early_reject")
    assert isinstance(late, Rejection) and "TTFT" in late.reason
    assert not isinstance(place_colocated(req(slo_ttft_s=1.0), [other], PRED, BS, 512), Rejection)
    slow = place_colocated(req(slo_tbt_s=0.005), [ColocatedLoad("c1", 0, 0, 0, 0)], PRED, BS, 512, admission="predictive")
    assert isinstance(slow, Rejection) and "TBT" in slow.reason and slow.retry_after_s < math.inf


# --- adaptive -------------------------------------------------------------------
def test_adaptive_looks_beyond_the_prefills_once_a_prompt_would_wait_half_its_ttft_slo_or_be_refused():
    from services.conductor.modes import SPILL_AT_TTFT_SHARE, spills
    from services.conductor.policy import Decision, PrefillChoice

    req = Request("r", 1000, 7, 16, slo_ttft_s=2.0, slo_tbt_s=0.05)

    def queued(ttft_s: float) -> Decision:
        return Decision(PrefillChoice("p0", ttft_s, 0), "d0", 0.01)

    assert not spills(queued(0.3), req)  # light load: disaggregated, as ever
    assert spills(queued(SPILL_AT_TTFT_SHARE * 2.0 + 0.01), req)
    assert spills(Rejection("overloaded", "predicted TTFT 2100 ms exceeds the SLO", 0.1), req)


def test_a_spill_must_take_a_step_or_two_within_the_tbt_slo_there_and_beat_disaggregation():
    from services.conductor.modes import SPILL_MIXED_STEPS, better_both
    from services.conductor.policy import Decision, PrefillChoice

    req = Request("r", 1000, 7, 16, slo_ttft_s=2.0, slo_tbt_s=0.1)
    queued = Decision(PrefillChoice("p0", 1.5, 0), "d0", 0.01)
    refused = Rejection("overloaded", "predicted TTFT 2100 ms exceeds the SLO", 0.1)

    def there(ttft_s: float, mixed_s: float = 0.09, steps: int = 1) -> ColocatedChoice:
        return ColocatedChoice("d0", ttft_s, 0, 0.01, mixed_s, steps)

    assert better_both(there(0.5), queued, req) and better_both(there(3.0), refused, req)
    assert not better_both(there(1.6), queued, req)  # not sooner
    assert not better_both(there(0.5, mixed_s=0.11), refused, req)  # its chunks would break the TBT there
    assert not better_both(there(0.5, steps=SPILL_MIXED_STEPS + 1), refused, req)  # too many steps in a row
    assert not better_both(refused, refused, req)
    capped = ColocatedChoice("d0", 0.5, 0, 0.01, 0.09, SPILL_MIXED_STEPS + 5, chunked=True)
    assert better_both(capped, refused, req)  # each of its many steps is sized to the SLO


def test_a_spill_is_priced_on_the_steps_the_engine_will_fill_beside_it():
    # vLLM steps a chunk of every waiting prompt together, up to its token budget:
    # behind 1,500 queued tokens, the fullest step holds 2,043 (a token to each decode).
    from services.conductor.modes import fullest_step_s

    prompt = req(prompt_len=1_000, slo_tbt_s=0.05)
    alone = ColocatedLoad("d0", 0, 0, batch=4, ctx_tokens=4_000, decode_chunk_tokens=256)
    behind = ColocatedLoad("d0", 1_500, 0, batch=4, ctx_tokens=4_000, decode_chunk_tokens=256)
    assert fullest_step_s(behind, prompt, PRED, BS, 2048) == pytest.approx(
        mixed_step_s(PRED, 5, 4_000 + 1_000, [(2_043, 0)]))
    assert fullest_step_s(alone, prompt, PRED, BS, 2048) == pytest.approx(mixed_step_s(PRED, 5, 5_000, [(256, 0)]))
    # On a prefill instance it decodes beside the role's prompts, which keep coming.
    prefill = ColocatedLoad("p0", 0, 0, batch=4, ctx_tokens=4_000, prefill_role=True)
    assert fullest_step_s(prefill, prompt, PRED, BS, 2048) == pytest.approx(
        mixed_step_s(PRED, 5, 5_000, [(2_043, 0)]))


def test_an_engine_that_caps_a_prompts_chunk_prefills_a_long_spill_in_slo_sized_steps():
    from services.conductor.modes import colocated_steps, fullest_step_s

    long_prompt = req(prompt_len=4_000, slo_tbt_s=0.05)
    capped = ColocatedLoad("d0", 0, 0, batch=4, ctx_tokens=4_000, decode_chunk_tokens=500)
    uncapped = ColocatedLoad("d0", 0, 0, batch=4, ctx_tokens=4_000)
    assert capped.chunked and not uncapped.chunked
    assert colocated_steps(capped, long_prompt, PRED, BS, 2048) == 8  # 4,000 tokens, 500 a step
    assert colocated_steps(uncapped, long_prompt, PRED, BS, 2048) == 2  # 2,044 a step (a token to each decode)
    assert fullest_step_s(capped, long_prompt, PRED, BS, 2048) == pytest.approx(
        mixed_step_s(PRED, 5, 4_000 + 4_000, [(500, 0)]))
    choice = place_colocated(long_prompt, [capped], PRED, BS, 2048)
    assert isinstance(choice, ColocatedChoice) and choice.chunked and choice.mixed_steps == 8
    # vLLM caps each prompt: beside another prefilling there, or with nobody decoding, it is not chunked alone.
    assert not ColocatedLoad("d0", 100, 0, batch=4, ctx_tokens=4_000, decode_chunk_tokens=500).chunked
    assert not ColocatedLoad("d0", 0, 0, batch=0, ctx_tokens=0, decode_chunk_tokens=500).chunked


def test_a_prompt_an_idle_pooled_engine_takes_in_one_step_stalls_nobody():
    from services.conductor.modes import fullest_step_s

    prompt = req(prompt_len=2_000, slo_tbt_s=0.05)
    idle = ColocatedLoad("d0", 0, 0, batch=0, ctx_tokens=0, decode_chunk_tokens=500, pooled=True)
    # Alone there, vLLM takes it whole (its cap binds only beside other requests), and
    # with no prefill instance nothing joins to wait the step out: its own step counts.
    assert fullest_step_s(idle, prompt, PRED, BS, 2048) == pytest.approx(PRED.decode_step_s(1, 2_000))
    choice = place_colocated(prompt, [idle], PRED, BS, 2048)
    assert isinstance(choice, ColocatedChoice) and choice.mixed_steps == 1
    assert better_both(choice, Rejection("unavailable", "no live prefill instance", 1.0), prompt)
    # Beside a prefill instance, a request it prefilled could join meanwhile and wait
    # the whole step out: the step is priced beside the joined batch, and refused.
    fed = replace(idle, pooled=False)
    assert fullest_step_s(fed, prompt, PRED, BS, 2048) == pytest.approx(mixed_step_s(PRED, 1, 2_000, [(2_000, 0)]))
    assert not better_both(place_colocated(prompt, [fed], PRED, BS, 2048), Rejection("overloaded", "", 1.0), prompt)
    # Beside one decode, the same prompt's capped chunks share its steps.
    busy = replace(idle, batch=1, ctx_tokens=1_000)
    assert fullest_step_s(busy, prompt, PRED, BS, 2048) == pytest.approx(mixed_step_s(PRED, 2, 3_000, [(500, 0)]))
    # Longer than a step, it would be chunked beside whoever joins: priced as before.
    long_prompt = req(prompt_len=4_000, slo_tbt_s=0.05)
    assert fullest_step_s(idle, long_prompt, PRED, BS, 2048) > PRED.decode_step_s(1, 4_000)
