"""yuebing/preflight.py: the one-line refusals before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from yuebing.preflight import (
    GIB,
    memory_available,
    memory_total,
    memory_warning,
    refuse_oversized_memory,
    refuse_unloadable_model,
)


def _model(folder, config=None, weights=True, tokenizer=True):
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights:
        (folder / "model.safetensors").write_bytes(b"x")
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.mark.parametrize(("config", "weights", "tokenizer", "says"), [
    (None, True, True, "no config.json"),
    ("not json", True, True, "not a model config"),
    ({"model_type": "llama"}, True, True, "names no architectures"),
    ({"architectures": ["LlamaForCausalLM"]}, False, True, "no weights"),
    ({"architectures": ["LlamaForCausalLM"]}, True, False, "no tokenizer"),
])
def test_a_folder_vllm_cannot_load_is_refused_saying_what_is_missing(tmp_path, config, weights, tokenizer, says):
    with pytest.raises(ValueError, match=says):
        refuse_unloadable_model(_model(tmp_path / "m", config, weights, tokenizer))


def test_a_loadable_folder_passes(tmp_path):
    refuse_unloadable_model(_model(tmp_path / "m", {"architectures": ["LlamaForCausalLM"]}))


def test_kv_caches_and_pools_beyond_the_machines_memory_are_refused():
    refuse_oversized_memory(2, 1, 2, GIB // 2, total=24 * GIB)
    refuse_oversized_memory(2, 100, 2, GIB, total=None)  # unknown: not refused
    with pytest.raises(ValueError, match=r"need 201\.0 GiB; this machine has 24\.0 GiB: lower --kv-cache-gib"):
        refuse_oversized_memory(2, 100, 2, GIB // 2, total=24 * GIB)


def test_memory_total_and_available_read_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684132 kB\nMemFree:  1 kB\nMemAvailable:   2048 kB\n")
    assert memory_total(meminfo) == 24684132 * 1024
    assert memory_available(meminfo) == 2048 * 1024
    assert memory_total(tmp_path / "missing") is None and memory_available(tmp_path / "missing") is None


def test_engines_beyond_the_free_memory_are_warned_of_with_their_processes_counted():
    # Four engines' 1 GiB caches and two pools fit 8 GiB free; their processes do not.
    warning = memory_warning(4, 1, 2, GIB // 4, available=8 * GIB)
    assert warning is not None and warning.startswith("4 CPU engines need about 13.3 GiB and 8.0 GiB is free")
    assert memory_warning(4, 1, 2, GIB // 4, available=16 * GIB) is None
    assert memory_warning(4, 1, 2, GIB // 4, available=None) is None


# --- the real command: each first-run mistake, one line within 5 s, nothing left behind ----------


def _first_run_mistakes(tmp_path):
    import fcntl
    import socket

    from yuebing.launcher import RUN_LOCK
    from yuebing.model import default_model_dir

    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    no_weights = _model(tmp_path / "no-weights", {"architectures": ["LlamaForCausalLM"]}, weights=False)
    held = tmp_path / "held"
    held.mkdir()
    lock = open(held / RUN_LOCK, "w")  # noqa: SIM115 (held until the test ends)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    model = ["--model", str(default_model_dir())]
    cases = {
        "port in use": ([*model, "--port", str(other.getsockname()[1])], "is in use by another program"),
        "dtype vLLM refuses": ([*model, "--dtype", "float64"], "dtype must be one of"),
        "no model": (["--model", str(tmp_path / "none")], "no config.json"),
        "model without weights": (["--model", str(no_weights)], "no weights in"),
        "KV caches beyond memory": ([*model, "--kv-cache-gib", "100000", "--gpus", "none"], "lower --kv-cache-gib"),
        "run folder in use": ([*model, "--run-dir", str(held)], "is using run folder"),
    }
    return cases, (other, lock)


def test_each_first_run_mistake_is_one_line_within_5_s_and_starts_nothing(tmp_path):
    cases, held = _first_run_mistakes(tmp_path)
    try:
        for name, (flags, says) in cases.items():
            started = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-m", "yuebing", "up", "--port", "0", *flags], text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            _, err = proc.communicate(timeout=30)
            took = time.monotonic() - started
            lines = err.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], (name, err)
            assert took < 5, f"{name}: {took:.1f}s"
            assert not _in_session(proc.pid), f"{name}: processes left behind"
    finally:
        for thing in held:
            thing.close()


def _in_session(sid: int) -> list[int]:
    """Processes still in the session the command led (it started its children there)."""
    left = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid:
                left.append(pid)
        except OSError:
            pass
    return left
