"""Processes vLLM spawns die with their parent (shared/lifetime.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import os
import shutil

import psutil
import pytest

# A parent that spawns a child the way vLLM spawns its engine, then waits forever.
PARENT = textwrap.dedent("""
    import multiprocessing, pathlib, sys, time
    from shared.lifetime import engine_process_dies_with_its_parent

    def child(marker):
        engine_process_dies_with_its_parent()
        pathlib.Path(marker).touch()
        time.sleep(600)

    if __name__ == "__main__":
        multiprocessing.set_start_method("spawn")
        engine_process_dies_with_its_parent()  # the parent itself is left alone
        multiprocessing.Process(target=child, args=(sys.argv[1],), daemon=False).start()
        time.sleep(600)
""")


def test_a_spawned_child_dies_when_its_parent_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    marker = tmp_path / "child-armed"
    parent = subprocess.Popen([sys.executable, str(script), str(marker)])
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert time.monotonic() < deadline and parent.poll() is None, "the child never started"
            time.sleep(0.05)
        children = psutil.Process(parent.pid).children()
        assert children and parent.poll() is None  # the plugin left the spawning process alone
        parent.kill()
        parent.wait(timeout=10)
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"outlived its parent: {alive}"
    finally:
        parent.kill()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="a PID namespace needs root and unshare")
def test_a_child_of_pid_1_lives_on(tmp_path):
    """In a container the service is pid 1: its engine must not take that for an orphaning."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    marker = tmp_path / "child-armed"
    # --kill-child: the namespace (its pid 1 and the engine child) dies with unshare, not left behind
    parent = subprocess.Popen(["unshare", "--fork", "--kill-child", "--pid", "--mount-proc", sys.executable, str(script),
                               str(marker)],
                              cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert time.monotonic() < deadline and parent.poll() is None, "the child died or never started"
            time.sleep(0.05)
        time.sleep(0.5)
        (namespace_init,) = psutil.Process(parent.pid).children()  # unshare's child: pid 1 inside
        spawned = [c for c in namespace_init.children() if "spawn_main" in " ".join(c.cmdline())]
        assert spawned, "the child of pid 1 killed itself"
    finally:
        parent.kill()


def test_vllm_loads_it_as_a_general_plugin():
    plugins = pytest.importorskip("vllm.plugins")
    from shared.lifetime import engine_process_dies_with_its_parent

    loaded = plugins.load_plugins_by_group(group=plugins.DEFAULT_PLUGINS_GROUP)
    assert loaded.get("yuebing_lifetime") is engine_process_dies_with_its_parent
