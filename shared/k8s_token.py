"""A Kubernetes ServiceAccount token, checked: the pod it was issued to.

The kubelet writes each pod a token of its own (a projected volume) whose claims name
the pod, its namespace and its ServiceAccount, signed by the cluster's
service-account issuer. Checked against that issuer's public keys (its JWKS, served by
the API server at /openid/v1/jwks), for the audience it was asked for and within its
lifetime, a token is proof of which pod sent it: a pod cannot make one naming another.
RS256 and ES256, the algorithms Kubernetes signs with.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

LEEWAY_S = 30.0  # clock skew forgiven at either end of a token's lifetime


@dataclass(frozen=True)
class Pod:
    """Who a token was issued to."""

    namespace: str
    name: str
    service_account: str
    expires_at: float  # unix time


class UnknownKey(ValueError):
    """Signed by a key not among those given: the cluster's keys may have rotated."""


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _int(text: str) -> int:
    return int.from_bytes(_unb64(text), "big")


def public_keys(jwks: dict[str, Any]) -> dict[str, Any]:
    """The JWKS's signing keys by key id."""
    keys = {}
    for jwk in jwks.get("keys", []):
        if jwk.get("kty") == "RSA":
            keys[jwk.get("kid", "")] = rsa.RSAPublicNumbers(_int(jwk["e"]), _int(jwk["n"])).public_key()
        elif jwk.get("kty") == "EC" and jwk.get("crv") == "P-256":
            keys[jwk.get("kid", "")] = ec.EllipticCurvePublicNumbers(_int(jwk["x"]), _int(jwk["y"]),
                                                                     ec.SECP256R1()).public_key()
    return keys


def _check_signature(key: Any, alg: str, signed: bytes, signature: bytes) -> None:
    if alg == "RS256" and isinstance(key, rsa.RSAPublicKey):
        key.verify(signature, signed, padding.PKCS1v15(), hashes.SHA256())
    elif alg == "ES256" and isinstance(key, ec.EllipticCurvePublicKey) and len(signature) == 64:
        der = encode_dss_signature(int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big"))
        key.verify(der, signed, ec.ECDSA(hashes.SHA256()))
    else:
        raise ValueError(f"algorithm {alg!r} does not fit the key")


def verify(token: str, keys: dict[str, Any], audience: str, now: float) -> Pod:
    """The pod `token` was issued to; a ValueError saying why it is refused."""
    try:
        head_b64, body_b64, signature_b64 = token.split(".")
        head, claims = json.loads(_unb64(head_b64)), json.loads(_unb64(body_b64))
    except ValueError as e:
        raise ValueError("not a JWT") from e
    key = keys.get(head.get("kid", ""))
    if key is None:
        raise UnknownKey(f"signed by an unknown key ({head.get('kid')!r})")
    try:
        _check_signature(key, head.get("alg", ""), f"{head_b64}.{body_b64}".encode(), _unb64(signature_b64))
    except InvalidSignature as e:
        raise ValueError("bad signature") from e
    return _pod(claims, audience, now)


def _pod(claims: dict[str, Any], audience: str, now: float) -> Pod:
    audiences = claims.get("aud", [])
    if audience not in (audiences if isinstance(audiences, list) else [audiences]):
        raise ValueError(f"not issued for {audience!r}")
    if now > claims.get("exp", 0) + LEEWAY_S or now < claims.get("nbf", 0) - LEEWAY_S:
        raise ValueError("expired, or not valid yet")
    k8s = claims.get("kubernetes.io") or {}
    pod = k8s.get("pod") or {}
    if not pod.get("name"):
        raise ValueError("issued to no pod (a token of a ServiceAccount alone)")
    return Pod(k8s.get("namespace", ""), pod["name"], (k8s.get("serviceaccount") or {}).get("name", ""),
               float(claims["exp"]))
