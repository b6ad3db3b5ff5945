"""The node's KV files: an owner-only folder, owner-only pool and SSD files created
fresh (never through a planted symlink), and a restart that never truncates the pool
file engines still map."""

from __future__ import annotations

import os
import stat

import pytest

from shared.kv.pool_file import PoolSlots
from shared.kv.wire import pool_path
from tests.messenger.nodes import GEOMETRY, pool, start, store


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_kv_folder_is_owner_only_and_the_pool_file_too(tmp_path):
    m = start(tmp_path, "a")
    assert mode(tmp_path / "kv") == 0o700 and mode(pool_path(str(tmp_path / "kv"), "a")) == 0o600
    m.close()


def test_a_kv_folder_of_ours_left_open_to_others_is_closed(tmp_path):
    (tmp_path / "kv").mkdir(mode=0o755)
    os.chmod(tmp_path / "kv", 0o755)
    start(tmp_path, "a").close()
    assert mode(tmp_path / "kv") == 0o700


def test_a_symlinked_kv_folder_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "kv").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match="symlink"):
        start(tmp_path, "a")


def test_a_symlink_planted_at_the_pool_path_is_not_followed(tmp_path):
    (tmp_path / "kv").mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    pool_path(str(tmp_path / "kv"), "a").symlink_to(victim)
    m = start(tmp_path, "a")
    assert victim.read_bytes() == b"precious"
    assert stat.S_ISREG(os.lstat(pool_path(str(tmp_path / "kv"), "a")).st_mode)
    m.close()


def test_a_restarted_messenger_leaves_the_old_pool_file_to_the_engines_that_map_it(tmp_path):
    first = start(tmp_path, "a")
    store(first, 7)
    path = pool_path(str(tmp_path / "kv"), "a")
    engine = PoolSlots.open(path, GEOMETRY, pool(first).slots.count)  # an engine's mapping
    old_inode = path.stat().st_ino
    second = start(tmp_path, "a")  # the messenger restarts (its old one never closed)
    assert path.stat().st_ino != old_inode
    assert set(bytes(engine.layer(0, 0))) == {7}  # not truncated under the engine
    engine.close()
    second.close()


def test_the_ssd_tier_is_owner_only_and_never_reads_through_a_symlink(tmp_path):
    ssd = tmp_path / "ssd"
    m = start(tmp_path, "a", slots=1, ssd_path=str(ssd), ssd_bytes=4 * GEOMETRY.slot_bytes)
    store(m, 1)
    store(m, 2)  # block 1 spills
    pool(m).ssd.flush()
    (spilled,) = ssd.glob("*.blk")
    assert mode(ssd) == 0o700 and mode(spilled) == 0o600
    m.close()
    victim = spilled.rename(tmp_path / "victim")  # a good block file, elsewhere
    spilled.symlink_to(victim)
    again = start(tmp_path, "a", slots=1, ssd_path=str(ssd), ssd_bytes=4 * GEOMETRY.slot_bytes)
    assert again.snapshot().ssd == [] and again.stats().ssd_dropped == 1  # the symlink is dropped, not read
    assert victim.exists() and not spilled.is_symlink()
    again.close()
