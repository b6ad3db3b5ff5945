import hashlib
import struct

import pytest

from shared.block_hash import ROOT, block_hashes, chain, hex_hashes, sha256_16, tail_hash


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(127)), 64)) == 1
    assert len(block_hashes(list(range(128)), 64)) == 2
    assert block_hashes(list(range(63)), 64) == []


def test_hash_is_chained_over_the_whole_prefix():
    a = list(range(192))
    b = [*a[:64], 999, *a[65:]]  # differs in block 1 only
    ha, hb = block_hashes(a, 64), block_hashes(b, 64)
    assert ha[0] == hb[0]
    assert ha[1] != hb[1]
    assert ha[2] != hb[2]  # block 2's tokens are equal, but its prefix is not


def test_equal_prefixes_have_equal_hashes_whatever_follows():
    prefix = list(range(1000, 1256))
    a, b = block_hashes([*prefix, *range(64)], 128, b"m"), block_hashes([*prefix, 7, *range(200)], 128, b"m")
    assert a[:2] == b[:2] and len(a) == 2 and len(b) == 3


def test_hash_is_stable_across_runs_and_salted_by_model():
    tokens = list(range(64))
    # Pinned: the value every service and the simulator must agree on.
    assert hex_hashes(tokens, 64) == ["581b375155db8a46a2c45db94775e5f8"]
    assert hex_hashes(tokens, 64, b"model-a") != hex_hashes(tokens, 64, b"model-b")
    # Another fingerprint under the same served name is another model.
    assert hex_hashes(tokens, 64, b"m\0" + b"1" * 64) != hex_hashes(tokens, 64, b"m\0" + b"2" * 64)
    assert hex_hashes(tokens, 64, b"model-a") != hex_hashes(tokens, 64)


def test_hash_is_truncated_sha256_of_the_previous_hash_and_little_endian_int64_tokens():
    tokens = [1, 2**40, 128_255, 0]
    salted = hashlib.sha256(ROOT + b"salt").digest()[:16]
    first = hashlib.sha256(salted + struct.pack("<4q", *tokens[:4])).digest()[:16]
    assert block_hashes(tokens, 4, b"salt") == [first]
    assert block_hashes(tokens, 2) == chain(tokens, 2, b"", sha256_16)
    assert all(len(h) == 16 for h in block_hashes(list(range(1024)), 16))


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        block_hashes([1, 2, 3], 0)


def test_a_prompts_tail_is_named_by_its_tokens_after_the_full_blocks_and_never_as_a_full_block():
    prompt = list(range(10))
    full = block_hashes(prompt, 4, b"m")
    tail = tail_hash(prompt, 4, b"m", full)
    assert tail is not None and tail not in full
    assert tail_hash(prompt[:8], 4, b"m", full) is None  # on a block boundary: no tail
    assert tail_hash([*prompt[:9], 99], 4, b"m", full) != tail  # its own tokens
    assert tail_hash(prompt, 4, b"other", block_hashes(prompt, 4, b"other")) != tail  # and salt
    assert tail_hash(prompt[:3], 4, b"m", []) != block_hashes([*prompt[:3], 0], 4, b"m")[0]
