"""Two gateways and two Conductors side by side, on fake engines (no model: a fixed
token stream, `--fake-engine-step-ms`): each gateway serves, their streams are the
same byte for byte but for their ids, and a client that drops its stream on either
gateway stops its decode."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.e2e.ops import eventually, log_events

pytestmark = pytest.mark.e2e

MODEL = "yuebing-tiny"


@pytest.fixture(scope="module")
def fake(launcher, tmp_path_factory):
    started = launcher(tmp_path_factory.mktemp("gateways"), "--fake-engine-step-ms", "20", "--gateways", "2",
                       "--conductors", "2", "--decode", "2")
    yield started.wait()
    started.stop()


def body(max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": "to both gateways", "max_tokens": max_tokens, "stream": True}


def test_both_gateways_stream_the_same_events(fake):
    assert len(fake.urls) == 2
    raw = []
    for url in fake.urls:
        r = httpx.post(f"{url}/v1/completions", json=body(12), timeout=30)
        assert r.status_code == 200, r.text
        raw.append(r.text)
    streams = [re.sub(r'"id":"cmpl-[0-9a-f]+","object":"text_completion","created":\d+', "", text) for text in raw]
    assert streams[0] == streams[1] and streams[0].count("data: ") == 12 + 1  # each token, then [DONE]
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in raw[0].split("\n\n") if line.startswith("data: {")]
    assert "".join(texts) == "aabcdefghijk"  # the fake engine's stream: prefill's "a", then decode's from "a"


@pytest.mark.parametrize("gateway", [0, 1])
def test_a_stream_dropped_on_either_gateway_stops_its_decode(fake, gateway):
    url = fake.urls[gateway]
    with httpx.stream("POST", f"{url}/v1/completions", json=body(900), timeout=30) as r:
        assert r.status_code == 200
        own = r.headers["x-yuebing-request-id"]
        lines = r.iter_lines()
        for _ in range(5):  # a few tokens in: decode is under way
            next(lines)
    started = time.monotonic()

    def cancelled() -> list[dict]:
        return [e for d in ("decode-0", "decode-1") for e in log_events(fake, d, "decode cancelled")
                if e.get("request_id", "").startswith(own)]

    eventually(cancelled, bool, f"decode of {own} cancelled", 10)
    assert time.monotonic() - started < 10  # its 900 tokens, one per 20 ms step, would take 18 s
