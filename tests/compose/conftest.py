"""One compose cluster (compose/docker-compose.yml, real containers) for the tests in
this folder, brought up as `make compose-up` does (yuebing/compose.py) under a project,
secrets, config and port of its own, and removed when this folder's tests end, so no
other cluster ever runs beside it. A machine where no Docker engine can start is the one
reason to skip."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.reference import DTYPE
from tests.suite_report import suite_report
from yuebing.compose import COMPOSE_DIR, ComposeOptions, DockerUnavailable, compose, down, ensure_engine, run, up
from yuebing.process import free_port

PROJECT = "yuebing-test"
MAX_MODEL_LEN = 1024


@dataclass
class ComposeCluster:
    options: ComposeOptions
    env: dict[str, str]

    @property
    def api(self) -> str:
        return f"{self.options.url}/v1"

    @property
    def key(self) -> str:
        return self.options.api_key_file.read_text().strip()

    def container(self, service: str) -> str:
        return f"{self.options.project}-{service}-1"

    def inspect(self, service: str, template: str) -> str:
        return run(["docker", "inspect", "-f", template, self.container(service)]).stdout.strip()

    def logs(self) -> str:
        return compose(self.options, "logs", "--tail", "40", env=self.env, check=False).stdout


def _config(folder: Path) -> Path:
    """compose/cluster.json with the dtype every greedy comparison pins."""
    config = json.loads((COMPOSE_DIR / "cluster.json").read_text())
    config.update(dtype=DTYPE, max_model_len=MAX_MODEL_LEN)
    path = folder / "cluster.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="package")
def compose_cluster(tmp_path_factory, request) -> ComposeCluster:
    tmp = tmp_path_factory.mktemp("compose")
    try:
        ensure_engine(tmp / "dockerd.log")
    except DockerUnavailable as e:
        pytest.skip(f"no Docker engine can run here: {e}")
    options = ComposeOptions(project=PROJECT, secrets=tmp / "secrets", config=_config(tmp), api_port=free_port(),
                             ready_timeout_s=600)
    started = time.monotonic()
    try:
        env = up(options, tmp)
    except BaseException:
        subprocess.run(["docker", "ps", "-a"], check=False)
        down(options)
        raise
    print(f"compose cluster up in {time.monotonic() - started:.0f}s")
    cluster = ComposeCluster(options, env)
    suite_report(request.config).started("compose", "compose/docker-compose.yml, containers", 2,
                                         time.monotonic() - started, cluster)
    yield cluster
    down(options)


@pytest.fixture(scope="package")
def compose_client(compose_cluster):
    from openai import OpenAI

    return OpenAI(base_url=compose_cluster.api, api_key=compose_cluster.key, timeout=120, max_retries=0)
