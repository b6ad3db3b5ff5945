"""The pure parts of yuebing/compose.py: the layout its secrets are made for, the
environment compose runs with, and the refusal of secrets made for another layout.
(tests/compose/ brings the cluster up for real.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from yuebing.compose import (ComposeOptions, daemon_environment, ensure_secrets, environment, health, layout,
                             listed_instances, service_commands)
from yuebing.process import free_port
from yuebing.secrets import Layout, Listen, Peer


def _model(*services: tuple[str, list[str], dict]) -> dict:
    return {"services": {name: {"command": command, **extra} for name, command, extra in services}}


MODEL = _model(
    ("nats", ["nats-server", "-c", "x"], {}),
    ("prefill-0", ["python", "-m", "services.prefill", "--instance-id", "prefill-0"], {}),
    ("prefill-1", ["python", "-m", "services.prefill", "--instance-id", "prefill-1"], {"profiles": ["off"]}),
    ("decode-0", ["python", "-m", "services.decode"], {}),
    ("messenger-0", ["python", "-m", "services.messenger"], {}),
    ("messenger-1", ["python", "-m", "services.messenger"], {}),
)


def test_the_layout_counts_the_services_that_start():
    assert set(service_commands(MODEL)) == {"prefill-0", "decode-0", "messenger-0", "messenger-1"}
    assert layout(MODEL) == Layout(prefill=1, decode=1, nodes=2)  # prefill-1's profile keeps it off


def test_up_waits_for_every_engine_and_messenger_that_starts_by_its_instance_id():
    model = _model(*[(n, c, {}) for n, c in [
        ("conductor", ["python", "-m", "services.conductor", "--instance-id", "conductor"]),
        ("prefill-0", ["python", "-m", "services.prefill", "--instance-id", "prefill-0"]),
        ("decode-0", ["python", "-m", "services.decode", "--instance-id", "decode-0", "--node", "node-1"]),
        ("messenger-1", ["python", "-m", "services.messenger", "--instance-id", "messenger-1"]),
    ]])
    assert listed_instances(model) == {"prefill-0", "decode-0", "messenger-1"}  # what /health lists


def test_the_environment_names_absolute_paths_and_skips_the_index_with_a_local_wheel(tmp_path):
    options = ComposeOptions(secrets=tmp_path / "s", config=Path("compose/cluster.json"), api_port=8123)
    env = environment(options, "yuebing-base:bookworm", local_torch=True)
    assert Path(env["YUEBING_SECRETS"]).is_absolute() and Path(env["YUEBING_CLUSTER_CONFIG"]).is_absolute()
    assert env["YUEBING_API_PORT"] == "8123" and env["YUEBING_TORCH_INDEX"] == ""
    assert "YUEBING_BASE" not in environment(options) and "YUEBING_TORCH_INDEX" not in environment(options)


def test_secrets_are_made_once_and_refused_for_another_layout(tmp_path):
    said = []
    ensure_secrets(tmp_path / "s", Layout(prefill=1, decode=1, nodes=2), said.append)
    key = (tmp_path / "s" / "api-key").read_bytes()
    ensure_secrets(tmp_path / "s", Layout(prefill=1, decode=1, nodes=2), said.append)
    assert (tmp_path / "s" / "api-key").read_bytes() == key and len(said) == 1
    with pytest.raises(RuntimeError, match="another layout .*decode-1"):
        ensure_secrets(tmp_path / "s", Layout(prefill=0, decode=2, nodes=2))


def test_a_single_servers_secrets_are_refused_for_a_nats_cluster_and_the_other_way_round(tmp_path):
    layout_ = Layout(prefill=1, decode=1, nodes=2)
    three = Listen(host="0.0.0.0", cluster=(Peer("nats"), Peer("nats-1"), Peer("nats-2")))
    ensure_secrets(tmp_path / "one", layout_)
    with pytest.raises(RuntimeError, match="routes between its NATS servers"):
        ensure_secrets(tmp_path / "one", layout_, listen=three)
    ensure_secrets(tmp_path / "three", layout_, listen=three)
    ensure_secrets(tmp_path / "three", layout_, listen=three)  # made once, and fits
    with pytest.raises(RuntimeError, match="a single NATS server"):
        ensure_secrets(tmp_path / "three", layout_)


def test_health_says_why_nothing_answered():
    status = health(f"http://127.0.0.1:{free_port()}")
    assert isinstance(status, str) and status.startswith("no answer")


def test_dockerd_starts_without_the_library_preloads_of_the_process_that_starts_it(monkeypatch):
    # It outlives this process and its virtual environment; a preload of a file since
    # deleted broke its iptables calls, so it could create no network.
    monkeypatch.setenv("LD_PRELOAD", "/gone/.venv/lib/libgomp.so.1")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/gone/.venv/lib64")
    env = daemon_environment()
    assert "LD_PRELOAD" not in env and "LD_LIBRARY_PATH" not in env and env["PATH"]
