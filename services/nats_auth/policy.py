"""Who a connecting engine pod may be on NATS, and what it may do there: the NATS auth
callout's decision, from plain data (no I/O, an explicit clock).

On Kubernetes an engine pod holds no password of its own: it logs in with the
ServiceAccount token the kubelet wrote it, as one of the pod's two identities (its
engine, `decode-3`, or its messenger, `messenger-decode-3`). The token says which pod
it is, so a pod can be no other pod's identity; the permissions are that identity's
own (shared/identity.py), exactly as a password identity's would be.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from shared.identity import Identity, permissions
from shared.k8s_token import Pod, UnknownKey, verify

ENGINE_POD = re.compile(r"(prefill|decode)-\d+")  # the StatefulSets' pods: compose/kubernetes/
ACCOUNT = "$G"  # nats-server's global account, where every Yuebing identity is


@dataclass(frozen=True)
class Settings:
    namespace: str  # the engines' namespace
    service_account: str  # the engines' ServiceAccount: no other pod of the namespace passes
    audience: str  # the audience their tokens are asked for (their projected volume's)


@dataclass(frozen=True)
class Grant:
    identity: Identity
    pod: Pod


@dataclass(frozen=True)
class Refusal:
    reason: str
    unknown_key: bool = False  # the token's key is not among those known: worth fetching them again


def identity_of(user: str, pod: Pod, settings: Settings) -> Identity:
    """The identity `user` names, if `pod` may be it; a ValueError saying why not."""
    if (pod.namespace, pod.service_account) != (settings.namespace, settings.service_account):
        raise ValueError(f"pod {pod.name} runs as {pod.namespace}/{pod.service_account}, not as the engines' "
                         f"{settings.namespace}/{settings.service_account}")
    engine = ENGINE_POD.fullmatch(pod.name)
    if engine is None:
        raise ValueError(f"pod {pod.name} is no engine pod")
    if user == pod.name:
        return Identity(user, engine.group(1))  # type: ignore[arg-type]
    if user == f"messenger-{pod.name}":
        return Identity(user, "messenger", node=pod.name)
    raise ValueError(f"pod {pod.name} may log in as {pod.name} or messenger-{pod.name}, not as {user!r}")


def decide(user: str, token: str, keys: dict[str, Any], settings: Settings, now: float) -> Grant | Refusal:
    """Whether `user`, presenting `token` as its password, gets in."""
    try:
        pod = verify(token, keys, settings.audience, now)
    except ValueError as e:
        return Refusal(f"token refused: {e}", unknown_key=isinstance(e, UnknownKey))
    try:
        return Grant(identity_of(user, pod, settings), pod)
    except ValueError as e:
        return Refusal(str(e))


def user_claims(grant: Grant, user_nkey: str, now: float) -> dict[str, Any]:
    """The user JWT's claims nats-server applies: the identity's name and permissions.
    No expiry: a connection lives as long as its pod's process, and each reconnect
    logs in again with the token the kubelet keeps fresh."""
    p = permissions(grant.identity)
    nats: dict[str, Any] = {"pub": {"allow": list(p.publish)}, "sub": {"allow": list(p.subscribe)},
                            "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2}
    if p.allow_responses:
        nats["resp"] = {"max": 1, "ttl": 0}
    return {"sub": user_nkey, "aud": ACCOUNT, "name": grant.identity.name, "iat": int(now), "nats": nats}


def response_claims(request: dict[str, Any], now: float, user_jwt: str = "", error: str = "") -> dict[str, Any]:
    """The authorization response to nats-server's request: for the user key it made
    for this connection and for that server, carrying the user JWT or the refusal."""
    nats = request["nats"]
    answer: dict[str, Any] = {"type": "authorization_response", "version": 2}
    answer |= {"jwt": user_jwt} if user_jwt else {"error": error}
    return {"sub": nats["user_nkey"], "aud": nats["server_id"]["id"], "iat": int(now), "nats": answer}
