"""`yuebing up`: the local cluster as child processes of one launcher.

Starts nats-server and every service with one shared config file, waits until every
gateway sees every instance alive, and supervises: a child that dies (nats-server
included) is reported with its exit status and the tail of its log and started again
after a backoff (yuebing/restarts.py); a crash loop stops the cluster, and so does
Ctrl-C (or SIGTERM).
Children start and stop through yuebing/process.py: each in its own process group,
sent SIGTERM if the launcher itself dies, so nothing is left behind. `up_process`
runs `yuebing up` itself as a child, for the live benchmarks.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from services.conductor.modes import CONDITIONAL_RULES, MODES
from shared.config import ClusterConfig, profile_path, save_config
from shared.engine.llm import engine_environment
from shared.model_identity import fingerprint
from shared.private_file import read_private, write_private
from shared import tenants
from shared.service import resolved
from yuebing import gpus, kv_folders, process, profile_cache
from yuebing.compose import gateway_sees
from yuebing.preflight import (
    memory_available,
    memory_total,
    memory_warning,
    refuse_oversized_memory,
    refuse_taken_ports,
    refuse_unloadable_transport,
)
from yuebing.process import free_port, free_ports
from yuebing.restarts import RestartPolicy
from yuebing.secrets import Layout, Listen, Peer, Secrets, generate, server_environment


@dataclass(frozen=True)
class UpOptions:
    """How `yuebing up` lays the cluster out; each field is also its flag (yuebing/flags.py)."""

    config: ClusterConfig
    prefill: Annotated[int, Meta(description="prefill instances (adaptive mode takes 0: a pooled fleet, each "
                                             "decode instance prefilling its own requests)")] = 1
    decode: Annotated[int, Meta(description="decode instances")] = 1
    cpp_groups: Annotated[
        int, Meta(description="CPP prefill groups besides --prefill: each one engine pipelined over --cpp-stages "
                              "processes, for long prompts")
    ] = 0
    cpp_stages: Annotated[int, Meta(description="pipeline stages of each CPP prefill group")] = 2
    nodes: Annotated[int, Meta(description="nodes (one messenger each)")] = 1
    gpus: Annotated[
        str, Meta(description="GPUs the engines get, each its own: auto (every one nvidia-smi lists; none: CPU "
                              "engines), none, or indices such as 0,1,2,3")
    ] = "auto"
    host: Annotated[str, Meta(description="address the API listens on")] = "127.0.0.1"
    port: Annotated[int, Meta(description="port the API listens on")] = 8000
    nats_port: Annotated[int, Meta(description="nats-server's port (0: a free one)")] = 0
    api_key_file: Annotated[
        Path | None, Meta(description="file holding the key clients must send as a bearer token (none: $YUEBING_API_KEY, "
                                      "else open)")
    ] = None
    tenants: Annotated[
        Path | None, Meta(description="tenants file (docs/tenants.md): their keys, cache groups and limits, read again "
                                      "when it changes; instead of --api-key-file")
    ] = None
    nats_tls: Annotated[bool, Meta(description="NATS over TLS, with a certificate authority made for this run")] = False
    fault_injection: Annotated[
        bool, Meta(description="let the admin identity arm the messengers' fault switches (tests, drills)")
    ] = False
    run_dir: Annotated[Path | None, Meta(description="where logs and the config go (none: a new temp dir)")] = None
    ready_file: Annotated[Path | None, Meta(description="write a JSON with the URL and pids here once ready")] = None
    start_timeout_s: Annotated[float, Meta(description="give up if not ready after this many seconds")] = 600.0
    gateways: Annotated[
        int, Meta(description="gateways serving the API side by side, on --port, --port+1, …")
    ] = 1
    nats_servers: Annotated[
        int, Meta(description="NATS servers, as one cluster (3 lose none of the control plane to one's death)")
    ] = 1

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1 or self.nodes < 1 or self.gateways < 1 or self.nats_servers < 1:
            raise ValueError("--decode, --nodes, --gateways and --nats-servers must each be at least 1, --prefill not "
                             "negative")
        if self.config.mode not in MODES:
            raise ValueError(f"unknown --mode {self.config.mode!r}; choose from {', '.join(MODES)}")
        if self.config.conditional_rule not in CONDITIONAL_RULES:
            raise ValueError(f"unknown --conditional-rule {self.config.conditional_rule!r}; "
                             f"choose from {', '.join(CONDITIONAL_RULES)}")
        if self.cpp_groups < 0 or self.cpp_stages < 2:
            raise ValueError("--cpp-groups must not be negative and --cpp-stages at least 2")
        if self.prefill + self.cpp_groups < 1 and self.config.mode not in ("colocated", "adaptive"):
            raise ValueError(f"--mode {self.config.mode} needs at least one prefill instance (adaptive mode runs "
                             "without: its decode instances then prefill their own requests)")
        if self.cpp_groups and self.config.mode == "colocated":
            raise ValueError("CPP groups are prefill instances: --mode colocated has none")

    @property
    def instances(self) -> tuple[int, int]:
        """(prefill, decode) instances to start. Colocated, as many engines all prefill
        and decode: they run as decode instances that prefill their requests too."""
        if self.config.mode == "colocated":
            return 0, self.prefill + self.decode
        return self.prefill + self.cpp_groups, self.decode

    def layout(self) -> str:
        prefill, decode = self.instances
        nodes = f"{self.nodes} node{'s' * (self.nodes > 1)}"
        if self.config.mode == "colocated":
            return f"{decode} colocated, {nodes}"
        rule = f" ({self.config.conditional_rule} rule)" if self.config.mode == "conditional" else ""
        cpp = f" ({self.cpp_groups} as CPP groups of {self.cpp_stages} stages)" if self.cpp_groups else ""
        return f"{self.config.mode}{rule}: {prefill} prefill{cpp}, {decode} decode, {nodes}"

    def stages(self, prefill: int) -> int:
        """Pipeline stages of prefill instance `prefill`: CPP groups come after the singles."""
        return self.cpp_stages if prefill >= self.prefill else 1

    def gpu_needs(self) -> list[tuple[str, int]]:
        """(engine, GPUs it needs), in start order: tensor-parallel size times stages."""
        prefills, decodes = self.instances
        tp = self.config.tensor_parallel_size
        return ([(f"prefill-{i}", tp("prefill") * self.stages(i)) for i in range(prefills)]
                + [(f"decode-{i}", tp("decode")) for i in range(decodes)])


@dataclass
class Child:
    """One supervised process. Every child is started again when it dies (each rebuilds
    its state from the others: heartbeats, snapshots; the others reconnect), on a new
    metrics port if its own was taken, unless it keeps failing the same way."""

    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)  # its own, over the cluster's (its GPUs)
    deaths: list[float] = field(default_factory=list)  # monotonic times
    start_at: float | None = None  # dead, and due to start again then
    restarts: int = 0
    failures: list[str] = field(default_factory=list)  # how each death read ("": by a signal)
    failed: bool = False  # given up: it failed the same way too many times in a row


@dataclass
class Cluster:
    options: UpOptions
    children: list[Child] = field(default_factory=list)
    stopping: bool = False
    failed: bool = False  # a required child died
    kv_dir: Path | None = None  # pool files and node sockets, removed at stop
    env: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # process → its Prometheus page
    secrets: Secrets | None = None
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    run_lock: int | None = None  # held while this launcher uses its run folder (closed with the process)
    kv_lock: int | None = None  # held while this launcher uses its KV folder (yuebing/kv_folders.py)
    ready: dict | None = None  # what the ready file says, once written
    nats_peers: list[Peer] = field(default_factory=list)  # a NATS cluster's servers (none: one server)

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        """Every gateway's API, the first's on --port."""
        return [f"http://{self.options.host}:{self.options.port + i}" for i in range(self.options.gateways)]

    def plan(self, run_dir: Path, config_path: Path, secrets: Secrets) -> None:
        o = self.options
        py = [sys.executable, "-m"]
        nats_bin = Path(sys.executable).with_name("nats-server")

        def add(name: str, argv: list[str], login: str = "") -> None:
            # Each child logs in to NATS as itself (gateways, as one role, as "gateway"):
            # its own credentials file, by path.
            if not is_nats(name):
                argv = [*argv, "--config", str(config_path), "--nats-credentials", str(secrets.credentials(login or name))]
            self.children.append(Child(name, argv, run_dir / f"{name}.log"))

        add("nats", [str(nats_bin), "-c", str(secrets.nats_config)])
        for i, peer in enumerate(self.nats_peers):  # a cluster: every server reads the one file, told who it is
            name = nats_name(i)
            if i:
                add(name, [str(nats_bin), "-c", str(secrets.nats_config)])
            self.children[-1].env = server_environment(peer, name, secrets.folder / f"jetstream-{i}")
        faults = ["--fault-injection"] if o.fault_injection else []
        for n in range(o.nodes):
            ids = ["--instance-id", f"messenger-{n}", "--node", f"node-{n}", *self._metrics_port(f"messenger-{n}")]
            kv_key = ["--kv-key-file", str(secrets.kv_key)]
            add(f"messenger-{n}", [*py, "services.messenger", *ids, *kv_key, *faults])
        for name in secrets_layout(self.options).conductor_names():
            tenants = ["--tenants", str(o.tenants.absolute())] if o.tenants is not None else []
            add(name, [*py, "services.conductor", "--instance-id", name, *tenants, *self._metrics_port(name)])
        # Instances are spread over the nodes: prefills from the first node, decodes from the last.
        # One whose engine died exits (shared/engine/runtime.py) and comes back with a
        # new engine, announcing a new pid the Conductor starts afresh from.
        prefills, decodes = o.instances
        for i in range(prefills):
            node = f"node-{i % o.nodes}"
            stages = ["--stages", str(o.stages(i))] if o.stages(i) > 1 else []
            add(f"prefill-{i}", [*py, "services.prefill", "--instance-id", f"prefill-{i}", "--node", node, *stages,
                                 *self._metrics_port(f"prefill-{i}")])
        for i in range(decodes):
            node = f"node-{(o.nodes - 1 - i) % o.nodes}"
            add(f"decode-{i}", [*py, "services.decode", "--instance-id", f"decode-{i}", "--node", node,
                                *self._metrics_port(f"decode-{i}")])
        key = ["--api-key-file", str(secrets.api_key)] if secrets.api_key is not None else []
        key += ["--cache-key-file", str(secrets.cache_key)]
        key += ["--tenants", str(o.tenants.absolute())] if o.tenants is not None else []
        for i, url in enumerate(self.urls):
            name = f"gateway-{i}" if i else "gateway"
            if i:
                self.metrics[name] = f"{url}/metrics"
            add(name, [*py, "services.gateway", "--host", o.host, "--port", str(o.port + i), *key], login="gateway")

    def _metrics_port(self, name: str) -> list[str]:
        return ["--metrics-port", str(self._draw_metrics_port(name))]

    def _draw_metrics_port(self, name: str) -> int:
        """A free port for the process's Prometheus page, listed in the ready file."""
        port = free_port()
        self.metrics[name] = f"http://127.0.0.1:{port}/metrics"
        return port

    def start(self) -> float:
        """Start every child and wait until every gateway sees every instance; the seconds it took."""
        o = self.options
        refuse_unloadable_transport(o.config)
        refuse_taken_ports(o.port, o.host, o.nats_port, o.gateways)
        devices = gpus.assign(o.gpu_needs(), gpus.usable(o.gpus, gpus.listed_gpus()))
        sizes = (sum(o.instances), o.config.kv_cache_gib, o.nodes, o.config.pool_bytes)
        if not devices:  # CPU engines: their KV caches come out of this machine's memory
            refuse_oversized_memory(*sizes, memory_total())
        started = time.monotonic()
        run_dir = o.run_dir or Path(tempfile.mkdtemp(prefix="yuebing-"))
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_lock = lock_run_dir(run_dir)
        if not devices and (warning := memory_warning(*sizes, memory_available())):
            say(f"warning: {warning}")  # after every refusal: a mistake is still one line
        clear_last_run(run_dir, o.ready_file)
        nats_port = o.nats_port or free_port()
        if o.nats_servers > 1:
            self.nats_peers = [Peer("127.0.0.1", nats_port if not i else free_port(), free_port())
                               for i in range(o.nats_servers)]
        self.secrets = make_secrets(run_dir / "secrets", o, Listen("127.0.0.1", nats_port, o.nats_tls,
                                                                  cluster=tuple(self.nats_peers)))
        config = self.config(run_dir, self.secrets.nats_url)
        say(f"time models from {profile_path(config)}: default SLOs TTFT {config.slo_ttft_ms:.0f} ms, "
            f"TBT {config.slo_tbt_ms:.0f} ms")
        config_path = run_dir / "cluster.json"
        save_config(config, config_path)
        self.plan(run_dir, config_path, self.secrets)
        self.give_gpus(devices)
        self.env = {**child_environment(), **engine_environment(config), "PYTHONUNBUFFERED": "1"}
        say(f"starting {len(self.children)} processes; logs in {run_dir}")
        for child in self.children:
            self.launch(child)
            if is_nats(child.name):
                process.wait_for_port(child.env.get("NATS_PORT", nats_port), timeout_s=10)
        self.wait_ready(started)
        elapsed = time.monotonic() - started
        self.ready = self.ready_state(config, run_dir, elapsed)
        self.write_ready()
        return elapsed

    def write_ready(self) -> None:
        """The ready file, written whole and renamed: a reader never sees half of it."""
        ready_file = self.options.ready_file
        if ready_file and self.ready is not None:
            part = ready_file.with_name(ready_file.name + ".part")
            part.write_text(json.dumps(self.ready, indent=2))
            part.replace(ready_file)

    def give_gpus(self, devices: dict[str, str]) -> None:
        """Each planned engine sees only its own GPUs (`gpus.assign`'s plan)."""
        for child in self.children:
            if child.name in devices:
                child.env = {"CUDA_VISIBLE_DEVICES": devices[child.name]}
        if devices:
            say("GPUs: " + ", ".join(f"{name} {ids}" for name, ids in devices.items()))

    def config(self, run_dir: Path, nats_url: str) -> ClusterConfig:
        """The options' config with this run's NATS address and KV folder."""
        config = self.options.config
        # Each cluster gets its own pool files and node sockets, so two clusters on one
        # machine (tests do this) never share a node.
        kv_dir = config.kv_dir or str(self.make_kv_dir(run_dir))
        self.kv_dir = Path(kv_dir)
        # Derived once here (the model's fingerprint, its profile, the SLOs), so every service agrees.
        config = msgspec.structs.replace(config, nats_url=nats_url, kv_dir=kv_dir)
        return resolved(with_profile(config, cancelled=lambda: self.stopping))  # Ctrl-C ends a profile pass

    def make_kv_dir(self, run_dir: Path) -> Path:
        """This run's KV folder, once the folders of launchers that died are gone."""
        shm = Path("/dev/shm")
        parent = shm if shm.is_dir() else run_dir
        for folder in kv_folders.sweep(parent):
            say(f"removed {folder}: its launcher is gone")
        folder, self.kv_lock = kv_folders.make(parent)
        return folder

    def ready_state(self, config: ClusterConfig, run_dir: Path, elapsed: float) -> dict:
        """What the ready file says (tests/e2e and the live benchmarks read it)."""
        return {
            "url": self.url,
            "urls": self.urls,
            "nats_url": config.nats_url,
            # What tests and operators use to ask the cluster over NATS.
            "admin_credentials": str(self.secrets.credentials("admin")) if self.secrets else "",
            "run_dir": str(run_dir),
            "pids": {c.name: c.process.pid for c in self.children if c.process},
            "startup_s": elapsed,
            "layout": self.options.layout(),
            "metrics": {"gateway": f"{self.url}/metrics", **self.metrics},
        }

    def launch(self, child: Child) -> None:
        env = {**self.env, **child.env} if self.env or child.env else None
        child.process = process.spawn(child.argv, child.log_path, env)

    def expected_instances(self) -> set[str]:
        return {c.name for c in self.children if c.name.split("-")[0] in ("prefill", "decode", "messenger")}

    def wait_ready(self, started: float) -> None:
        want = self.expected_instances()
        while True:
            looping = self.check_children()
            if looping:
                raise RuntimeError(f"{', '.join(looping)} kept dying during start-up")
            if failed := [c.name for c in self.children if c.failed]:
                raise RuntimeError(f"{', '.join(failed)} could not start (see its log)")
            if self.stopping:
                raise RuntimeError("stopped before the cluster was ready")
            seen = self.live_instances()
            if seen is not None and want <= seen:
                return
            if time.monotonic() - started > self.options.start_timeout_s:
                missing = sorted(want - (seen or set()))
                raise RuntimeError(f"not ready after {self.options.start_timeout_s:.0f}s; missing {missing}")
            time.sleep(0.5)

    def live_instances(self) -> set[str] | None:
        """The instances every gateway sees alive (None: a gateway not answering yet)."""
        seen = [gateway_sees(url) for url in self.urls]
        return None if None in seen else set.intersection(*seen)  # type: ignore[arg-type]

    def check_children(self) -> list[str]:
        """Report children that died and schedule their restart; start those that are
        due. Returns the children in a crash loop, which stops the cluster."""
        now = time.monotonic()
        looping = []
        for child in self.children:
            if self.stopping:
                break
            if child.start_at is not None and now >= child.start_at:
                self.restart(child)
            elif child.start_at is None and not child.failed and child.process is not None \
                    and child.process.poll() is not None:
                if not self.died(child, now):
                    looping.append(child.name)
        return looping

    def died(self, child: Child, now: float) -> bool:
        """Report a death and schedule the restart; False if the cluster must stop (a
        crash loop, or a required child given up)."""
        child.deaths.append(now)
        code = child.process.returncode
        child.failures.append(f"{process.describe_exit(code)}: {process.tail(child.log_path, 1)}" if code > 0 else "")
        say(f"{child.name} (pid {child.process.pid}) {process.describe_exit(code)}; last lines of {child.log_path}:")
        print(process.tail(child.log_path), file=sys.stderr, flush=True)
        delay = self.policy.delay(child.deaths, now)
        if delay is None:
            say(f"{child.name} died {self.policy.crash_loop} times in {self.policy.window_s:.0f}s: a crash loop; "
                "stopping the cluster")
            self.stopping = self.failed = True
            return False
        if self.policy.gives_up(child.failures):
            return self.give_up(child)
        child.start_at = now + delay
        say(f"restarting {child.name} in {delay:.1f}s")
        return True

    def give_up(self, child: Child) -> bool:
        """Mark a child that keeps failing the same way as failed, in one line; an
        engine instance's slot stays empty (the Conductor places around it), any other
        child stops the cluster. False if the cluster must stop."""
        child.failed = True
        say(f"{child.name} failed {self.policy.same_in_a_row} times in a row the same way "
            f"({child.failures[-1]}); not starting it again")
        if child.name.split("-")[0] in ("prefill", "decode"):
            return True
        say("stopping the cluster")
        self.stopping = self.failed = True
        return False

    def restart(self, child: Child) -> None:
        child.start_at = None
        child.restarts += 1
        self.rebook_metrics_port(child)
        self.launch(child)
        say(f"{child.name} restarted (pid {child.process.pid}, restart {child.restarts})")

    def rebook_metrics_port(self, child: Child) -> None:
        """A child whose metrics port another program holds now (its bind failed, or
        the port was taken while it was down) starts again on a free one."""
        if "--metrics-port" not in child.argv:
            return
        at = child.argv.index("--metrics-port") + 1
        old = int(child.argv[at])
        if not process.port_taken(old):
            return
        port = self._draw_metrics_port(child.name)
        child.argv[at] = str(port)
        if self.ready is not None:
            self.ready["metrics"][child.name] = self.metrics[child.name]
            self.write_ready()
        say(f"{child.name}'s metrics port {old} is taken: it starts again on {port}")

    def supervise(self) -> None:
        while not self.stopping:
            self.check_children()
            time.sleep(0.5)

    def stop(self, grace_s: float = 15.0) -> None:
        self.stopping = True
        # Services first (they drain their NATS connections), nats-server last.
        self._stop([c for c in self.children if not is_nats(c.name)], grace_s)
        self._stop([c for c in self.children if is_nats(c.name)], grace_s)
        if self.kv_dir is not None and not self.options.config.kv_dir:
            shutil.rmtree(self.kv_dir, ignore_errors=True)
        for lock in (self.kv_lock, self.run_lock):  # the folders are free for the next launcher
            if lock is not None:
                os.close(lock)
        self.kv_lock = self.run_lock = None

    def _stop(self, children: list[Child], grace_s: float) -> None:
        started = {c.process: c for c in children if c.process is not None}
        for proc in process.stop(list(started), grace_s):
            say(f"{started[proc].name} did not stop in {grace_s:.0f}s; killed it")


def with_profile(config: ClusterConfig, cancelled: Callable[[], bool] = lambda: False) -> ClusterConfig:
    """The config with its model's time-model profile (yuebing/profile_cache.py) where it
    names none; fake engines keep the shipped one, which they imitate."""
    if config.profile or config.fake_engine_step_ms or not (Path(config.model) / "config.json").is_file():
        return config
    fp = config.model_fingerprint or fingerprint(config.model)
    path = profile_cache.ensure(Path(config.model), config.dtype, say, fp, cancelled)
    return msgspec.structs.replace(config, profile=str(path), model_fingerprint=fp)


def clear_last_run(run_dir: Path, ready_file: Path | None) -> None:
    """A run folder used before holds its last run's secrets (never overwritten, so
    made anew) and maybe its ready file, which would name a cluster no longer there.
    Called with the folder's lock held: no other launcher is using them."""
    if ready_file is not None:
        ready_file.unlink(missing_ok=True)
    old = run_dir / "secrets"
    if old.is_symlink():
        raise ValueError(f"{old} is a symbolic link: refusing to use it for this run's secrets")
    if old.exists():
        shutil.rmtree(old)


def secrets_layout(o: UpOptions) -> Layout:
    return Layout(*o.instances, o.nodes, conductors=o.config.conductors)


def nats_name(i: int) -> str:
    """The cluster's NATS servers: `nats`, then `nats-1`, `nats-2`..."""
    return f"nats-{i}" if i else "nats"


def is_nats(name: str) -> bool:
    return name == "nats" or name.startswith("nats-")


def make_secrets(folder: Path, o: UpOptions, listen: Listen) -> Secrets:
    """This run's secrets: NATS identities on loopback, and the API key if there is one."""
    made = generate(folder, secrets_layout(o), listen)
    key = api_key(o.api_key_file)
    if o.tenants is not None:
        check_tenants(o.tenants, key)
    return dataclasses.replace(made, api_key=write_private(folder / "api-key", key.encode())) if key else made


def check_tenants(path: Path, key: str) -> None:
    """A tenants file that the gateways will serve (refused before anything starts)."""
    if key:
        raise ValueError("--tenants replaces the API key: unset $YUEBING_API_KEY or --api-key-file (give that key "
                         "to a tenant in the file)")
    tenants.load(str(path))


def api_key(path: Path | None) -> str:
    """The key from --api-key-file, else $YUEBING_API_KEY; never from a command line."""
    if path is not None:
        key = read_private(path).decode().strip()
        if not key:
            raise ValueError(f"{path} is empty")
        return key
    return os.environ.get("YUEBING_API_KEY", "")


# Secrets a user may have in the launcher's environment: each child gets its own by
# path instead, and the API key only reaches the gateway.
PRIVATE_ENV = ("YUEBING_API_KEY", "YUEBING_API_KEY_FILE", "YUEBING_NATS_CREDENTIALS", "YUEBING_KV_KEY_FILE",
               "YUEBING_TENANTS_FILE", "YUEBING_CACHE_KEY_FILE")


def child_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}


RUN_LOCK = "yuebing-up.lock"
GATEWAY_PORTS = 4  # a started cluster's --port and the next ones: room for --gateways up to this many


def lock_run_dir(run_dir: Path) -> int:
    """Hold `run_dir` for this launcher (an open, locked file): a second `yuebing up` on
    it would write over the first one's config, secrets and logs. Refused in one line."""
    fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ValueError(f"another yuebing up (pid {holder}) is using run folder {run_dir}: stop it, "
                         "or choose another --run-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def say(text: str) -> None:
    print(f"[yuebing] {text}", file=sys.stderr, flush=True)


def up(options: UpOptions) -> int:
    cluster = Cluster(options)

    def on_signal(signum: int, _frame: object) -> None:
        cluster.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        elapsed = cluster.start()
        served = f"{options.layout()}, model {options.config.served_model_name}"
        say(f"ready in {elapsed:.1f}s: OpenAI API at {cluster.url}/v1 ({served}); Ctrl-C stops")
        cluster.supervise()
        code = 1 if cluster.failed else 0
    except RuntimeError as e:
        say(f"error: {e}")
        code = 1
    finally:
        if cluster.children or cluster.kv_dir is not None:  # a start refused at once has nothing to stop
            say("stopping")
            cluster.stop()
            say("stopped")
    return code


@contextmanager
def up_process(work: Path, name: str, *flags: str, timeout_s: float = 600.0) -> Iterator[str]:
    """`yuebing up *flags` as a child process, for benchmarks: its log, run folder and
    ready file under `work`, named after `name`. Yields the API's URL once the cluster
    is ready, and stops it as Ctrl-C would on leaving."""
    with up_launcher(work, name, *flags, timeout_s=timeout_s) as (url, _proc):
        yield url


@contextmanager
def up_launcher(work: Path, name: str, *flags: str, timeout_s: float = 600.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Like `up_process`, also yielding the launcher (its children are the cluster's processes)."""
    ready = work / f"{name}.ready.json"
    argv = [sys.executable, "-m", "yuebing", "up", "--port", str(free_ports(GATEWAY_PORTS)),
            "--run-dir", str(work / name), "--ready-file", str(ready), *flags]
    log = work / f"{name}.log"
    ready.unlink(missing_ok=True)  # a last run's would read as this one ready
    proc = process.spawn(argv, log, {**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        yield process.wait_until(lambda: _ready_url(ready), proc, timeout_s, f"yuebing up (see {log})"), proc
    finally:
        process.stop([proc], grace_s=60.0, sig=signal.SIGINT)


def _ready_url(ready: Path) -> str | None:
    return json.loads(ready.read_text())["url"] if ready.exists() else None
