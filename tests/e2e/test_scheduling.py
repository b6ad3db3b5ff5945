"""The Conductor's policies on a live cluster with two prefill instances (the shared
two-of-each layout, cache-aware placement): a prompt that shares a long prefix with
an earlier one goes where that prefix is cached."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.e2e.ops import conductor_stats, eventually, scrape

pytestmark = pytest.mark.e2e


def complete(cluster, prompt: list[int]) -> dict:
    body = {"model": "yuebing-tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{cluster.api}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_cache_aware_sends_shared_prefixes_back_to_their_instance(two_of_each):
    rng = random.Random(3)
    # Round robin would alternate instances and miss every second time.
    for _ in range(3):
        prefix = [rng.randrange(32, 127) for _ in range(640)]  # five 128-token blocks
        complete(two_of_each, prefix + [10])
        again = complete(two_of_each, prefix + [rng.randrange(32, 127) for _ in range(40)])
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 640


def test_the_conductor_learns_how_long_decodes_take(two_of_each):
    # Configured t_d is 10 s; these decodes take well under one: each completed one
    # moves the books' t_d towards what the cluster does.
    before = conductor_stats(two_of_each).decode_time_ms
    rng = random.Random(4)
    for _ in range(3):
        complete(two_of_each, [rng.randrange(32, 127) for _ in range(100)])
    # Each completion reaches the Conductor as a request update after its response:
    # wait for the third one's, rather than reading the books before it arrives.
    eventually(lambda: conductor_stats(two_of_each).decode_time_ms, lambda after: after < before * 0.95**2,
               "t_d learned from three completed decodes")


def test_each_instance_measures_its_pace_against_the_profile_and_the_conductor_uses_it(two_of_each):
    # Every prediction the Conductor makes is multiplied by how much slower than the
    # profile the instance runs now (shared/calibration.py): 1 exactly until there is
    # evidence, then the ratio of what prefills (the Conductor's own books) and decode
    # steps (the decode service's heartbeat) took against what the profile said.
    rng = random.Random(5)
    for _ in range(4):
        body = {"model": "yuebing-tiny", "prompt": [rng.randrange(32, 127) for _ in range(200)], "max_tokens": 24,
                "temperature": 0}
        assert httpx.post(f"{two_of_each.api}/completions", json=body, timeout=60).status_code == 200
    # A decode's ratio rests on its requests' token gaps (its page says how many seconds
    # of them), and reaches the Conductor with its next heartbeat. It can be exactly 1:
    # gaps within a bin (1.8 %) of the profile's, on an hour this host runs at its pace.
    def decode_paces() -> dict[str, tuple[float, float]]:
        pages = {n: scrape(url) for n, url in two_of_each.metrics.items() if n.startswith("decode-")}
        return {n: (only(page, "yuebing_instance_slowdown_evidence_seconds"), only(page, "yuebing_instance_slowdown"))
                for n, page in pages.items()}

    measured = eventually(decode_paces, lambda p: any(evidence > 0 for evidence, _ in p.values()),
                          "a decode instance's slowdown resting on its requests")
    seen = eventually(lambda: conductor_stats(two_of_each).slowdown,
                      lambda s: all(abs(s.get(n, 0.0) - pace) < 0.01 for n, (evidence, pace) in measured.items()
                                    if evidence > 0)
                      and any(s.get(f"prefill-{i}", 1.0) != 1.0 for i in (0, 1)),
                      "the decode's slowdown at the Conductor, and a prefill instance's measured")
    assert all(0.1 <= x <= 100 for x in seen.values()), seen


def only(page: dict[str, float], name: str) -> float:
    """The one sample of `name` on an instance's page."""
    (value,) = (v for key, v in page.items() if key.split("[", 1)[0] == name)
    return value
