"""The AIPerf client's pure parts: the trace it replays, its command line, and its
records read back as outcomes (yuebing/bench/aiperf.py)."""

import json
from pathlib import Path

from yuebing.bench import aiperf
from yuebing.lab.trace import TraceRequest

TRACE = [TraceRequest(0.0, 300, 8, (1, 2, 3)), TraceRequest(250.4, 100, 4, (1, 9)), TraceRequest(500.0, 50, 2, (7,))]


def record(session: int, ttft_ms: float = 100.0, gaps_ms: tuple[float, ...] = (10.0, 30.0)) -> dict:
    return {"metadata": {"session_num": session}, "error": None,
            "metrics": {"time_to_first_token": {"value": ttft_ms, "unit": "ms"},
                        "inter_chunk_latency": {"value": list(gaps_ms), "unit": "ms"}}}


def test_the_trace_goes_in_the_mooncake_format_with_whole_millisecond_timestamps():
    lines = [json.loads(line) for line in aiperf.dataset_lines(TRACE)]
    assert lines[1] == {"timestamp": 250, "input_length": 100, "output_length": 4, "hash_ids": [1, 9]}


def test_records_become_outcomes_in_the_trace_order_refusals_and_failures_apart():
    refused = {"metadata": {"session_num": 1}, "error": {"code": 429, "message": "busy"}, "metrics": {}}
    got = aiperf.outcomes([refused, record(0, 120.0, (10.0, 10.0, 40.0))], TRACE, 2.0, 0.05)
    first, second, third = got
    assert first.completed and first.ttft_s == 0.12 and first.tbt_mean_s == 0.02 and first.tbt_tail_s == 0.04
    assert second.rejected and not second.failed
    assert third.failed and not third.completed  # no record at all
    assert [o.arrival_s for o in got] == [0.0, 0.2504, 0.5]


def test_the_command_replays_the_schedule_streaming_over_every_url(tmp_path: Path):
    run = aiperf.Run(("http://a:1", "http://b:2"), "tiny", 128, tmp_path, seed=3, api_key="k")
    argv = aiperf.argv(run, "aiperf", tmp_path / "t.jsonl", tmp_path / "out")
    assert argv[:2] == ["aiperf", "profile"] and "--fixed-schedule" in argv and "--streaming" in argv
    assert argv[argv.index("--isl-block-size") + 1] == "128" and argv.count("--url") == 2
    assert argv[argv.index("--api-key") + 1] == "k" and argv[argv.index("--tokenizer") + 1] == aiperf.TOKENIZER_REPO


def test_the_tokenizer_is_offered_as_an_offline_hugging_face_cache_entry(tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    root = aiperf.tokenizer_cache(model, tmp_path / "hf")
    repo = root / "hub" / "models--yuebing--tokenizer"
    assert (repo / "refs" / "main").read_text() == "local"
    assert (repo / "snapshots" / "local" / "tokenizer.json").read_text() == "{}"


def test_a_missing_aiperf_is_a_clear_error(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("YUEBING_AIPERF", str(tmp_path / "nowhere"))
    try:
        aiperf.executable()
    except RuntimeError as e:
        assert "make aiperf" in str(e)
    else:
        raise AssertionError("no error")
