"""The KV-transfer tests again, over ZeroMQ (`--kv-transport zmq`; the default is
tcp): a cluster of their own, the same assertions (tests/e2e/transfer_suite.py)."""

from __future__ import annotations

import pytest

from tests.e2e.ops import cluster_over
from tests.e2e.transfer_suite import *  # noqa: F403 (the suite's tests, collected here)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(launcher, tmp_path_factory):
    yield from cluster_over(launcher, tmp_path_factory.mktemp("zmq"), "zmq")


def test_the_messengers_run_zeromq(cluster):
    for node in ("0", "1"):
        assert '"kv_transport":"zmq"' in cluster.log(f"messenger-{node}")
