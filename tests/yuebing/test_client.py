"""The streaming client (yuebing/client.py) against a small local SSE server."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from yuebing import client

USAGE = {"prompt_tokens": 3, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}
REPORT = {"prefill_instance": "prefill-0", "decode_kv_loaded_tokens": 2}


def _sse(chunk: dict | str) -> bytes:
    return b"data: " + (chunk if isinstance(chunk, str) else json.dumps(chunk)).encode() + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["prompt"] == "busy":
        return web.json_response({"error": {"message": "overloaded"}}, status=429)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(_sse({"choices": [{"text": "a", "token_ids": [97]}]}))
    await response.write(_sse({"choices": [{"text": "", "token_ids": [1, 2]}]}))  # held-back text: still tokens
    if body["prompt"] == "fail":
        await response.write(_sse({"error": {"message": "decode died"}}))
        return response
    await response.write(_sse({"choices": [], "usage": USAGE, "yuebing": REPORT}))
    await response.write(_sse("[DONE]"))
    return response


async def chat(request: web.Request) -> web.StreamResponse:
    assert request.headers["Authorization"] == "Bearer k"
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for delta in ({"role": "assistant", "content": ""}, {"content": "hi"}, {"content": "!"}):
        await response.write(_sse({"choices": [{"index": 0, "delta": delta}]}))
    await response.write(_sse("[DONE]"))
    return response


@pytest.fixture
async def url():
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    await runner.cleanup()


async def test_a_stream_gives_token_times_usage_and_the_yuebing_report(url):
    async with client.session() as s:
        got = await client.stream(s, url, client.completion_body("m", "ok", 3))
    assert got.ok and got.status == 200 and got.tokens == 3 and got.text == "a"
    assert got.sent_at <= got.token_times[0] <= got.token_times[-1] and got.ttft_s >= 0
    assert got.usage == USAGE and got.cached_tokens == 2 and got.yuebing == REPORT
    assert got.check() is got


async def test_rejection_and_errors_come_back_instead_of_raising(url):
    async with client.session() as s:
        busy = await client.stream(s, url, client.completion_body("m", "busy", 3))
        failed = await client.stream(s, url, client.completion_body("m", "fail", 3))
        gone = await client.stream(s, "http://127.0.0.1:1", client.completion_body("m", "ok", 3))
    assert busy.rejected and not busy.ok and "overloaded" in busy.error
    assert failed.status == 200 and not failed.ok and failed.tokens == 3 and "decode died" in failed.error
    assert gone.status == 0 and gone.error and not gone.rejected
    with pytest.raises(RuntimeError, match="HTTP 429"):
        busy.check()


async def test_chat_bodies_go_to_chat_completions_and_count_a_token_per_delta(url):
    async with client.session(api_key="k") as s:
        got = await client.stream(s, url, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert got.ok and got.text == "hi!" and got.tokens == 2 and got.usage is None
