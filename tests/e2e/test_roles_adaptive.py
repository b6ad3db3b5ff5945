"""The planner live on two instances in adaptive mode (the default): under a
decode-bound load (short prompts, long outputs) it moves the prefill instance to
decode, both engines then decode and prefill locally, and greedy outputs stay equal
to the reference engine's across the change (its engine never restarted)."""

from __future__ import annotations

import concurrent.futures
import random

import pytest

from tests.e2e.ops import conductor_stats, eventually
from tests.e2e.test_migration import log_events
from tests.e2e.test_roles import complete, load_until_moved, prompt

pytestmark = pytest.mark.e2e

CLIENTS = 12


@pytest.fixture(scope="module")
def two(launcher, tmp_path_factory):
    started = launcher(tmp_path_factory.mktemp("roles2"), "--prefill", "1", "--decode", "1", "--planner")
    yield started.wait()
    started.stop()


@pytest.mark.destructive
def test_the_planner_moves_the_prefill_to_decode_and_outputs_stay_exact(two, reference):
    cluster = two
    # Short prompts, long outputs, and a tight TBT SLO of their own (a lone step is
    # predicted at about 3 ms): decode room runs out under a dozen streams, and its
    # refusals are what the planner reads as demand for decode.
    load_until_moved(cluster, CLIENTS, prompt_tokens=40, max_tokens=120, headers={"x-yuebing-slo-tbt-ms": "5"})
    assert conductor_stats(cluster).role_changes >= 1, "no role change under a decode-bound load"
    roles = eventually(lambda: conductor_stats(cluster).roles, lambda r: r.get("prefill-0") == "decode",
                       "prefill-0 decoding", 60)
    assert "prefill" not in roles.values()
    rnd = random.Random(7)
    prompts = [prompt(rnd, 300) for _ in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # at once: both engines take some
        replies = list(pool.map(lambda t: complete(cluster, t, max_tokens=8), prompts))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    assert [r.json()["choices"][0]["token_ids"] for r in replies] == reference.greedy(prompts, 8)
    modes = [r.json()["yuebing"]["serving_mode"] for r in replies]
    assert {(m["rule"], m["reason"]) for m in modes} == {("planner", "no_prefill_role")}
    # The instance launched to prefill, its engine never restarted, now decodes what it prefills.
    assert log_events(cluster, "prefill-0", "decode start"), "prefill-0 never decoded"
    assert len(log_events(cluster, "prefill-0", "prefill ready")) == 1
