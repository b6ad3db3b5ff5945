"""`yuebing sim-planner`: every static split beside the planner and the oracle, on a
shifting and a steady trace, and the planner's split over time as a plot."""

from __future__ import annotations

import argparse
import json

import pytest

from yuebing.cli import build_parser
from yuebing.commands import sim_planner


def parse(*argv: str) -> argparse.Namespace:
    return build_parser((sim_planner,)).parse_args(["sim-planner", *argv])


def test_it_prints_each_split_the_planner_and_the_oracle_and_plots_the_split(tmp_path, capsys):
    out = tmp_path / "planner.json"
    args = parse("--instances", "4", "--limit", "600", "--copies", "1", "--speed", "1.5", "--jobs", "2", "--plot-dir", str(tmp_path), "--json", str(out))
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "1P" in printed and "3P" in printed and "planner" in printed and "oracle" in printed
    result = json.loads(out.read_text())
    for name in ("shifting", "steady"):
        r = result[name]
        assert set(r["static_goodput_rps"]) == {"1", "2", "3"}
        assert r["planner_goodput_rps"] > 0 and r["oracle_goodput_rps"] >= max(r["static_goodput_rps"].values()) * 0.99
    assert (tmp_path / "planner_split.png").stat().st_size > 0


def test_in_adaptive_mode_the_static_splits_include_the_pooled_fleet(tmp_path, capsys):
    out = tmp_path / "planner.json"
    args = parse("--instances", "3", "--limit", "300", "--copies", "1", "--speed", "1.5", "--jobs", "1",
                 "--mode", "adaptive", "--json", str(out))
    assert args.func(args) == 0
    assert "0P" in capsys.readouterr().out
    assert set(json.loads(out.read_text())["steady"]["static_goodput_rps"]) == {"0", "1", "2"}


def test_bad_length_factors_are_refused():
    args = parse("--middle", "3")
    with pytest.raises(ValueError, match="input,output"):
        args.func(args)
