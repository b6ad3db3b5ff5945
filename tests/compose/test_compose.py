"""The compose file runs the same services, with the same flags, as `yuebing up`."""

import importlib
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shared.config import load_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
SERVICES = {"gateway", "conductor", "prefill", "decode", "messenger"}


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_every_service_runs_from_one_image_and_nats_is_official():
    spec = _compose()["services"]
    assert spec["nats"]["image"].startswith("nats:")
    images = {s["image"] for name, s in spec.items() if name != "nats"}
    assert images == {"yuebing:latest"}
    modules = {s["command"][2].split(".")[1] for s in spec.values() if s["command"][:2] == ["python", "-m"]}
    assert modules == SERVICES


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_commands_parse_with_the_services_own_flags(name, monkeypatch):
    spec = _compose()["services"]
    commands = [s["command"][3:] for s in spec.values() if s["command"][:3] == ["python", "-m", f"services.{name}"]]
    assert commands, f"no container runs services.{name}"
    assert (ROOT / "services" / name / "__main__.py").exists()
    monkeypatch.setenv("YUEBING_CONFIG", "/config/cluster.json")
    for argv in commands:
        args = importlib.import_module(f"services.{name}.__main__").parser().parse_args(argv)
        assert args.config == "/config/cluster.json"


def test_cluster_config_is_valid_and_points_at_the_nats_container():
    config = load_config(ROOT / "compose" / "cluster.json")
    assert config.nats_url == "nats://nats:4222"
    assert config.model.startswith("/models/")


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker client")
def test_docker_compose_accepts_the_file():
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("docker compose plugin not installed")
    r = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_engines_share_their_nodes_pool_volume_with_its_messenger():
    spec = _compose()["services"]
    config = load_config(ROOT / "compose" / "cluster.json")

    def node_and_kv(service: dict) -> tuple[str, str]:
        cmd = service["command"]
        node = cmd[cmd.index("--node") + 1]
        (volume,) = [v.split(":")[0] for v in service["volumes"] if v.endswith(f":{config.kv_dir}")]
        return node, volume

    messengers = dict(node_and_kv(s) for s in spec.values() if "services.messenger" in s["command"])
    engines = [s for s in spec.values() if {"services.prefill", "services.decode"} & set(s["command"])]
    assert len(messengers) == 2 and engines
    for engine in engines:
        node, volume = node_and_kv(engine)
        assert messengers[node] == volume
