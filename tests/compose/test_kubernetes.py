"""The Kubernetes manifests (compose/kubernetes/): valid against a pinned Kubernetes
(kubernetes-validate's offline schemas, strict), their GPU overlay too, every secret
file they mount present in what `yuebing secrets --kubernetes` writes, and the same
commands, flags and secret files as the compose cluster, so the two cannot drift apart."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import kubernetes_validate
import msgspec
import pytest
import yaml

from shared.config import ClusterConfig, load_config
from yuebing.compose import COMPOSE_DIR, ComposeOptions, resolved, service_commands
from services.conductor.metrics import ConductorMetrics
from services.nats_auth.app import parser as nats_auth_parser
from tests.conductor.test_app import conductor
from yuebing.secrets import (
    KUBERNETES_NATS,
    SERVER_VARIABLES,
    Layout,
    Listen,
    generate,
    kubernetes_secrets,
    write_api_key,
)

KUBERNETES = "1.33.0"  # native sidecars (the messenger) are on by default from 1.29, GA in 1.33
BASE = COMPOSE_DIR / "kubernetes"
GPU = BASE / "gpu"
TENANTS = BASE / "tenants"


def documents(folder: Path = BASE) -> list[dict]:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    return [d for f in kustomization["resources"] for d in yaml.safe_load_all((folder / f).read_text())]


def gpu_documents() -> list[dict]:
    return overlay_documents(GPU)


def overlay_documents(overlay: Path) -> list[dict]:
    """An overlay applied the way kustomize applies its JSON 6902 patches."""
    docs = copy.deepcopy(documents())
    for patch in yaml.safe_load((overlay / "kustomization.yaml").read_text())["patches"]:
        target = patch["target"]
        ops = yaml.safe_load((overlay / patch["path"]).read_text())
        for doc in docs:
            if doc["kind"] == target["kind"] and doc["metadata"]["name"] == target["name"]:
                for op in ops:
                    _apply(doc, op)
    return docs


def _apply(doc: dict, op: dict) -> None:
    *parents, last = [t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
    node = doc
    for token in parents:
        node = node[int(token)] if isinstance(node, list) else node[token]
    if op["op"] == "add" and last == "-":  # the end of a list
        node.append(op["value"])
        return
    assert op["op"] == "add" or last in node or (isinstance(node, list) and int(last) < len(node)), op["path"]
    node[int(last) if isinstance(node, list) else last] = op["value"]


def workloads(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


@pytest.mark.parametrize("variant", ["cpu", "gpu", "tenants"])
def test_every_manifest_is_valid_for_the_pinned_kubernetes(variant):
    docs = {"cpu": documents, "gpu": gpu_documents, "tenants": lambda: overlay_documents(TENANTS)}[variant]()
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_tenants_overlay_mounts_the_secret_as_a_folder_for_the_gateway_and_the_conductor():
    found = workloads(overlay_documents(TENANTS))
    for name in ("gateway", "conductor"):
        (container,) = found[name]["spec"]["template"]["spec"]["containers"]
        command = container["command"]
        assert command[command.index("--tenants") + 1] == "/run/tenants/tenants.json"
        mount = next(m for m in container["volumeMounts"] if m["name"] == "tenants")
        assert mount["mountPath"] == "/run/tenants" and "subPath" not in mount  # updates reach the pod
        volumes = {v["name"]: v for v in found[name]["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tenants"]["secret"]["secretName"] == "yuebing-tenants"
    gateway = found["gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert "--api-key-file" not in gateway["command"] and "--cache-key-file" in gateway["command"]


def test_the_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_the_cluster_config_is_valid(variant):
    docs = documents() if variant == "cpu" else gpu_documents()
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    config = msgspec.json.decode(config_map["data"]["cluster.json"].encode(), type=ClusterConfig)  # validates
    assert config.nats_url == Listen(cluster=KUBERNETES_NATS).url and config.kv_dir == "/kv"


def test_only_the_engines_of_the_gpu_variant_ask_for_gpus():
    for variant, docs in (("cpu", documents()), ("gpu", gpu_documents())):
        for name, workload in workloads(docs).items():
            asks = [c["name"] for c in containers(workload) if "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})]
            assert asks == (["engine"] if variant == "gpu" and name in ("prefill", "decode") else []), (variant, name)


def test_every_mounted_secret_file_is_in_the_generated_secrets(tmp_path):
    layout = Layout(prefill=2, decode=2, engine_nodes=True, engines_by_token=True)
    generate(tmp_path, layout, Listen(host="0.0.0.0"), mounted_at=Path("/run/secrets"))
    write_api_key(tmp_path)
    secrets = {s["metadata"]["name"]: set(s["data"]) for s in kubernetes_secrets(tmp_path, layout)}
    for doc in kubernetes_secrets(tmp_path, layout):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    for name, workload in workloads(documents()).items():
        volumes = {v["name"]: v["secret"]["secretName"] for v in workload["spec"]["template"]["spec"]["volumes"]
                   if "secret" in v}
        pods = [f"{name}-{i}" for i in range(2)] if workload["kind"] == "StatefulSet" else [name]
        for container in containers(workload):
            for mount in container.get("volumeMounts", []):
                if mount["name"] in volumes:
                    for pod in pods:
                        key = mount.get("subPath") or mount["subPathExpr"].replace("$(POD_NAME)", pod)
                        assert key in secrets[volumes[mount["name"]]], (name, container["name"], key)


# --- drift: the same commands as compose -------------------------------------------------

OWN = "<own credentials>"


def normalized(command: list[str], mounts: dict[str, str]) -> dict[str, str]:
    """A service's flags, with what differs by design between compose and Kubernetes
    (instance and node names, the pod's address, its own credentials' file name) made
    alike; every other value must be equal. `mounts`: path in the container → secret file."""
    flags = dict(zip(command[3::2], command[4::2]))
    if "--nats-token-file" in flags:  # a pod's token, where compose gives each instance a password
        del flags["--nats-token-file"]
        flags["--nats-credentials"] = "/run/secrets/<own>.nats.json"
    for flag in ("--instance-id", "--node"):
        if flag in flags:
            flags[flag] = re.sub(r"(node|prefill|decode|messenger)-\d+|conductor(-\d+)?|\$\(POD_NAME\)", "<name>",
                                 flags[flag])
            flags[flag] = flags[flag].replace("messenger-<name>", "<name>")
    for flag in ("--advertise-host", "--channel-advertise-host"):  # a service name in compose, a pod IP here
        if flag in flags:
            flags[flag] = "<address>"
    for flag, path in flags.items():
        if path.startswith("/run/secrets/"):
            secret_file = mounts.get(path, Path(path).name)
            flags[flag] = OWN if re.fullmatch(r"(messenger-)?(prefill|decode|messenger)-.*\.nats\.json|<own>\.nats\.json",
                                              secret_file) or "$(POD_NAME)" in secret_file else secret_file
    return flags


def kubernetes_commands() -> list[tuple[str, list[str], dict[str, str]]]:
    """(workload, command, mounted secret files) of each Yuebing service container."""
    out = []
    for name, workload in workloads(documents()).items():
        for c in containers(workload):
            if c["command"][:2] == ["python", "-m"]:
                mounts = {m["mountPath"]: m.get("subPath") or m.get("subPathExpr") for m in c.get("volumeMounts", [])
                          if m["mountPath"].startswith("/run/secrets/")}
                out.append((name, c["command"], mounts))
    return out


def test_kubernetes_runs_the_services_as_compose_does():
    compose: dict[str, dict[str, str]] = {}
    for name, command in service_commands(resolved(ComposeOptions())).items():
        flags = normalized(command, {})
        assert compose.setdefault(command[2], flags) == flags, name  # every instance of a role alike
    seen = set()
    for workload, command, mounts in kubernetes_commands():
        if command[2] == "services.nats_auth":  # engine pods' token logins: compose gives each a password
            continue
        seen.add(command[2])
        assert normalized(command, mounts) == compose[command[2]], (workload, command[2])
    assert seen == set(compose)


def test_nats_runs_the_same_server_config():
    (nats,) = [c for w in workloads(documents()).values() for c in containers(w) if c["name"] == "nats"]
    compose_nats = resolved(ComposeOptions())["services"]["nats"]["command"]
    assert nats["command"] == compose_nats


def test_compose_and_kubernetes_read_the_same_cluster_settings_where_they_share_them():
    (config_map,) = [d for d in documents() if d["kind"] == "ConfigMap"]
    kube = json.loads(config_map["data"]["cluster.json"])
    compose = json.loads((COMPOSE_DIR / "cluster.json").read_text())
    load_config(COMPOSE_DIR / "cluster.json")
    # Compose's one NATS server against the Kubernetes cluster of three: the one difference.
    assert {k: v for k, v in kube.items() if k in compose and k != "nats_url"} == {
        k: v for k, v in compose.items() if k != "nats_url"}


# --- scaled out: every role by its replicas ------------------------------------------------

def kinds(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def test_gateways_conductors_and_nats_run_several_each_with_a_disruption_budget():
    found, config = workloads(documents()), cluster_config()
    assert found["gateway"]["spec"]["replicas"] >= 2
    assert found["conductor"]["spec"]["replicas"] == config.conductors >= 2  # digests on: they share their books
    assert found["nats"]["kind"] == "StatefulSet" and found["nats"]["spec"]["replicas"] == len(KUBERNETES_NATS) == 3
    assert found["nats"]["spec"]["serviceName"] == KUBERNETES_NATS[0].host.split(".")[1]
    budgets = {name: b["spec"] for name, b in kinds("PodDisruptionBudget").items()}
    assert budgets == {"gateway": {"minAvailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/component": "gateway"}}},
                       "conductor": {"minAvailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/component": "conductor"}}},
                       "nats": {"maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/component": "nats"}}}}


def test_the_gateway_scales_on_cpu_and_the_engines_on_the_conductors_signals():
    scalers = {name: h["spec"] for name, h in kinds("HorizontalPodAutoscaler").items()}
    assert scalers["gateway"]["metrics"][0]["resource"]["name"] == "cpu" and scalers["gateway"]["minReplicas"] >= 2
    for role in ("prefill", "decode"):
        (metric,) = scalers[role]["metrics"]
        assert metric["external"]["metric"]["name"] == f"yuebing_conductor_{role}_load_ratio"
        assert scalers[role]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": role}
    page = ConductorMetrics(conductor()).registry
    named = {m.name for m in page.collect()}
    assert {"yuebing_conductor_prefill_load_ratio", "yuebing_conductor_decode_load_ratio"} <= named


def test_a_stopping_engine_has_time_to_drain_before_it_is_killed():
    drain_s = cluster_config().drain_timeout_s
    for name in ("prefill", "decode"):
        grace = workloads(documents())[name]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= drain_s + 20, name  # the drain, then the engine's own shutdown


def test_kubernetes_secrets_route_nats_between_the_statefulsets_pods(tmp_path):
    made = generate(tmp_path, Layout(engine_nodes=True), Listen("0.0.0.0", cluster=KUBERNETES_NATS),
                    mounted_at=Path("/run/secrets"))
    text = made.nats_config.read_text()
    assert [f"@nats-{i}.nats-cluster:6222" in text for i in range(3)] == [True] * 3
    (nats,) = [c for c in containers(workloads(documents())["nats"]) if c["name"] == "nats"]
    env = {e["name"] for e in nats["env"]}
    assert env == set(SERVER_VARIABLES)  # each server told who it is, as server_config's file asks


def cluster_config() -> ClusterConfig:
    (config_map,) = [d for d in documents() if d["kind"] == "ConfigMap"]
    return msgspec.json.decode(config_map["data"]["cluster.json"].encode(), type=ClusterConfig)


def test_engine_pods_log_in_with_their_own_tokens_and_nothing_per_replica_is_in_a_secret(tmp_path):
    layout = Layout(prefill=2, decode=2, engine_nodes=True, engines_by_token=True)
    generate(tmp_path, layout, Listen(host="0.0.0.0", cluster=KUBERNETES_NATS), mounted_at=Path("/run/secrets"))
    write_api_key(tmp_path)
    secrets = {s["metadata"]["name"]: set(s["data"]) for s in kubernetes_secrets(tmp_path, layout)}
    assert secrets["yuebing-prefill"] == secrets["yuebing-decode"] == {"kv.key"}
    defaults = nats_auth_parser().parse_args(["--issuer-seed-file", "x"])
    found = workloads(documents())
    for role in ("prefill", "decode"):
        spec = found[role]["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == defaults.service_account
        (projected,) = [v["projected"] for v in spec["volumes"] if v["name"] == "nats-token"]
        (source,) = projected["sources"]
        assert source["serviceAccountToken"]["audience"] == defaults.audience
        for c in containers(found[role]):
            if c["command"][:2] == ["python", "-m"]:
                assert c["command"][c["command"].index("--nats-token-file") + 1] == "/var/run/secrets/yuebing/token"
    nats = found["nats"]["spec"]["template"]["spec"]
    assert nats["serviceAccountName"] == "yuebing-nats"
    (callout,) = [c for c in nats["containers"] if c["name"] == "nats-auth"]
    assert "--issuer-seed-file" in callout["command"]
    bindings = kinds("ClusterRoleBinding")
    assert bindings["yuebing-nats-issuer-discovery"]["roleRef"]["name"] == "system:service-account-issuer-discovery"
    assert "auth_callout" in (tmp_path / "nats-server.conf").read_text()
