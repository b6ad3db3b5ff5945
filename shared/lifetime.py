"""A process that must not outlive the one that started it: the kernel signals it
when its parent dies (Linux's PR_SET_PDEATHSIG), however the parent died."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """Have `sig` sent to this process when its parent dies (no-op off Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):  # not Linux: process groups still cover an orderly stop
        pass


def engine_process_dies_with_its_parent() -> None:
    """vLLM's engine-core and worker processes survive a SIGKILLed parent (measured:
    a killed decode service left its engine running, holding its KV cache, and its
    restart then ran beside it). A vLLM "general plugin" (pyproject.toml), run in
    every vLLM process: the processes vLLM spawns die with their parent. The one that
    builds the engine (a service, a test, `yuebing profile`) is left alone."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    die_with_parent(signal.SIGKILL)
    # The parent died before the line above took effect: this process was adopted.
    # (Not "adopted by pid 1": in a container the parent itself is pid 1.)
    if os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGKILL)
