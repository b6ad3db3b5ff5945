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


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_each_container_gets_only_its_own_secrets():
    spec = _compose()["services"]
    for name, service in spec.items():
        if service["command"][:2] != ["python", "-m"]:
            continue
        creds = _flag(service["command"], "--nats-credentials")
        assert creds == f"/run/secrets/{name}.nats.json", name
        mounted = set(service.get("secrets", []))
        assert {s for s in mounted if s.endswith(".nats.json")} == {f"{name}.nats.json"}
        assert ("kv.key" in mounted) == name.startswith("messenger-")
        assert ("api-key" in mounted) == (name == "gateway")
    assert spec["nats"]["secrets"] == ["nats-server.conf"]


def test_the_secrets_compose_names_are_the_ones_yuebing_secrets_writes(tmp_path):
    from yuebing import cli

    assert cli.main(["secrets", "--out", str(tmp_path / "s"), "--nodes", "2", "--nats-host", "0.0.0.0",
                     "--mounted-at", "/run/secrets"]) == 0
    declared = _compose()["secrets"]
    assert {Path(s["file"]).name for s in declared.values()} == set(declared)
    # The admin's stays with the operator.
    assert set(declared) == {p.name for p in (tmp_path / "s").iterdir()} - {"admin.nats.json"}


def test_the_api_is_on_loopback_with_a_key_and_the_kv_plane_is_internal():
    compose = _compose()
    spec = compose["services"]
    assert spec["gateway"]["ports"] == ["127.0.0.1:8000:8000"]
    assert _flag(spec["gateway"]["command"], "--api-key-file") == "/run/secrets/api-key"
    assert compose["networks"]["kv"]["internal"] and compose["networks"]["control"]["internal"]
    on_kv = {name for name, s in spec.items() if "kv" in s.get("networks", [])}
    assert on_kv == {"messenger-0", "messenger-1"}


def test_engines_wait_for_the_model_and_their_messenger():
    spec = _compose()["services"]
    for name in ("prefill-0", "decode-0"):
        assert {"nats", "model-init"} <= set(spec[name]["depends_on"])
        assert any(dep.startswith("messenger-") for dep in spec[name]["depends_on"])


def test_every_service_restarts_and_the_gateway_is_healthy_only_while_serving():
    spec = _compose()["services"]
    assert all(s["restart"] == "unless-stopped" for name, s in spec.items() if name != "model-init")
    check = spec["gateway"]["healthcheck"]["test"]
    assert "/health" in check[-1] and check[:2] == ["CMD", "python"]


def test_the_gpu_override_gives_every_engine_its_own_gpus():
    base = _compose()["services"]
    gpu = yaml.safe_load((ROOT / "compose" / "docker-compose.gpu.yml").read_text())["services"]
    engines = {name for name, s in base.items() if s["command"][:3] in (["python", "-m", "services.prefill"],
                                                                          ["python", "-m", "services.decode"])}
    assert set(gpu) == engines  # every engine, and nothing else, reserves GPUs
    ids = [i for s in gpu.values() for d in s["deploy"]["resources"]["reservations"]["devices"] for i in d["device_ids"]]
    assert len(ids) == len(set(ids))
    assert all(d["driver"] == "nvidia" and d["capabilities"] == ["gpu"]
               for s in gpu.values() for d in s["deploy"]["resources"]["reservations"]["devices"])
