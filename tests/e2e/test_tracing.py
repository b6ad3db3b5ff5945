"""One OpenTelemetry trace per request: a cluster with `--otlp-endpoint` sends its
spans to an OTLP/HTTP receiver this test runs, and one disaggregated request yields
one trace with spans from the gateway, the Conductor, prefill, the messengers
(the push of the prompt's KV to decode's node) and decode, each parented inside it
and in time order. A request whose decode instance dies mid-stream stays one trace:
its continuation on the prefill instance (the shared cluster's only other engine)
is in it."""

from __future__ import annotations

import os
import random
import signal
import time

import httpx
import pytest

from tests.e2e.ops import beating, eventually, log_events
from yuebing.lab.otlp import Receiver, Span

pytestmark = pytest.mark.e2e

DEADLINE_S = 30.0  # each process's exporter sends every 5 s


@pytest.fixture(scope="module")
def traced(cluster, otlp):
    """The shared cluster sends its spans to the suite's OTLP receiver (tests/e2e/conftest.py)."""
    return cluster, otlp


SERVICES = {"yuebing-gateway", "yuebing-conductor", "yuebing-prefill", "yuebing-messenger", "yuebing-decode"}


def trace_of(receiver: Receiver, request_id: str, services: set[str] = SERVICES) -> list[Span]:
    """The spans of the trace whose gateway span carries `request_id`, once every
    service's are in, each with its parent: the prefill node's messenger's push, the decode span with its
    wait for KV, and vLLM's span of each engine's share (a decode instance killed
    mid-stream takes its own to its grave)."""
    deadline, spans = time.monotonic() + DEADLINE_S, []
    while time.monotonic() < deadline:
        every = receiver.snapshot()
        roots = [s for s in every if s.name == "gateway.request" and s.attributes.get("yuebing.request_id") == request_id]
        spans = [s for s in every if roots and s.trace_id == roots[0].trace_id]
        names, ids = [s.name for s in spans], {s.span_id for s in spans}
        # Every span's parent in too (a parent is exported when it ends, after its
        # children), where both are `services`' (a killed decode may have exported a
        # child of a span that died with it).
        parented = all(s.parent_id in ids for s in spans if s not in roots and s.service in services)
        if services <= {s.service for s in spans} and {"decode", "decode.kv_wait", "messenger.push"} <= set(names) \
                and names.count("llm_request") >= 2 and parented:
            return spans
        time.sleep(0.5)
    raise AssertionError(f"no whole trace for {request_id}: {spans}")


def test_a_disaggregated_request_is_one_trace_across_the_services_parented_in_time_order(traced):
    cluster, receiver = traced
    reply = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=60, json={
        "model": "yuebing-tiny", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me about mooncakes. " * 30}]})
    assert reply.status_code == 200
    spans = trace_of(receiver, reply.headers["x-yuebing-request-id"])
    by_name = {s.name: s for s in spans}
    root = by_name["gateway.request"]
    ids = {s.span_id for s in spans}
    assert root.parent_id == "" and all(s.parent_id in ids for s in spans if s is not root)
    decide, prefill, decode = by_name["conductor.decide"], by_name["prefill"], by_name["decode"]
    assert decide.parent_id == by_name["gateway.schedule"].span_id
    assert prefill.parent_id == by_name["gateway.prefill"].span_id
    assert decode.parent_id == by_name["gateway.decode_start"].span_id
    assert root.start_ns <= decide.start_ns <= prefill.start_ns <= decode.start_ns <= root.end_ns
    assert decide.attributes["yuebing.accepted"] is True and decide.attributes["yuebing.decode"] == "decode-0"
    wait = by_name["decode.kv_wait"]  # the decode's wait for the prompt's KV, inside its span
    assert wait.parent_id == decode.span_id and decode.start_ns <= wait.start_ns <= wait.end_ns <= decode.end_ns
    # The prompt's KV, layer by layer from prefill's node to decode's, inside prefill.
    push = by_name["messenger.push"]
    assert push.service == "yuebing-messenger" and push.parent_id == prefill.span_id
    assert push.attributes["to_node"] != push.attributes["node"] and prefill.start_ns <= push.start_ns <= decode.end_ns
    # vLLM's own span of each engine's share, inside ours, with its times.
    vllm = {s.service: s for s in spans if s.name == "llm_request"}
    assert vllm.keys() == {"yuebing-prefill", "yuebing-decode"}
    assert vllm["yuebing-prefill"].parent_id == prefill.span_id
    assert vllm["yuebing-decode"].parent_id == decode.span_id
    assert vllm["yuebing-decode"].attributes["gen_ai.latency.e2e"] > 0


@pytest.mark.destructive
def test_a_request_migrated_after_its_decode_died_stays_one_trace(traced):
    cluster, receiver = traced
    pid = beating(cluster, "decode-0")  # its pid now, up again after the destructive tests before this one
    prompt = [random.Random(34).randrange(32, 127) for _ in range(300)]
    body = {"model": "yuebing-tiny", "prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        request_id = r.headers["x-yuebing-request-id"]
        lines = r.iter_lines()
        chunks = 0
        while chunks < 20:  # the stream is under way on its first decode instance
            chunks += next(lines).startswith("data: {")
        placed = eventually(lambda: [e["decode"] for e in log_events(cluster, "conductor", "scheduled")
                                     if e.get("request_id") == request_id], bool, "the request's placement logged")
        killed = placed[-1]
        assert killed == "decode-0", placed
        os.kill(pid, signal.SIGKILL)
        assert [line for line in lines if line][-1] == "data: [DONE]"  # finished on the prefill instance
    # The killed decode's spans died with it; the continuation's are the prefill service's.
    spans = trace_of(receiver, request_id, SERVICES - {"yuebing-decode"})
    ids = {s.span_id for s in spans}
    root = next(s for s in spans if s.name == "gateway.request")
    survivors = [s for s in spans if s.service != "yuebing-decode"]
    assert all(s.parent_id in ids for s in survivors if s is not root)
    starts = sorted(s.attributes["instance"] for s in spans if s.name == "gateway.decode_start")
    other = "prefill-0"  # the only engine left decodes what it prefills
    assert starts == sorted([killed, other])  # both attempts, in the one trace
    decodes = [s for s in spans if s.name == "decode"]
    assert [s.attributes["instance"] for s in decodes] == [other]  # the dead one's spans died with it
    assert root.start_ns <= decodes[0].start_ns <= decodes[0].end_ns <= root.end_ns

