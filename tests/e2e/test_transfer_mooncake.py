"""The KV-transfer tests again, over Mooncake's Transfer Engine (`--kv-transport
mooncake`, TCP here): a cluster of their own, the same assertions. Greedy outputs
equal plain vLLM, decode computes at most block_size - 1 prompt tokens, a corrupted
layer is detected, and a messenger killed mid-transfer ends its requests cleanly.
Skipped, saying why, only where the engine cannot load."""

from __future__ import annotations

import pytest

from tests.e2e import test_faults, test_transfer
from tests.e2e.ops import openai_client
from tests.messenger.test_mooncake_transport import WHY_NOT

pytestmark = pytest.mark.e2e

if WHY_NOT:
    pytest.skip(f"Mooncake Transfer Engine cannot load: {WHY_NOT}", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster(launcher, tmp_path_factory):
    started = launcher(tmp_path_factory.mktemp("mooncake"), "--nodes", "2", "--kv-transport", "mooncake",
                       "--fault-injection")
    try:
        yield started.wait()
    finally:
        started.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster)


def test_the_messengers_run_the_transfer_engine(cluster):
    for node in ("0", "1"):
        assert '"kv_transport": "mooncake"' in cluster.log(f"messenger-{node}")
        assert "mooncake transfer engine" in cluster.log(f"messenger-{node}")


def test_decode_loads_prefill_kv_and_matches_plain_vllm(cluster, client, reference):
    test_transfer.test_decode_loads_prefill_kv_and_matches_plain_vllm(cluster, client, reference)


def test_concurrent_requests_each_load_their_own_blocks(cluster, client, reference):
    test_transfer.test_concurrent_requests_each_load_their_own_blocks(cluster, client, reference)


def test_a_block_corrupted_in_transit_is_detected_and_recomputed(cluster, client, reference):
    test_transfer.test_a_block_corrupted_in_transit_is_detected_and_recomputed(cluster, client, reference)


def test_decode_does_not_wait_for_blocks_prefills_pool_had_no_room_for(cluster, client, reference):
    test_transfer.test_decode_does_not_wait_for_blocks_prefills_pool_had_no_room_for(cluster, client, reference)


def test_killing_the_decode_nodes_messenger_mid_transfer(cluster, client, reference):
    """Last here: it kills this module's own cluster's messenger, not the shared cluster's."""
    test_faults.test_killing_the_decode_nodes_messenger_mid_transfer(cluster, client, reference)
