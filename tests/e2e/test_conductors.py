"""Two Conductors sharing one cluster (`yuebing up --conductors 2`), on one prefill
and one decode instance (the shared two-conductors layout, tests/layouts.py):

- requests sent together are placed by both Conductors, both hold the same books
  while they run (each one's stats, read over NATS), and greedy outputs equal the
  reference engine's;
- one Conductor SIGKILLed while requests keep coming: every request is served, and
  once they end the books are empty (the lost one's placements, whose updates went
  to it alone, leave the survivor's)."""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import time

import httpx
import pytest

from tests.e2e.ops import eventually, every_conductor_stats
from tests.e2e.test_migration import greedy_to_the_end

pytestmark = pytest.mark.e2e

MODEL = "yuebing-tiny"
NAMES = {"conductor", "conductor-1"}
MAX_TOKENS = 200  # long enough to read both Conductors' books while they run


def prompt(seed: int, n: int = 120) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(32, 127) for _ in range(n)]


def complete(cluster, tokens: list[int], max_tokens: int) -> list[int]:
    body = {"model": MODEL, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(f"{cluster.api}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def agree(stats: dict) -> bool:
    """Both Conductors answer, and their books hold the same requests on each instance."""
    if set(stats) != NAMES:
        return False
    a, b = (stats[name].booked for name in sorted(NAMES))
    return {k: v for k, v in a.items() if v} == {k: v for k, v in b.items() if v}


def test_both_conductors_place_requests_and_hold_the_same_books(two_conductors, reference):
    cluster = two_conductors
    prompts = [prompt(seed) for seed in range(16)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, cluster, p, MAX_TOKENS) for p in prompts]
        # While they run: the same books on both, some requests in them.
        eventually(lambda: every_conductor_stats(cluster, seconds=0.3),
                   lambda s: agree(s) and sum(s["conductor"].booked.values()) > 0, "the same books, in flight")
        outputs = [f.result() for f in futures]
    for p, out in list(zip(prompts, outputs))[:4]:
        assert out == greedy_to_the_end(reference, p, MAX_TOKENS)[0]
    stats = eventually(lambda: every_conductor_stats(cluster, seconds=0.3),
                       lambda s: agree(s) and not any(s["conductor"].booked.values()), "empty books on both")
    accepted = {name: s.accepted for name, s in stats.items()}
    assert all(n > 0 for n in accepted.values()) and sum(accepted.values()) >= len(prompts), accepted
    assert all(s.peer_bookings > 0 for s in stats.values())


@pytest.mark.destructive
def test_a_conductor_killed_loses_no_request(two_conductors):
    cluster = two_conductors
    served, failed = [], []
    end = time.monotonic() + 12
    killed = False
    seed = 100
    while time.monotonic() < end:
        if not killed and time.monotonic() > end - 9:
            os.kill(cluster.pids["conductor-1"], signal.SIGKILL)
            killed = True
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            batch = [pool.submit(_status, cluster, prompt(seed + i)) for i in range(4)]
            for f in batch:
                (served if f.result() == 200 else failed).append(f.result())
        seed += 4
    assert killed and served and not failed, f"{len(served)} served, failed: {failed}"
    eventually(lambda: every_conductor_stats(cluster, seconds=0.3),
               lambda s: "conductor" in s and not any(n for x in s.values() for n in x.booked.values()),
               "every Conductor's books empty (the launcher restarts the killed one)", timeout_s=30)


def _status(cluster, tokens: list[int]) -> int:
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{cluster.api}/completions", json=body, timeout=60).status_code
