"""KV transfer on the real cluster (prefill on node-0, decode on node-1, two
messengers talking ZeroMQ TCP): decode loads what prefill computed instead of
computing it again, and its greedy output still equals plain vLLM token for token.

"Computed by decode" comes from vLLM's own counter (the decode request's
num_cached_tokens, reported in the response's `yuebing` field), not from logs.
"""

from __future__ import annotations

import concurrent.futures
import random

import pytest

from tests.e2e.ops import arm_faults, messenger

pytestmark = pytest.mark.e2e

BLOCK = 128
MAX_TOKENS = 12


def prompt(length: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(32, 127) for _ in range(length)]


def complete(client, ids: list[int]):
    r = client.completions.create(
        model="yuebing-tiny", prompt=ids, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True},
    )
    assert r.model_extra["prompt_token_ids"] == ids
    return r.choices[0].model_extra["token_ids"], r.model_extra["yuebing"]


def complete_with_id(client, ids: list[int]) -> tuple[list[int], dict, str]:
    """Also the gateway's id for the request, which every instance logs it under."""
    raw = client.completions.with_raw_response.create(
        model="yuebing-tiny", prompt=ids, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True},
    )
    r = raw.parse()
    return r.choices[0].model_extra["token_ids"], r.model_extra["yuebing"], raw.headers["x-yuebing-request-id"]


# Shorter than a block, not a multiple of it, exactly two blocks, near the 1024-token limit.
LENGTHS = [60, 300, 2 * BLOCK, 1000]


def test_the_messengers_run_plain_tcp_by_default(cluster):
    for node in ("0", "1"):
        assert '"kv_transport":"tcp"' in cluster.log(f"messenger-{node}")


def test_decode_loads_prefill_kv_and_matches_plain_vllm(cluster, client, reference):
    before = messenger(cluster, "node-1")
    prompts = [prompt(n, seed=n) for n in LENGTHS]
    results = [complete(client, p) for p in prompts]
    want = reference.greedy(prompts, MAX_TOKENS)
    for p, (tokens, report), expected in zip(prompts, results, want):
        assert tokens == expected, f"prompt of {len(p)} tokens"
        assert report["kv_blocks"] == -(-len(p) // BLOCK), report  # the connector's word, through vLLM
        # Every prompt token, the partial tail's too: decode computes only the token prefill sampled.
        assert report["decode_kv_loaded_tokens"] == len(p), report
        assert report["decode_computed_prompt_tokens"] == 0, report
    after = messenger(cluster, "node-1")
    sent_blocks = sum(-(-n // BLOCK) for n in LENGTHS)
    assert after.blocks_received - before.blocks_received == sent_blocks
    assert after.checksum_failures == before.checksum_failures


def test_concurrent_requests_each_load_their_own_blocks(cluster, client, reference):
    prompts = [prompt(200 + 97 * i, seed=100 + i) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: complete(client, p), prompts))
    assert [tokens for tokens, _ in results] == reference.greedy(prompts, MAX_TOKENS)
    for p, (_, report) in zip(prompts, results):
        assert report["decode_computed_prompt_tokens"] == 0, report
        assert report["decode_kv_loaded_tokens"] == len(p)


def test_a_block_corrupted_in_transit_is_detected_and_recomputed(cluster, client, reference):
    before = messenger(cluster, "node-1")
    # The prefill node's messenger flips a byte in the next layer it sends: block 0.
    armed = arm_faults(cluster, "node-0", corrupt_next=1)
    assert armed.corrupt_pending == 1
    p = prompt(700, seed=7)
    tokens, report = complete(client, p)
    assert tokens == reference.greedy([p], MAX_TOKENS)[0]
    after = messenger(cluster, "node-1")
    assert after.checksum_failures == before.checksum_failures + 1
    assert messenger(cluster, "node-0").corrupt_pending == 0
    # Block 0 never became visible, so decode computed the prompt from there on.
    assert report["decode_kv_loaded_tokens"] == 0
    assert report["decode_computed_prompt_tokens"] == len(p)


def test_decode_does_not_wait_for_blocks_prefills_pool_had_no_room_for(cluster, client, reference):
    # The prefill node's pool refuses the prompt's first two blocks (as if full of
    # pinned blocks): nothing decode could load is coming, so decode is told to wait
    # for no block and computes the prompt at once, rather than after kv_wait_s.
    armed = arm_faults(cluster, "node-0", no_room_next=2)
    assert armed.no_room_pending == 2
    p = prompt(900, seed=9)  # 7 full blocks
    tokens, report, request_id = complete_with_id(client, p)
    assert tokens == reference.greedy([p], MAX_TOKENS)[0]
    assert messenger(cluster, "node-0").no_room_pending == 0
    assert report["kv_blocks"] == 0, report
    assert report["decode_kv_loaded_tokens"] == 0 and report["decode_computed_prompt_tokens"] == len(p)
    # What decode was told to wait for, from its own log of the request.
    (start,) = [line for line in cluster.log("decode-0").splitlines() if '"decode start"' in line and request_id in line]
    assert '"kv_blocks":0' in start, start


def test_the_shared_cluster_runs_disaggregated_and_says_so(client):
    _, report = complete(client, prompt(200, seed=31))
    assert report["serving_mode"]["mode"] == "disaggregated" and report["prefill_instance"] == "prefill-0"
