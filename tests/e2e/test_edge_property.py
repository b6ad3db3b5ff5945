"""The API edge of the real cluster under a few hundred generated requests (every
field, odd headers, raw and gzip bodies, malformed HTTP; tests/gateway/edge_cases.py):
never a 5xx, every error an OpenAI-style JSON body, and a normal request still
succeeds afterwards. Generation stays short (max_tokens ≤ 4) so this stays fast."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.gateway.edge_cases import Case, cases, check, send

pytestmark = pytest.mark.e2e
EXAMPLES = 300
STATUSES: dict[int, int] = {}  # what the generated requests got: some must have been served


@pytest.fixture(scope="module")
def url(cluster) -> str:
    return cluster.url


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases(authorized=False))  # the session cluster runs without an API key
def test_no_generated_request_gets_a_5xx_or_a_non_json_error(url, case):
    reply = send(url, case)
    STATUSES[reply.status] = STATUSES.get(reply.status, 0) + 1
    check(case, reply)


def test_a_normal_request_succeeds_afterwards(url):
    assert not STATUSES or (STATUSES.get(200, 0) >= 10 and STATUSES.get(400, 0) >= 100), STATUSES
    body = {"model": "yuebing-tiny", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    raw = send(url, Case("/v1/completions", json.dumps({**body, "messages": None, "prompt": "x"}).encode(),
                         ((b"Content-Type", b"application/json"),)))
    assert raw.status == 200
