"""The KV-transfer tests again, over Mooncake's Transfer Engine (`--kv-transport
mooncake`, TCP here): a cluster of their own, the same assertions
(tests/e2e/transfer_suite.py). Skipped, saying why, only where the engine cannot load."""

from __future__ import annotations

import pytest

from tests.e2e.ops import cluster_over
from tests.e2e.transfer_suite import *  # noqa: F403 (the suite's tests, collected here)
from tests.messenger.test_mooncake_transport import WHY_NOT

pytestmark = pytest.mark.e2e

if WHY_NOT:
    pytest.skip(f"Mooncake Transfer Engine cannot load: {WHY_NOT}", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster(launcher, tmp_path_factory):
    yield from cluster_over(launcher, tmp_path_factory.mktemp("mooncake"), "mooncake")


def test_the_messengers_run_the_transfer_engine(cluster):
    for node in ("0", "1"):
        assert '"kv_transport":"mooncake"' in cluster.log(f"messenger-{node}")
        assert "mooncake transfer engine" in cluster.log(f"messenger-{node}")
