"""The simulator against the live cluster (`yuebing bench fidelity`): the same trace
replayed live and simulated, mean TTFT and mean TBT side by side."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from shared.predictor import Predictor
from yuebing.lab.calibration import calibrate
from yuebing.lab.gaps import decode_gaps, decode_gaps_by_load
from yuebing.lab.outcome import Outcome, summarize
from yuebing.lab.replay import ReplayOptions, replay
from yuebing.lab.sim import simulate
from yuebing.lab.sim_config import SimConfig
from yuebing.lab.trace import TraceRequest


@dataclass
class Fidelity:
    result: dict  # what --json writes: per run and over the runs, live and simulated means, their ratios
    live: list[Outcome]  # per request, in trace order, run after run
    simulated: list[Outcome]


def fidelity(url: str, trace: Sequence[TraceRequest], options: ReplayOptions, sim_config: SimConfig,
             predictor: Predictor, repeats: int = 1) -> Fidelity:
    """The same trace on the live cluster and in the simulator. Each run calibrates
    anew (the simulator gets the host-sharing figures `calibrate` measures) and
    replays the trace with fresh prompts, so no cache carries over; over several runs
    the means of the runs' means are compared, since one live run on a shared machine
    moves by several per cent."""
    runs, live_all, sim_all = [], [], []
    for i in range(repeats):
        run_options = replace(options, salt=options.salt + i)
        host = asyncio.run(calibrate(url, run_options, predictor, sim_config))
        outcomes, wall = asyncio.run(replay(url, trace, run_options))
        sim = simulate(trace, replace(sim_config, host=host), predictor)
        live, simulated = summarize(outcomes, wall), sim.result
        simulated.pop("load_over_time")
        runs.append({"live": live, "sim": simulated, "compare": compare([live], [simulated]), "host": asdict(host),
                     "live_decode_gaps": decode_gaps_by_load(decode_gaps(outcomes))})
        live_all += outcomes
        sim_all += sim.outcomes
    result = {"requests": len(trace), "repeats": repeats, "runs": runs,
              "compare": compare([r["live"] for r in runs], [r["sim"] for r in runs])}
    return Fidelity(result, live_all, sim_all)


def compare(live: Sequence[dict], sim: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Mean TTFT and mean TBT, live against simulated, each the mean over runs
    (`summarize` results)."""
    out = {}
    for key, field_ in (("ttft_mean_s", "ttft_s"), ("tbt_mean_s", "tbt_mean_s")):
        a, b = (statistics.fmean(r[field_]["mean"] for r in runs) for runs in (live, sim))
        out[key] = {"live": a, "sim": b, "sim_over_live": b / a if a else 0.0}
    return out
