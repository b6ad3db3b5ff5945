"""The KV-transfer tests a cluster over another transport runs again: a module
imports them beside its own `cluster` fixture (tests/e2e/ops.py: `cluster_over`), and
pytest collects them there. Greedy outputs equal plain vLLM, decode computes none of
the prompt (its partial tail comes as a block too), a corrupted layer is detected, and a messenger killed
mid-transfer ends its requests cleanly."""

from __future__ import annotations

import pytest

from tests.e2e import test_faults, test_transfer
from tests.e2e.ops import openai_client


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster)


def test_decode_loads_prefill_kv_and_matches_plain_vllm(cluster, client, reference):
    test_transfer.test_decode_loads_prefill_kv_and_matches_plain_vllm(cluster, client, reference)


def test_concurrent_requests_each_load_their_own_blocks(cluster, client, reference):
    test_transfer.test_concurrent_requests_each_load_their_own_blocks(cluster, client, reference)


def test_a_block_corrupted_in_transit_is_detected_and_recomputed(cluster, client, reference):
    test_transfer.test_a_block_corrupted_in_transit_is_detected_and_recomputed(cluster, client, reference)


def test_decode_does_not_wait_for_blocks_prefills_pool_had_no_room_for(cluster, client, reference):
    test_transfer.test_decode_does_not_wait_for_blocks_prefills_pool_had_no_room_for(cluster, client, reference)


@pytest.mark.destructive
def test_killing_the_decode_nodes_messenger_mid_transfer(cluster, client, reference):
    """Last of the suite: it kills its cluster's messenger (tests after it only read logs)."""
    test_faults.test_killing_the_decode_nodes_messenger_mid_transfer(cluster, client, reference)
