"""Serving modes on live clusters (`yuebing up --mode`): each serves greedy outputs
equal to plain vLLM's, and says where each prompt was prefilled and why.

colocated: two engines that prefill and decode. conditional (Mooncake's rule) with a
256-token step budget: a prompt that fits one step is prefilled on its decode
instance, a longer one goes through the prefill instance, as the decision counters
show. pooled: adaptive mode with no prefill instance, two decode instances each
prefilling its own requests. disaggregated is the shared cluster's mode
(tests/e2e/test_transfer.py says so)."""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import pytest

from tests.e2e.ops import conductor_stats, openai_client
from tests.e2e.test_transfer import BLOCK, MAX_TOKENS, complete, prompt

pytestmark = pytest.mark.e2e

STEP_TOKENS = 256
FLAGS = {
    "colocated": ("--mode", "colocated", "--prefill", "1", "--decode", "1"),
    "conditional": ("--mode", "conditional", "--step-tokens", str(STEP_TOKENS)),
    "pooled": ("--prefill", "0", "--decode", "2"),
}
PLACED = {"colocated": {"colocated"}, "conditional": {"local", "disaggregated"}, "pooled": {"local"}}


@pytest.fixture(scope="module", params=list(FLAGS))
def moded(request, launcher, tmp_path_factory):
    """One cluster per mode, one at a time (the next starts once this one stopped)."""
    started = launcher(tmp_path_factory.mktemp(request.param), *FLAGS[request.param])
    try:
        yield request.param, started.wait()
    finally:
        started.stop()


@pytest.fixture(scope="module")
def moded_client(moded):
    return openai_client(moded[1])


def decisions(cluster) -> dict[tuple[str, str], float]:
    """The gateway's serving-mode counters: (mode, reason) → placements."""
    page = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    pattern = r'^yuebing_gateway_serving_mode_total\{mode="(\w+)",reason="(\w+)",rule="\w+"\} (\S+)$'
    return {(m, r): float(n) for m, r, n in re.findall(pattern, page, re.MULTILINE)}


def test_each_mode_serves_greedy_outputs_equal_to_plain_vllm(moded, moded_client, reference):
    mode, _ = moded
    prompts = [prompt(n, seed=300 + n) for n in (20, 130, 300, 600, 900)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: complete(moded_client, p), prompts))
    assert [tokens for tokens, _ in results] == reference.greedy(prompts, MAX_TOKENS)
    for p, (_, report) in zip(prompts, results):
        assert report["serving_mode"]["mode"] in PLACED[mode]
        local = report["serving_mode"]["mode"] != "disaggregated"
        assert (report["prefill_instance"] == "") == local, report


def test_a_one_token_request_is_served_in_every_mode(moded, moded_client, reference):
    p = prompt(150, seed=7)
    r = moded_client.completions.create(model="yuebing-tiny", prompt=p, max_tokens=1, temperature=0,
                                        extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == reference.greedy([p], 1)[0]


def test_colocated_sends_a_shared_prefix_back_to_the_engine_that_holds_it(moded, moded_client):
    mode, cluster = moded
    if mode != "colocated":
        pytest.skip("colocated placement")
    shared = prompt(5 * BLOCK, seed=11)
    _, first = complete(moded_client, shared + [40])
    _, again = complete(moded_client, shared + prompt(30, seed=12))
    assert again["decode_instance"] == first["decode_instance"]
    assert again["decode_kv_loaded_tokens"] >= 5 * BLOCK  # its engine's prefix cache: not computed again
    assert (again["serving_mode"]["rule"], again["serving_mode"]["reason"]) == ("colocated", "least_delay")
    assert conductor_stats(cluster).modes["colocated:least_delay"] >= 2


def test_conditional_prefills_a_short_prompt_on_decode_and_a_long_one_on_prefill(moded, moded_client, reference):
    mode, cluster = moded
    if mode != "conditional":
        pytest.skip("conditional's rule")
    short, long = prompt(100, seed=21), prompt(3 * STEP_TOKENS, seed=22)
    before = decisions(cluster)
    for p in (short, long):
        tokens, _ = complete(moded_client, p)
        assert tokens == reference.greedy([p], MAX_TOKENS)[0]
    after = decisions(cluster)
    gained = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
    # The short prompt fits one step on decode (nothing else decodes there: no TBT at
    # stake); the long one would be chunked there, so prefill takes it.
    assert gained == {("local", "unchunked_within_tbt"): 1.0, ("disaggregated", "would_chunk"): 1.0}
    stats = conductor_stats(cluster).modes
    assert stats["local:unchunked_within_tbt"] >= 1 and stats["disaggregated:would_chunk"] >= 1


def test_a_pooled_cluster_is_ready_without_a_prefill_instance_and_says_why_decode_prefills(moded, moded_client):
    mode, cluster = moded
    if mode != "pooled":
        pytest.skip("adaptive mode's pooled fleet")
    health = httpx.get(f"{cluster.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["instances"]["prefill"] == []
    _, report = complete(moded_client, prompt(200, seed=41))
    assert (report["serving_mode"]["rule"], report["serving_mode"]["reason"]) == ("pooled", "no_prefill_instance")
    assert conductor_stats(cluster).modes["local:no_prefill_instance"] >= 1
