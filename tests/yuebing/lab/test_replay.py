"""The live replay: prompts that share what the trace shares, and requests measured
as the simulator reports them (against a small local stand-in for the gateway)."""

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from yuebing.lab.replay import ReplayOptions, prompt_tokens, replay
from yuebing.lab.trace import TraceRequest

STEP_S = 0.01  # the stand-in's time per generated token
REJECT, FAIL = 13, 17  # output lengths the stand-in answers with a 429 and a 500
SLO_SEEN = web.AppKey("slo_seen", list)  # each request's x-yuebing-slo-ttft-ms


def test_equal_hash_ids_give_equal_token_blocks():
    a = prompt_tokens(TraceRequest(0, 300, 1, (7, 8, 9)), block_tokens=128)
    b = prompt_tokens(TraceRequest(0, 256, 1, (7, 8)), block_tokens=128)
    c = prompt_tokens(TraceRequest(0, 256, 1, (7, 5)), block_tokens=128)
    assert len(a) == 300 and len(b) == 256
    assert a[:256] == b  # shared prefix, token for token
    assert c[:128] == b[:128] and c[128:] != b[128:]
    assert all(32 <= t < 127 for t in a)


def test_the_salt_gives_fresh_prompts_with_the_same_sharing():
    r1, r2 = TraceRequest(0, 256, 1, (1, 2)), TraceRequest(0, 256, 1, (1, 3))
    assert prompt_tokens(r1, 128, salt=1) != prompt_tokens(r1, 128, salt=2)
    assert prompt_tokens(r1, 128, salt=2)[:128] == prompt_tokens(r2, 128, salt=2)[:128]


async def completions(request: web.Request) -> web.StreamResponse:
    """A gateway in miniature: one token every STEP_S, usage at the end (half the
    prompt cached); it notes the SLO header each request carries."""
    request.app[SLO_SEEN].append(request.headers.get("x-yuebing-slo-ttft-ms"))
    body = await request.json()
    if body["max_tokens"] in (REJECT, FAIL):
        return web.json_response({"error": "no"}, status=429 if body["max_tokens"] == REJECT else 500)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(body["max_tokens"]):
        await asyncio.sleep(STEP_S)
        await response.write(b"data: " + json.dumps({"choices": [{"text": "", "token_ids": [65]}]}).encode() + b"\n\n")
    usage = {"prompt_tokens_details": {"cached_tokens": len(body["prompt"]) // 2}}
    await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
    return response


@pytest.fixture
async def gateway():
    app = web.Application()
    app[SLO_SEEN] = []
    app.router.add_post("/v1/completions", completions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), app[SLO_SEEN]
    await server.close()


async def test_every_request_is_sent_at_its_time_and_measured(gateway):
    trace = [TraceRequest(0.0, 200, 5, (1,)), TraceRequest(100.0, 100, 3, (2,)), TraceRequest(50.0, 50, REJECT, (3,)),
             TraceRequest(0.0, 50, FAIL, (4,))]
    url, slo_headers = gateway
    outcomes, wall = await replay(url, trace, ReplayOptions(block_tokens=512, progress=False, slo_ttft_ms=900))
    assert slo_headers == ["900"] * 4
    first, second, rejected, failed = outcomes  # in trace order
    assert first.completed and second.completed and wall >= 0.1 + 3 * STEP_S
    assert len(first.token_times) == 5 and first.cached_tokens == 100
    assert second.sent_at - first.sent_at >= 0.099  # sent at its time (100 ms), not before
    # TTFT from the trace's arrival (at least the stand-in's step); TBT from the gaps.
    assert first.ttft_s >= STEP_S * 0.9 and second.ttft_s >= STEP_S * 0.9
    assert first.tbt_mean_s > 0 and first.tbt_tail_s >= first.tbt_mean_s
    assert first.end_s == pytest.approx(first.token_times[-1] - first.token_times[0] + first.ttft_s)
    assert rejected.rejected and not rejected.failed and not rejected.completed
    assert failed.failed and not failed.rejected and not failed.completed
