"""The KV store through a messenger crash on the real cluster (issue 16): node-1's
messenger is SIGKILLed, the launcher starts it again, and its engines attach to the
new one by themselves (a new pool file, carved by the decode worker's hello and
mapped again), so decode loads KV again without any engine being restarted.

Relies on the launcher restarting a dead messenger (yuebing/launcher.py supervises
every child)."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from tests.e2e.ops import eventually, messenger, service

pytestmark = pytest.mark.e2e

BLOCK = 128


def prompt(length: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(32, 127) for _ in range(length)]


def loaded_tokens(client, ids: list[int]) -> int:
    r = client.completions.create(model="yuebing-tiny", prompt=ids, max_tokens=4, temperature=0,
                                  extra_body={"return_token_ids": True})
    return r.model_extra["yuebing"]["decode_kv_loaded_tokens"]


@pytest.mark.destructive
def test_a_restarted_messenger_is_attached_again_and_decode_loads_kv_without_engine_restarts(cluster, client):
    assert loaded_tokens(client, prompt(2 * BLOCK + 20, seed=1)) == 2 * BLOCK + 20  # the path works before
    engines = {name: service(cluster, f"services.{name}") for name in ("prefill", "decode")}
    assert all(engines.values()), engines
    old = service(cluster, "services.messenger", "node-1")
    assert old is not None
    os.kill(old.pid, signal.SIGKILL)
    killed = time.monotonic()
    new = eventually(lambda: service(cluster, "services.messenger", "node-1"),
                     lambda p: p is not None and p.pid != old.pid, "the launcher restarting node-1's messenger",
                     timeout_s=60)
    # Nobody restarted the engines, yet the new messenger's pool is carved: the decode
    # worker saw its ticks name no pool and said hello again.
    eventually(lambda: _stats(cluster), lambda s: s is not None and s.pool_slots > 0,
               "node-1's new pool carved by its engine", timeout_s=30)
    carved_s = time.monotonic() - killed
    # Transfers resume: node-0's messenger learns the new endpoint from a heartbeat.
    seeds = iter(range(100, 130))
    eventually(lambda: loaded_tokens(client, prompt(2 * BLOCK + 20, seed=next(seeds))), lambda n: n == 2 * BLOCK + 20,
               "decode loading prefill's KV through the restarted messenger", timeout_s=60)
    for name, proc in engines.items():
        assert service(cluster, f"services.{name}").pid == proc.pid, f"{name} was restarted"
    assert new.is_running()
    # The loads' pins went with their Release notes (or would with their leases).
    eventually(lambda: messenger(cluster, "node-1"), lambda s: s.blocks_received >= 2 and s.pinned == 0,
               "node-1's blocks received and unpinned")
    print(f"node-1's pool carved again {carved_s:.1f} s after the kill")


def _stats(cluster):
    try:
        return messenger(cluster, "node-1")
    except Exception:  # no answer while it is down
        return None
