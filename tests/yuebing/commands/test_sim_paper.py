"""`yuebing sim-paper`: each figure printed beside the paper's number, and plotted."""

from __future__ import annotations

import argparse
import json

import pytest

from yuebing.cli import build_parser
from yuebing.commands import sim_paper


def parse(*argv: str) -> argparse.Namespace:
    return build_parser((sim_paper,)).parse_args(["sim-paper", *argv])


def test_fig12_prints_capacities_beside_the_papers_range_and_plots_them(tmp_path, capsys):
    out = tmp_path / "paper.json"
    args = parse("--parts", "fig12", "--lengths", "16384", "--long-context-requests", "60", "--probes", "3",
                 "--plot-dir", str(tmp_path), "--json", str(out))
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "Fig. 12" in printed and "paper: +50 % to +525 %" in printed and "vLLM-[4M] paper" in printed
    rows = json.loads(out.read_text())["fig12"]
    assert {r["setup"] for r in rows} == {"Mooncake-[3P+1D]", "Mooncake-[2P+2D]", "vLLM-[4M] paper", "vLLM-[4M] chunked"}
    assert (tmp_path / "fig12.png").stat().st_size > 0


def test_an_unknown_part_is_refused_naming_the_parts():
    args = parse("--parts", "fig14")
    with pytest.raises(ValueError, match="fig11, fig12, fig13, table3"):
        args.func(args)
