from shared.block_hash import block_hashes, hex_hashes


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


def test_hash_is_stable_across_runs_and_salted_by_model():
    tokens = list(range(64))
    # Pinned: the value every service and the simulator must agree on.
    assert hex_hashes(tokens, 64) == ["5923af417c80939b0c373b62abcb1507"]
    assert hex_hashes(tokens, 64, b"model-a") != hex_hashes(tokens, 64, b"model-b")
