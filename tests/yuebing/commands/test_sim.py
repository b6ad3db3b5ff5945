"""`yuebing sim` from its flags to its table and JSON (the command module alone, in a
parser of its own)."""

import argparse
import json

import pytest

from yuebing.cli import build_parser
from yuebing.commands import sim


def parse(*argv: str) -> argparse.Namespace:
    return build_parser((sim,)).parse_args(["sim", *argv])


def test_every_policy_times_admission_given_is_a_run(tmp_path, capsys):
    out = tmp_path / "sim.json"
    args = parse("--synthetic", "300", "--rate", "2", "--input-mean", "3000", "--policy", "round_robin,kvcentric",
                 "--admission", "none,predictive", "--prefill", "2", "--decode", "2", "--slo-tbt-ms", "80",
                 "--no-layerwise", "--json", str(out))
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    runs = [(r["policy"], r["admission"], r["requests"]) for r in result["runs"]]
    assert runs == [(p, a, 300) for p in ("round_robin", "kvcentric") for a in ("none", "predictive")]
    (config,) = {c for c in sim.sim_configs(args) if c.policy == "kvcentric" and c.admission == "none"}
    assert (config.prefill, config.slo_tbt_s, config.layerwise, config.seed) == (2, 0.08, False, 0)
    assert "kvcentric  predictive  2:2" in capsys.readouterr().out


def test_the_shipped_trace_by_name_and_a_prefill_decode_sweep(tmp_path):
    out = tmp_path / "sweep.json"
    args = parse("--trace", "conversation", "--limit", "200", "--pd-total", "4", "--speed", "4", "--json", str(out))
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["trace"] == "conversation"
    assert [(r["prefill"], r["decode"], r["requests"]) for r in result["runs"]] == [(1, 3, 200), (2, 2, 200), (3, 1, 200)]


def test_find_capacity_reports_a_speed_per_configuration(tmp_path, capsys):
    out = tmp_path / "capacity.json"
    args = parse("--synthetic", "100", "--rate", "1", "--input-mean", "2000", "--find-capacity", "--json", str(out))
    assert args.func(args) == 0
    (found,) = json.loads(out.read_text())["capacity"]
    assert found["capacity_speed"] > 1.0 and len(found["probes"]) == 12
    assert "kvcentric/none: speed" in capsys.readouterr().out


def test_a_trace_or_a_synthetic_one_is_required():
    with pytest.raises(SystemExit):
        parse("--policy", "kvcentric")
