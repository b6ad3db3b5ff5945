"""`yuebing profile` on the real engine, with a tiny grid: it measures, fits, and
writes a profile the Conductor can load."""

import json

import pytest

from shared.predictor import load_predictor
from yuebing.model import default_model_dir
from yuebing.profile import Grid, fastest, profile

pytestmark = pytest.mark.e2e


def test_profile_writes_a_loadable_profile(tmp_path):
    model = default_model_dir()
    if not (model / "config.json").exists():
        pytest.fail(f"no model at {model}: `make test` writes it")
    grid = Grid(prefill_totals=(128, 256, 512, 1024), prefix_shares=(0.0, 0.5), batches=(1, 2, 4), contexts=(128, 512),
                repeats=1, steps=(2, 6))
    out = tmp_path / "profile.json"
    meta = profile(model, out, grid, max_model_len=2048)
    data = json.loads(out.read_text())
    phases = [r["phase"] for r in data["rows"]]
    assert phases.count("prefill") == len(grid.prefill_points()) and phases.count("decode") == len(grid.decode_points())
    assert all(r["ms"] > 0 for r in data["rows"])
    assert meta["kv_bytes_per_token"] == 4 * 2 * 2 * 64 * 4  # layers · K,V · kv heads · head dim · float32
    assert meta["transfer_GBps"] > 0 and set(meta["held_out_mape_percent"]) == {"prefill", "decode"}
    predictor = load_predictor(out)
    assert predictor.prefill_s(1024) > predictor.prefill_s(128) > 0


def test_the_fastest_timing_skips_noise_that_is_not_positive():
    ticks = []
    timings = iter([50.0, -3.0, 0.0, 7.0, 9.0])  # untimed first, then two repeats of noise
    assert fastest(lambda: next(timings), 2, lambda: ticks.append(1)) == 7.0
    assert len(ticks) == 4  # it stopped at the first positive one
    assert fastest(iter([1.0, 5.0, 4.0]).__next__, 2, lambda: None) == 4.0
    with pytest.raises(RuntimeError, match="no positive timing"):
        fastest(lambda: -1.0, 1, lambda: None)
