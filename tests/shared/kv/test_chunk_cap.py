"""The prompt chunk cap that follows the decode work on an engine."""

from shared.kv.chunk_cap import KV_CHUNK_CAP, ChunkCaps


def test_the_smallest_cap_of_the_requests_on_the_engine_holds_until_the_last_ends():
    caps = ChunkCaps(launched=0)  # launched for prefill: whole prompts
    assert caps.threshold() == 0
    assert caps.add("a", {KV_CHUNK_CAP: 512}) and caps.add("b", {KV_CHUNK_CAP: 256})
    assert caps.threshold() == 256
    assert caps.remove("b") and caps.threshold() == 512
    assert caps.remove("a") and caps.threshold() == 0  # its launch role's again
    assert not caps.remove("a")  # ended once


def test_a_launch_cap_stays_the_floor_and_requests_without_one_change_nothing():
    caps = ChunkCaps(launched=256)  # launched for decode
    assert caps.add("a", {KV_CHUNK_CAP: 1024}) and caps.threshold() == 256
    for params in (None, {}, {"kv_blocks": 3}, {KV_CHUNK_CAP: 0}, {KV_CHUNK_CAP: -5}, {KV_CHUNK_CAP: "64"},
                   {KV_CHUNK_CAP: True}, {KV_CHUNK_CAP: 64.0}):
        assert not caps.add("x", params)  # malformed or absent: asks for none
    assert not caps.remove("x") and caps.threshold() == 256
