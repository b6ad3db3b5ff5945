"""The gateway with its real pipeline on a bus.Link, over a nats-server that a test
stops, restarts, and whose client it closes: every request is answered (a 503 while
NATS is away or the client is being remade, never a 500), and the gateway serves
again once NATS is back, without a restart."""

from __future__ import annotations

import contextlib
import time

import orjson
import pytest

from services.gateway.pipeline import Pipeline
from shared import bus
from shared.config import ClusterConfig
from shared.liveness import Registry
from shared.messages import SCHEDULE, ScheduleReply, ScheduleRequest, encode
from tests.gateway.served import MODEL, NatsServer, Served, read_reply, request_bytes, wait_until

pytestmark = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(), reason="no tiny model (make test writes it)")
BODY = orjson.dumps({"model": "yuebing-tiny", "prompt": "hi", "max_tokens": 2})


@pytest.fixture
def cluster():
    natsd = NatsServer().start()
    config = ClusterConfig(model=str(MODEL), max_model_len=512, nats_url=natsd.url, schedule_timeout_s=0.5)
    served = Served(config, pipeline=None)
    link = served.call(bus.Link(natsd.url, "gateway", retry_s=0.1).start())
    served.gateway.pipeline = Pipeline(link, config, Registry(timeout_s=config.liveness_timeout_s))
    yield natsd, served, link
    served.call(link.close())
    served.close()
    natsd.stop()


def ask(served: Served) -> tuple[int, dict, float]:
    s = served.connect()
    start = time.monotonic()
    s.sendall(request_bytes("/v1/completions", BODY))
    status, _, body = read_reply(s)
    s.close()
    return status, orjson.loads(body)["error"], time.monotonic() - start


def test_every_request_is_answered_through_an_outage_and_a_lost_client(cluster):
    natsd, served, link = cluster
    status, error, _ = ask(served)  # NATS up, no Conductor: nobody serves the subject
    assert status == 503 and error["message"].startswith("conductor unavailable")

    natsd.stop()
    wait_until(lambda: not link.is_connected, 10, "the client sees the outage")
    status, error, took = ask(served)  # buffered, then the Conductor's timeout
    assert status == 503 and took < 0.5 + 1.0

    served.call(_close(link.client))  # closed for good, with no server to make a new one on
    status, error, took = ask(served)
    assert status == 503 and error["code"] == "bus_unavailable" and took < 0.5

    natsd.start()
    wait_until(lambda: link.is_connected and link.replacements == 1, 15, "a new client")
    served.call(link.subscribe(SCHEDULE, cb=_busy_conductor))
    status, error, _ = ask(served)  # through NATS again: the (busy) Conductor's own answer
    assert status == 429 and error["code"] == "overloaded"
    assert served.metric('yuebing_gateway_nats_errors_total{error="ConnectionClosedError"}') == 1


async def _close(nc) -> None:
    with contextlib.suppress(ConnectionError):  # nats-py's close flushes to the dead socket, and says so
        await nc.close()


async def _busy_conductor(msg) -> None:
    ask = bus.decode(msg.data, ScheduleRequest)
    await msg.respond(encode(ScheduleReply(request_id=ask.request_id, accepted=False, rejection="overloaded",
                                           reason="busy", retry_after_s=1.0)))
