"""bus.Link over a real nats-server: a client closed for good (by us, or by the
server's protocol error) is replaced and its subscriptions made again; an outage
fails publishes fast once the bounded buffer is full, and the client reconnects
when the server is back. Every wait has a deadline."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest

from shared import bus
from tests.gateway.served import NatsServer


@pytest.fixture
def natsd():
    server = NatsServer().start()
    yield server
    server.stop()


class Echo:
    """A link whose every client answers on 'echo', counting the clients and events."""

    def __init__(self, url: str) -> None:
        self.clients = 0
        self.events: list[str] = []
        self.link = bus.Link(url, "test", on_connect=self.on_connect, on_event=self.events.append, retry_s=0.1)

    async def on_connect(self, nc) -> None:
        self.clients += 1

        async def answer(msg) -> None:
            await msg.respond(b"pong:" + msg.data)

        await nc.subscribe("echo", cb=answer)

    async def ask(self) -> bytes:
        return (await self.link.request("echo", b"x", timeout=2)).data


async def until(predicate, timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.fixture
async def echo(natsd):
    e = Echo(natsd.url)
    await e.link.start()
    yield e
    await e.link.close()


async def test_a_client_closed_for_good_is_replaced_with_its_subscriptions(echo):
    assert await echo.ask() == b"pong:x"
    first = echo.link.client
    await first.close()  # as a server's protocol error would: no reconnect from here
    with pytest.raises(nats.errors.ConnectionClosedError):
        await echo.link.publish("anything", b"")  # until the new client is up: at once, no wait
    await until(lambda: echo.link.replacements == 1 and echo.link.is_connected)
    assert echo.link.client is not first and echo.clients == 2
    assert await echo.ask() == b"pong:x"
    assert "closed" in echo.events and "replaced" in echo.events


async def test_a_servers_protocol_error_closes_the_client_and_the_link_recovers(echo):
    # A control line over the server's 4 KiB limit: nats-server answers -ERR and drops
    # the client, which nats-py then closes for good (the 4,100-character header).
    first = echo.link.client
    await echo.link.publish("s." + "x" * 4100, b"")
    await until(lambda: echo.link.replacements == 1 and echo.link.is_connected)
    assert first.is_closed and await echo.ask() == b"pong:x"


async def test_an_outage_fails_fast_once_the_buffer_is_full_and_the_client_reconnects(natsd, echo):
    natsd.stop()
    await until(lambda: not echo.link.is_connected)
    chunk = b"x" * (256 << 10)
    with pytest.raises(nats.errors.OutboundBufferLimitError):
        async with asyncio.timeout(5):  # bounded: never a wait on a server that is not there
            for _ in range(bus.PENDING_BYTES // len(chunk) + 2):
                await echo.link.publish("nowhere", chunk)
    natsd.start()
    await until(lambda: echo.link.is_connected and "reconnected" in echo.events, 15)  # and says so
    assert "disconnected" in echo.events
    assert await echo.ask() == b"pong:x"
    assert echo.link.replacements == 0  # reconnected, not remade


async def test_a_client_closed_during_an_outage_is_remade_when_the_server_returns(natsd, echo):
    natsd.stop()
    await echo.link.client.close()
    with pytest.raises(bus.BusError):
        await echo.link.request("echo", b"x", timeout=1)
    natsd.start()
    await until(lambda: echo.link.replacements == 1 and echo.link.is_connected, 15)
    assert await echo.ask() == b"pong:x"
