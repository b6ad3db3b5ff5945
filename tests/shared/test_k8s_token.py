"""shared/k8s_token.py: a ServiceAccount token names its pod only when the cluster's
key signed it, for our audience, within its lifetime."""

from __future__ import annotations

import base64
import json
import time

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from shared.k8s_token import Pod, public_keys, verify


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _n(value: int) -> str:
    return _b64(value.to_bytes((value.bit_length() + 7) // 8, "big"))


class Issuer:
    """A cluster's service-account issuer, for tests: it signs tokens as the API server
    does, and publishes its keys as the API server's JWKS does."""

    def __init__(self, kid: str = "k1", alg: str = "RS256") -> None:
        self.kid, self.alg = kid, alg
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048) if alg == "RS256" \
            else ec.generate_private_key(ec.SECP256R1())

    def jwks(self) -> dict:
        numbers = self.key.public_key().public_numbers()
        if self.alg == "RS256":
            return {"keys": [{"kty": "RSA", "kid": self.kid, "alg": "RS256", "use": "sig", "n": _n(numbers.n),
                              "e": _n(numbers.e)}]}
        return {"keys": [{"kty": "EC", "kid": self.kid, "crv": "P-256", "x": _n(numbers.x), "y": _n(numbers.y)}]}

    def token(self, pod: str, namespace: str = "yuebing", account: str = "yuebing-engine",
              audience: str = "yuebing-nats", lifetime_s: float = 3600, now: float | None = None) -> str:
        now = time.time() if now is None else now
        claims = {"aud": [audience], "exp": int(now + lifetime_s), "iat": int(now), "nbf": int(now),
                  "iss": "https://kubernetes.default.svc.cluster.local",
                  "sub": f"system:serviceaccount:{namespace}:{account}",
                  "kubernetes.io": {"namespace": namespace, "pod": {"name": pod, "uid": "u-1"},
                                    "serviceaccount": {"name": account, "uid": "u-2"}}}
        head = _b64(json.dumps({"alg": self.alg, "kid": self.kid}).encode()) + "." + _b64(json.dumps(claims).encode())
        if self.alg == "RS256":
            signature = self.key.sign(head.encode(), padding.PKCS1v15(), hashes.SHA256())
        else:
            r, s = decode_dss_signature(self.key.sign(head.encode(), ec.ECDSA(hashes.SHA256())))
            signature = r.to_bytes(32, "big") + s.to_bytes(32, "big")
        return head + "." + _b64(signature)


@pytest.mark.parametrize("alg", ["RS256", "ES256"])
def test_a_token_signed_by_the_cluster_names_its_pod(alg):
    issuer = Issuer(alg=alg)
    pod = verify(issuer.token("decode-3"), public_keys(issuer.jwks()), "yuebing-nats", time.time())
    assert (pod.namespace, pod.name, pod.service_account) == ("yuebing", "decode-3", "yuebing-engine")
    assert isinstance(pod, Pod) and pod.expires_at > time.time()


def test_a_token_is_refused_when_forged_expired_for_another_audience_or_of_an_unknown_key():
    issuer, other = Issuer(), Issuer()
    keys = public_keys(issuer.jwks())
    now = time.time()
    cases = {
        "bad signature": other.token("decode-3"),  # another key under the same key id
        "expired": issuer.token("decode-3", lifetime_s=-120),
        "not issued for": issuer.token("decode-3", audience="https://kubernetes.default.svc"),
        "unknown key": Issuer(kid="k2").token("decode-3"),
        "not a JWT": "a-password",
    }
    for says, token in cases.items():
        with pytest.raises(ValueError, match=says):
            verify(token, keys, "yuebing-nats", now)
    head, body, signature = issuer.token("decode-3").split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=="))
    claims["kubernetes.io"]["pod"]["name"] = "decode-4"  # a pod naming another: the signature no longer fits
    forged = f"{head}.{_b64(json.dumps(claims).encode())}.{signature}"
    with pytest.raises(ValueError, match="bad signature"):
        verify(forged, keys, "yuebing-nats", now)
