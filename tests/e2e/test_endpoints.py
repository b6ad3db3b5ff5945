"""The server's own endpoints beside the API, against `vllm serve` on the same model:
`/version` names the same vLLM, `/ping` answers GET and POST as `/health` does, and
neither asks for a key (vLLM guards only /v1)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def roots(cluster, vllm_serve):
    return [url.removesuffix("/v1") for url in (cluster.api, vllm_serve)]


def test_version_names_the_same_vllm(roots):
    ours, theirs = (httpx.get(f"{root}/version", timeout=10) for root in roots)
    assert ours.status_code == theirs.status_code == 200
    assert ours.json()["version"] == theirs.json()["version"]
    assert ours.json()["yuebing"]


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_is_a_health_check_as_in_vllm(roots, method):
    ours, theirs = (httpx.request(method, f"{root}/ping", timeout=10) for root in roots)
    assert ours.status_code == theirs.status_code == 200
    assert ours.json()["status"] == "ok"


@pytest.mark.parametrize("priority", [-3, 0, 5])
def test_a_priority_is_taken_as_vllm_takes_it(roots, model_dir, priority):
    """vLLM's `priority` (lower first in the queues: the gateway's and each engine's,
    which run vLLM's priority scheduling): the answer is vLLM's answer."""
    body = {"model": model_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "priority": priority}
    ours, theirs = (httpx.post(f"{root}/v1/chat/completions", json=body, timeout=60) for root in roots)
    assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
    said = [r.json()["choices"][0]["message"] for r in (ours, theirs)]
    assert [(m["role"], m["content"]) for m in said] == [(said[1]["role"], said[1]["content"])] * 2
