"""Cancellation and failure on the real cluster: a client that goes away frees the
instances; a decode process that dies ends the stream with an error, not a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import httpx
import nats
import openai
import pytest

from shared.messages import HEARTBEAT, Heartbeat, decode

pytestmark = pytest.mark.e2e

LONG = {"model": "yuebing-tiny", "messages": [{"role": "user", "content": "go on forever"}],
        "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}


def latest_heartbeat(nats_url: str, instance_id: str, seconds: float = 1.5) -> Heartbeat:
    async def listen() -> Heartbeat:
        nc = await nats.connect(nats_url)
        sub = await nc.subscribe(HEARTBEAT)
        found = None
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                msg = await sub.next_msg(timeout=max(0.01, end - time.monotonic()))
            except nats.errors.TimeoutError:
                break
            hb = decode(msg.data, Heartbeat)
            if hb.instance_id == instance_id:
                found = hb
        await nc.close()
        assert found is not None, f"no heartbeat from {instance_id}"
        return found

    return asyncio.run(listen())


def test_client_disconnect_cancels_the_request_on_the_instance(cluster):
    before = latest_heartbeat(cluster.nats_url, "decode-0")
    request_id = f"disconnect-{uuid.uuid4().hex[:8]}"
    with httpx.stream("POST", f"{cluster.api}/chat/completions", json=LONG, headers={"x-request-id": request_id}, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(10)]
        assert any(line.startswith("data: ") for line in got)
    # The connection is closed mid-stream; the decode instance must abort the request.
    deadline = time.monotonic() + 15
    while True:
        hb = latest_heartbeat(cluster.nats_url, "decode-0")
        if hb.aborted_total > before.aborted_total and hb.num_running == 0:
            break
        assert time.monotonic() < deadline, f"decode-0 still running the abandoned request: {hb}"
    assert "decode cancelled" in cluster.log("decode-0") and request_id in cluster.log("decode-0")


@pytest.mark.destructive
def test_killing_decode_mid_stream_ends_the_stream_with_an_error(cluster, client):
    stream = client.chat.completions.create(**{k: v for k, v in LONG.items() if k != "ignore_eos"},
                                            extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(5):
        next(chunks)
    os.kill(cluster.pids["decode-0"], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in chunks:
            assert time.monotonic() - killed < 30, "stream kept going after its decode instance died"
    assert time.monotonic() - killed < 15  # liveness timeout + margin, far below the 60 s deadline
    # The launcher says which child died and why.
    deadline = time.monotonic() + 10
    while "decode-0 (pid" not in cluster.launcher_log.read_text():
        assert time.monotonic() < deadline, "launcher did not report the dead decode instance"
        time.sleep(0.2)
    assert "killed by SIGKILL" in cluster.launcher_log.read_text()
    # With no decode instance left, the next request fails fast and cleanly.
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="yuebing-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert e.value.status_code == 503
    assert time.monotonic() - start < 10
