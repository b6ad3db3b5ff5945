"""The suite's real local clusters (`yuebing up`), one shared layout at a time
(tests/layouts.py: first the shared cluster, nats-server, two nodes' messengers,
conductor, 1 prefill on node-0, 1 decode on node-1, gateway; then the others), and
a plain in-process vLLM engine on the same model as the reference for greedy
outputs, for the whole session.

The clusters run with the default (loose) SLOs, so only requests that ask for tight
SLOs in their headers can be rejected."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from shared.config import ClusterConfig, load_config
from shared.engine.llm import engine_environment
from tests.e2e.ops import openai_client
from tests.layouts import LAYOUTS, REAL_MODEL, TENANT_KEYS, TOOL_CALL_PARSER, write_tenants
from tests.reference import DTYPE
from tests.suite_report import SuiteReport, suite_report
from yuebing import process
from yuebing.lab.otlp import receiving
from yuebing.launcher import GATEWAY_PORTS
from yuebing.model import default_model_dir
from yuebing.process import free_port, free_ports

MAX_MODEL_LEN = 1024
POOL_MIB = 128  # the tiny model's KV: 512 KiB a 128-token block, so 256 blocks a node
START_TIMEOUT_S = 420
SERVE_START_TIMEOUT_S = 240


@dataclass
class Cluster:
    url: str
    nats_url: str
    pids: dict[str, int]
    run_dir: Path
    launcher: subprocess.Popen
    launcher_log: Path
    metrics: dict[str, str]  # service → its Prometheus page
    admin_credentials: Path  # the admin NATS identity: what tests ask the services with
    urls: list[str]  # every gateway's (`url` is the first's)
    api_key: str = ""  # what its OpenAI clients send (tests/e2e/ops.py); "": none asked

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    def config(self) -> ClusterConfig:
        """The config file this run's services read (with the launcher's additions)."""
        return load_config(self.run_dir / "cluster.json")

    def credentials(self, identity: str) -> Path:
        """Another identity's NATS credentials (the security tests log in as them)."""
        return self.run_dir / "secrets" / f"{identity}.nats.json"

    def log(self, name: str) -> str:
        return (self.run_dir / f"{name}.log").read_text(errors="replace")


@pytest.fixture(scope="session")
def real_model_dir(request) -> Path:
    """The real model, fetched while the tests before its layout ran (`start_fetch`)."""
    path = real_model_path()
    fetching = request.config.stash.get(FETCHING, None)
    if fetching is not None:
        proc, log = fetching
        try:
            proc.wait(timeout=FETCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.stop([proc], grace_s=5)
            pytest.fail(f"yuebing model fetch took over {FETCH_TIMEOUT_S} s: {log.read_text()[-2000:]}")
        assert proc.returncode == 0, f"yuebing model fetch failed: {log.read_text()[-2000:]}"
        shutil.rmtree(log.parent, ignore_errors=True)  # its log, kept where it failed
    if not (path / "config.json").exists():
        pytest.fail(f"no model at {path}: `yuebing model fetch {REAL_MODEL} --out {path}` writes it")
    return path


def real_model_path() -> Path:
    return default_model_dir().parent / REAL_MODEL


def start_fetch(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`yuebing model fetch` in the background where a test will want the real model
    and it is not there yet: mostly one core's work (a download, a conversion, a
    profile on one engine thread) that runs beside the tests that come first."""
    path = real_model_path()
    if (path / "config.json").exists() or not any("real_model_dir" in item.fixturenames for item in items):
        return
    log = Path(tempfile.mkdtemp(prefix="yuebing-fetch-")) / "fetch.log"
    proc = process.spawn([sys.executable, "-m", "yuebing", "model", "fetch", REAL_MODEL, "--out", str(path)], log)
    config.stash[FETCHING] = (proc, log)
    config.add_cleanup(lambda: process.stop([proc], grace_s=5))


@dataclass
class Launch:
    """A `yuebing up` child process and where it reports."""

    proc: subprocess.Popen
    ready: Path
    log: Path
    flags: tuple[str, ...] = ()
    report: SuiteReport | None = None  # told of the cluster once it is ready

    def wait(self) -> Cluster:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready.exists():
            if self.proc.poll() is not None:
                pytest.fail(f"yuebing up exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"cluster not ready after {START_TIMEOUT_S}s:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.5)
        state = json.loads(self.ready.read_text())
        cluster = Cluster(
            state["url"], state["nats_url"], state["pids"], Path(state["run_dir"]), self.proc, self.log, state["metrics"],
            Path(state["admin_credentials"]), state["urls"],
        )
        if self.report is not None:
            fake = "--fake-engine-step-ms" in self.flags
            engines = 0 if fake else sum(1 for name in state["pids"] if name.startswith(("prefill-", "decode-")))
            layout = state["layout"] + (" (fake engines)" if fake else "") + f" [{' '.join(self.flags)}]"
            self.report.started(self.ready.parent.name, layout, engines, state["startup_s"], cluster)
        return cluster

    def stop(self) -> None:
        """Ctrl-C, then check that every process it started is gone (once: a second call does nothing)."""
        if self.proc.returncode is not None:
            return
        descendants = _descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            pytest.fail("yuebing up did not stop within 60 s of SIGINT")
        time.sleep(0.5)
        orphans = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not orphans, f"processes left behind after stop: {orphans}"
        assert "stopped" in self.log.read_text()


def launch(model_dir: Path, tmp: Path, *flags: str, report: SuiteReport | None = None) -> Launch:
    argv = [
        sys.executable, "-m", "yuebing", "up",
        "--model", str(model_dir),
        "--port", str(free_ports(GATEWAY_PORTS)),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--dtype", DTYPE,
        "--request-timeout", "60",
        # Loose SLOs: only requests that ask for tight ones in their headers are rejected.
        "--slo-ttft-ms", "10000", "--slo-tbt-ms", "1000",
        # Each node's pool is resident (shared memory): a few clusters and the
        # reference engine share this 24 GiB machine at once. A test may ask for more.
        "--pool-mib", str(POOL_MIB),
        "--run-dir", str(tmp / "run"),
        "--ready-file", str(tmp / "ready.json"),
        *flags,
    ]  # fmt: skip
    log = tmp / "launcher.log"
    # Its own process group, and SIGTERM (an orderly stop) if pytest dies: a pytest
    # killed before its teardown would otherwise leave the whole cluster running.
    return Launch(process.spawn(argv, log), tmp / "ready.json", log, flags, report)


# The shared layouts (tests/conftest.py, LAYOUTS), each stopped as soon as the last
# test that uses it has ended (tests/conftest.py orders the suite so that each one's
# users run together, one layout after another), not at the session's end. The same
# goes for plain vLLM's server, which tests on the first layout compare against.
FETCHING = pytest.StashKey[tuple]()  # the real model's fetch: (its process, its log)
FETCH_TIMEOUT_S = 900
SERVERS = ("vllm_serve", "real_vllm_serve")  # plain vLLM's servers, stopped after their last users too
STARTED = pytest.StashKey[dict]()  # fixture name → what it started (anything with a stop())
EARLY = pytest.StashKey[dict]()  # plain vLLM's servers started beside their layouts, not yet waited for
LAST_USER = pytest.StashKey[dict]()  # fixture name → the node id of the last test that uses it


@pytest.hookimpl(trylast=True)  # after tests/conftest.py has put the suite in order
def pytest_collection_modifyitems(config, items):
    last = {}
    for item in items:
        for name in (*LAYOUTS, *SERVERS):
            if name in item.fixturenames:
                last[name] = item.nodeid
    config.stash[LAST_USER] = last
    config.stash[STARTED] = {}
    config.stash[EARLY] = {}
    start_fetch(config, items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    started = item.config.stash.get(STARTED, {})
    for name, nodeid in item.config.stash.get(LAST_USER, {}).items():
        if nodeid == item.nodeid and name in started:
            started.pop(name).stop()


def started_for(request, name: str, it):
    """Remember what a shared fixture started, so that its last user's teardown stops it."""
    request.config.stash[STARTED][name] = it
    return it


@pytest.fixture(scope="session")
def launcher(model_dir, request):
    """Starts another cluster: launcher(tmp_dir, *flags) → Launch (wait() it, stop() it)."""
    return lambda tmp, *flags: launch(model_dir, tmp, *flags, report=suite_report(request.config))


@pytest.fixture(scope="session")
def otlp():
    """An OTLP/HTTP receiver the shared cluster sends its spans to (tests/e2e/test_tracing.py)."""
    with receiving() as receiver:
        yield receiver


def _layout(model_dir: Path, tmp_path_factory, request, name: str, *more: str, beside: tuple[str, str] = ()):
    """Starts the shared layout `name` (tests/layouts.py) without waiting; stopped
    after its last user, or at the session's end. `beside`: plain vLLM's server
    (its fixture's name and dtype) to start with it (`_serve_beside`)."""
    started = launch(model_dir, tmp_path_factory.mktemp(name.removesuffix("_process")), *LAYOUTS[name], *more,
                     report=suite_report(request.config))
    if beside:
        _serve_beside(request, beside[0], model_dir, beside[1], tmp_path_factory)
    yield started_for(request, name, started)
    started.stop()


@pytest.fixture(scope="session")
def cluster_process(model_dir, tmp_path_factory, request, otlp):
    """The shared cluster, started without waiting so the reference engine loads
    meanwhile, and plain vLLM's server beside it."""
    yield from _layout(model_dir, tmp_path_factory, request, "cluster_process", "--otlp-endpoint", otlp.endpoint,
                       beside=("vllm_serve", DTYPE))


@pytest.fixture(scope="session")
def two_of_each_process(model_dir, tmp_path_factory, request):
    yield from _layout(model_dir, tmp_path_factory, request, "two_of_each_process")


@pytest.fixture(scope="session")
def two_of_each(two_of_each_process) -> Cluster:
    """Two nodes, two prefill and two decode instances (cache-aware placement), for the
    tests that need a second instance of a role: retry and migration, scheduling, chaos."""
    return two_of_each_process.wait()


@pytest.fixture(scope="session")
def tenants_file(tmp_path_factory) -> Path:
    """The tenants of the two-Conductor layout (tests/layouts.py): rewritten by the tenants' tests."""
    return write_tenants(tmp_path_factory.mktemp("tenants"))


@pytest.fixture(scope="session")
def two_conductors_process(model_dir, tmp_path_factory, request, tenants_file):
    yield from _layout(model_dir, tmp_path_factory, request, "two_conductors_process", "--tenants", str(tenants_file))


@pytest.fixture(scope="session")
def two_conductors(two_conductors_process) -> Cluster:
    """Two gateways and two Conductors over one prefill and one decode instance, KV
    over ZeroMQ, tenants: the Conductors' tests, the KV-transfer tests over that
    transport, and the tenants' tests. Its OpenAI clients are a tenant's (`ops`);
    plain HTTP requests sending no key, the anonymous tenant's."""
    return dataclasses.replace(two_conductors_process.wait(), api_key=TENANT_KEYS["ops"])


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@dataclass
class Served:
    """Plain vLLM's OpenAI server, started by `vllm_serve`."""

    proc: subprocess.Popen
    api: str  # its /v1 URL
    log: Path
    started: float  # when it was spawned (monotonic)

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="session")
def vllm_serve(model_dir, cluster, tmp_path_factory, request):
    """Plain vLLM's OpenAI server on the same model, dtype and tool parser, for the
    tests that compare whole API responses (started beside the shared cluster when
    anything collected uses it: `_serve_beside`); its /v1 URL. Its users run one
    after another and it stops after the last: a resident engine more would crowd
    the later layouts out of memory."""
    yield from _serve(model_dir, DTYPE, tmp_path_factory, request, "vllm_serve")


@pytest.fixture(scope="session")
def real_model_process(real_model_dir, tmp_path_factory, request):
    yield from _layout(real_model_dir, tmp_path_factory, request, "real_model_process",
                       beside=("real_vllm_serve", "auto"))


@pytest.fixture(scope="session")
def real_model(real_model_process) -> Cluster:
    """The real model's cluster (tests/layouts.py)."""
    return real_model_process.wait()


@pytest.fixture(scope="session")
def real_vllm_serve(real_model_dir, real_model, tmp_path_factory, request):
    """Plain vLLM's OpenAI server on the real model, as `real_model` serves it."""
    yield from _serve(real_model_dir, "auto", tmp_path_factory, request, "real_vllm_serve")


def _serve(model_dir: Path, dtype: str, tmp_path_factory, request, name: str):
    served = request.config.stash[EARLY].pop(name, None) or _spawn_serve(model_dir, dtype, tmp_path_factory)
    try:
        _wait_healthy(served.api.removesuffix("/v1"), served.proc, served.log)
        suite_report(request.config).started(name.replace("_", " "), f"plain vLLM's OpenAI server ({model_dir.name})",
                                             1, time.monotonic() - served.started, served.api)
        started_for(request, name, served)
        yield served.api
    finally:
        served.stop()


def _spawn_serve(model_dir: Path, dtype: str, tmp_path_factory) -> Served:
    port = free_port()
    # Its Responses store on, as Yuebing's is: chained responses compare with chained ones.
    env = {**os.environ, **engine_environment(ClusterConfig(kv_cache_gib=1)), "VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    log = tmp_path_factory.mktemp("vllm") / "serve.log"
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
            "--served-model-name", model_dir.name, "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN),
            "--enforce-eager", "--seed", "0", "--enable-auto-tool-choice", "--tool-call-parser", TOOL_CALL_PARSER]
    return Served(process.spawn(argv, log, env), f"http://127.0.0.1:{port}/v1", log, time.monotonic())


def _serve_beside(request, name: str, model_dir: Path, dtype: str, tmp_path_factory) -> None:
    """Start plain vLLM's server `name` now, beside a layout that is starting, when
    any collected test uses it: the two load at once on the machine's cores, rather
    than one after the other (its fixture then only waits for it)."""
    if any(name in item.fixturenames for item in request.session.items):
        early = request.config.stash[EARLY]
        early[name] = _spawn_serve(model_dir, dtype, tmp_path_factory)
        request.addfinalizer(lambda: early.pop(name).stop() if name in early else None)  # never waited for


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"vllm serve exited: {log.read_text()[-2000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"vllm serve not healthy within {SERVE_START_TIMEOUT_S} s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def cluster(cluster_process) -> Cluster:
    return cluster_process.wait()


@pytest.fixture(scope="session")
def client(cluster):
    return openai_client(cluster)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
