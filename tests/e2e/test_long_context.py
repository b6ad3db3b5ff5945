"""CPP live (`yuebing up --cpp-groups 1`): a cluster with one single prefill
instance, one CPP group (one vLLM engine pipelined over 2 stage processes, each
saving the layers it owns into the node pool) and one decode.

A long uncached prompt goes to the group (its pipeline time model predicts a lower
TTFT), decode then loads every full prompt block the two stages wrote, and the
greedy output equals plain vLLM's; a short prompt stays on the single instance.
The decisions are counted in the Conductor's stats and named in the response."""

from __future__ import annotations

import pytest

from tests.e2e.ops import conductor_stats, openai_client
from tests.e2e.test_transfer import BLOCK, MAX_TOKENS, complete, prompt

pytestmark = pytest.mark.e2e

CHUNK = 512  # --step-tokens: a 3,000-token prompt is 6 chunks, in flight on both stages at once
FLAGS = ("--prefill", "1", "--cpp-groups", "1", "--cpp-stages", "2", "--decode", "1",
         "--max-model-len", "4096", "--step-tokens", str(CHUNK))


@pytest.fixture(scope="module")
def cpp_cluster(launcher, tmp_path_factory):
    started = launcher(tmp_path_factory.mktemp("cpp"), *FLAGS)
    try:
        yield started.wait()
    finally:
        started.stop()


@pytest.fixture(scope="module")
def cpp_client(cpp_cluster):
    return openai_client(cpp_cluster)


def test_a_long_prompt_is_prefilled_by_the_cpp_group_and_decode_loads_every_block(cpp_client, reference):
    long = prompt(3000, seed=41)
    tokens, report = complete(cpp_client, long)
    assert tokens == reference.greedy([long], MAX_TOKENS)[0]
    assert (report["prefill_instance"], report["prefill_route"]) == ("prefill-1", "cpp:faster"), report
    # Both stages' layers reached the pool: every block ready (the tail too), none recomputed.
    assert report["decode_kv_loaded_tokens"] == 3000
    assert report["decode_computed_prompt_tokens"] == 0


def test_a_short_prompt_stays_on_the_single_instance(cpp_cluster, cpp_client, reference):
    short = prompt(200, seed=42)
    tokens, report = complete(cpp_client, short)
    assert tokens == reference.greedy([short], MAX_TOKENS)[0]
    assert (report["prefill_instance"], report["prefill_route"]) == ("prefill-0", "single:short_input"), report
    routes = conductor_stats(cpp_cluster).routes
    assert routes.get("single:short_input", 0) >= 1 and routes.get("cpp:faster", 0) >= 1, routes
