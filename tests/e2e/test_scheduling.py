"""The Conductor's policies on a live cluster with two prefill instances: a prompt
that shares a long prefix with an earlier one goes where that prefix is cached."""

from __future__ import annotations

import random

import httpx
import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_prefills(launcher, tmp_path_factory):
    started = launcher(tmp_path_factory.mktemp("two-prefills"), "--prefill", "2", "--policy", "cache_aware")
    yield started.wait()
    started.stop()


def complete(cluster, prompt: list[int]) -> dict:
    body = {"model": "yuebing-tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{cluster.api}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_cache_aware_sends_shared_prefixes_back_to_their_instance(two_prefills):
    rng = random.Random(3)
    # Round robin would alternate instances and miss every second time.
    for _ in range(3):
        prefix = [rng.randrange(32, 127) for _ in range(640)]  # five 128-token blocks
        complete(two_prefills, prefix + [10])
        again = complete(two_prefills, prefix + [rng.randrange(32, 127) for _ in range(40)])
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 640
