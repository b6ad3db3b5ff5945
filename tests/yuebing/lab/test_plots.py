"""PNG plots of simulated and live runs."""

from pathlib import Path

from shared.predictor import Predictor
from yuebing.lab.outcome import Outcome
from yuebing.lab.plots import plot_pairs, plot_runs
from yuebing.lab.sim import simulate
from yuebing.lab.sim_config import SimConfig
from yuebing.lab.trace import TraceRequest

PNG = b"\x89PNG\r\n\x1a\n"


def test_simulated_runs_are_plotted_as_png(tmp_path):
    flat = Predictor(prefill_coef=(0.0, 1.0, 0.0, 0.0), decode_coef=(10.0, 0.0, 0.0))
    trace = [TraceRequest(float(i * 100), 600, 5, (i, i + 1000)) for i in range(6)]
    runs = [simulate(trace, SimConfig(prefill=1, decode=1, policy=p, kv_bytes_per_token=0, sample_every_s=0.1), flat)
            for p in ("round_robin", "cache_aware")]
    paths = plot_runs(runs, tmp_path / "plots")
    assert [Path(p).name for p in paths] == ["cdf.png", "load_over_time.png"]
    assert all(Path(p).read_bytes()[:8] == PNG for p in paths)


def test_fidelity_pairs_plot_is_a_png(tmp_path):
    def outcome(ttft: float, tbt: float) -> Outcome:
        return Outcome(0.0, 100, 10, 1.0, 1.0, ttft_s=ttft, tbt_mean_s=tbt)

    live, simulated = [outcome(0.3, 0.010), outcome(0.5, 0.012)], [outcome(0.25, 0.009), outcome(0.6, 0.011)]
    path = plot_pairs(live, simulated, tmp_path / "pairs.png")
    assert Path(path).read_bytes()[:8] == PNG
