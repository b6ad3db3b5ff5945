"""The planner live (`--planner`, disaggregated mode), on one prefill and two decode instances: under a
prefill-bound load (long prompts, a token or two out) it moves a decode instance to
prefill without restarting its engine, that instance then prefills requests, and
greedy outputs stay equal to the reference engine's across the change."""

from __future__ import annotations

import concurrent.futures
import random
import time

import httpx
import pytest

from tests.e2e.ops import conductor_stats, eventually
from tests.e2e.test_migration import log_events

pytestmark = pytest.mark.e2e

MODEL = "yuebing-tiny"
LOAD_S = 120  # the longest load before the planner moves (it decides every 2 s here, twice in a row)
# The planner at test speed: a decision every 2 s on the last 10 s of arrivals.
FAST_PLANNER = ("--planner", "--planner-interval-s", "2", "--planner-window-s", "10")


@pytest.fixture(scope="module")
def planned(launcher, tmp_path_factory):
    started = launcher(tmp_path_factory.mktemp("roles"), "--prefill", "1", "--decode", "2", *FAST_PLANNER,
                       "--mode", "disaggregated")
    yield started.wait()
    started.stop()


def prompt(rnd: random.Random, n: int = 900) -> list[int]:
    return [rnd.randrange(32, 127) for _ in range(n)]


def complete(cluster, tokens: list[int], max_tokens: int = 2, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": MODEL, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    return httpx.post(f"{cluster.api}/completions", json=body, headers=headers, timeout=120)


def load_until_moved(cluster, clients: int = 4, prompt_tokens: int = 900, max_tokens: int = 2,
                     headers: dict[str, str] | None = None) -> None:
    """Clients send requests back to back (by default long prompts, a token or two
    out) until the planner has moved a role."""
    deadline = time.monotonic() + LOAD_S

    def client(seed: int) -> None:
        rnd = random.Random(seed)
        while time.monotonic() < deadline and not conductor_stats(cluster).role_changes:
            r = complete(cluster, prompt(rnd, prompt_tokens), max_tokens, headers)
            assert r.status_code in (200, 429), r.text  # shed under load, never failed

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))


@pytest.mark.destructive
def test_the_planner_moves_a_decode_to_prefill_and_outputs_stay_exact(planned, reference):
    cluster = planned
    load_until_moved(cluster)
    stats = conductor_stats(cluster)
    assert stats.role_changes >= 1, "no role change under a prefill-bound load"
    moved = eventually(lambda: conductor_stats(cluster).roles, lambda r: "prefill" in r.values(), "the drain done", 60)
    (instance,) = [iid for iid, role in moved.items() if role == "prefill"]
    assert instance.startswith("decode-")
    rnd = random.Random(7)
    prompts = [prompt(rnd, 300) for _ in range(8)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # at once: both prefill instances take some
        replies = list(pool.map(lambda t: complete(cluster, t, max_tokens=8), prompts))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    assert [r.json()["choices"][0]["token_ids"] for r in replies] == reference.greedy(prompts, 8)
    # The instance it was launched as, its engine never restarted, now prefills.
    assert log_events(cluster, instance, "prefill start"), f"{instance} never prefilled"
    assert len(log_events(cluster, instance, "decode ready")) == 1
