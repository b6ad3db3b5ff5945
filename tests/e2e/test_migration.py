"""Retry and migration on a live cluster with two prefill and two decode instances
(services/gateway/retry.py): a decode service SIGKILLed in the middle of a long
greedy stream hands the request to the other decode, and the client's stream goes
on with no token missing or repeated, equal to the reference engine's greedy
output; a prefill service stopped (SIGSTOP) before its first token has its
requests placed on the other prefill; a decode stopped on purpose (SIGTERM) hands its
stream on at the end of its drain, and it continues exactly."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import re
import signal
import time
from collections.abc import Callable

import httpx
import psutil
import pytest

from shared.messages import HEARTBEAT, Heartbeat
from tests.e2e.ops import admin, beating, collect, eventually, log_events

pytestmark = pytest.mark.e2e

MODEL = "yuebing-tiny"
PROMPT_TOKENS = 400  # three full 128-token blocks: the continuation loads them from the node pool
MAX_TOKENS = 500  # the prompt and all of it fit in the test clusters' 1024-token context
KILL_AFTER = 40  # tokens the client has when its decode service is killed


def heartbeats(cluster, seconds: float = 1.2,
               until: Callable[[Heartbeat], bool] | None = None) -> dict[str, Heartbeat]:
    """Every instance's latest heartbeat, heard for `seconds`, or until one that
    `until` accepts arrives."""
    async def listen() -> dict[str, Heartbeat]:
        nc = await admin(cluster)
        heard = await collect(await nc.subscribe(HEARTBEAT), Heartbeat, seconds, until)
        await nc.close()
        return {hb.instance_id: hb for hb in heard}

    return asyncio.run(listen())


def serving_decode(hb: Heartbeat) -> bool:
    return hb.role == "decode" and hb.num_running > 0


def retries(cluster, stage: str) -> float:
    page = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    found = re.search(rf'^yuebing_gateway_retries_total\{{stage="{stage}"\}} (\S+)$', page, re.MULTILINE)
    assert found, f"no retry counter for {stage} on the gateway's /metrics"
    return float(found.group(1))


def sse(lines) -> object:
    """The data payloads of an SSE stream, up to [DONE]."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line[len("data: "):])


def greedy_to_the_end(reference, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """The reference engine's greedy output past any EOS, as a stream with ignore_eos
    asks (Reference.greedy stops at EOS: the tiny model's comes early), and each
    token's log probability."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    [out] = reference.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    tokens = list(out.outputs[0].token_ids)
    return tokens, [position[t].logprob for t, position in zip(tokens, out.outputs[0].logprobs)]


def complete(cluster, prompt: list[int]) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    r = httpx.post(f"{cluster.api}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.destructive
def test_a_prefill_stopped_before_its_first_token_has_its_requests_placed_on_the_other(two_of_each, reference):
    cluster = two_of_each
    rnd = random.Random(61)
    prompts = [[rnd.randrange(32, 127) for _ in range(200)] for _ in range(4)]
    eventually(lambda: heartbeats(cluster), lambda seen: {"prefill-0", "prefill-1"} <= set(seen), "both prefills beating")
    before = retries(cluster, "prefill")
    stopped = psutil.Process(cluster.pids["prefill-0"])
    # Requests sent at once, while the cluster still counts prefill-0 alive: round
    # robin gives it half of them, and it never answers them.
    stopped.suspend()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            start = time.monotonic()
            results = list(pool.map(lambda p: complete(cluster, p), prompts))
        took = time.monotonic() - start
    finally:
        stopped.resume()
    assert results == reference.greedy(prompts, 8)
    assert retries(cluster, "prefill") >= before + 1
    assert took < 20  # a few heartbeats to notice, far from the 60 s deadline or the prefill timeout
    assert any(e.get("failed_instance") == "prefill-0" for e in log_events(cluster, "gateway", "retrying"))


@pytest.mark.destructive
def test_a_decode_killed_mid_stream_hands_the_stream_to_another_that_finishes_it_exactly(two_of_each, reference):
    cluster = two_of_each
    prompt = [random.Random(16).randrange(32, 127) for _ in range(PROMPT_TOKENS)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True, "logprobs": 1}
    before = retries(cluster, "migration")
    for instance in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        beating(cluster, instance)  # all up: the tests before this one stop and restart instances
    nodes = heartbeats(cluster, 1.5)  # each instance's node and pid now
    tokens: list[int] = []
    logprobs: list[float] = []
    with httpx.stream("POST", f"{cluster.api}/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        request_id = r.headers["x-yuebing-request-id"]
        events = sse(r.iter_lines())
        while len(tokens) < KILL_AFTER:
            choice = next(events)["choices"][0]
            tokens += choice["token_ids"]
            logprobs += choice["logprobs"]["token_logprobs"] if choice["logprobs"] else []
        # The Conductor's placement of this very request: a heartbeat showing a decode
        # busy may be another's (a request the earlier test's resumed prefill handed on).
        placed = eventually(lambda: [e for e in log_events(cluster, "conductor", "scheduled")
                                     if e.get("request_id") == request_id], bool, "the request's placement logged")
        serving = [placed[-1]["decode"]]
        assert serving[0] in {"decode-0", "decode-1"}, f"a decode instance serves the stream: {placed}"
        os.kill(nodes[serving[0]].pid, signal.SIGKILL)
        killed_at = len(tokens)
        usage = None
        for event in events:
            if event["choices"]:
                tokens += event["choices"][0]["token_ids"]
                logprobs += (event["choices"][0]["logprobs"] or {}).get("token_logprobs", [])
            else:
                usage = event
    assert killed_at < MAX_TOKENS - 100, "the stream was nearly over when its decode died: make it longer"
    # No token missing or repeated: the whole output is the plain engine's greedy one,
    # and so is each token's log probability, on either side of the hand-off.
    expected, expected_logprobs = greedy_to_the_end(reference, prompt, MAX_TOKENS)
    assert tokens == expected
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    (other,) = {"decode-0", "decode-1"} - set(serving)
    where = usage["yuebing"]
    assert (where["decode_instance"], where["migrations"], where["attempts"]) == (other, 1, 2)
    assert retries(cluster, "migration") == before + 1
    # Each attempt logged with the request's id; the continuation's decode loaded the
    # prompt's blocks from its node's pool and computed only the rest, where that pool
    # holds them: prefill's node and the first decode's do (a continuation on another
    # node computes them: a decode pulls nothing from other nodes' pools).
    assert [e["stage"] for e in log_events(cluster, "gateway", "retrying") if e.get("request_id") == request_id] == [
        "migration"]
    continued = eventually(lambda: [e for e in log_events(cluster, other, "decode kv")
                                    if e.get("request_id") == f"{request_id}-a2"], bool, "the continuation's decode")
    held = {nodes[placed[-1]["prefill"]].node, nodes[serving[0]].node}
    # Full blocks only: its prompt runs on through the tokens streamed before, which the
    # tail prefill saved does not hold.
    assert continued[0]["loaded_tokens"] == (PROMPT_TOKENS // 128 * 128 if nodes[other].node in held else 0)


def killed_mid_stream(cluster, url: str, body: dict, delta: Callable[[dict], str | None],
                      sig: signal.Signals = signal.SIGKILL) -> tuple[str, list[dict]]:
    """The stream of `body` at `url`, its decode sent `sig` after KILL_AFTER text deltas
    (`delta`: an event's text, or None): its joined text and every event."""
    for instance in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        beating(cluster, instance)  # all up: a test before this one killed a decode
    nodes = heartbeats(cluster, 1.5)
    texts, seen = [], []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        request_id = r.headers["x-yuebing-request-id"]
        events = sse(r.iter_lines())
        while len(texts) < KILL_AFTER:
            seen.append(next(events))
            texts += [t] if (t := delta(seen[-1])) is not None else []
        placed = eventually(lambda: [e for e in log_events(cluster, "conductor", "scheduled")
                                     if e.get("request_id") == request_id], bool, "the request's placement logged")
        os.kill(nodes[placed[-1]["decode"]].pid, sig)
        for event in events:
            seen.append(event)
            texts += [t] if (t := delta(event)) is not None else []
    return "".join(texts), seen


def long_prompt(seed: int) -> str:
    return "".join(chr(random.Random(seed).randrange(97, 123)) for _ in range(PROMPT_TOKENS))


@pytest.mark.destructive
def test_a_responses_stream_outlives_its_decode_stopping_equal_to_an_uninterrupted_run(two_of_each):
    """A scale-down or a rolling restart stops a decode with SIGTERM: it takes nothing
    new, gives its streams drain_timeout_s (0 s in this layout) and hands on what is
    still running, which another decode continues exactly. A Responses API stream runs
    the one pipeline: it moves as a chat stream does, its events in sequence.
    (Anthropic's Messages API is the same pipeline under another adapter; its stream
    events are compared with vLLM's in test_messages.py.)"""
    cluster = two_of_each
    body = {"model": MODEL, "max_output_tokens": 300, "temperature": 0, "input": long_prompt(19), "store": False}
    url = f"{cluster.api}/responses"
    whole = httpx.post(url, json=body, timeout=120).json()
    assert whole["usage"]["output_tokens"] >= 200, whole
    before = retries(cluster, "migration")
    earlier = len(drains(cluster))
    text, seen = killed_mid_stream(cluster, url, body,
                                   lambda e: e["delta"] if e["type"] == "response.output_text.delta" else None,
                                   sig=signal.SIGTERM)
    assert text == whole["output"][0]["content"][0]["text"]
    assert seen[-1]["type"] == "response.completed" and seen[-1]["response"]["status"] == whole["status"] == "incomplete"
    assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
    assert retries(cluster, "migration") == before + 1
    drained = eventually(lambda: drains(cluster), lambda d: len(d) > earlier, "the stopped decode's drain logged")
    assert [e["handed_on"] for e in drained[earlier:]] == [1]  # the stream, handed on at the drain's end


def drains(cluster) -> list[dict]:
    return [e for d in ("decode-0", "decode-1") for e in log_events(cluster, d, "decode drained")]
