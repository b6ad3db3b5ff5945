"""The connector's scheduler decisions, as plain functions: what to claim, wait for,
load, save, and report."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from shared.kv.plan import (
    Load,
    Match,
    Save,
    Send,
    Tracked,
    Wait,
    claimed,
    finished_params,
    match,
    matched_tokens,
    plan_load,
    saves_due,
    take_reserved,
    track,
)
from shared.kv.wire import NO_ROOM, NOT_NEEDED

BS = 4  # tokens per block


def hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in range(n)]


@dataclass
class Pool:
    ready: set[bytes] = field(default_factory=set)
    failed: set[bytes] = field(default_factory=set)
    alive: bool = True

    def has_failed(self, block_hash: bytes) -> bool:
        return block_hash in self.failed


def waiting(blocks: int, kv_blocks: int, until: float = 10.0) -> Tracked:
    return Tracked(hashes=hashes(blocks), wait=Wait(kv_blocks=kv_blocks, until=until))


# --- what a request asks for -------------------------------------------------------------
def test_a_request_without_kv_params_is_not_tracked():
    assert track(None, list(range(8)), BS, b"s", now=0.0) is None
    assert track({"other": 1}, list(range(8)), BS, b"s", now=0.0) is None


def test_kv_params_become_a_send_and_a_wait():
    t = track({"kv_dest": "node-2", "kv_blocks": 9, "kv_wait_s": 1.5}, list(range(10)), BS, b"s", now=100.0)
    assert t is not None and len(t.hashes) == 3 and t.tail == 2  # two full blocks and a tail of two tokens
    assert t.send == Send(kv_dest="node-2")
    assert t.wait == Wait(kv_blocks=3, until=101.5)  # never more than the prompt's blocks


def test_a_decode_names_the_tail_prefill_saved_not_one_holding_the_token_prefill_sampled():
    prompt = list(range(10))
    prefill = track({"kv_dest": "node-2"}, prompt, BS, b"s", now=0.0)
    decode = track({"kv_blocks": 3, "kv_prompt_tokens": 10}, [*prompt, 99], BS, b"s", now=0.0)
    assert prefill is not None and decode is not None
    assert decode.hashes == prefill.hashes and decode.tail == 2
    assert track({"kv_blocks": 3}, [*prompt, 99], BS, b"s", now=0.0).hashes[-1] != prefill.hashes[-1]
    other = track({"kv_dest": "n"}, [*prompt[:9], 7], BS, b"s", now=0.0)
    assert other.hashes[:2] == prefill.hashes[:2] and other.hashes[2] != prefill.hashes[2]


def test_decode_claims_the_tail_and_computes_only_the_sampled_token():
    t = Tracked(hashes=hashes(3), tail=2)  # 10 prompt tokens; decode runs 11
    pool = Pool(ready=set(hashes(3)))
    m = match(t, num_tokens=11, num_computed_tokens=0, block_size=BS, pool=pool, now=0.0)
    assert m == Match(0, 3) and matched_tokens(t, m, BS) == 10
    assert claimed(t, m, num_external_tokens=10, block_size=BS) == 3
    assert claimed(t, m, num_external_tokens=8, block_size=BS) == 2  # vLLM took the full blocks only
    # Prefill (10 tokens) must compute the last: the tail is not its to claim.
    assert match(t, num_tokens=10, num_computed_tokens=0, block_size=BS, pool=pool, now=0.0) == Match(0, 2)


def test_the_tail_saves_with_the_step_that_computes_the_prompts_last_token():
    t = Tracked(hashes=hashes(3), tail=2, send=Send(kv_dest="d"))
    assert saves_due({"s": t}, computed={"s": 0}, scheduled={"s": 9}, block_size=BS) == [("s", t, 2)]
    assert saves_due({"s": t}, computed={"s": 0}, scheduled={"s": 10}, block_size=BS) == [("s", t, 3)]


# --- what a step claims --------------------------------------------------------------------
def test_the_leading_ready_blocks_are_claimed_but_never_the_one_holding_the_last_token():
    t = Tracked(hashes=hashes(3))
    pool = Pool(ready=set(hashes(3)))
    assert match(t, num_tokens=12, num_computed_tokens=0, block_size=BS, pool=pool, now=0.0) == Match(0, 2)
    assert match(t, num_tokens=13, num_computed_tokens=0, block_size=BS, pool=pool, now=0.0) == Match(0, 3)
    pool.ready.discard(hashes(3)[1])
    assert match(t, num_tokens=13, num_computed_tokens=0, block_size=BS, pool=pool, now=0.0) == Match(0, 1)


def test_claims_start_past_what_vllm_has_computed():
    t = Tracked(hashes=hashes(4))
    pool = Pool(ready=set(hashes(4)[2:]))
    assert match(t, 17, num_computed_tokens=8, block_size=BS, pool=pool, now=0.0) == Match(2, 2)
    assert match(t, 17, num_computed_tokens=16, block_size=BS, pool=pool, now=0.0) == Match(4, 0)


def test_a_request_waits_for_blocks_on_their_way_until_its_deadline():
    t = waiting(blocks=3, kv_blocks=3, until=10.0)
    pool = Pool(ready=set(hashes(1)))
    assert match(t, 13, 0, BS, pool, now=5.0) is None  # ask again next step
    assert match(t, 13, 0, BS, pool, now=10.0) == Match(0, 1, expected=3)  # late: compute the rest


@pytest.mark.parametrize("why", ["failed", "dead"])
def test_nothing_waits_for_a_failed_block_or_a_dead_messenger(why):
    t = waiting(blocks=3, kv_blocks=3)
    pool = Pool(ready=set(hashes(1)), failed={hashes(3)[2]} if why == "failed" else set(), alive=why != "dead")
    assert match(t, 13, 0, BS, pool, now=0.0) == Match(0, 1 if why == "failed" else 0, expected=3)


def test_a_request_claims_at_once_when_its_blocks_are_all_here():
    t = waiting(blocks=3, kv_blocks=2)
    assert match(t, 13, 0, BS, Pool(ready=set(hashes(2))), now=0.0) == Match(0, 2, expected=2)


def test_vllm_may_allocate_fewer_blocks_than_were_matched():
    t = Tracked(hashes=hashes(3))
    assert claimed(t, Match(0, 3), num_external_tokens=8, block_size=BS) == 2
    assert claimed(t, Match(0, 3), num_external_tokens=0, block_size=BS) == 0
    assert claimed(t, Match(0, 1), num_external_tokens=12, block_size=BS) == 1


def test_claimed_blocks_the_pin_missed_are_loaded_as_failed():
    # Block 2 was ready when matched and evicted before the pin: vLLM must recompute it
    # (and block 3 after it, which the pin never reached).
    assert plan_load("r", [10, 11, 12, 13], pinned=[5, 6]) == (Load("r", [10, 11], [5, 6]), [12, 13])
    assert plan_load("r", [10], pinned=[]) == (None, [10])
    assert plan_load("r", [], pinned=[]) == (None, [])
    # A tail loads before the forward only where the pin reached it.
    assert plan_load("r", [10, 11], pinned=[5, 6], tail=True) == (Load("r", [10, 11], [5, 6], tail=True), [])
    assert plan_load("r", [10, 11], pinned=[5], tail=True) == (Load("r", [10], [5]), [11])


# --- what a step saves ---------------------------------------------------------------------
def test_saves_are_due_for_blocks_a_step_completes():
    saving = Tracked(hashes=hashes(3), send=Send(kv_dest="d", saved=1))
    tracked = {"s": saving, "w": waiting(3, 3)}
    due = saves_due(tracked, computed={"s": 4, "w": 0}, scheduled={"s": 8, "w": 12, "x": 4}, block_size=BS)
    assert due == [("s", saving, 3)]
    assert saves_due(tracked, computed={"s": 4}, scheduled={"s": 2}, block_size=BS) == []  # nothing new completes


def test_a_step_whose_claimed_blocks_failed_to_load_saves_nothing_and_its_rerun_does():
    # The step computes past a block that never loaded (its KV is whatever vLLM's block
    # held): saving would put wrong KV into the pool under the prompt's hashes.
    t = Tracked(hashes=hashes(3), send=Send(kv_dest="d"), load_failed=True)
    assert saves_due({"s": t}, computed={"s": 2 * BS}, scheduled={"s": BS + 2}, block_size=BS) == []
    # vLLM reruns the request from the failed block: that step's blocks save.
    assert saves_due({"s": t}, computed={"s": 0}, scheduled={"s": 3 * BS + 2}, block_size=BS) == [("s", t, 3)]


def test_prefill_tells_decode_how_many_leading_blocks_the_pool_took():
    # Three steps complete blocks 0-2, 3-5 and 6; the pool has no room for block 4, so
    # the run decode can load ends at block 3 (blocks 5 and 6 go, but past a gap).
    t = Tracked(hashes=hashes(7), send=Send(kv_dest="node-1"))
    steps = [(0, 3, [100, 101, 102], [5, NOT_NEEDED, 7]), (3, 6, [103, 104, 105], [8, NO_ROOM, 9]), (6, 7, [106], [10])]
    saves = [take_reserved(t.send, done, ids, t.hashes[start:done], slots) for start, done, ids, slots in steps]
    h = t.hashes
    assert saves == [[Save(100, 5, h[0]), Save(102, 7, h[2])], [Save(103, 8, h[3]), Save(105, 9, h[5])],
                     [Save(106, 10, h[6])]]
    assert finished_params(t) == {"kv_blocks": 4}


def test_a_reservation_without_an_answer_ends_the_run():
    send, h = Send(kv_dest="d"), hashes(4)
    assert take_reserved(send, 2, [1, 2], h[:2], [3, 4]) == [Save(1, 3, h[0]), Save(2, 4, h[1])]
    assert take_reserved(send, 3, [5], h[2:3], None) == []  # no messenger: decode computes block 2
    assert take_reserved(send, 4, [6], h[3:], [7]) == [Save(6, 7, h[3])]
    assert (send.saved, send.kv_blocks) == (4, 2)


def test_only_a_request_sending_somewhere_reports_kv_blocks():
    assert finished_params(Tracked(hashes=[], send=Send(kv_dest=""))) is None  # kept here
    assert finished_params(waiting(2, 2)) is None


def test_the_hashes_a_request_carries_are_used_and_equal_those_computed_here():
    from shared.block_hash import block_hashes, hex_hashes
    from shared.kv.plan import prompt_hashes

    prompt = list(range(300))
    carried = hex_hashes(prompt, 128, b"m")
    assert prompt_hashes({"kv_hashes": carried}, prompt, 128, b"m") == block_hashes(prompt, 128, b"m")
    # What a request carries names its blocks: a wrong-length list is not trusted.
    assert prompt_hashes({"kv_hashes": carried[:1]}, prompt, 128, b"m") == block_hashes(prompt, 128, b"m")
    assert prompt_hashes({"kv_hashes": ["00" * 16] * 2}, prompt, 128, b"m") == [bytes(16)] * 2
