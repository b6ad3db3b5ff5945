"""`yuebing sim` across serving modes: a run per mode, rule and TBT SLO, and the
capacity table against colocated beside the paper's figures."""

import argparse
import json

from yuebing.cli import build_parser
from yuebing.commands import sim
from yuebing.commands.sim_modes import capacity_table


def parse(*argv: str) -> argparse.Namespace:
    return build_parser((sim,)).parse_args(["sim", *argv])


def test_a_run_per_mode_conditional_rule_and_tbt_slo():
    args = parse("--synthetic", "50", "--mode", "colocated,conditional", "--conditional-rule", "mooncake,llmd",
                 "--tbt-slos", "100,300", "--step-tokens", "0", "--local-prefill-tokens", "700")
    configs = [(c.mode, c.conditional_rule, c.slo_tbt_s, c.step_tokens, c.local_prefill_tokens)
               for c in sim.sim_configs(args)]
    assert [c[:3] for c in configs] == [(m, r, s) for s in (0.1, 0.3)
                                        for m, r in (("colocated", "mooncake"), ("conditional", "mooncake"),
                                                     ("conditional", "llmd"))]
    assert {c[3:] for c in configs} == {(0, 700)}


def test_find_capacity_across_modes_prints_the_table_against_colocated(tmp_path, capsys):
    out = tmp_path / "capacity.json"
    args = parse("--synthetic", "100", "--rate", "1", "--input-mean", "2000", "--mode", "colocated,disaggregated",
                 "--tbt-slos", "100,200", "--find-capacity", "--capacity-probes", "4", "--json", str(out))
    assert args.func(args) == 0
    found = json.loads(out.read_text())["capacity"]
    assert [(f["mode"], f["slo_tbt_s"], len(f["probes"])) for f in found] == [
        ("colocated", 0.1, 4), ("disaggregated", 0.1, 4), ("colocated", 0.2, 4), ("disaggregated", 0.2, 4)]
    printed = capsys.readouterr().out
    assert "kvcentric/none colocated TBT 100 ms: speed" in printed
    assert "TBT SLO  colocated  disaggregated  paper synthetic" in printed
    assert "+62 %" in printed and "+40 %" in printed  # the paper's synthetic figures at 100 and 200 ms


def test_the_table_shows_each_modes_gain_over_colocated_and_the_papers():
    found = [{"mode": "colocated", "slo_tbt_s": 0.1, "capacity_rps": 1.0},
             {"mode": "disaggregated", "slo_tbt_s": 0.1, "capacity_rps": 2.5},
             {"mode": "colocated", "slo_tbt_s": 0.3, "capacity_rps": 0.0},
             {"mode": "disaggregated", "slo_tbt_s": 0.3, "capacity_rps": 3.0}]
    lines = capacity_table(found, "conversation").splitlines()
    assert lines[1].split() == ["TBT", "SLO", "colocated", "disaggregated", "paper", "conversation"]
    assert lines[2].split() == ["100", "ms", "1.00", "2.50", "(+150", "%)", "+498", "%"]
    assert lines[3].split() == ["300", "ms", "0.00", "3.00", "(colocated", "0)", "+59", "%"]
    # A trace of none of the paper's workloads: all three of its figures.
    assert "paper tool&agent" in capacity_table(found, "mine.jsonl")


def test_the_comparison_table_names_each_runs_mode_and_its_local_prefills(capsys):
    args = parse("--synthetic", "60", "--rate", "1", "--input-mean", "600", "--mode", "colocated,conditional",
                 "--conditional-rule", "llmd", "--prefill", "1", "--decode", "1")
    assert args.func(args) == 0
    rows = capsys.readouterr().out.splitlines()[-2:]
    assert rows[0].split()[3:5] == ["colocated", "0"]
    mode, local = rows[1].split()[3:5]
    assert mode == "conditional/llmd" and int(local) > 0
