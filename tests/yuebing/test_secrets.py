"""A generated cluster's NATS identities, against a real nats-server started with the
generated configuration: no login, no entry; each identity only where its job is."""

import asyncio
import os
import sys
from pathlib import Path

import nats
import pytest

from shared import bus
from shared.identity import load_credentials
from shared.messages import SCHEDULE, messenger_faults_subject, prefill_subject
from yuebing.process import free_port, spawn, stop, wait_for_port
from yuebing.secrets import Layout, Listen, Peer, generate, server_environment


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "tls"])
def secrets(request, tmp_path_factory):
    port, tmp = free_port(), tmp_path_factory.mktemp("s")
    made = generate(tmp / "secrets", Layout(prefill=1, decode=1, nodes=2), Listen(port=port, tls=request.param))
    server = Path(sys.executable).with_name("nats-server")
    proc = spawn([str(server), "-c", str(made.nats_config)], tmp / "nats.log")
    wait_for_port(port, timeout_s=10)
    yield made
    stop([proc], grace_s=5)


async def login(secrets, name: str, errors: list[str] | None = None):
    nc = await bus.connect(secrets.nats_url, name, load_credentials(str(secrets.credentials(name))))
    if errors is not None:
        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        nc._error_cb = on_error  # nats-py has no setter; the violations arrive here
    return nc


async def cannot_connect(secrets, **login) -> None:
    tls = load_credentials(str(secrets.credentials("admin"))).tls()  # trusts the server, logs in as nobody
    with pytest.raises(nats.errors.Error, match="[Aa]uthorization"):
        async with asyncio.timeout(10):
            await nats.connect(secrets.nats_url, tls=tls, allow_reconnect=False, connect_timeout=2, **login)


async def test_a_client_without_credentials_cannot_connect(secrets):
    await cannot_connect(secrets)


async def test_wrong_password_cannot_connect(secrets):
    await cannot_connect(secrets, user="admin", password="guess")


async def test_decode_cannot_answer_the_conductor_nor_read_prompts_nor_arm_faults(secrets):
    admin, conductor = await login(secrets, "admin"), await login(secrets, "conductor")
    errors: list[str] = []
    decode = await login(secrets, "decode-0", errors)
    seen: list[bytes] = []

    async def impostor(msg):
        seen.append(msg.data)
        await msg.respond(b"impostor")

    async def honest(msg):
        await msg.respond(b"conductor")

    await conductor.subscribe(SCHEDULE, cb=honest)
    for subject in (SCHEDULE, prefill_subject("prefill-0"), messenger_faults_subject("node-0")):
        await decode.subscribe(subject, cb=impostor)
    await decode.publish(messenger_faults_subject("node-0"), b"{}")
    await decode.flush()
    await conductor.flush()
    await wait_for(lambda: len(errors) >= 4, "the server refusing all four")
    answers = [(await admin.request(SCHEDULE, b"x", timeout=2)).data for _ in range(5)]
    await admin.publish(prefill_subject("prefill-0"), b"a prompt")
    await admin.flush()
    assert answers == [b"conductor"] * 5 and seen == []
    assert sum("permissions violation" in e for e in errors) == 4, errors
    for nc in (admin, conductor, decode):
        await nc.close()


async def test_replies_go_to_the_askers_own_inbox(secrets):
    errors: list[str] = []
    gateway = await login(secrets, "gateway", errors)
    await gateway.subscribe("_INBOX.conductor.>")
    await gateway.flush()
    await wait_for(lambda: errors, "the server refusing another identity's inbox")
    await gateway.close()


async def wait_for(condition, what: str, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


def test_engine_nodes_give_every_engine_a_messenger_of_its_own():
    layout = Layout(prefill=1, decode=2, nodes=5, engine_nodes=True)
    messengers = {i.name: i.node for i in layout.identities() if i.role == "messenger"}
    assert messengers == {"messenger-prefill-0": "prefill-0", "messenger-decode-0": "decode-0",
                          "messenger-decode-1": "decode-1"}


def test_kubernetes_secrets_split_the_set_by_component(tmp_path):
    import base64

    from yuebing.secrets import kubernetes_secrets, write_api_key

    layout = Layout(prefill=1, decode=1, engine_nodes=True)
    generate(tmp_path, layout, Listen(host="0.0.0.0"), mounted_at=Path("/run/secrets"))
    write_api_key(tmp_path)
    secrets = {s["metadata"]["name"]: s["data"] for s in kubernetes_secrets(tmp_path, layout)}
    assert set(secrets["yuebing-decode"]) == {"kv.key", "decode-0.nats.json", "messenger-decode-0.nats.json"}
    assert set(secrets["yuebing-gateway"]) == {"gateway.nats.json", "api-key", "cache.key"}
    assert "admin.nats.json" not in {k for data in secrets.values() for k in data}  # the operator's, kept out
    assert base64.b64decode(secrets["yuebing-gateway"]["api-key"]) == (tmp_path / "api-key").read_bytes()


async def test_the_gateway_keeps_responses_in_jetstream_and_an_engine_cannot_read_them(secrets):
    """The generated server runs JetStream; the gateway's identity reaches its bucket
    (made, written, read back, scoped by tenant), the decode identity does not."""
    from nats.js.api import KeyValueConfig

    from services.gateway.response_store import BUCKET, ResponseStore, Stored
    from shared.identity import RESPONSES_BUCKET

    link = await bus.Link(secrets.nats_url, "gateway", load_credentials(str(secrets.credentials("gateway")))).start()
    store = ResponseStore(link, ttl_s=60, max_bytes=1 << 20)
    kept = Stored({"id": "resp_" + "c" * 32, "output": [{"type": "message"}]}, [{"role": "user", "content": "hi"}])
    await store.put("acme", kept)
    assert (await store.get("acme", kept.response["id"])) == kept
    assert await store.get("beta", kept.response["id"]) is None and await store.get("acme", "resp_../x") is None
    await link.close()
    decode = await login(secrets, "decode-0")
    js = decode.jetstream(timeout=2)
    with pytest.raises(Exception):  # a permissions violation: no reply, so a timeout or a no-responders error
        await js.key_value(BUCKET)
    with pytest.raises(Exception):
        await js.create_key_value(KeyValueConfig(bucket=RESPONSES_BUCKET + "_other"))
    await decode.close()


async def answered(admin, timeout_s: float = 20) -> None:
    """Until a schedule request is answered across the cluster."""
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                if (await admin.request(SCHEDULE, b"1", timeout=1)).data == b"placed":
                    return
            except nats.errors.Error:
                await asyncio.sleep(0.2)


def start_cluster(tmp: Path, tls: bool = False):
    """A generated three-server NATS cluster on loopback: (the set, each server's port → its process)."""
    peers = tuple(Peer("127.0.0.1", free_port(), free_port()) for _ in range(3))
    made = generate(tmp / "secrets", Layout(), Listen(port=peers[0].port, tls=tls, cluster=peers))
    server = Path(sys.executable).with_name("nats-server")
    procs = [spawn([str(server), "-c", str(made.nats_config)], tmp / f"nats-{i}.log",
                   {**os.environ, **server_environment(p, f"nats-{i}", tmp / f"js-{i}")})
             for i, p in enumerate(peers)]
    for p in peers:
        wait_for_port(p.port, timeout_s=10)
    return made, {p.port: proc for p, proc in zip(peers, procs, strict=True)}


def test_a_cluster_of_three_lists_every_server_and_routes_with_a_password_of_its_own(tmp_path):
    peers = (Peer("nats-0"), Peer("nats-1"), Peer("nats-2"))
    made = generate(tmp_path / "s", Layout(), Listen("0.0.0.0", cluster=peers), mounted_at=Path("/run/secrets"))
    assert made.nats_url == "nats://nats-0:4222,nats://nats-1:4222,nats://nats-2:4222"
    text = made.nats_config.read_text()
    assert '"server_name": $NATS_SERVER_NAME' in text and '"store_dir": $NATS_STORE_DIR' in text
    routes = [line for line in text.splitlines() if "nats://route:" in line]
    assert [r.split("@")[1].strip('", ') for r in routes] == ["nats-0:6222", "nats-1:6222", "nats-2:6222"]
    users = {f.read_text() for f in made.folder.glob("*.nats.json")}
    assert not any(r.split(":")[2].split("@")[0] in u for r in routes for u in users)  # no client knows it


async def test_clients_of_a_cluster_lose_nothing_when_the_server_they_use_dies(tmp_path):
    made, procs = start_cluster(tmp_path)
    try:
        conductor = await login(made, "conductor")
        admin = await login(made, "admin")
        heard: list[bytes] = []

        async def on_schedule(msg) -> None:
            heard.append(msg.data)
            await msg.respond(b"placed")

        await conductor.subscribe(SCHEDULE, "conductors", cb=on_schedule)
        await conductor.flush()
        await answered(admin)  # once the servers' routes carry the subscription
        used = conductor.connected_url.port
        stop([procs[used]], grace_s=5)  # the conductor's server goes: it reconnects to another
        await answered(admin)
        assert conductor.is_connected and conductor.connected_url.port != used
        await conductor.close()
        await admin.close()
    finally:
        stop(list(procs.values()), grace_s=5)
