"""The control plane loses no request to one server's death: on the shared
two-Conductor layout (two gateways, two Conductors, a NATS cluster of three:
tests/layouts.py), streams keep running while one NATS server is SIGKILLed and one
Conductor is stopped (SIGTERM, as a scale-down or a rolling restart stops it). Every
stream ends with all its tokens, equal to the reference engine's greedy output; the
stored Responses are kept on every NATS server (JetStream replicas), so the death of
one loses none."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import threading
import time

import httpx
import psutil
import pytest

from shared import bus
from shared.identity import RESPONSES_BUCKET, load_credentials
from tests.e2e.ops import eventually
from tests.e2e.test_migration import greedy_to_the_end

pytestmark = pytest.mark.e2e

MODEL = "yuebing-tiny"
MAX_TOKENS = 48
STREAMS = 3  # at once, each sending its next as soon as one ends


def prompt(seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(32, 127) for _ in range(150)]


def stream(cluster, seed: int) -> tuple[int, list[int], str]:
    """One streamed completion: (status, its token ids, an error event's text or "")."""
    body = {"model": MODEL, "prompt": prompt(seed), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    tokens: list[int] = []
    with httpx.stream("POST", f"{cluster.api}/completions", json=body, timeout=60) as r:
        if r.status_code != 200:
            return r.status_code, tokens, r.read().decode()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return 200, tokens, json.dumps(event["error"])
            tokens += event["choices"][0].get("token_ids") or []
    return 200, tokens, ""


class Load:
    """STREAMS clients streaming one completion after another until stopped."""

    def __init__(self, cluster) -> None:
        self.cluster, self.stop = cluster, threading.Event()
        self.done: list[tuple[int, int, list[int], str]] = []  # (seed, status, tokens, error)
        self.pool = concurrent.futures.ThreadPoolExecutor(STREAMS)
        self.futures = [self.pool.submit(self._client, 1000 * (i + 1)) for i in range(STREAMS)]

    def _client(self, seed: int) -> None:
        while not self.stop.is_set():
            self.done.append((seed, *stream(self.cluster, seed)))
            seed += 1

    def finish(self) -> list[tuple[int, int, list[int], str]]:
        self.stop.set()
        for f in self.futures:
            f.result(timeout=120)
        self.pool.shutdown()
        return self.done


def child(cluster, program: str, name: str) -> psutil.Process | None:
    """The launcher's live child running `program` as `name` (its --instance-id, or a
    NATS server's name): pids change as earlier tests' victims restart."""
    for p in psutil.Process(cluster.launcher.pid).children():
        try:
            argv, env = p.cmdline(), p.environ()
            if any(a.endswith(program) for a in argv[:3]) and (name in argv or env.get("NATS_SERVER_NAME") == name):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def bucket_replicas(cluster) -> int:
    """How many servers keep the stored Responses, asked as the gateways ask JetStream."""
    async def ask() -> int:
        nc = await bus.connect(cluster.nats_url, "tests", load_credentials(str(cluster.credentials("gateway"))))
        try:
            info = await nc.jetstream().stream_info(f"KV_{RESPONSES_BUCKET}")
            return info.config.num_replicas
        finally:
            await nc.close()

    return asyncio.run(ask())


def stored_response(cluster, text: str) -> str:
    body = {"model": MODEL, "input": text, "max_output_tokens": 8, "temperature": 0, "store": True}
    r = httpx.post(f"{cluster.api}/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["id"]


@pytest.mark.destructive
def test_streams_survive_a_nats_server_killed_and_a_conductor_stopped(two_conductors, reference):
    cluster = two_conductors

    def live(program: str, name: str) -> psutil.Process:  # up again, if an earlier test killed it
        return eventually(lambda: child(cluster, program, name), bool, f"{name} running", timeout_s=60)

    kept = stored_response(cluster, "kept on every server")
    assert bucket_replicas(cluster) == 3
    load = Load(cluster)
    try:
        eventually(lambda: len(load.done), lambda n: n >= STREAMS, "streams running", timeout_s=60)
        live("nats-server", "nats-1").kill()
        time.sleep(4)
        live("services.conductor", "conductor-1").terminate()
        time.sleep(4)
    finally:
        done = load.finish()
    failed = [(seed, status, len(tokens), error) for seed, status, tokens, error in done
              if status != 200 or error or len(tokens) != MAX_TOKENS]
    assert not failed and len(done) >= 2 * STREAMS, f"{len(done)} streams, failed: {failed}"
    for seed, _, tokens, _ in done[:2]:
        assert tokens == greedy_to_the_end(reference, prompt(seed), MAX_TOKENS)[0]
    r = httpx.get(f"{cluster.api}/responses/{kept}", timeout=30)
    assert r.status_code == 200, r.text
