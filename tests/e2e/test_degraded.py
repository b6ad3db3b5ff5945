"""A cluster that loses every instance of one role degrades instead of refusing
(services/conductor/modes.py `fallback`), on the shared cluster's one prefill and one
decode instance:

- its decode service SIGKILLed in the middle of a greedy stream: the stream goes on
  on the prefill instance, which prefills and decodes, equal to the reference
  engine's output; the launcher says which child died and how, its engine processes
  go with it; while the decode restarts, new requests are served there, none refused;
- the same with the decode's vLLM engine-core killed: the service then exits, the
  launcher says so and starts it again;
- its prefill service SIGKILLed: the decode instance prefills locally."""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import time

import httpx
import psutil
import pytest

from tests.e2e.ops import beating, eventually
from tests.e2e.test_migration import greedy_to_the_end, heartbeats, serving_decode, sse

pytestmark = pytest.mark.e2e

MODEL = "yuebing-tiny"
PROMPT_TOKENS = 300
MAX_TOKENS = 400
KILL_AFTER = 30
RESTART_S = 120  # a killed service is back within this (its supervisor's backoff and the engine's load)


@pytest.fixture(scope="module")
def one_of_each(cluster):
    """The shared cluster (one prefill and one decode instance): these tests kill its
    processes, so they run after its other tests. Each stream's decode is checked
    before the kill (an idle cluster places a lone stream disaggregated; adaptive
    admission would run it whole on the prefill engine only to save it from a refusal)."""
    return cluster


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(32, 127) for _ in range(n)]


def complete(cluster, tokens: list[int]) -> httpx.Response:
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    return httpx.post(f"{cluster.api}/completions", json=body, timeout=60)


def stream_through(cluster, reference, seed: int, kill) -> tuple[dict, float]:
    """A long greedy stream whose decode is killed (`kill(pid)`) after KILL_AFTER
    tokens; checked against the reference. Its usage chunk, and when the kill was."""
    tokens_in = prompt(seed)
    body = {"model": MODEL, "prompt": tokens_in, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    tokens: list[int] = []
    usage = None
    with httpx.stream("POST", f"{cluster.api}/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = sse(r.iter_lines())
        while len(tokens) < KILL_AFTER:
            tokens += next(events)["choices"][0]["token_ids"]
        serving = heartbeats(cluster, 5.0, until=serving_decode)
        assert serving_decode(serving["decode-0"]), "decode-0 serves the stream"
        kill(serving["decode-0"].pid)
        killed_at = time.monotonic()
        for event in events:
            if event["choices"]:
                tokens += event["choices"][0]["token_ids"]
            else:
                usage = event
    assert tokens == greedy_to_the_end(reference, tokens_in, MAX_TOKENS)[0]
    return usage, killed_at


def served_while_down(cluster, reference, instance_id: str, seed: int) -> list[dict]:
    """Requests sent until `instance_id` beats again: every one is served (greedy
    output equal to the reference's), none refused. Their `yuebing` fields."""
    seen, rnd = [], random.Random(seed)
    deadline = time.monotonic() + RESTART_S
    while time.monotonic() < deadline:
        tokens = prompt(rnd.randrange(1 << 30), 150)
        r = complete(cluster, tokens)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == reference.greedy([tokens], 8)[0]
        seen.append(r.json()["yuebing"])
        health = httpx.get(f"{cluster.url}/health", timeout=10)
        if instance_id not in {iid for ids in health.json()["instances"].values() for iid in ids}:
            assert health.status_code == 200, health.text  # the other role serves alone: the gateway is ready
        if instance_id in heartbeats(cluster, 0.6):
            break
    return seen


def engine_processes(service_pid: int) -> list[psutil.Process]:
    engines = [p for p in psutil.Process(service_pid).children(recursive=True)
               if "EngineCore" in p.name() + " ".join(p.cmdline())]
    assert engines, "the decode service runs its vLLM engine in processes of its own"
    return engines


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def reported(cluster, text: str) -> str:
    """The launcher's log once it says `text` (which child died, and why)."""
    return eventually(cluster.launcher_log.read_text, lambda log: text in log, f"the launcher reporting {text!r}",
                      timeout_s=10)


@pytest.mark.destructive
def test_a_killed_decode_service_hands_its_stream_and_new_requests_to_the_prefill_instance(one_of_each, reference):
    cluster = one_of_each
    beating(cluster, "decode-0", RESTART_S)
    engines: list[psutil.Process] = []

    def kill_service(pid: int) -> None:
        engines.extend(psutil.Process(pid).children(recursive=True))
        os.kill(pid, signal.SIGKILL)

    usage, _ = stream_through(cluster, reference, 16, kill_service)
    where = usage["yuebing"]
    assert (where["decode_instance"], where["migrations"]) == ("prefill-0", 1)
    assert "killed by SIGKILL" in reported(cluster, "decode-0 (pid")
    # Its engine goes with it: left running, it would hold its KV cache (a GPU's
    # memory) beside the instance the launcher starts in its place.
    assert engines
    eventually(lambda: [p.pid for p in engines if alive(p)], lambda left: not left,
               "the killed decode service's engine processes gone", timeout_s=10)
    during = served_while_down(cluster, reference, "decode-0", 3)
    assert any(y["decode_instance"] == "prefill-0" and y["serving_mode"]["reason"] == "no_decode_live" for y in during)
    beating(cluster, "decode-0", RESTART_S)
    back = complete(cluster, prompt(99, 150)).json()["yuebing"]
    eventually(lambda: complete(cluster, prompt(98, 150)).json()["yuebing"]["decode_instance"],
               lambda d: d == "decode-0", "disaggregated again once decode-0 is back", 30)
    assert back["prefill_instance"] == "prefill-0"


@pytest.mark.destructive
def test_a_killed_decode_engine_core_degrades_the_same_way(one_of_each, reference):
    cluster = one_of_each
    beating(cluster, "decode-0", RESTART_S)

    services: list[psutil.Process] = []

    def kill_engine(pid: int) -> None:
        services.append(psutil.Process(pid))
        (engine,) = engine_processes(pid)
        engine.kill()

    usage, killed_at = stream_through(cluster, reference, 17, kill_engine)
    assert usage["yuebing"]["decode_instance"] == "prefill-0"
    # The service's loop outlives its engine: it must notice, stop beating, and exit,
    # rather than keep announcing an instance that fails everything it is sent.
    eventually(lambda: alive(services[0]), lambda up: not up, "the decode service exiting after its engine died",
               timeout_s=15)
    assert time.monotonic() - killed_at < 15
    reported(cluster, "exited with code 3")
    served_while_down(cluster, reference, "decode-0", 4)
    beating(cluster, "decode-0", RESTART_S)  # started again, with a new engine


@pytest.mark.destructive
def test_a_killed_prefill_service_leaves_the_decode_instance_prefilling(one_of_each, reference):
    cluster = one_of_each
    pid = beating(cluster, "prefill-0", RESTART_S)
    beating(cluster, "decode-0", RESTART_S)
    os.kill(pid, signal.SIGKILL)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        during = pool.submit(served_while_down, cluster, reference, "prefill-0", 5).result()
    local = [y for y in during if y["serving_mode"] and y["serving_mode"]["reason"] == "no_prefill_live"]
    assert local and all(y["decode_instance"] == "decode-0" and not y["prefill_instance"] for y in local)
