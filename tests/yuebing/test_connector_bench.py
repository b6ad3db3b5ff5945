"""`yuebing bench connector` on this machine's CPU, as a smoke test of its output:
every case measured, the loaded blocks checked equal (the bench raises otherwise),
the ratios what the times say. Not a timed test: no figure is held to a bar here."""

from __future__ import annotations

import json

import pytest

from yuebing import cli
from yuebing.bench.connector import resolve
from yuebing.bench.connector_config import ConnectorBench


def test_the_cpu_bench_measures_every_case_and_says_so(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert cli.main(["bench", "connector", "--device", "cpu", "--model-shape", "tiny", "--tokens", "64", "256",
                     "--repeats", "1", "--warmup", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device_type"] == "cpu" and result["model_shape"] == "tiny"
    assert [r["tokens"] for r in result["rows"]] == [64, 256] and [r["blocks"] for r in result["rows"]] == [4, 16]
    for r in result["rows"]:
        assert r["prefill_ms"] > 0 and r["with_saves_ms"] > 0 and r["load_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["with_saves_ms"] / r["prefill_ms"])
        assert r["load_over_recompute"] == pytest.approx(r["load_ms"] / r["prefill_ms"])
        assert r["noted_after_end_ms"] >= 0
    assert result["bare_gbps"]["memcpy"] > 0 and result["bare_gbps"]["checksum_one_thread"] > 0
    printed = capsys.readouterr().out
    assert "ratio" in printed and printed.count(result["device"][:28]) >= 3  # each row names its device


@pytest.mark.parametrize("bad, why", [({"device": "tpu"}, "--device"), ({"model_shape": "llama9"}, "--model-shape"),
                                      ({"tokens": (8,)}, "at least one block"),
                                      ({"save_copies": "kernels"}, "--save-copies")])
def test_bad_settings_are_refused_with_the_flag_named(bad, why):
    with pytest.raises(ValueError, match=why):
        resolve(ConnectorBench(**{"device": "cpu", "model_shape": "tiny", **bad}))
