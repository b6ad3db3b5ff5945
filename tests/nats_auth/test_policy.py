"""services/nats_auth/policy.py: an engine pod is its own engine or its own messenger
on NATS, with that identity's permissions, and nobody else."""

import time

import pytest

from services.nats_auth.policy import Grant, Refusal, Settings, decide, identity_of, response_claims, user_claims
from shared.identity import Identity, permissions
from shared.k8s_token import Pod, public_keys
from tests.shared.test_k8s_token import Issuer

SETTINGS = Settings(namespace="yuebing", service_account="yuebing-engine", audience="yuebing-nats")


def pod(name: str, namespace: str = "yuebing", account: str = "yuebing-engine") -> Pod:
    return Pod(namespace, name, account, time.time() + 3600)


def test_a_pod_is_its_engine_or_its_messenger():
    assert identity_of("decode-3", pod("decode-3"), SETTINGS) == Identity("decode-3", "decode")
    assert identity_of("prefill-0", pod("prefill-0"), SETTINGS) == Identity("prefill-0", "prefill")
    assert identity_of("messenger-decode-3", pod("decode-3"), SETTINGS) == Identity(
        "messenger-decode-3", "messenger", node="decode-3")


@pytest.mark.parametrize("user, who, says", [
    ("decode-4", pod("decode-3"), "may log in as decode-3 or messenger-decode-3, not as 'decode-4'"),
    ("messenger-decode-4", pod("decode-3"), "not as 'messenger-decode-4'"),
    ("gateway", pod("decode-3"), "not as 'gateway'"),
    ("decode-3", pod("decode-3", namespace="other"), "runs as other/yuebing-engine"),
    ("decode-3", pod("decode-3", account="default"), "runs as yuebing/default"),
    ("gateway-5d8f", pod("gateway-5d8f"), "no engine pod"),
])
def test_a_pod_is_nobody_else(user, who, says):
    with pytest.raises(ValueError, match=says):
        identity_of(user, who, SETTINGS)


def test_the_decision_checks_the_token_first():
    issuer = Issuer()
    keys = public_keys(issuer.jwks())
    granted = decide("decode-3", issuer.token("decode-3"), keys, SETTINGS, time.time())
    assert isinstance(granted, Grant) and granted.identity == Identity("decode-3", "decode")
    refused = decide("decode-3", issuer.token("decode-3", audience="other"), keys, SETTINGS, time.time())
    assert isinstance(refused, Refusal) and "token refused" in refused.reason and not refused.unknown_key
    rotated = decide("decode-3", Issuer(kid="k2").token("decode-3"), keys, SETTINGS, time.time())
    assert isinstance(rotated, Refusal) and rotated.unknown_key  # worth fetching the keys again


def test_the_user_jwt_carries_the_identitys_own_permissions_in_the_global_account():
    grant = Grant(Identity("decode-3", "decode"), pod("decode-3"))
    claims = user_claims(grant, "UKEY", now=100.0)
    p = permissions(grant.identity)
    assert (claims["sub"], claims["aud"], claims["name"]) == ("UKEY", "$G", "decode-3")
    assert claims["nats"]["pub"]["allow"] == list(p.publish) and claims["nats"]["sub"]["allow"] == list(p.subscribe)
    assert claims["nats"]["resp"] == {"max": 1, "ttl": 0} and "exp" not in claims
    request = {"nats": {"user_nkey": "UKEY", "server_id": {"id": "NSERVER"}}}
    assert response_claims(request, 100.0, error="no")["nats"] == {"type": "authorization_response", "version": 2,
                                                                  "error": "no"}
    assert response_claims(request, 100.0, user_jwt="j")["aud"] == "NSERVER"
