"""The compose files, as compose itself reads them (anchors merged, overrides applied):
the same services, flags and secrets as `yuebing up`, each container given only its own."""

import importlib
from pathlib import Path

import pytest

from shared.config import load_config
from yuebing.compose import COMPOSE_DIR, ComposeOptions, layout, nats_listen, resolved, service_commands
from yuebing.secrets import SERVER_VARIABLES

ROOT = COMPOSE_DIR.parent
SERVICES = {"gateway", "conductor", "prefill", "decode", "messenger"}
BASE = COMPOSE_DIR / "docker-compose.yml"
COLOCATED = COMPOSE_DIR / "docker-compose.colocated.yml"
GPU = COMPOSE_DIR / "docker-compose.gpu.yml"
HA = COMPOSE_DIR / "docker-compose.ha.yml"


def _model(*overrides: Path) -> dict:
    return resolved(ComposeOptions(files=(BASE, *overrides)))


@pytest.fixture(scope="module")
def spec() -> dict:
    return _model()["services"]


def _bind(service: dict, target: str) -> str | None:
    return next((v["source"] for v in service.get("volumes", []) if v["target"] == target), None)


def test_every_service_nats_included_runs_from_one_image(spec):
    assert {s["image"] for s in spec.values()} == {"yuebing:latest"}
    assert spec["nats"]["command"][0] == "nats-server"
    assert {command[2].split(".")[1] for command in service_commands({"services": spec}).values()} == SERVICES


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_commands_parse_with_the_services_own_flags(name, spec, monkeypatch):
    commands = [s["command"][3:] for s in spec.values() if s["command"][:3] == ["python", "-m", f"services.{name}"]]
    assert commands, f"no container runs services.{name}"
    assert (ROOT / "services" / name / "__main__.py").exists()
    monkeypatch.setenv("YUEBING_CONFIG", "/config/cluster.json")
    for argv in commands:
        args = importlib.import_module(f"services.{name}.__main__").parser().parse_args(argv)
        assert args.config == "/config/cluster.json"


@pytest.mark.parametrize("overrides", [(), (COLOCATED,), (GPU,), (HA,)], ids=["disaggregated", "colocated", "gpu", "ha"])
def test_each_layout_reads_a_valid_config_and_every_service_its_model(overrides):
    model = _model(*overrides)
    (config_file,) = {_bind(s, "/config/cluster.json") for s in model["services"].values() if "command" in s
                      and s["command"][0] == "python"}
    config = load_config(config_file)
    listen = nats_listen(model)  # every NATS server by its service's name
    assert config.nats_url == (listen.url if listen.cluster else "nats://nats:4222")
    assert config.model.startswith("/models/")
    for name in service_commands(model):
        assert any(v["target"] == "/models" for v in model["services"][name]["volumes"]), name
    expected = {(): "adaptive", (COLOCATED,): "colocated", (GPU,): "adaptive", (HA,): "adaptive"}[overrides]
    assert config.mode == expected


def test_the_colocated_layout_runs_two_engines_that_prefill_too():
    assert layout(_model(COLOCATED)).prefill == 0 and layout(_model(COLOCATED)).decode == 2


def test_engines_share_their_nodes_pool_volume_with_its_messenger(spec):
    config = load_config(ROOT / "compose" / "cluster.json")

    def node_and_kv(service: dict) -> tuple[str, str]:
        cmd = service["command"]
        node = cmd[cmd.index("--node") + 1]
        return node, _bind(service, config.kv_dir)

    messengers = dict(node_and_kv(s) for s in spec.values() if "services.messenger" in s["command"])
    engines = [s for s in spec.values() if {"services.prefill", "services.decode"} & set(s["command"])]
    assert len(messengers) == 2 and engines
    for engine in engines:
        node, volume = node_and_kv(engine)
        assert messengers[node] == volume


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_each_container_gets_only_its_own_secrets(spec):
    for name, service in spec.items():
        if service["command"][:2] != ["python", "-m"]:
            continue
        creds = _flag(service["command"], "--nats-credentials")
        assert creds == f"/run/secrets/{name}.nats.json", name
        mounted = {s["source"] for s in service.get("secrets", [])}
        assert {s for s in mounted if s.endswith(".nats.json")} == {f"{name}.nats.json"}
        assert ("kv.key" in mounted) == name.startswith("messenger-")
        assert ("api-key" in mounted) == ("cache.key" in mounted) == (name == "gateway")
    assert [s["source"] for s in spec["nats"]["secrets"]] == ["nats-server.conf"]


def test_the_secrets_compose_names_are_the_ones_yuebing_secrets_writes(tmp_path):
    from yuebing import cli

    assert cli.main(["secrets", "--out", str(tmp_path / "s"), "--nodes", "2", "--nats-host", "0.0.0.0",
                     "--mounted-at", "/run/secrets"]) == 0
    declared = {k: v for k, v in _model()["secrets"].items() if k != "ca"}  # ca: the build's
    assert {Path(s["file"]).name for s in declared.values()} == set(declared)
    # The admin's stays with the operator.
    assert set(declared) == {p.name for p in (tmp_path / "s").iterdir()} - {"admin.nats.json"}


def test_the_api_is_on_loopback_with_a_key_and_the_kv_plane_is_internal():
    compose = _model()
    spec = compose["services"]
    (port,) = spec["gateway"]["ports"]
    assert (port["host_ip"], port["target"]) == ("127.0.0.1", 8000)
    assert _flag(spec["gateway"]["command"], "--api-key-file") == "/run/secrets/api-key"
    assert compose["networks"]["kv"]["internal"] and compose["networks"]["control"]["internal"]
    on_kv = {name for name, s in spec.items() if "kv" in s.get("networks", [])}
    assert on_kv == {"messenger-0", "messenger-1"}


def test_engines_wait_for_the_model_and_their_messenger(spec):
    for name in ("prefill-0", "decode-0"):
        assert spec[name]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
        assert spec[name]["depends_on"]["nats"]["condition"] == "service_healthy"
        assert any(dep.startswith("messenger-") for dep in spec[name]["depends_on"])


def test_every_service_restarts_and_the_gateway_is_healthy_only_while_serving(spec):
    assert all(s["restart"] == "unless-stopped" for name, s in spec.items() if name != "model-init")
    check = spec["gateway"]["healthcheck"]["test"]
    assert "/health" in check[-1] and check[:2] == ["CMD", "python"]


def test_the_gpu_override_builds_cuda_vllm_and_gives_every_engine_its_own_gpus():
    whole = _model(GPU)
    model = whole["services"]
    assert model["model-init"]["build"]["args"]["EXTRA"] == "gpu"
    reserving = {name: s["deploy"]["resources"]["reservations"]["devices"] for name, s in model.items()
                 if s.get("deploy", {}).get("resources", {}).get("reservations")}
    engines = {name for name, c in service_commands(whole).items() if c[2] in ("services.prefill", "services.decode")}
    assert set(reserving) == engines  # every engine, and nothing else, reserves GPUs
    ids = [i for devices in reserving.values() for d in devices for i in d["device_ids"]]
    assert len(ids) == len(set(ids))
    assert all(d["driver"] == "nvidia" and d["capabilities"] == ["gpu"] for ds in reserving.values() for d in ds)


def test_the_tenants_override_mounts_the_folder_and_drops_the_single_key():
    whole = _model(COMPOSE_DIR / "docker-compose.tenants.yml")["services"]
    for name in ("gateway", "conductor"):
        assert _flag(whole[name]["command"], "--tenants") == "/run/tenants/tenants.json", name
        assert _bind(whole[name], "/run/tenants") is not None, name  # a folder: a renamed file is seen
        assert _bind(whole[name], "/config/cluster.json") is not None  # the base's mounts stay
    gateway = whole["gateway"]
    assert _flag(gateway["command"], "--api-key-file") is None
    assert {s["source"] for s in gateway["secrets"]} == {"gateway.nats.json", "cache.key"}


def test_the_ha_layout_runs_three_nats_servers_two_conductors_and_two_gateways_behind_haproxy():
    model = _model(HA)
    spec = model["services"]
    servers = {name: s for name, s in spec.items() if s["command"][0] == "nats-server"}
    assert sorted(servers) == ["nats", "nats-1", "nats-2"]
    for name, server in servers.items():
        assert set(server["environment"]) == set(SERVER_VARIABLES) and server["environment"]["NATS_SERVER_NAME"] == name
    assert len({_bind(s, "/data") for s in servers.values()}) == 3  # each its own JetStream files
    conductors = [c for c in service_commands(model).values() if c[2] == "services.conductor"]
    assert len(conductors) == load_config(_bind(spec["conductor"], "/config/cluster.json")).conductors == 2
    assert len({c[c.index("--instance-id") + 1] for c in conductors}) == 2
    gateways = sorted(name for name, c in service_commands(model).items() if c[2] == "services.gateway")
    assert gateways == ["gateway", "gateway-1"]
    published = {name for name, s in spec.items() if s.get("ports")}
    assert published == {"lb"} and spec["lb"]["ports"][0]["host_ip"] == "127.0.0.1"
    config = (COMPOSE_DIR / "haproxy" / "haproxy.cfg").read_text()
    assert [line.split()[1] for line in config.splitlines() if line.strip().startswith("server ")] == gateways
    assert layout(model).decode == 2


def test_haproxys_own_errors_have_the_apis_error_shape():
    import json

    for code in (502, 503, 504):
        head, body = (COMPOSE_DIR / "haproxy" / f"{code}.http").read_bytes().decode().split("\r\n\r\n")
        assert head.startswith(f"HTTP/1.1 {code} ") and "Content-Type: application/json" in head
        assert int(head.split("Content-Length: ")[1].split("\r\n")[0]) == len(body.encode())
        error = json.loads(body)["error"]
        assert error["type"] == "server_error" and error["message"]
