"""Moving block layers between messengers. `Transport` is the interface the messenger
uses; `ZmqTransport` implements it over ZeroMQ TCP. An RDMA transport would
implement the same three calls.

Sends never block the messenger's event loop: a peer that is gone or too slow
makes `send` return False (the block is then computed by its reader), and the
payload goes out as a zero-copy frame straight from the pool's shared memory.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import zmq
import zmq.asyncio

# Messages queued per peer before sends fail: a few prompts' worth of layers.
SEND_HWM = 20_000


class Transport(Protocol):
    endpoint: str  # where peers reach this messenger

    def connect(self, endpoint: str) -> None:
        """Open the path to a peer early, so its first transfer does not pay for it."""

    def send(self, endpoint: str, header: bytes, payload: memoryview | bytes) -> bool:
        """Queue one (header, payload) message for a peer; False if it cannot be queued."""

    async def receive(self) -> tuple[bytes, memoryview]:
        """The next (header, payload) message from any peer."""

    def close(self) -> None: ...


def keep_receive_buffers() -> None:
    """ZeroMQ mallocs a buffer per received message. glibc serves big ones with a
    fresh mmap and unmaps it on free, so every multi-MiB layer paid a page fault
    per 4 KiB; keeping them on the heap lets the memory be reused warm."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc caps it at 32 MiB
    libc.mallopt(m_trim_threshold, 256 << 20)


class ZmqTransport:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str = "") -> None:
        keep_receive_buffers()
        self._ctx = zmq.asyncio.Context()
        self._send_ctx = zmq.Context()  # plain sockets: NOBLOCK sends, no futures
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, SEND_HWM)
        self._pull.setsockopt(zmq.RCVBUF, 8 << 20)
        if port:
            self._pull.bind(f"tcp://{host}:{port}")
        else:
            port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{advertise_host or host}:{port}"
        self._peers: dict[str, zmq.Socket] = {}

    def connect(self, endpoint: str) -> None:
        if endpoint not in self._peers:
            sock = self._send_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.SNDBUF, 8 << 20)
            sock.connect(endpoint)
            self._peers[endpoint] = sock

    def send(self, endpoint: str, header: bytes, payload: memoryview | bytes) -> bool:
        self.connect(endpoint)
        try:
            self._peers[endpoint].send_multipart([header, payload], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    async def receive(self) -> tuple[bytes, memoryview]:
        header, payload = await self._pull.recv_multipart(copy=False)
        return header.bytes, payload.buffer

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close(0)
        self._pull.close(0)
        self._send_ctx.term()
        self._ctx.term()
