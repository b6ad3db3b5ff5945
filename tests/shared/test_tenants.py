import json

import pytest

from shared import tenants
from shared.tenants import DEFAULT_TENANT, Tenants, cache_salt, check_client_salt, key_sha256, parse, single


def file(*entries: dict) -> bytes:
    return json.dumps({"tenants": list(entries)}).encode()


def entry(tenant_id: str, *keys: str, **more) -> dict:
    digests = [key_sha256(k) for k in keys] or [key_sha256(tenant_id)]
    return {"id": tenant_id, "key_sha256": digests[0] if len(digests) == 1 else digests, **more}


def test_a_key_finds_its_tenant_and_no_other():
    t = parse(file(entry("acme", "k-acme"), entry("beta", "k-beta-old", "k-beta-new")))
    assert t.authenticate(b"k-acme").id == "acme"
    assert t.authenticate(b"k-beta-old").id == t.authenticate(b"k-beta-new").id == "beta"
    assert t.authenticate(b"k-nobody") is None
    assert t.authenticate(b"") is None


def test_defaults_a_group_of_its_own_no_limits_standard():
    (t,) = parse(file(entry("acme"))).by_id.values()
    assert (t.cache_group, t.requests_per_minute, t.tokens_per_minute, t.max_streams, t.priority, t.weight) == \
        ("acme", 0, 0, 0, "standard", 1.0)


def test_the_single_key_settings_are_one_tenant():
    assert single(None).open and single(None).authenticate(b"anything").id == DEFAULT_TENANT
    one = single("sekrit")
    assert not one.open and one.authenticate(b"sekrit").id == DEFAULT_TENANT
    assert one.authenticate(b"other") is None
    assert one.by_id[DEFAULT_TENANT].cache_group == ""  # the cluster's one cache, unsalted as before


@pytest.mark.parametrize("bad, says", [
    (b"{", "not a tenants file"),
    (b'{"tenants": []}', "at least one"),
    (file(entry("Acme")), "tenants[0].id"),
    (file(entry("a" * 64)), "tenants[0].id"),
    (file({"id": "acme", "key_sha256": "abc"}), "key_sha256"),
    (file({"id": "acme", "key_sha256": []}), "key_sha256"),
    (file(entry("acme", priority="gold")), "priority"),
    (file(entry("acme", requests_per_minute=-1)), "requests_per_minute"),
    (file(entry("acme", weight=0)), "weight"),
    (file(entry("acme", cache_group="a/b")), "cache_group"),
    (file(entry("acme", colour="red")), "colour"),
    (file(entry("acme", "k1"), entry("acme", "k2")), "unique"),
    (file(entry("acme", "k1"), entry("beta", "k1")), "two tenants"),
])
def test_a_bad_file_says_what_is_wrong(bad, says):
    with pytest.raises(ValueError, match=None) as e:
        parse(bad)
    assert says in str(e.value)


def test_get_answers_for_a_tenant_the_file_dropped():
    t = parse(file(entry("acme")))
    assert t.get("acme").cache_group == "acme"
    assert t.get("gone").id == "gone" and t.get("gone").max_streams == 0


def test_the_salt_is_keyed_and_folds_the_clients_under_the_groups():
    key = b"k" * 32
    assert cache_salt(key, "") == ""  # the one cache: unsalted
    a, b = cache_salt(key, "acme"), cache_salt(key, "beta")
    assert a != b and len(a) == 32
    assert cache_salt(b"other key", "acme") != a  # nobody without the key names it
    assert cache_salt(key, "acme") == a  # every gateway, every time
    own = cache_salt(key, "acme", "mine")
    assert own not in (a, cache_salt(key, "beta", "mine"))
    assert cache_salt(key, "", "mine") not in ("", own)


@pytest.mark.parametrize("salt", ["", "a/b", "x@y", "a\\b", "n\0", "s" * 129, 5, None])
def test_a_clients_salt_is_checked_as_vllm_does(salt):
    with pytest.raises(ValueError, match="cache_salt"):
        check_client_salt(salt)


def test_load_refuses_a_file_open_to_others(tmp_path):
    p = tmp_path / "tenants.json"
    p.write_bytes(file(entry("acme")))
    p.chmod(0o644)
    with pytest.raises(PermissionError):
        tenants.load(str(p))
    p.chmod(0o600)
    assert isinstance(tenants.load(str(p)), Tenants)


def write(p, raw: bytes) -> None:
    p.write_bytes(raw)
    p.chmod(0o600)


def test_a_changed_file_is_read_again_and_a_bad_one_keeps_the_last_good(tmp_path):
    from structlog.testing import capture_logs

    p = tmp_path / "tenants.json"
    write(p, file(entry("acme", "k1")))
    w = tenants.Watched.open(str(p))
    assert not w.refresh()  # unchanged
    write(p, file(entry("acme", "k1", "k2-longer")))
    assert w.refresh() and w.current.authenticate(b"k2-longer").id == "acme"
    with capture_logs() as logs:
        write(p, b'{"tenants": [{"id": "acme"}]}x')
        assert not w.refresh() and not w.refresh()  # once per version
        p.unlink()
        assert not w.refresh()
    assert [e["event"] for e in logs] == ["tenants file refused: the last good one stays in force"] * 2
    assert w.current.authenticate(b"k1").id == "acme"


def test_a_bad_file_at_start_is_fatal(tmp_path):
    p = tmp_path / "tenants.json"
    write(p, b"{}")
    with pytest.raises(ValueError, match="tenants"):
        tenants.Watched.open(str(p))


def test_an_anonymous_tenant_takes_requests_without_a_key_never_a_wrong_one():
    t = parse(file(entry("acme", "k-acme"), {"id": "public", "anonymous": True, "priority": "sheddable"}))
    assert t.authenticate(b"").id == "public"
    assert t.authenticate(b"k-acme").id == "acme"
    assert t.authenticate(b"k-wrong") is None
    assert parse(file(entry("acme"))).authenticate(b"") is None


@pytest.mark.parametrize("bad, says", [
    (file({"id": "a", "anonymous": True}, {"id": "b", "anonymous": True}), "at most one"),
    (file({"id": "a", "anonymous": True, "metrics": True}), "/metrics"),
    (file({"id": "a"}), "anonymous"),
])
def test_anonymous_rules(bad, says):
    with pytest.raises(ValueError) as e:
        parse(bad)
    assert says in str(e.value)
