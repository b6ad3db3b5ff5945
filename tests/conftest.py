"""Suite-wide order. Two clusters and the reference engine at once do not fit this
machine's memory (an engine is three processes and ~3.4 GB; with twenty-odd GB in
use the engines thrashed and every heartbeat missed), so tests run in four groups
(the reference engine, one engine, lives through the session):

0. everything that starts no cluster;
1. the tests on the session's shared cluster (tests/e2e/conftest.py);
2. those of them marked `destructive` (they kill its processes);
3. the modules that start clusters of their own, once the shared one has stopped
   (it stops after the last test of groups 1-2: tests/e2e/conftest.py).

A module goes whole into the group of its first test, so that its own module-scoped
cluster starts once."""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.suite_report"]  # where the time went, printed at the end of each run

SHARED = "cluster_process"  # the fixture that starts the shared cluster (tests/e2e/conftest.py)
OWN = "launcher"  # the fixture that starts a cluster of a test's own


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _group(item: pytest.Item, shared_modules: set[str], own_modules: set[str]) -> int:
    if _module(item) in shared_modules:
        return 2 if item.get_closest_marker("destructive") else 1
    return 3 if _module(item) in own_modules else 0


def pytest_collection_modifyitems(config, items):
    shared = {_module(i) for i in items if SHARED in i.fixturenames}
    own = {_module(i) for i in items if OWN in i.fixturenames} - shared
    items.sort(key=lambda item: _group(item, shared, own))
