"""The pool file's slot layout and self-describing block header."""

from __future__ import annotations

import pytest

from shared.kv_pool import HEADER_BYTES, Geometry, Header, PoolFile, checksum

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


def test_two_mappings_of_one_pool_file_share_memory(tmp_path):
    small = Geometry(layers=2, shape=(1, 4, 4), dtype="uint8", itemsize=1, layout="x")
    writer = PoolFile(tmp_path / "p.pool", small, slots=3, create=True)
    reader = PoolFile(tmp_path / "p.pool", small, slots=3, create=False)
    writer.layer(2, 1)[:] = bytes(range(16))
    assert bytes(reader.layer(2, 1)) == bytes(range(16))
    assert checksum(reader.layer(2, 1)) == checksum(bytes(range(16)))
    assert bytes(reader.layer(2, 0)) == bytes(16)
    writer.close()
    reader.close()


def test_bad_geometry_is_refused():
    with pytest.raises(ValueError):
        Geometry(layers=0, shape=(1, 1, 1), dtype="uint8", itemsize=1, layout="x")
