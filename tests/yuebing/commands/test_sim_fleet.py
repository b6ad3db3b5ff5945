"""`yuebing sim-fleet`: fleets of several sizes on the tiled conversation trace, the
small ones beside every instance scored."""

from __future__ import annotations

import argparse
import json

import pytest

from yuebing.cli import build_parser
from yuebing.commands import sim_fleet


def parse(*argv: str) -> argparse.Namespace:
    return build_parser((sim_fleet,)).parse_args(["sim-fleet", *argv])


def test_each_fleet_reports_decisions_index_and_placement_against_every_instance_scored(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    args = parse("--sizes", "4", "8", "--base", "4", "--limit", "300", "--shortlist", "1", "--exact-up-to", "4",
                 "--policies", "kvcentric", "--json", str(out))
    assert args.func(args) == 0
    assert "fleet scale" in capsys.readouterr().out
    runs = json.loads(out.read_text())["runs"]
    assert [(r["instances"], r["shortlist"], r["requests"]) for r in runs] == [(4, 1, 300), (4, 0, 300), (8, 1, 600)]
    short, exact = runs[0], runs[1]
    assert short["goodput_rps_vs_exact"] == pytest.approx(short["goodput_rps"] / exact["goodput_rps"])
    for r in runs:
        assert r["goodput_rps"] > 0 and r["decision_us"]["p99"] >= r["decision_us"]["p50"] > 0
        assert r["indexed_blocks"] > 0 and r["index_entries"] >= r["indexed_blocks"]


def test_sizes_must_be_multiples_of_the_base():
    args = parse("--sizes", "24", "--base", "16")
    with pytest.raises(ValueError, match="multiple"):
        args.func(args)
