"""Two gateways and two Conductors side by side (the shared two-Conductor layout,
tests/layouts.py): each gateway serves, their greedy streams are the same byte for
byte but for their ids, and a client that drops its stream on either gateway stops
its decode."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.e2e.ops import eventually, log_events

pytestmark = pytest.mark.e2e

MODEL = "yuebing-tiny"


def body(max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": "to both gateways", "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True}


def test_both_gateways_stream_the_same_events(two_conductors):
    assert len(two_conductors.urls) == 2
    raw = []
    for url in two_conductors.urls:  # no key: the anonymous tenant's requests
        r = httpx.post(f"{url}/v1/completions", json=body(12), timeout=60)
        assert r.status_code == 200, r.text
        raw.append(r.text)
    streams = [re.sub(r'"id":"cmpl-[0-9a-f]+","object":"text_completion","created":\d+', "", text) for text in raw]
    assert streams[0] == streams[1] and streams[0].count("data: ") >= 2 and streams[0].endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("gateway", [0, 1])
def test_a_stream_dropped_on_either_gateway_stops_its_decode(two_conductors, gateway):
    url = two_conductors.urls[gateway]
    with httpx.stream("POST", f"{url}/v1/completions", json=body(900), timeout=60) as r:
        assert r.status_code == 200
        own = r.headers["x-yuebing-request-id"]
        lines = r.iter_lines()
        for _ in range(5):  # a few tokens in: decode is under way
            next(lines)

    def ended() -> list[str]:
        return [e["event"] for event in ("decode cancelled", "decode done")
                for e in log_events(two_conductors, "decode-0", event) if e.get("request_id", "").startswith(own)]

    # Cancelled, not run to its 900th token.
    assert eventually(ended, bool, f"decode of {own} ended", 15) == ["decode cancelled"]
