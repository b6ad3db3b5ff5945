"""The Conductor's policies on a live cluster with two prefill instances (the shared
two-of-each layout, cache-aware placement): a prompt that shares a long prefix with
an earlier one goes where that prefix is cached."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.e2e.ops import conductor_stats, eventually

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
    # The decode's ratio reaches the Conductor with its next heartbeat.
    seen = eventually(lambda: conductor_stats(two_of_each).slowdown,
                      lambda s: any(s.get(f"decode-{i}", 1.0) != 1.0 for i in (0, 1))
                      and any(s.get(f"prefill-{i}", 1.0) != 1.0 for i in (0, 1)),
                      "slowdowns measured for decode and for a prefill instance")
    assert all(0.1 <= x <= 100 for x in seen.values()), seen
