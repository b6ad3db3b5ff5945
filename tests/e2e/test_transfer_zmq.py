"""The KV-transfer tests again, over ZeroMQ (`--kv-transport zmq`; the default is
tcp): a cluster of their own, the same assertions. Greedy outputs equal plain vLLM,
decode computes at most block_size - 1 prompt tokens, a corrupted layer is detected,
and a messenger killed mid-transfer ends its requests cleanly."""

from __future__ import annotations

import pytest

from tests.e2e import test_faults, test_transfer
from tests.e2e.ops import openai_client

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(launcher, tmp_path_factory):
    started = launcher(tmp_path_factory.mktemp("zmq"), "--nodes", "2", "--kv-transport", "zmq", "--fault-injection")
    try:
        yield started.wait()
    finally:
        started.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster)


def test_the_messengers_run_zeromq(cluster):
    for node in ("0", "1"):
        assert '"kv_transport": "zmq"' in cluster.log(f"messenger-{node}")


def test_decode_loads_prefill_kv_and_matches_plain_vllm(cluster, client, reference):
    test_transfer.test_decode_loads_prefill_kv_and_matches_plain_vllm(cluster, client, reference)


def test_a_block_corrupted_in_transit_is_detected_and_recomputed(cluster, client, reference):
    test_transfer.test_a_block_corrupted_in_transit_is_detected_and_recomputed(cluster, client, reference)


def test_killing_the_decode_nodes_messenger_mid_transfer(cluster, client, reference):
    """Last here: it kills this module's own cluster's messenger, not the shared cluster's."""
    test_faults.test_killing_the_decode_nodes_messenger_mid_transfer(cluster, client, reference)
