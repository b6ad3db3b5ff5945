"""The cluster-wide store on a real cluster of three nodes: prefill-0 on node-0,
prefill-1 on node-1, decode-0 on node-2; the Conductor alternates prefill instances
(round robin), so only the store can make one reuse what the other computed."""

from __future__ import annotations

import os
import random
import signal
import time
import urllib.request

import pytest

from shared.block_hash import hex_hashes
from tests.e2e.ops import conductor_stats, messenger, openai_client

pytestmark = pytest.mark.e2e

BLOCK = 128
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def store_cluster(launcher, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store")
    # A small DRAM pool (15 blocks per node) so that a few prompts push blocks to SSD;
    # vLLM's own prefix cache off, so that every reuse goes through the store.
    started = launcher(tmp, "--prefill", "2", "--nodes", "3", "--policy", "round_robin", "--no-engine-prefix-cache",
                       "--pool-mib", "8", "--ssd-dir", str(tmp / "ssd"), "--ssd-mib", "64")
    cluster = started.wait()
    cluster.ssd = tmp / "ssd"
    yield cluster
    started.stop()


@pytest.fixture(scope="module")
def store_client(store_cluster):
    return openai_client(store_cluster)


def tokens(n: int, rnd: random.Random) -> list[int]:
    return [rnd.randrange(32, 127) for _ in range(n)]


def complete(client, ids: list[int]):
    r = client.completions.create(model="yuebing-tiny", prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"return_token_ids": True})
    return r.choices[0].model_extra["token_ids"], r.usage.prompt_tokens_details.cached_tokens, r.model_extra["yuebing"]


PREFIX = tokens(5 * BLOCK, random.Random(42))


def test_a_prefix_computed_on_one_node_is_reused_by_a_prefill_on_another(store_cluster, store_client, reference):
    rnd = random.Random(1)
    first = PREFIX + tokens(100, rnd)
    second = PREFIX + tokens(150, rnd)
    out1, cached1, where1 = complete(store_client, first)
    out2, cached2, where2 = complete(store_client, second)
    assert where1["prefill_instance"] != where2["prefill_instance"]  # round robin: the other node
    assert cached1 == 0
    assert cached2 >= len(PREFIX)  # pulled from another node's pool, not computed
    assert [out1, out2] == reference.greedy([first, second], MAX_TOKENS)
    # The prefill node's messenger received the blocks it did not compute.
    node = "node-0" if where2["prefill_instance"] == "prefill-0" else "node-1"
    assert messenger(store_cluster, node).blocks_received >= len(PREFIX) // BLOCK


def test_a_pull_sends_only_the_blocks_the_puller_lacks(store_cluster, store_client, reference):
    # Round robin goes on from the test above: the third prompt to the first one's
    # instance (it holds PREFIX and computes 2 blocks more), the fourth to the other,
    # whose node's pool holds PREFIX already (pulled above): only the 2 new blocks travel
    # (the model's context is 1,024 tokens).
    rnd = random.Random(2)
    longer = PREFIX + tokens(2 * BLOCK, rnd)
    third, fourth = longer + tokens(50, rnd), longer + tokens(70, rnd)
    _, _, where3 = complete(store_client, third)
    holder, puller = ("node-1", "node-0") if where3["prefill_instance"] == "prefill-1" else ("node-0", "node-1")
    sent0, got0 = messenger(store_cluster, holder), messenger(store_cluster, puller)
    out, cached, where4 = complete(store_client, fourth)
    assert where4["prefill_instance"] != where3["prefill_instance"]
    assert cached >= len(longer)
    assert out == reference.greedy([fourth], MAX_TOKENS)[0]
    sent, got = messenger(store_cluster, holder), messenger(store_cluster, puller)
    assert got.blocks_received - got0.blocks_received == 2
    # Every layer the holder sent was new to the puller: none of PREFIX's went again.
    assert sent.layers_out - sent0.layers_out == got.layers_in - got0.layers_in > 0


def ssd_totals(cluster) -> tuple[int, int, int]:
    """(hits from SSD, spills, damaged files dropped) over every node."""
    stats = [messenger(cluster, f"node-{n}") for n in range(3)]
    return sum(s.hits_ssd for s in stats), sum(s.spills for s in stats), sum(s.ssd_dropped for s in stats)


def test_blocks_spill_to_ssd_come_back_and_a_damaged_file_is_never_served(store_cluster, store_client, reference):
    rnd = random.Random(5)
    kept, damaged = tokens(4 * BLOCK, rnd), tokens(4 * BLOCK, rnd)
    for prefix in (kept, damaged):
        complete(store_client, prefix + tokens(60, rnd))
    # Enough other prompts to push every node's DRAM (15 blocks) past both prefixes.
    for _ in range(6):
        complete(store_client, tokens(7 * BLOCK + 10, rnd))
    hits0, spills, dropped0 = ssd_totals(store_cluster)
    assert spills > 0
    # Damage every SSD copy of the second prefix's blocks, in their payload.
    names = {h + ".blk" for h in hex_hashes(damaged, BLOCK, store_cluster.config().model_salt)}
    files = [f for f in store_cluster.ssd.glob("*/*.blk") if f.name in names]
    assert files, "the prefix never reached an SSD tier"
    for f in files:
        data = bytearray(f.read_bytes())
        data[-10] ^= 0xFF
        f.write_bytes(bytes(data))

    again = kept + tokens(70, rnd)
    out, cached, _ = complete(store_client, again)
    assert cached >= len(kept)  # served from SSD, not computed
    assert out == reference.greedy([again], MAX_TOKENS)[0]
    assert ssd_totals(store_cluster)[0] > hits0

    bad = damaged + tokens(70, rnd)
    out, cached, _ = complete(store_client, bad)
    assert out == reference.greedy([bad], MAX_TOKENS)[0]  # computed, not served from a bad file
    assert ssd_totals(store_cluster)[2] > dropped0
    page = urllib.request.urlopen(store_cluster.metrics["messenger-2"], timeout=5).read().decode()
    assert "yuebing_messenger_spills_total" in page and 'tier="ssd"' in page


def test_the_conductor_rebuilds_its_pool_index_after_a_restart(store_cluster, store_client, reference):
    before = conductor_stats(store_cluster)
    assert before.pool_blocks >= len(PREFIX) // BLOCK and len(before.pool_nodes) == 3
    os.kill(store_cluster.pids["conductor"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while "conductor restarted" not in store_cluster.launcher_log.read_text():
        assert time.monotonic() < deadline, "the launcher did not restart the Conductor"
        time.sleep(0.2)
    while True:  # the new Conductor knows nothing until the messengers' snapshots arrive
        try:
            after = conductor_stats(store_cluster)
            if after.pool_blocks >= before.pool_blocks and after.accepted == 0:
                break
        except Exception:  # not up yet
            pass
        assert time.monotonic() < deadline, "the pool index was not rebuilt"
        time.sleep(0.5)
    third = PREFIX + tokens(200, random.Random(3))
    out, cached, _ = complete(store_client, third)
    assert cached >= len(PREFIX)
    assert out == reference.greedy([third], MAX_TOKENS)[0]
