"""The cluster against outsiders and a misbehaving member, on the real session cluster:
NATS refuses a client without credentials; a client holding the decode instance's
credentials can neither answer the Conductor, nor read the prompts sent to the
prefill instance, nor arm a messenger's fault switch, while requests go on being
served normally; and a ZeroMQ peer without the cluster's KV key cannot get a block
into a node's pool."""

from __future__ import annotations

import asyncio

import httpx
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared import bus
from shared.identity import load_credentials
from shared.messages import SCHEDULE, messenger_faults_subject, prefill_subject
from tests.e2e.ops import eventually, latest_heartbeat, messenger
from tests.messenger.test_tcp_transport import INTRUDERS
from tests.messenger.test_transport import block_frames

pytestmark = pytest.mark.e2e


def test_a_client_without_credentials_cannot_connect(cluster):
    async def attempt() -> None:
        async with asyncio.timeout(10):
            await nats.connect(cluster.nats_url, allow_reconnect=False, connect_timeout=2)

    with pytest.raises(nats.errors.Error, match="Authorization"):
        asyncio.run(attempt())


class Impostor:
    """A connection as decode-0 that tries to listen where it must not, and records
    what reaches it and what the server refused."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.refused: list[str] = []
        self.nc = None

    async def start(self, cluster) -> None:
        creds = load_credentials(str(cluster.credentials("decode-0")))
        self.nc = await bus.connect(cluster.nats_url, "impostor", creds)

        async def on_error(e: Exception) -> None:
            self.refused.append(str(e))

        self.nc._error_cb = on_error  # nats-py has no setter; permission violations arrive here

        async def on_msg(msg) -> None:
            self.seen.append(msg.subject)
            await msg.respond(b'{"v": 1}')

        for subject in (SCHEDULE, prefill_subject("prefill-0"), messenger_faults_subject("node-0")):
            await self.nc.subscribe(subject, cb=on_msg)
        await self.nc.publish(messenger_faults_subject("node-0"), b'{"op": "fault", "corrupt_next": 5}')
        await self.nc.flush()


def test_the_decode_identity_cannot_impersonate_the_conductor_read_prompts_or_arm_faults(cluster, client):
    impostor = Impostor()
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(impostor.start(cluster))

        async def refused_all() -> None:
            async with asyncio.timeout(10):
                while len(impostor.refused) < 4:
                    await asyncio.sleep(0.05)

        loop.run_until_complete(refused_all())
        for _ in range(3):  # scheduled by the Conductor, prefilled by prefill-0: the impostor hears none of it
            out = client.completions.create(model="yuebing-tiny", prompt="a secret prompt", max_tokens=4, temperature=0)
            assert out.choices[0].text is not None
        loop.run_until_complete(impostor.nc.flush())
        assert impostor.seen == []
        assert all("permissions violation" in e for e in impostor.refused)
        assert messenger(cluster, "node-0").corrupt_pending == 0
    finally:
        loop.run_until_complete(impostor.nc.close())
        loop.close()


def _rejected(cluster, node: int) -> float:
    """messenger-<node>'s count of refused KV peers, from its Prometheus page."""
    text = httpx.get(cluster.metrics[f"messenger-{node}"], timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "yuebing_messenger_kv_peers_rejected_total":
                return sample.value
    raise AssertionError("no kv_peers_rejected counter on the metrics page")


def test_a_kv_peer_without_the_cluster_key_cannot_put_a_block_into_a_pool(cluster, tmp_path):
    # Well-formed block messages (right layout, right checksums) from outside the cluster:
    # in plaintext, and sealed with another cluster's key.
    endpoint = latest_heartbeat(cluster, "messenger-1").endpoint
    before, rejected = messenger(cluster, "node-1"), _rejected(cluster, 1)
    closes = [INTRUDERS["plaintext"](endpoint, block_frames(tmp_path, 5)),
              INTRUDERS["another cluster's key"](endpoint, block_frames(tmp_path, 6))]
    try:
        eventually(lambda: _rejected(cluster, 1), lambda n: n >= rejected + 2, "both intruders refused")
    finally:
        for close in closes:
            close()
    after = messenger(cluster, "node-1")
    assert (after.layers_in, after.blocks_received) == (before.layers_in, before.blocks_received)
