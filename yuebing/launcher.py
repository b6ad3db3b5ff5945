"""`yuebing up`: the local cluster as child processes of one launcher.

Starts nats-server and every service with one shared config file, waits until the
gateway sees every instance alive, and supervises: a child that dies is reported
with its exit status and the tail of its log; Ctrl-C (or SIGTERM) stops them all.
Each child runs in its own process group and gets SIGTERM if the launcher itself
dies (PR_SET_PDEATHSIG), so nothing is left behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import ClusterConfig, save_config
from shared.engine import engine_environment

PR_SET_PDEATHSIG = 1
MAX_RESTARTS = 5  # per child that is restarted at all


@dataclass(frozen=True)
class UpOptions:
    config: ClusterConfig
    prefill: int = 1
    decode: int = 1
    nodes: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    nats_port: int = 0  # 0: a free port
    api_key: str | None = None
    run_dir: Path | None = None
    ready_file: Path | None = None
    start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1 or self.nodes < 1:
            raise ValueError("--prefill, --decode and --nodes must each be at least 1")


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    critical: bool  # the cluster cannot serve without it
    restart: bool = False  # started again when it dies (its state is rebuilt from the others)
    process: subprocess.Popen[bytes] | None = None
    reported: bool = False
    restarts: int = 0


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: process groups still cover an orderly stop
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class Cluster:
    options: UpOptions
    children: list[Child] = field(default_factory=list)
    stopping: bool = False
    failed: bool = False  # a required child died
    kv_dir: Path | None = None  # pool files and node sockets, removed at stop
    env: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # messenger → its Prometheus page

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.options.port}"

    def plan(self, run_dir: Path, config_path: Path, nats_port: int) -> None:
        o = self.options
        py = [sys.executable, "-m"]
        nats_bin = Path(sys.executable).with_name("nats-server")
        cfg = ["--config", str(config_path)]

        def add(name: str, argv: list[str], critical: bool, restart: bool = False) -> None:
            self.children.append(Child(name, argv, run_dir / f"{name}.log", critical, restart))

        add("nats", [str(nats_bin), "-a", "127.0.0.1", "-p", str(nats_port)], True)
        for n in range(o.nodes):
            port = free_port()
            self.metrics[f"messenger-{n}"] = f"http://127.0.0.1:{port}/metrics"
            argv = [*py, "services.messenger", *cfg, "--instance-id", f"messenger-{n}", "--node", f"node-{n}", "--metrics-port", str(port)]
            add(f"messenger-{n}", argv, False)
        # The Conductor rebuilds its view from heartbeats and the messengers' snapshots,
        # so a dead one is simply started again.
        add("conductor", [*py, "services.conductor", *cfg], False, restart=True)
        # Instances are spread over the nodes: prefills from the first node, decodes from the last.
        for i in range(o.prefill):
            node = f"node-{i % o.nodes}"
            add(f"prefill-{i}", [*py, "services.prefill", *cfg, "--instance-id", f"prefill-{i}", "--node", node], False)
        for i in range(o.decode):
            node = f"node-{(o.nodes - 1 - i) % o.nodes}"
            add(f"decode-{i}", [*py, "services.decode", *cfg, "--instance-id", f"decode-{i}", "--node", node], False)
        gw = [*py, "services.gateway", *cfg, "--host", o.host, "--port", str(o.port)]
        add("gateway", gw, True)

    def start(self) -> float:
        o = self.options
        started = time.monotonic()
        run_dir = o.run_dir or Path(tempfile.mkdtemp(prefix="yuebing-"))
        run_dir.mkdir(parents=True, exist_ok=True)
        nats_port = o.nats_port or free_port()
        config = o.config
        # Each cluster gets its own pool files and node sockets, so two clusters on one
        # machine (tests do this) never share a node.
        shm = Path("/dev/shm")
        kv_dir = config.kv_dir or tempfile.mkdtemp(prefix="yuebing-kv-", dir=shm if shm.is_dir() else run_dir)
        self.kv_dir = Path(kv_dir)
        fields = {f: getattr(config, f) for f in config.__struct_fields__}
        config = ClusterConfig(**{**fields, "nats_url": f"nats://127.0.0.1:{nats_port}", "kv_dir": kv_dir})
        config_path = run_dir / "cluster.json"
        save_config(config, config_path)
        self.plan(run_dir, config_path, nats_port)
        env = {**os.environ, **engine_environment(config), "PYTHONUNBUFFERED": "1"}
        if o.api_key:
            env["YUEBING_API_KEY"] = o.api_key
        say(f"starting {len(self.children)} processes; logs in {run_dir}")
        self.env = env
        for child in self.children:
            self.launch(child)
            if child.name == "nats":
                wait_for_port(nats_port, timeout=10)
        self.wait_ready(started)
        elapsed = time.monotonic() - started
        if o.ready_file:
            state = {
                "url": self.url,
                "nats_url": config.nats_url,
                "run_dir": str(run_dir),
                "pids": {c.name: c.process.pid for c in self.children if c.process},
                "startup_s": elapsed,
                "metrics": {"gateway": f"{self.url}/metrics", **self.metrics},
            }
            o.ready_file.write_text(json.dumps(state, indent=2))
        return elapsed

    def launch(self, child: Child) -> None:
        log_file = open(child.log_path, "ab")  # noqa: SIM115 - handed to the child
        child.process = subprocess.Popen(
            child.argv, stdout=log_file, stderr=subprocess.STDOUT, env=self.env, start_new_session=True, preexec_fn=_die_with_parent
        )
        log_file.close()

    def expected_instances(self) -> set[str]:
        return {c.name for c in self.children if c.name.split("-")[0] in ("prefill", "decode", "messenger")}

    def wait_ready(self, started: float) -> None:
        want = self.expected_instances()
        while True:
            dead = self.check_children()
            if dead:
                raise RuntimeError(f"{', '.join(dead)} died during start-up")
            if self.stopping:
                raise RuntimeError("stopped before the cluster was ready")
            seen = self.live_instances()
            if seen is not None and want <= seen:
                return
            if time.monotonic() - started > self.options.start_timeout_s:
                raise RuntimeError(f"not ready after {self.options.start_timeout_s:.0f}s; missing {sorted(want - (seen or set()))}")
            time.sleep(0.5)

    def live_instances(self) -> set[str] | None:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        except (OSError, ValueError):
            return None
        return {iid for ids in body.get("instances", {}).values() for iid in ids}

    def check_children(self) -> list[str]:
        """Report children that died; restart those that are restarted, and return the
        names of the rest. A critical one stops the cluster."""
        dead = []
        for child in self.children:
            code = child.process.poll() if child.process else None
            if code is None or child.reported or self.stopping:
                continue
            child.reported = True
            say(f"{child.name} (pid {child.process.pid}) {describe_exit(code)}; last lines of {child.log_path}:")
            print(tail(child.log_path), file=sys.stderr, flush=True)
            if child.restart and not child.critical and child.restarts < MAX_RESTARTS:
                child.restarts += 1
                child.reported = False
                self.launch(child)
                say(f"{child.name} restarted (pid {child.process.pid}, restart {child.restarts} of {MAX_RESTARTS})")
                continue  # back, so not dead: start-up goes on
            dead.append(child.name)
            if child.critical:
                say(f"{child.name} is required; stopping the cluster")
                self.stopping = self.failed = True
        return dead

    def supervise(self) -> None:
        while not self.stopping:
            self.check_children()
            time.sleep(0.5)

    def stop(self, grace_s: float = 15.0) -> None:
        self.stopping = True
        # Services first (they drain their NATS connections), nats-server last.
        services = [c for c in self.children if c.name != "nats"]
        self._stop_group(services, grace_s)
        self._stop_group([c for c in self.children if c.name == "nats"], grace_s)
        if self.kv_dir is not None and not self.options.config.kv_dir:
            shutil.rmtree(self.kv_dir, ignore_errors=True)

    def _stop_group(self, children: list[Child], grace_s: float) -> None:
        for child in children:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in children:
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{child.name} did not stop in {grace_s:.0f}s; killing it")
            # Kill what is left in the group (e.g. a vLLM engine-core process).
            _signal_group(child, signal.SIGKILL)


def _signal_group(child: Child, sig: signal.Signals) -> None:
    if child.process is None:
        return
    try:
        os.killpg(child.process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_for_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout:.0f}s")


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
        o = options
        say(
            f"ready in {elapsed:.1f}s: OpenAI API at {cluster.url}/v1 "
            f"({o.prefill} prefill, {o.decode} decode, {o.nodes} node{'s' * (o.nodes > 1)}, model {o.config.served_model_name}); Ctrl-C stops"
        )
        cluster.supervise()
        code = 1 if cluster.failed else 0
    except RuntimeError as e:
        say(f"error: {e}")
        code = 1
    finally:
        say("stopping")
        cluster.stop()
        say("stopped")
    return code
