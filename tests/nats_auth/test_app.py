"""The NATS auth callout as it runs (`python -m services.nats_auth`) beside a real
nats-server configured by `yuebing secrets` for token logins: an engine pod's token
logs it in as its engine or its messenger, each with only its own subjects; a token
claiming another pod, one for another audience, or no token, gets nobody in; the
password identities log in as before, without asking the callout."""

from __future__ import annotations

import asyncio
import http.server
import json
import sys
import threading
from pathlib import Path

import nats
import pytest

from shared import bus
from shared.identity import NatsCredentials, load_credentials
from shared.messages import decode_subject
from tests.shared.test_k8s_token import Issuer
from yuebing.process import free_port, spawn, stop, wait_for_port, wait_until
from yuebing.secrets import AUTH_SEED, AUTH_USER, Layout, Listen, generate


class Jwks(http.server.BaseHTTPRequestHandler):
    """The API server's /openid/v1/jwks, for tests: the issuer's keys."""

    body = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *_args) -> None:
        pass


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(the secrets, the issuer of the engines' tokens, a folder for token files)."""
    tmp = tmp_path_factory.mktemp("auth")
    port = free_port()
    made = generate(tmp / "secrets", Layout(engine_nodes=True, engines_by_token=True), Listen(port=port))
    issuer = Issuer()
    Jwks.body = json.dumps(issuer.jwks()).encode()
    jwks = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Jwks)
    threading.Thread(target=jwks.serve_forever, daemon=True).start()
    config = tmp / "cluster.json"
    config.write_text(json.dumps({"nats_url": made.nats_url, "model": str(tmp)}))
    server = spawn([str(Path(sys.executable).with_name("nats-server")), "-c", str(made.nats_config)], tmp / "nats.log")
    wait_for_port(port, timeout_s=10)
    callout = spawn([sys.executable, "-m", "services.nats_auth", "--config", str(config),
                     "--nats-credentials", str(made.credentials(AUTH_USER)),
                     "--issuer-seed-file", str(made.folder / AUTH_SEED),
                     "--jwks-url", f"http://127.0.0.1:{jwks.server_port}/jwks", "--api-token-file", str(tmp / "none")],
                    tmp / "nats_auth.log")
    wait_until(lambda: "nats auth ready" in (tmp / "nats_auth.log").read_text() or None, None, 60, "the callout")
    yield made, issuer, tmp
    stop([callout, server], grace_s=5)
    jwks.shutdown()


def token_file(folder: Path, name: str, token: str) -> str:
    path = folder / f"{name}.token"
    path.write_text(token)
    return str(path)


async def login(made, user: str, token_path: str, errors: list[str] | None = None):
    nc = await bus.connect(made.nats_url, user, NatsCredentials(user=user, token_file=token_path))
    if errors is not None:
        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        nc._error_cb = on_error  # nats-py has no setter; permission violations arrive here
    return nc


async def refused(made, user: str, token_path: str) -> None:
    with pytest.raises(nats.errors.Error, match="[Aa]uthorization"):
        async with asyncio.timeout(15):
            await nats.connect(made.nats_url, user=user, password=Path(token_path).read_text(),
                               allow_reconnect=False, connect_timeout=5)


async def test_an_engine_pod_is_its_engine_with_its_own_subjects_only(cluster):
    made, issuer, tmp = cluster
    errors: list[str] = []
    engine = await login(made, "decode-3", token_file(tmp, "decode-3", issuer.token("decode-3")), errors)
    await engine.subscribe(decode_subject("decode-3"))
    await engine.flush()
    await engine.subscribe(decode_subject("decode-4"))  # another instance's requests
    await engine.flush()
    await asyncio.sleep(0.3)
    await engine.close()
    assert len(errors) == 1 and "subscription" in errors[0] and "decode-4" in errors[0], errors
    messenger = await login(made, "messenger-decode-3", token_file(tmp, "m-decode-3", issuer.token("decode-3")))
    assert messenger.is_connected
    await messenger.close()


async def test_a_token_gets_nobody_else_in(cluster):
    made, issuer, tmp = cluster
    mine = token_file(tmp, "decode-3", issuer.token("decode-3"))
    await refused(made, "decode-4", mine)  # another pod's identity
    await refused(made, "gateway", mine)  # a password identity: the callout is not even asked
    await refused(made, "decode-3", token_file(tmp, "aud", issuer.token("decode-3", audience="other")))
    await refused(made, "decode-3", token_file(tmp, "forged", Issuer().token("decode-3")))
    await refused(made, "decode-3", token_file(tmp, "none", "no-token"))
    log = (tmp / "nats_auth.log").read_text()
    assert "may log in as decode-3 or messenger-decode-3, not as 'decode-4'" in log


async def test_password_identities_log_in_as_before(cluster):
    made, _, _ = cluster
    gateway = await bus.connect(made.nats_url, "gateway", load_credentials(str(made.credentials("gateway"))))
    assert gateway.is_connected
    await gateway.close()
    assert not made.credentials("decode-0").exists()  # nothing made per replica
