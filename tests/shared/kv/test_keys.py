"""The cluster's KV key file: owner-only, never written through a planted file or
symlink, never read when others could have read or replaced it."""

from __future__ import annotations

import json
import os
import stat

import pytest

from shared.kv.keys import ClusterKeys, generate_keys, load_keys, write_keys


def test_a_written_key_file_is_owner_only_and_loads_back(tmp_path):
    path = tmp_path / "kv.key"
    keys = write_keys(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"public": keys.public.decode(), "secret": keys.secret.decode()}
    assert load_keys(path) == keys


def test_fresh_keys_differ_and_the_secret_never_shows_in_a_repr():
    a, b = generate_keys(), generate_keys()
    assert a != b
    assert a.secret.decode() not in repr(a) and a.public.decode() in repr(a)


def test_nothing_already_at_the_path_is_overwritten_or_written_through(tmp_path):
    existing, target, link = tmp_path / "kv.key", tmp_path / "target", tmp_path / "link.key"
    existing.write_text("keep")
    target.write_text("keep")
    link.symlink_to(target)
    for path in (existing, link):
        with pytest.raises(FileExistsError):
            write_keys(path)
    assert existing.read_text() == target.read_text() == "keep"


def test_a_key_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "kv.key"
    write_keys(path)
    for mode in (0o640, 0o604):
        os.chmod(path, mode)
        with pytest.raises(ValueError, match="open to others"):
            load_keys(path)


def test_a_symlinked_or_malformed_key_file_is_refused(tmp_path):
    real, link = tmp_path / "kv.key", tmp_path / "link.key"
    write_keys(real)
    link.symlink_to(real)
    with pytest.raises(ValueError, match="link.key"):
        load_keys(link)
    other = generate_keys()
    mismatched = tmp_path / "mismatched.key"
    mismatched.write_text(json.dumps({"public": other.public.decode(), "secret": generate_keys().secret.decode()}))
    os.chmod(mismatched, 0o600)
    with pytest.raises(ValueError, match="not the secret key's"):
        load_keys(mismatched)


def test_keys_must_be_curve_keys():
    with pytest.raises(ValueError, match="40 Z85"):
        ClusterKeys(b"short", b"short")
