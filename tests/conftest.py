"""Suite-wide order. Two clusters and the reference engine at once do not fit this
machine's memory (an engine is three processes and ~3.4 GB; with twenty-odd GB in
use the engines thrashed and every heartbeat missed), so tests run in groups (the
reference engine, one engine, lives through the session):

0. everything that starts no cluster, then the compose cluster's tests;
1. for each shared layout in turn (tests/layouts.py), the tests that use it, then
   those of them marked `destructive` (they kill its processes; `last=True`: after
   the other destructive ones). Each layout stops after its last test
   (tests/e2e/conftest.py), before the next one starts;
2. the modules that start clusters of their own, once the shared ones have stopped.

A module goes whole into the group of its first layout, so that its own
module-scoped fixtures start once. Within a layout, the modules that compare against plain
`vllm serve` run first, one after another, so that its engine stops early."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.layouts import LAYOUTS
from tests.reference import Reference
from tests.suite_report import suite_report
from yuebing.model import default_model_dir

pytest_plugins = ["tests.suite_report"]  # where the time went, printed at the end of each run

OWN = "launcher"  # the fixture that starts a cluster of a test's own
SERVE = "vllm_serve"  # plain vLLM's server (tests/e2e/conftest.py)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _layout(item: pytest.Item) -> int | None:
    """The index of the shared layout the item uses (None: none)."""
    return next((i for i, name in enumerate(LAYOUTS) if name in item.fixturenames), None)


def _destructive(item: pytest.Item) -> int:
    """0: leaves its cluster as it found it; 1: kills its processes; 2: so, and last."""
    marker = item.get_closest_marker("destructive")
    return 0 if marker is None else 2 if marker.kwargs.get("last") else 1


def pytest_collection_modifyitems(config, items):
    layout: dict[str, int | None] = {}
    for item in items:
        found = [i for i in (layout.get(_module(item)), _layout(item)) if i is not None]
        layout[_module(item)] = min(found, default=None)
    own = {_module(i) for i in items if OWN in i.fixturenames}
    serving = {_module(i) for i in items if SERVE in i.fixturenames}

    def key(item: pytest.Item) -> tuple[int, ...]:
        module = _module(item)
        if layout[module] is not None:
            return (1, layout[module], _destructive(item), module not in serving)
        # The compose cluster after the other tests that start none: the real model's
        # fetch (tests/e2e/conftest.py start_fetch) then shares the machine with tests
        # that use one core, not with an image build and two engines.
        return (2,) if module in own else (0, module.startswith("tests/compose/"))

    items.sort(key=key)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    path = default_model_dir()
    if not (path / "config.json").exists():
        pytest.fail(f"no model at {path}: `make test` writes it (yuebing model init)")
    return path


@pytest.fixture(scope="session")
def reference(model_dir, request) -> Reference:
    """Plain vLLM in pytest, kept for the whole session from its first user on (the
    compose cluster's tests, then every layout's and the clusters of their own)."""
    started = time.monotonic()
    ref = Reference(model_dir)
    suite_report(request.config).started("reference", "plain vLLM engine in pytest", 1, time.monotonic() - started, ref)
    yield ref
    ref.close()
