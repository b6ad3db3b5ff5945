"""The gateway's app on a real port with its loop on a thread of its own, for tests
that talk to it over raw sockets (slow clients, clients that stop reading) and
measure it from outside; and a real nats-server that a test may stop and restart."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from aiohttp import web

from services.gateway.access import Access
from services.gateway import server
from services.gateway.app import Gateway
from services.gateway.text import Tokenizer
from shared.config import ClusterConfig
from shared.liveness import Registry
from shared.messages import TokenChunk

MODEL = Path(__file__).resolve().parents[2] / "models" / "yuebing-tiny"
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll `predicate` until it is truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.01)
    return value


class EndlessPipeline:
    """Streams tokens until it is closed (a client that never stops reading gets
    them forever), or waits on `gate` first; records what happened on the loop."""

    def __init__(self) -> None:
        self.registry = Registry(timeout_s=5.0)
        self.nc = SimpleNamespace(is_connected=True)
        self.started = threading.Event()
        self.closed = threading.Event()
        self.gate: asyncio.Event | None = None  # set by a test: each run waits for it before its tokens
        self.running = 0
        self.fail: BaseException | None = None  # raised by run() instead of any token
        self.endless = False  # past max_tokens: until the gateway closes it
        self.owners: list = []  # whose each run was (services/gateway/pipeline.py Owner)

    async def run(self, request_id, prompt, sampling, deadline, slo, report, owner=None, sink=None):
        self.owners.append(owner)
        self.running += 1
        self.started.set()
        try:
            if self.fail is not None:
                raise self.fail
            if self.gate is not None:
                await self.gate.wait()
            for seq in range(1 << 40):
                last = not self.endless and seq == sampling.max_tokens - 1
                yield TokenChunk(request_id=request_id, seq=seq, token_ids=[97 + seq % 26],
                                 finish_reason="length" if last else None)
                if last:
                    return
                if seq % 64 == 63:
                    await asyncio.sleep(0)  # as real chunks arrive: the loop runs between them
        finally:
            self.running -= 1
            self.closed.set()


class Served:
    """Gateway(config, tiny tokenizer, pipeline) behind the hardened runner on
    127.0.0.1; its event loop runs on a thread."""

    def __init__(self, config: ClusterConfig, pipeline: Any, tokenizer: Tokenizer | None = None) -> None:
        self.pipeline = pipeline
        self.gateway = Gateway(config, tokenizer or Tokenizer(str(MODEL)), pipeline, Access.single(KEY))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.port = self.call(self._start())

    def call(self, coro: Any, timeout_s: float = 30) -> Any:
        """Run a coroutine on the server's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> tuple[web.AppRunner, int]:
        runner = server.GatewayRunner(self.gateway.app(), server.Guard(self.gateway.limits, self.gateway.metrics))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    def connect(self, rcvbuf: int = 0) -> socket.socket:
        s = socket.socket()
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(30)
        s.connect(("127.0.0.1", self.port))
        return s

    def metric(self, name: str) -> float:
        """A sample's value on /metrics (0 when absent), e.g. 'yuebing_gateway_shed_total{reason="queue_full"}'."""
        for line in self.gateway.metrics.render().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def close(self) -> None:
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.gateway.executor.shutdown(wait=False)


def request_bytes(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: gateway", f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in {**AUTH, **(headers or {})}.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def read_reply(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole HTTP response (Content-Length bodies only) from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = s.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(lines[0].split(" ")[1]), headers, body


def closed_within(s: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Read until the server closes the connection; what it sent and how long it took."""
    s.settimeout(timeout_s)
    start, data = time.monotonic(), b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - start


class NatsServer:
    """A nats-server on a fixed port, to stop and start again (the client's reconnect)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> NatsServer:
        binary = Path(sys.executable).with_name("nats-server")
        self.proc = subprocess.Popen([str(binary), "-a", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._listening, 10, "nats-server listening")
        return self

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None
