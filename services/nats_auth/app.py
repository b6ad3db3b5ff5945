"""The NATS auth callout, wired: a sidecar of each NATS server, logged in to it as the
`nats-auth` identity, answering the server's authorization requests
($SYS.REQ.USER.AUTH, one queue group across the cluster's sidecars) with
services/nats_auth/policy.py's decision, signed by the issuer key the server trusts.

The engines' tokens are checked against the cluster's service-account keys, fetched
from the API server (its JWKS) at start, every KEYS_REFRESH_S, and again when a token
names a key not seen yet (at most once every KEYS_RETRY_S).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import time
from typing import Any

import aiohttp
import structlog
from nats.aio.msg import Msg

from services.nats_auth import policy
from shared import bus, nats_jwt
from shared.config import ClusterConfig
from shared.identity import AUTH_CALLOUT
from shared.k8s_token import public_keys
from shared.private_file import read_private

log = structlog.get_logger(__name__)

IN_CLUSTER = "/var/run/secrets/kubernetes.io/serviceaccount"  # a pod's own API credentials
KEYS_REFRESH_S = 600.0
KEYS_RETRY_S = 30.0
FETCH_TIMEOUT_S = 10.0


def parser() -> argparse.ArgumentParser:
    from shared import service

    p = service.parser("nats_auth", instance=False)
    p.add_argument("--issuer-seed-file", required=True, help="owner-only file: the account nkey seed nats-server's "
                   "auth_callout.issuer names (yuebing secrets --kubernetes writes it)")
    p.add_argument("--jwks-url", default="https://kubernetes.default.svc/openid/v1/jwks",
                   help="the cluster's service-account signing keys")
    p.add_argument("--api-token-file", default=f"{IN_CLUSTER}/token", help="bearer token for --jwks-url "
                   "(none if missing)")
    p.add_argument("--api-ca-file", default=f"{IN_CLUSTER}/ca.crt", help="CA of --jwks-url (if it is https)")
    p.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "yuebing"), help="the engines' namespace")
    p.add_argument("--service-account", default="yuebing-engine", help="the engine pods' ServiceAccount")
    p.add_argument("--audience", default="yuebing-nats", help="the audience of the engines' projected tokens")
    return p


class Keys:
    """The cluster's service-account keys, fetched and kept fresh."""

    def __init__(self, url: str, token_file: str, ca_file: str) -> None:
        self.url, self.token_file, self.ca_file = url, token_file, ca_file
        self.keys: dict[str, Any] = {}
        self.fetched_at = 0.0

    async def fetch(self) -> None:
        headers = {}
        if os.path.exists(self.token_file):
            with open(self.token_file) as f:  # the kubelet rotates it: read each time
                headers["Authorization"] = f"Bearer {f.read().strip()}"
        tls = ssl.create_default_context(cafile=self.ca_file) if self.url.startswith("https") else None
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.get(self.url, headers=headers, ssl=tls) as r:
            r.raise_for_status()
            self.keys = public_keys(await r.json(content_type=None))
        self.fetched_at = time.monotonic()
        log.info("service-account keys fetched", url=self.url, keys=len(self.keys))

    async def refresh(self, min_age_s: float) -> None:
        """Fetch again unless fetched within `min_age_s`; a failure keeps the keys held."""
        if time.monotonic() - self.fetched_at < min_age_s:
            return
        try:
            await self.fetch()
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            self.fetched_at = time.monotonic()  # not again at once: the next request waits KEYS_RETRY_S
            log.warning("service-account keys not fetched: the ones held stay", url=self.url, error=str(e))

    async def keep_fresh(self) -> None:
        while True:
            await asyncio.sleep(KEYS_REFRESH_S)
            await self.refresh(KEYS_REFRESH_S / 2)


class Callout:
    def __init__(self, issuer: nats_jwt.KeyPair, keys: Keys, settings: policy.Settings) -> None:
        self.issuer, self.keys, self.settings = issuer, keys, settings

    async def on_request(self, msg: Msg) -> None:
        try:
            request = nats_jwt.decode(msg.data.decode())  # signed by the server that asks
            opts = request["nats"].get("connect_opts") or {}
        except (ValueError, KeyError, UnicodeDecodeError) as e:
            log.warning("authorization request unreadable: not answered", error=str(e))
            return
        user, token = str(opts.get("user", "")), str(opts.get("pass", ""))
        outcome = policy.decide(user, token, self.keys.keys, self.settings, time.time())
        if isinstance(outcome, policy.Refusal) and outcome.unknown_key:  # the cluster's keys rotated
            await self.keys.refresh(KEYS_RETRY_S)
            outcome = policy.decide(user, token, self.keys.keys, self.settings, time.time())
        await msg.respond(self.answer(request, outcome).encode())

    def answer(self, request: dict[str, Any], outcome: policy.Grant | policy.Refusal) -> str:
        now = time.time()
        client = request["nats"].get("client_info") or {}
        if isinstance(outcome, policy.Refusal):
            log.warning("nats login refused", user=client.get("user"), host=client.get("host"), reason=outcome.reason)
            return nats_jwt.encode(policy.response_claims(request, now, error=outcome.reason), self.issuer)
        user_jwt = nats_jwt.encode(policy.user_claims(outcome, request["nats"]["user_nkey"], now), self.issuer)
        log.info("nats login", user=outcome.identity.name, role=outcome.identity.role, pod=outcome.pod.name,
                 host=client.get("host"))
        return nats_jwt.encode(policy.response_claims(request, now, user_jwt=user_jwt), self.issuer)


async def main(config: ClusterConfig, args: argparse.Namespace, stop: asyncio.Event) -> None:
    try:
        issuer = nats_jwt.KeyPair(read_private(args.issuer_seed_file).decode().strip())
        issuer.public_key  # noqa: B018 - a bad seed stops it here, not at the first login
    except (OSError, ValueError) as e:
        raise SystemExit(f"nats_auth: issuer seed: {e}") from e
    keys = Keys(args.jwks_url, args.api_token_file, args.api_ca_file)
    await keys.refresh(0)
    callout = Callout(issuer, keys, policy.Settings(args.namespace, args.service_account, args.audience))
    nc = await bus.connect(config.nats_url, "nats-auth", args.nats_credentials)
    await nc.subscribe(AUTH_CALLOUT, queue="nats-auth", cb=callout.on_request)
    fresh = asyncio.create_task(callout.keys.keep_fresh())
    log.info("nats auth ready", issuer=issuer.public_key, keys=len(keys.keys), jwks=args.jwks_url)
    await stop.wait()
    fresh.cancel()
    await bus.close(nc)
