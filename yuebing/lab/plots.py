"""PNG plots of simulated and live runs: TTFT and TBT distributions, load over time,
and simulated against live request by request. matplotlib is imported only here,
and only when a plot is drawn."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yuebing.lab.outcome import Outcome

if TYPE_CHECKING:
    from yuebing.lab.sim import SimRun


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(outcomes_by_name: dict[str, Sequence[Outcome]], path: str | Path) -> str:
    """TTFT and TBT CDFs of completed requests, one line per named run."""
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, outcomes in outcomes_by_name.items():
        done = [o for o in outcomes if o.completed]
        for ax, values in ((a1, [o.ttft_s for o in done]), (a2, [o.tbt_tail_s * 1e3 for o in done])):
            values.sort()
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    a1.set(xlabel="TTFT (s)", ylabel="share of completed requests", xscale="log", title="TTFT CDF")
    a2.set(xlabel="TBT, mean of longest 10 % gaps (ms)", xscale="log", title="TBT CDF")  # a stalled few reach seconds
    a1.legend(fontsize=7)
    return _save(fig, path)


def plot_runs(runs: Sequence[SimRun], out_dir: str | Path) -> list[str]:
    """CDFs of TTFT and TBT per simulated run (cdf.png), and load over time, prefill
    queue against decode batch (load_over_time.png), where the oscillation of plain
    early rejection shows."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels = [f"{r.result['policy']}/{r.result['admission']}" for r in runs]
    return [plot_cdfs(dict(zip(labels, (r.outcomes for r in runs))), out / "cdf.png"),
            _plot_load(runs, labels, out / "load_over_time.png")]


def _plot_load(runs: Sequence[SimRun], labels: Sequence[str], path: Path) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.4 * len(runs)), sharex=True, squeeze=False)
    for ax, name, run in zip(axes[:, 0], labels, runs):
        samples = run.result["load_over_time"]
        t = [x["t"] for x in samples]
        ax.plot(t, [x["prefill_queue_s"] for x in samples], color="tab:blue")
        ax.set_ylabel("prefill queue (s)", color="tab:blue", fontsize=8)
        twin = ax.twinx()
        twin.plot(t, [x["decode_batch"] for x in samples], color="tab:orange")
        twin.set_ylabel("decode batch", color="tab:orange", fontsize=8)
        ax.set_title(name, fontsize=9)
    axes[-1, 0].set_xlabel("simulated time (s)")
    return _save(fig, path)


def plot_pairs(live: Sequence[Outcome], simulated: Sequence[Outcome], path: str | Path) -> str:
    """Each request's TTFT and mean TBT, simulated against live (the same requests in
    the same order): points off the diagonal show where (in which requests, at which
    load) the simulator errs."""
    plt = _pyplot()
    pairs = [(a, b) for a, b in zip(live, simulated) if a.completed and b.completed]
    metrics: tuple[tuple[str, float, Callable[[Outcome], float]], ...] = (
        ("TTFT (s)", 1.0, lambda o: o.ttft_s), ("mean TBT (ms)", 1e3, lambda o: o.tbt_mean_s))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (name, scale, get) in zip(axes, metrics):
        xs = [get(a) * scale for a, _ in pairs]
        ys = [get(b) * scale for _, b in pairs]
        top = max(xs + ys, default=1.0) * 1.05
        ax.scatter(xs, ys, s=12, c=[a.arrival_s for a, _ in pairs], cmap="viridis")
        ax.plot([0, top], [0, top], color="grey", lw=0.8)
        for k in (0.85, 1.15):
            ax.plot([0, top], [0, top * k], color="grey", lw=0.5, ls=":")
        ax.set(xlabel=f"live {name}", ylabel=f"simulated {name}", xlim=(0, top), ylim=(0, top),
               title=f"{name.split(' (')[0]}: per request (colour: arrival), ±15 % dotted")
    return _save(fig, path)


def plot_capacity(rows: Sequence[dict], group: str, label: str, title: str, path: str | Path) -> str:
    """Capacity bars: a group per value of `group` (a TBT SLO, an input length), a
    bar per setup, as the paper's figures compare systems."""
    plt = _pyplot()
    groups = list(dict.fromkeys(r[group] for r in rows))
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    width = 0.8 / len(setups)
    fig, ax = plt.subplots(figsize=(11, 4))
    for i, name in enumerate(setups):
        heights = [next((r["capacity_rps"] for r in rows if r[group] == g and r["setup"] == name), 0.0) for g in groups]
        ax.bar([k + i * width for k in range(len(groups))], heights, width, label=name)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(groups))], [str(g) for g in groups])
    ax.set(xlabel=label, ylabel="capacity (req/s within the SLOs)", title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _save(fig, path)


def plot_split(splits: dict[str, Sequence[tuple[float, int]]], instances: int, path: str | Path) -> str:
    """The planner's prefill instances over simulated time, one line per named run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, split in splits.items():
        ax.step([t for t, _ in split], [p for _, p in split], where="post", label=name)
    ax.set(xlabel="simulated time (s)", ylabel="prefill instances", ylim=(0, instances),
           title=f"the planner's split of {instances} instances")
    ax.legend()
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)  # pyplot keeps every figure open until closed
    return str(path)
