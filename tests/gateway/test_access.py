import json

import pytest
from aiohttp.test_utils import make_mocked_request

from services.gateway.access import Access
from shared.tenants import key_sha256, parse

KEY = b"c" * 32
FILE = {"tenants": [
    {"id": "acme", "key_sha256": key_sha256("k-acme"), "cache_group": "shared"},
    {"id": "beta", "key_sha256": key_sha256("k-beta"), "cache_group": "shared"},
    {"id": "gamma", "key_sha256": key_sha256("k-gamma")},
    {"id": "ops", "key_sha256": key_sha256("k-ops"), "metrics": True},
]}


def access() -> Access:
    return Access(parse(json.dumps(FILE).encode()), KEY, metrics_require_key=True)


def call(path: str, key: str | None = None):
    return make_mocked_request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})


def test_each_key_is_its_tenant_and_an_unknown_one_nobody():
    a = access()
    assert a.tenant(call("/v1/models", "k-acme")).id == "acme"
    assert a.tenant(call("/v1/models", "k-gamma")).id == "gamma"
    assert a.tenant(call("/v1/models", "k-nope")) is None
    assert a.tenant(call("/v1/models")) is None


def test_only_an_operator_reads_metrics():
    a = access()
    assert a.guarded("/metrics") and a.guarded("/tokenize") and not a.guarded("/health")
    assert a.tenant(call("/metrics", "k-acme")) is None
    assert a.tenant(call("/metrics", "k-ops")).id == "ops"


def test_one_group_one_salt_and_a_clients_salt_splits_it():
    a = access()
    acme, beta, gamma = (a.tenants.by_id[t] for t in ("acme", "beta", "gamma"))
    assert a.salt(acme, None) == a.salt(beta, None) != a.salt(gamma, None)
    assert a.salt(acme, "mine") not in (a.salt(acme, None), a.salt(gamma, "mine"))
    assert a.salt(acme, "mine") == a.salt(beta, "mine")  # one group: the same split is the same cache


def test_the_single_key_is_the_one_cache_unsalted():
    a = Access.single("sesame")
    tenant = a.tenant(call("/v1/models", "sesame"))
    assert tenant.id == "default" and a.salt(tenant, None) == ""
    assert a.tenant(call("/v1/models", "wrong")) is None
    assert Access.single(None).tenant(call("/v1/models")).id == "default"


def test_a_tenants_file_needs_the_cache_key_and_no_single_key(tmp_path):
    p = tmp_path / "tenants.json"
    p.write_text(json.dumps(FILE))
    p.chmod(0o600)
    with pytest.raises(ValueError, match="cache key"):
        Access.from_files(None, str(p), None)
    with pytest.raises(ValueError, match="not both"):
        Access.from_files("sesame", str(p), None)
    short = tmp_path / "cache.key"
    short.write_bytes(b"x" * 8)
    short.chmod(0o600)
    with pytest.raises(ValueError, match="too short"):
        Access.from_files(None, str(p), str(short))
    short.write_bytes(KEY)
    a = Access.from_files(None, str(p), str(short))
    assert a.metrics_require_key and a.tenant(call("/v1/models", "k-beta")).id == "beta"


def test_only_a_critical_tenant_goes_before_the_default_priority_among_several():
    from shared.tenants import Tenant

    one = Access.single("k")
    assert one.priority(Tenant("default"), -5) == -5  # one tenant: vLLM's rule, as asked
    several = access()
    assert several.priority(Tenant("a"), -5) == 0 and several.priority(Tenant("a"), 7) == 7
    assert several.priority(Tenant("c", priority="critical"), -5) == -5
