"""The one way yuebing starts and stops child processes (the launcher's services,
the benchmarks' servers, nats-server and messengers).

- `spawn(argv, log, env=None)`: a child in its own process group (so a signal to
  the group reaches whatever it starts in turn, e.g. vLLM's engine-core process),
  writing stdout and stderr to `log` (appended; None: discarded), and sent SIGTERM
  if this process dies first (Linux), so nothing outlives its parent.
- `stop(procs, grace_s, sig=SIGTERM)`: signal every group, wait up to the grace for
  all of them together, then SIGKILL each group (whatever is left in it); returns
  those that had not exited in time.
- `describe_exit(code)`, `tail(log, lines)`: for reporting a child that died.
- `wait_until(check, proc, timeout_s, what)`: poll `check()` until it returns
  something, failing as soon as `proc` exits.
- `free_port()`, `free_ports(count)`: ports no other draw on this machine holds
  (yuebing/ports.py); `wait_for_port(port, timeout_s)`.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from shared.lifetime import die_with_parent
from yuebing.ports import PortBook, pick

T = TypeVar("T")


def spawn(argv: Sequence[str], log: Path | None, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `argv` in a new session (its own process group), output into `log`."""
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child's from here
    try:
        return subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=die_with_parent,
        )
    finally:
        if log is not None:
            out.close()  # the child holds its own descriptor


def signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # gone already (and its pid maybe reused)
        pass


def stop(
    procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 15.0, sig: signal.Signals = signal.SIGTERM,
) -> list[subprocess.Popen[bytes]]:
    """Stop every process and its group: `sig`, then SIGKILL after `grace_s`. Returns
    the processes that were still running when the grace ran out."""
    for proc in procs:
        signal_group(proc, sig)
    deadline = time.monotonic() + grace_s
    late = []
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            late.append(proc)
        # Whatever it started and left behind in its group goes too.
        signal_group(proc, signal.SIGKILL)
    for proc in late:
        proc.wait()
    return late


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def tail(path: Path, lines: int = 8) -> str:
    """The last lines of a log ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_until(
    check: Callable[[], T | None], proc: subprocess.Popen[bytes] | None, timeout_s: float, what: str,
    interval_s: float = 0.5,
) -> T:
    """Poll `check` until it returns other than None; a RuntimeError naming `what`
    when `proc` exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} {describe_exit(proc.returncode)}")
        found = check()
        if found is not None:
            return found
        time.sleep(interval_s)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f}s")


def free_port(host: str = "127.0.0.1") -> int:
    """A free port for a server started next (see `free_ports`)."""
    return free_ports(1, host)


def free_ports(count: int, host: str = "127.0.0.1", book: PortBook | None = None) -> int:
    """The first of `count` consecutive free ports (`yuebing up --gateways N` takes
    --port … --port+N-1), booked (yuebing/ports.py) so that no other draw on this
    machine hands them out before the server binds them. Drawn below the kernel's
    ephemeral range: a port the kernel picks is in it, and any outgoing connection may
    take it, or its neighbours, before the server binds."""
    low = _ephemeral_low()
    first, last = max(1024, low - 12_000), low - count
    if last <= first:  # an unusual range that starts near 1024: draw anywhere unprivileged
        first, last = 1024, 65_535 - count
    candidates = [random.randrange(first, last) for _ in range(200)]
    try:
        base = (book or PortBook()).book(count, candidates, lambda p: port_taken(p, host))
    except OSError:  # no book to be had (a read-only temp folder): draw unbooked
        base = pick(candidates, count, set(), lambda p: port_taken(p, host))
    if base is None:
        raise RuntimeError(f"no {count} consecutive free ports below {low} on {host}")
    return base


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """Whether another program listens on `port` (a port left in TIME_WAIT is free,
    as it is to the servers we start, which reuse addresses)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def wait_for_port(port: int, timeout_s: float, host: str = "127.0.0.1") -> None:
    def listening() -> bool | None:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return None

    wait_until(listening, None, timeout_s, f"port {port}", interval_s=0.05)
