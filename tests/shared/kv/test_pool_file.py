"""The pool file's slot layout and self-describing block header."""

from __future__ import annotations

import os
import stat

import pytest

from shared.kv.pool_file import HEADER_BYTES, Geometry, Header, PoolFile, PoolSlots, checksum

GEOMETRY = Geometry(layers=4, shape=(2, 128, 128), dtype="float32", itemsize=4, layout="dims0123")


def test_slots_are_layer_major_after_a_header():
    assert GEOMETRY.layer_bytes == 2 * 128 * 128 * 4
    assert GEOMETRY.slot_bytes == HEADER_BYTES + 4 * GEOMETRY.layer_bytes
    assert GEOMETRY.layer_offset(3) == HEADER_BYTES + 3 * GEOMETRY.layer_bytes


def test_header_round_trips_and_detects_damage():
    header = Header(b"h" * 16, 42, GEOMETRY, [1, 2, 3, 4])
    packed = bytearray(header.pack())
    assert Header.unpack(bytes(packed), 4, "dims0123") == header
    packed[-1] ^= 1  # a layer checksum
    with pytest.raises(ValueError, match="checksum"):
        Header.unpack(bytes(packed), 4, "dims0123")


SMALL = Geometry(layers=2, shape=(1, 4, 4), dtype="uint8", itemsize=1, layout="x")


def test_two_mappings_of_one_pool_file_share_memory(tmp_path):
    # The messenger creates the file at start-up; an engine maps the slots its Hello was given.
    writer = PoolSlots(PoolFile(tmp_path / "p.pool", 3 * SMALL.slot_bytes + 100, create=True), SMALL)
    assert writer.count == 3  # the bytes past the last whole slot are not used
    reader = PoolSlots.open(tmp_path / "p.pool", SMALL, 3)
    writer.layer(2, 1)[:] = bytes(range(16))
    assert bytes(reader.layer(2, 1)) == bytes(range(16))
    assert checksum(reader.layer(2, 1)) == checksum(bytes(range(16)))
    assert bytes(reader.layer(2, 0)) == bytes(16)
    writer.close()
    reader.close()


def test_bad_geometry_is_refused():
    with pytest.raises(ValueError):
        Geometry(layers=0, shape=(1, 1, 1), dtype="uint8", itemsize=1, layout="x")


def test_a_pool_file_too_small_for_one_block_cannot_be_carved(tmp_path):
    file = PoolFile(tmp_path / "p.pool", SMALL.slot_bytes - 1, create=True)
    with pytest.raises(ValueError, match="holds no block"):
        PoolSlots(file, SMALL)
    file.close()


def test_an_engine_cannot_map_more_than_the_file_holds(tmp_path):
    PoolFile(tmp_path / "p.pool", SMALL.slot_bytes, create=True).close()
    with pytest.raises(ValueError, match="smaller"):
        PoolSlots.open(tmp_path / "p.pool", SMALL, 2)


def test_a_new_pool_file_is_owner_only_and_replaces_a_symlink_without_following_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "p.pool").symlink_to(victim)
    with pytest.raises(OSError):  # an engine never maps through a symlink
        PoolSlots.open(tmp_path / "p.pool", SMALL, 1)
    file = PoolFile(tmp_path / "p.pool", SMALL.slot_bytes, create=True)
    assert victim.read_bytes() == b"precious"
    assert stat.S_IMODE(os.lstat(tmp_path / "p.pool").st_mode) == 0o600
    file.close()
