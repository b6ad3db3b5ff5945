"""The long-context study (yuebing/lab/long_context.py, `yuebing sim-long-context`):
single, CPP and elastic sequence parallelism on the shipped GPU profile."""

import json

import pytest

from shared.predictor import load_predictor
from yuebing import cli
from yuebing.lab import data
from yuebing.lab.long_context import (
    Setup,
    esp_degree,
    esp_prefill_s,
    lone_times,
    poisson_arrivals,
    run_all,
    run_cpp,
    run_esp,
    run_single,
    study,
    winners,
)
from yuebing.shapes import SHAPES

PRED = load_predictor(data.GPU_PROFILE, "llama3-8b")
SETUP = Setup(SHAPES["llama3-8b"])
LENGTHS = (8192, 32768, 65536, 131072)


@pytest.fixture(scope="module")
def rows():
    return study(PRED, SETUP, LENGTHS, (2, 4, 8), load=0.7, requests=60, seed=3)


def test_alone_two_stages_beat_one_instance_from_32k(rows):
    for row in rows:
        lone = row["lone"]
        if row["tokens"] >= 32768:
            assert lone["cpp-2"]["ttft_mean_s"] < lone["single"]["ttft_mean_s"], row["tokens"]
    short = rows[0]["lone"]  # one 8k chunk: the stages only add their fixed costs and hand-over
    assert short["cpp-2"]["ttft_mean_s"] > short["single"]["ttft_mean_s"]


def test_cpp_holds_more_instance_seconds_than_single(rows):
    for row in rows:
        for load in ("lone", "loaded"):
            single = row[load]["single"]["instance_s"]
            for s in (2, 4, 8):
                assert row[load][f"cpp-{s}"]["instance_s"] >= single, (row["tokens"], load, s)
        # alone, a group of 8 holds its bubbles: more than a group of 2
        assert row["lone"]["cpp-8"]["instance_s"] > row["lone"]["cpp-2"]["instance_s"]


def test_queueing_counts_in_ttft_under_load(rows):
    for row in rows:
        for name, result in row["loaded"].items():
            assert result["ttft_p90_s"] >= result["ttft_mean_s"] * 0.99
            assert result["ttft_mean_s"] >= row["lone"][name]["ttft_mean_s"] * 0.999, (row["tokens"], name)


def test_esp_time_falls_with_its_degree_while_its_instance_seconds_rise():
    tokens = 65536
    times = [esp_prefill_s(PRED, SETUP, tokens, d)[0] for d in (1, 2, 4, 8)]
    assert times[0] == pytest.approx(PRED.prefill_s(tokens))  # one instance: the profile's unchunked prefill
    assert times == sorted(times, reverse=True) and times[-1] < times[0] / 4
    held = [d * t for d, t in zip((1, 2, 4, 8), times)]
    assert held == sorted(held) and held[-1] > held[0]


def test_esp_ring_communication_hides_behind_long_attention_and_shows_on_a_slow_link():
    assert esp_prefill_s(PRED, SETUP, 131072, 8)[1] == 0.0  # 128k: each ring step's attention outlasts its send
    short, exposed = esp_prefill_s(PRED, SETUP, 8192, 8)
    assert exposed > 0.0
    slow = Setup(SHAPES["llama3-8b"], link_bytes_per_s=2.5e9)
    assert esp_prefill_s(PRED, slow, 8192, 8)[0] > short
    # so LoongServe's choice takes fewer instances over a slow link
    assert esp_degree(PRED, slow, 8192, idle=8, waiting=1) < esp_degree(PRED, SETUP, 8192, idle=8, waiting=1) == 8


def test_esp_shares_idle_instances_among_waiting_prompts():
    assert esp_degree(PRED, SETUP, 65536, idle=8, waiting=1) == 8
    assert esp_degree(PRED, SETUP, 65536, idle=8, waiting=4) == 2
    assert esp_degree(PRED, SETUP, 65536, idle=3, waiting=5) == 1
    assert esp_degree(PRED, Setup(SHAPES["llama3-8b"], esp_max=4), 65536, idle=8, waiting=1) == 4


def test_every_strategy_serves_every_prompt_in_arrival_order_on_its_instances():
    arrivals = poisson_arrivals(3.0, 40, seed=1)
    for served in (run_single(PRED, SETUP, 32768, arrivals), run_cpp(PRED, SETUP, 4, 32768, arrivals),
                   run_esp(PRED, SETUP, 32768, arrivals)):
        assert [s.arrival for s in served] == arrivals
        assert all(s.arrival <= s.start < s.finish for s in served)
        assert all(0 < s.degree <= SETUP.instances for s in served)
    with pytest.raises(ValueError):
        run_cpp(PRED, Setup(SHAPES["llama3-8b"], instances=4), 8, 8192, arrivals)


def test_the_ring_sends_the_kv_where_a_pipeline_sends_activations(rows):
    for row in rows:
        loaded = row["loaded"]
        assert loaded["single"]["link_gb"] == 0.0
        # a stage boundary: one hidden vector per token (4096 × bf16), S − 1 times
        assert loaded["cpp-4"]["link_gb"] == pytest.approx(3 * row["tokens"] * 8192 / 1e9)
        assert loaded["esp"]["link_gb"] > loaded["cpp-8"]["link_gb"]


def test_winners_name_the_least_strategy_per_length_and_share_ties():
    rows = [{"tokens": t, "lone": {"a": {"m": a}, "b": {"m": b}}} for t, a, b in
            ((1, 1.0, 2.0), (2, 1.0, 3.0), (3, 2.0, 2.001), (4, 3.0, 1.0))]
    assert winners(rows, "lone", "m") == [("a", [1, 2]), ("a=b", [3]), ("b", [4])]


def test_lone_times_match_the_lone_runs():
    times = lone_times(PRED, SETUP, 65536, (2, 4, 8))
    lone = run_all(PRED, SETUP, 65536, (2, 4, 8), [0.0])
    assert {name: r["ttft_mean_s"] for name, r in lone.items()} == pytest.approx(times)


def test_the_command_prints_the_table_and_writes_its_json(tmp_path, capsys):
    out = tmp_path / "lc.json"
    assert cli.main(["sim-long-context", "--lengths", "8192,65536", "--requests", "30", "--stages", "2,4",
                     "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "where each wins:" in printed and "extrapolate" in printed and "cpp-4" in printed
    result = json.loads(out.read_text())
    assert result["profile_measured_tokens"] == 32768
    assert [r["tokens"] for r in result["rows"]] == [8192, 65536]
    for row in result["rows"]:
        assert set(row["lone"]) == set(row["loaded"]) == {"single", "cpp-2", "cpp-4", "esp"}
        assert set(row["loaded"]["esp"]) == {"ttft_mean_s", "ttft_p90_s", "instance_s", "degree_mean", "link_gb"}
    assert set(result["wins"]) >= {"TTFT alone", "instance-s loaded"}
    assert cli.main(["sim-long-context", "--profile-model", "gpt-9"]) != 0  # no shape known for it
    assert "--profile-model" in capsys.readouterr().err
