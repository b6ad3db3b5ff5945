"""Ports drawn for servers that have not bound them yet, booked so that no draw on
this machine hands out the same port twice.

A port checked free is only free *now*: a launcher draws a dozen ports before its
children bind them, and pytest draws more for servers of its own meanwhile. Every
draw (`yuebing.process.free_ports`) books its ports here, in one file per user that
every yuebing process shares under a lock, and no draw takes a port booked by a live
process in the last `LEASE_S` seconds. By then the server bound it, or never will.

- `Lease`, `live(leases, now, alive)`, `pick(candidates, count, booked, taken)`: pure.
- `PortBook(path)`: the file; `book(count, candidates, taken)` draws and books.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

LEASE_S = 600.0  # longer than any child takes to bind its port (an engine's start on a slow host)


@dataclass(frozen=True)
class Lease:
    pid: int  # the process that drew the port
    until: float  # wall-clock time the booking lapses


def live(leases: dict[int, Lease], now: float, alive: Callable[[int], bool]) -> dict[int, Lease]:
    """The bookings still in force: not lapsed, and their drawer still running."""
    return {port: lease for port, lease in leases.items() if lease.until > now and alive(lease.pid)}


def pick(candidates: Iterable[int], count: int, booked: set[int], taken: Callable[[int], bool]) -> int | None:
    """The first candidate base whose `count` ports are neither booked nor taken."""
    for base in candidates:
        ports = range(base, base + count)
        if not any(p in booked for p in ports) and not any(taken(p) for p in ports):
            return base
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class PortBook:
    """The bookings file, read and rewritten whole under an exclusive lock."""

    def __init__(self, path: Path | None = None):
        self.path = path or Path(tempfile.gettempdir()) / f"yuebing-ports-{os.getuid()}.json"

    def book(self, count: int, candidates: Iterable[int], taken: Callable[[int], bool]) -> int | None:
        """Draw the first free run of `count` ports among `candidates` and book it for
        this process; None when none is free."""
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            now = time.time()
            leases = live(_read(fd), now, pid_alive)
            base = pick(candidates, count, set(leases), taken)
            if base is not None:
                leases.update({p: Lease(os.getpid(), now + LEASE_S) for p in range(base, base + count)})
                _write(fd, leases)
            return base
        finally:
            os.close(fd)  # closing releases the lock

    def _open(self) -> int:
        # Never through a link, and only a file of our own: the folder is shared.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        if os.fstat(fd).st_uid != os.getuid():
            os.close(fd)
            raise PermissionError(f"{self.path} belongs to another user")
        return fd


def _read(fd: int) -> dict[int, Lease]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    try:
        entries = json.loads(raw or b"{}")
        return {int(port): Lease(int(pid), float(until)) for port, (pid, until) in entries.items()}
    except (ValueError, TypeError):  # a torn or foreign file: start the book afresh
        return {}


def _write(fd: int, leases: dict[int, Lease]) -> None:
    data = json.dumps({str(p): [lease.pid, lease.until] for p, lease in leases.items()}).encode()
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    os.write(fd, data)
