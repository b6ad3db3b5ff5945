"""The KV-transfer tests again, over ZeroMQ (`--kv-transport zmq`; the default is
tcp): on the shared two-conductors layout, whose KV moves over ZeroMQ (tests/layouts.py),
the same assertions (tests/e2e/transfer_suite.py)."""

from __future__ import annotations

import pytest

from tests.e2e.transfer_suite import *  # noqa: F403 (the suite's tests, collected here)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(two_conductors):
    return two_conductors


def test_the_messengers_run_zeromq(cluster):
    for node in ("0", "1"):
        assert '"kv_transport":"zmq"' in cluster.log(f"messenger-{node}")
