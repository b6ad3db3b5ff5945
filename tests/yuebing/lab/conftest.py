"""A stand-in for the gateway, for the lab's tests of its live side (replay,
calibration): streams `max_tokens` token ids after a prefill time proportional to
the prompt, one every `step_s`, then usage with half the prompt cached."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer


@dataclass
class StandIn:
    url: str = ""
    prefill_s_per_token: float = 0.0
    step_s: float = 0.01  # per generated token
    reject_tokens: int = 13  # a request for this many tokens gets a 429
    fail_tokens: int = 17  # ... and this many a 500
    slo_ttft_seen: list[str | None] = field(default_factory=list)  # each request's x-yuebing-slo-ttft-ms


STAND_IN = web.AppKey("stand_in", StandIn)


def _sse(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def _completions(request: web.Request) -> web.StreamResponse:
    stand_in = request.app[STAND_IN]
    stand_in.slo_ttft_seen.append(request.headers.get("x-yuebing-slo-ttft-ms"))
    body = await request.json()
    if body["max_tokens"] in (stand_in.reject_tokens, stand_in.fail_tokens):
        return web.json_response({"error": "no"}, status=429 if body["max_tokens"] == stand_in.reject_tokens else 500)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await asyncio.sleep(stand_in.prefill_s_per_token * len(body["prompt"]))
    for i in range(body["max_tokens"]):
        if i:
            await asyncio.sleep(stand_in.step_s)
        await response.write(_sse({"choices": [{"text": "", "token_ids": [65]}]}))
    await response.write(_sse({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": len(body["prompt"]) // 2}}}))
    await response.write(b"data: [DONE]\n\n")
    return response


@pytest.fixture
async def gateway():
    stand_in = StandIn()
    app = web.Application()
    app[STAND_IN] = stand_in
    app.router.add_post("/v1/completions", _completions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    stand_in.url = str(server.make_url("")).rstrip("/")
    yield stand_in
    await server.close()
