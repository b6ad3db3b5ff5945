"""Starting and stopping children (yuebing/process.py), on real tiny processes."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest

from yuebing import process

IGNORES_TERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
)
# A child that starts a grandchild in its own group, prints its pid and waits.
WITH_GRANDCHILD = (
    "import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "print(g.pid, flush=True); time.sleep(60)"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split()[2] != "Z"


def test_a_child_logs_to_its_file_and_its_exit_is_described(tmp_path):
    log = tmp_path / "c.log"
    proc = process.spawn([sys.executable, "-c", "import sys; print('hello'); sys.exit(3)"], log)
    assert proc.wait(timeout=10) == 3
    assert process.tail(log) == "hello" and process.describe_exit(3) == "exited with code 3"
    assert process.describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert os.getpgid(os.getpid()) != proc.pid  # its own group


def test_stop_kills_what_ignores_the_signal_after_the_grace(tmp_path):
    log = tmp_path / "c.log"
    proc = process.spawn([sys.executable, "-c", IGNORES_TERM], log)
    process.wait_until(lambda: True if "up" in process.tail(log) else None, proc, 10, "child", interval_s=0.05)
    started = time.monotonic()
    assert process.stop([proc], grace_s=0.5) == [proc]
    assert proc.returncode == -signal.SIGKILL and time.monotonic() - started < 5


def test_stop_takes_the_whole_group_with_it(tmp_path):
    log = tmp_path / "c.log"
    proc = process.spawn([sys.executable, "-c", WITH_GRANDCHILD], log)
    grandchild = process.wait_until(lambda: int(process.tail(log)) if process.tail(log) else None, proc, 10, "child")
    assert process.stop([proc], grace_s=5) == []
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_wait_until_fails_as_soon_as_the_process_exits(tmp_path):
    proc = process.spawn([sys.executable, "-c", "import sys; sys.exit(2)"], None)
    with pytest.raises(RuntimeError, match="server exited with code 2"):
        process.wait_until(lambda: None, proc, 30, "server", interval_s=0.05)


def test_wait_for_port_sees_a_listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        process.wait_for_port(s.getsockname()[1], timeout_s=5)
    with pytest.raises(RuntimeError):
        process.wait_for_port(process.free_port(), timeout_s=0.3)


def test_free_ports_are_consecutive_free_and_outside_the_ephemeral_range():
    base = process.free_ports(4)
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert 1024 <= base and base + 4 <= low
    assert not any(process.port_taken(base + i) for i in range(4))
    with socket.socket() as taken:  # a listener on a port is what `port_taken` sees
        taken.bind(("127.0.0.1", base))
        taken.listen()
        assert process.port_taken(base)
