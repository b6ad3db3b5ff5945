"""The cap on vLLM's idle busy-wait (shared/engine/spin.py)."""

import time

import pytest
import zmq

from shared.engine.spin import SPIN_ENV, limit_idle_spin


def test_a_sleeping_queue_reader_rechecks_without_a_notification(monkeypatch):
    # vLLM's reader sleeps on a ZeroMQ notification once its spin ends; when that
    # notification is dropped it used to sleep through a 5 s recheck (a 5 s stall in
    # a decode stream). Capped, a reader with no notification comes back at once.
    shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    # Undone after the test: the patch and the variable engines started later inherit.
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", shm_broadcast.SpinCondition.wait)
    monkeypatch.setenv(SPIN_ENV, "0.001")
    limit_idle_spin()
    context = zmq.Context()
    address = f"inproc://yuebing-spin-{time.monotonic_ns()}"
    writer = shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address=address)
    try:
        assert reader.busy_loop_s == 1  # vLLM's default, capped when it waits
        reader.last_read = time.monotonic() - 1.0  # idle long past any spin
        started = time.monotonic()
        reader.wait(timeout_ms=5000)  # what vLLM passes: its recheck interval
        assert time.monotonic() - started < 0.5
        assert reader.busy_loop_s == pytest.approx(0.001)
    finally:
        for s in (writer.local_notify_socket, reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket):
            s.close(linger=0)
        context.term()


def test_vllm_loads_the_spin_cap_as_a_general_plugin(monkeypatch):
    # The cap reaches vLLM's spawned processes only as a plugin that vLLM itself
    # loads there: an install without the entry point would bring the stalls back.
    plugins = pytest.importorskip("vllm.plugins")
    shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", shm_broadcast.SpinCondition.wait)
    monkeypatch.setenv(SPIN_ENV, "0.003")
    loaded = plugins.load_plugins_by_group(group=plugins.DEFAULT_PLUGINS_GROUP)
    assert loaded.get("yuebing_idle_spin") is limit_idle_spin
    loaded["yuebing_idle_spin"]()
    assert shm_broadcast.SpinCondition.wait.yuebing_limit == 0.003
