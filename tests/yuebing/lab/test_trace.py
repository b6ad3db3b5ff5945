"""Traces: Mooncake's format (plain or gzipped), the shipped conversation trace,
synthetic traces and rescaling."""

import gzip
import json

import pytest

from yuebing.lab.data import CONVERSATION_TRACE
from yuebing.lab.trace import (
    TRACE_BLOCK_TOKENS,
    Mix,
    SyntheticSpec,
    TraceError,
    TraceRequest,
    load_trace,
    rescale,
    synthetic,
    tiled,
)

LINES = [{"timestamp": 20, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},
         {"timestamp": 10, "input_length": 100, "output_length": 7, "hash_ids": [1]}]


def test_a_gzipped_trace_reads_as_the_plain_one_sorted_by_arrival(tmp_path):
    text = "".join(json.dumps(line) + "\n" for line in LINES)
    (tmp_path / "t.jsonl").write_text(text)
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    plain, zipped = (load_trace(tmp_path / name) for name in ("t.jsonl", "t.jsonl.gz"))
    assert plain == zipped == [TraceRequest(10.0, 100, 7, (1,)), TraceRequest(20.0, 600, 3, (1, 2))]


def test_a_bad_line_is_an_error_naming_it(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(LINES[0]) + "\n" + json.dumps({**LINES[1], "hash_ids": [1, 2, 3]}) + "\n")
    with pytest.raises(TraceError, match="bad.jsonl:2: 3 hash ids for 100 tokens"):
        load_trace(path)


def test_the_shipped_conversation_trace_is_mooncakes():
    trace = load_trace(CONVERSATION_TRACE)
    assert len(trace) == 12_031
    assert trace[-1].timestamp_ms / 1e3 == pytest.approx(3537, abs=1)
    assert sum(r.input_length for r in trace) / len(trace) == pytest.approx(12_035, abs=1)
    assert load_trace(CONVERSATION_TRACE, limit=5) == trace[:5]


def test_synthetic_requests_share_prefixes_as_specified():
    spec = SyntheticSpec(requests=400, rate_per_s=10.0, shared_prefix_ratio=1.0, prefixes=2, seed=3)
    trace = synthetic(spec)
    assert len(trace) == 400 and trace == synthetic(spec)  # seeded
    assert len({r.hash_ids[0] for r in trace}) == 2
    assert all(len(r.hash_ids) == -(-r.input_length // TRACE_BLOCK_TOKENS) for r in trace)


def test_rescaling_keeps_the_hash_ids_of_what_is_left_of_each_prompt():
    (r,) = rescale([TraceRequest(1000.0, 2048, 400, (1, 2, 3, 4))], speed=2.0, length_factor=0.25, max_output=64)
    assert r == TraceRequest(500.0, 512, 64, (1, 2, 3, 4))  # 512-token blocks became 128-token ones
    (capped,) = rescale([TraceRequest(0.0, 2048, 4, (1, 2, 3, 4))], length_factor=0.25, max_input=200)
    assert capped.input_length == 200 and capped.hash_ids == (1, 2)


def test_a_shifting_trace_changes_its_middle_third_and_keeps_arrivals():
    from yuebing.lab.trace import shifting

    trace = [TraceRequest(i * 100.0, 1000 + i, 50, (i * 10, i * 10 + 1)) for i in range(9)]
    out = shifting(trace, middle=Mix(3.0, 0.1), outer=Mix(1.0, 1.0))
    assert out[:3] == trace[:3] and out[6:] == trace[6:]
    for before, after in zip(trace[3:6], out[3:6]):
        assert after.timestamp_ms == before.timestamp_ms and after.output_length == 5
        assert after.input_length == 3 * before.input_length
        assert after.hash_ids[:2] == before.hash_ids and len(after.hash_ids) == -(-after.input_length // 512)
    added = [h for r in out[3:6] for h in r.hash_ids[2:]]
    assert len(set(added)) == len(added) and not set(added) & {h for r in trace for h in r.hash_ids}  # unshared
    shorter = shifting(trace, outer=Mix(0.25, 4.0))[0]
    assert (shorter.input_length, shorter.output_length, shorter.hash_ids) == (250, 200, (0,))


def test_a_mix_appends_an_unshared_document_to_every_prompt():
    from yuebing.lab.trace import shifting

    trace = [TraceRequest(i * 100.0, 100 * (i + 1), 64, (i,)) for i in range(3)]
    out = shifting(trace, middle=Mix(1.0, 0.25, document_tokens=1000), outer=Mix(1.0, 0.25, document_tokens=1000))
    assert [r.input_length for r in out] == [1100, 1200, 1300]  # short prompts become long ones
    assert all(r.output_length == 16 and r.hash_ids[0] == i and len(r.hash_ids) == 3 for i, r in enumerate(out))
    assert Mix.parse("0.5,0.0625,8000") == Mix(0.5, 0.0625, 8000) and Mix.parse("3,0.125") == Mix(3.0, 0.125)
    for bad in ("3", "1,2,3,4", "a,b", "0,1", "1,1,-5"):
        with pytest.raises(ValueError):
            Mix.parse(bad)


def test_a_tiled_trace_multiplies_users_interleaved_with_their_own_prompts():
    trace = [TraceRequest(0.0, 1024, 10, (0, 1)), TraceRequest(100.0, 512, 5, (0,)), TraceRequest(200.0, 512, 5, (2,))]
    out = tiled(trace, 2)
    assert len(out) == 6 and [r.timestamp_ms for r in out] == sorted(r.timestamp_ms for r in out)
    first, second = out[0], out[1]
    assert first.hash_ids == (0, 1) and second.hash_ids == (3, 4)  # the copy's own blocks, past the trace's
    assert 0.0 < second.timestamp_ms < 100.0  # between the first copy's arrivals
    assert tiled(trace, 1) == trace
    with pytest.raises(ValueError):
        tiled(trace, 0)
