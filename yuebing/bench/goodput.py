"""`yuebing bench goodput`: for each serving mode (colocated, disaggregated,
conditional), the highest request rate at which at least 90 % of requests meet both
SLOs, measured live on this machine, as Mooncake and DistServe compare systems.

Every mode serves the same workload: the first requests of the shipped conversation
trace, scaled to the small model as `yuebing bench replay` scales it (lengths and
512-token blocks × `length_factor`, capped to the context), and replayed by
yuebing/lab/replay.py at a rate the search picks (the trace's timestamps compressed
or stretched). One `yuebing up --mode M` cluster per mode, one at a time; the rate is
bisected on a log scale between two bounds. A request counts if its TTFT and its
TBT (the mean of its longest 10 % of gaps, as the simulator judges it) both meet
their SLOs; a 429 or a failure is a miss.
`plain_vllm` adds two plain vLLM OpenAI servers (yuebing/bench/vllm_serve.py), the client round-robining over them,
to show what the gateway itself costs.

The pure parts (the search given an attainment function, attainment from outcomes,
the table, the ratios to colocated) come first; the live driver after them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import os
import shlex
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from msgspec import Meta

from yuebing.bench.soak import Slo
from yuebing.lab.outcome import Outcome
from yuebing.lab.trace import (TRACE_BLOCK_TOKENS, Mix, TraceRequest, base_rate, load_trace, rescale, shifting,
                               third_cuts)

if TYPE_CHECKING:
    from yuebing.lab.replay import ReplayOptions

# "default": `yuebing up` with no --mode flag, as a new user runs it; "planner": the
# same with --planner (roles that follow the load); "traced": the same with every
# process sending its spans to a receiver the bench runs (what tracing costs);
# "sampled": the same tracing a tenth of the requests (--otlp-sample 0.1); "pooled":
# the same with no prefill instance and two decode instances, each prefilling its own
# requests (the split the planner reaches when it moves the prefill instance).
MODES = ("default", "planner", "pooled", "traced", "sampled", "colocated", "disaggregated", "conditional")
SETUPS = {"default": [], "planner": ["--planner"], "pooled": []}  # adaptive mode's setups, not a --mode
TRACED = {"traced": ["--otlp-sample", "1"], "sampled": ["--otlp-sample", "0.1"]}  # setups that send spans
DEFAULT_MODES = ("colocated", "disaggregated", "conditional")
CLIENTS = ("yuebing", "aiperf")
TBT_STATS = ("tail", "mean")
PLAIN_VLLM = "plain vLLM ×2"  # the baseline's name in the table, the JSON and the plot


TBT_SLO = Meta(description="TBT SLO, ms, on the mean of a request's longest 10 % of gaps")


@dataclass(frozen=True)
class Workload:
    """The live benchmarks' clusters and what they are judged by: the trace scaled to
    the small model, the engines, the SLOs (each field is also a flag: yuebing/flags.py)."""

    length_factor: Annotated[float, Meta(description="scale the trace's lengths (and 512-token blocks) by this")] = 0.25
    max_model_len: Annotated[int, Meta(description="the engines' context; prompts are capped to fit it")] = 2048
    max_output: Annotated[int, Meta(description="output tokens at most, after scaling")] = 64
    # bfloat16 (vLLM's `auto` here) prefills about 7x slower on this CPU (docs/simulator.md,
    # "Live benchmark and simulator fidelity"): probes would take minutes each.
    dtype: Annotated[str, Meta(description="the engines' dtype")] = "float32"
    slo_ttft_ms: Annotated[float, Meta(description="TTFT SLO, ms (the cluster's and the replay's)")] = 3000.0
    slo_tbt_ms: Annotated[float, TBT_SLO] = 25.0
    up_flags: Annotated[str, Meta(description="more `yuebing up` flags for every cluster")] = ""


@dataclass(frozen=True)
class GoodputSpec(Workload):
    """What `yuebing bench goodput` measures; each field is also its flag (yuebing/flags.py)."""

    modes: Annotated[str, Meta(description="serving modes, comma-separated, in this order (default: no --mode "
                                           "flag)")] = ",".join(DEFAULT_MODES)
    trace: Annotated[str, Meta(description="a trace in the Mooncake format (empty: the shipped conversation trace)")] = ""
    client: Annotated[str, Meta(description="who sends the requests: yuebing (its replay) or aiperf (NVIDIA AIPerf, "
                                            "`make aiperf`)")] = "yuebing"
    rates: Annotated[str, Meta(description="request rates to probe, comma-separated, req/s (empty: bisect between "
                                           "--min-rate and --max-rate)")] = ""
    tbt_stat: Annotated[str, Meta(description="a request's TBT: tail (mean of its longest 10 %% of gaps) or mean "
                                              "(of all its gaps, AIPerf's inter-token latency)")] = "tail"
    conditional_rule: Annotated[str, Meta(description="conditional mode's rule (yuebing up --conditional-rule)")] = (
        "mooncake")
    requests: Annotated[int, Meta(description="requests of each probe: the conversation trace's first N")] = 40
    min_rate: Annotated[float, Meta(description="lower bound of the rate search, requests/s")] = 0.25
    max_rate: Annotated[float, Meta(description="upper bound of the rate search, requests/s")] = 4.0
    probes: Annotated[int, Meta(description="replays per mode (bisection on a log scale between the bounds)")] = 5
    target: Annotated[float, Meta(description="share of requests that must meet both SLOs")] = 0.9
    # The trace's timestamps come in 3 s steps, ~10 requests at each (its resolution,
    # not its users' behaviour): replayed as they are, each step is a burst of ten
    # long prompts whatever the rate, and every mode's capacity is the burst's, not
    # the rate's (measured: 27-75 % attainment at any rate from 0.27 req/s up).
    spread: Annotated[bool, Meta(description="spread each trace timestamp's requests evenly until the next")] = True
    warmup: Annotated[int, Meta(description="requests sent (and not counted) before a server's first probe")] = 4
    prompt_seed: Annotated[int, Meta(description="salt of the prompt tokens (each probe adds its number)")] = 0
    shift: Annotated[str, Meta(description="a mix that shifts: the middle third's input,output length factors "
                                           "and optional appended document tokens (e.g. 3,0.125: long prompts, "
                                           "short answers; empty: none)")] = ""
    outer: Annotated[str, Meta(description="with --shift: the outer thirds' input,output length factors and "
                                           "optional document tokens (empty: the trace as it is)")] = ""
    plain_vllm: Annotated[bool, Meta(description="also measure 2 plain vLLM servers, round-robin from the client")] = (
        False)

    def __post_init__(self) -> None:
        unknown = set(self.mode_list) - set(MODES)
        if unknown or not self.mode_list:
            raise ValueError(f"--modes takes some of {', '.join(MODES)}; got {self.modes!r}")
        if not 0 < self.min_rate < self.max_rate:
            raise ValueError("need 0 < --min-rate < --max-rate")
        if self.probes < 1 or self.requests < 2 or self.warmup < 0:
            raise ValueError("--probes must be at least 1, --requests at least 2, --warmup not negative")
        if not 0 < self.target <= 1 or self.slo_ttft_ms <= 0 or self.slo_tbt_ms <= 0:
            raise ValueError("--target must be in (0, 1], the SLOs positive")
        if not 0 < self.max_output < self.max_model_len:
            raise ValueError("--max-output must be positive and below --max-model-len")
        self._check_workload()

    def _check_workload(self) -> None:
        """Who sends what, and at which rates."""
        if self.client not in CLIENTS or self.tbt_stat not in TBT_STATS:
            raise ValueError(f"--client takes {' or '.join(CLIENTS)}, --tbt-stat {' or '.join(TBT_STATS)}")
        if any(r <= 0 for r in self.rate_list) or len(set(self.rate_list)) != len(self.rate_list):
            raise ValueError(f"--rates takes distinct positive rates, comma-separated; got {self.rates!r}")
        if self.trace and not Path(self.trace).is_file():
            raise ValueError(f"--trace: no such file: {self.trace}")
        for flag, mix in (("--shift", self.shift), ("--outer", self.outer)):
            try:
                if mix:
                    Mix.parse(mix)
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None
        if self.outer and not self.shift:
            raise ValueError("--outer reshapes the thirds around --shift's: give --shift too")

    @property
    def mode_list(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.modes.split(",") if m.strip())

    @property
    def rate_list(self) -> tuple[float, ...]:
        try:
            return tuple(float(r) for r in self.rates.split(",") if r.strip())
        except ValueError:
            raise ValueError(f"--rates takes numbers, comma-separated; got {self.rates!r}") from None

    @property
    def probe_count(self) -> int:
        return len(self.rate_list) or self.probes


@dataclass(frozen=True)
class Attainment:
    """Shares of all the requests of a run (refused and failed ones count as misses)."""

    requests: int
    both: float
    ttft: float
    tbt: float
    rejected: int = 0  # 429s: admission turned them away
    failed: int = 0
    thirds: tuple[int, ...] = ()  # with --shift: requests within both SLOs in each third of the trace


@dataclass(frozen=True)
class Probe:
    rate_rps: float
    attainment: Attainment


@dataclass(frozen=True)
class Search:
    """The probes of one rate search, in the order they were made."""

    probes: tuple[Probe, ...]
    target: float

    @property
    def at_capacity(self) -> Probe | None:
        """The fastest probe that met the target (None: none did)."""
        passed = [p for p in self.probes if p.attainment.both >= self.target]
        return max(passed, key=lambda p: p.rate_rps, default=None)

    @property
    def capacity_rps(self) -> float:
        best = self.at_capacity
        return best.rate_rps if best else 0.0


@dataclass(frozen=True)
class ModeResult:
    name: str  # "colocated", "conditional/mooncake", PLAIN_VLLM
    search: Search
    deaths: int = 0  # processes the launcher reported dead during the mode's run
    notes: list[str] = field(default_factory=list)  # what went wrong: any makes the command fail
    spans: int | None = None  # the traced setup: spans its receiver took
    role_changes: list[str] = field(default_factory=list)  # the planner's moves, as its Conductor logged them


# --- pure: attainment, the search, the ratios, the table -------------------------


def attainment(outcomes: Sequence[Outcome], slo: Slo, tbt_stat: str = "tail", thirds: bool = False) -> Attainment:
    """Who met the TTFT SLO, the TBT SLO, and both, among every request sent. TBT is
    by default the mean of a request's longest 10 % of gaps (`Outcome.tbt_tail_s`), as
    Mooncake measures it and as the simulator judges it (`Outcome.within_slo`): a mean
    over all gaps (`tbt_stat="mean"`, AIPerf's inter-token latency) would hide a
    prefill chunk's stall among many short steps. `thirds`: also count the good
    requests of each third (a shifting mix's parts, as `shifting` cuts them)."""
    n = len(outcomes)
    ttft = [o.completed and o.ttft_s <= slo.ttft_s for o in outcomes]
    tbt = [o.completed and (o.tbt_tail_s if tbt_stat == "tail" else o.tbt_mean_s) <= slo.tbt_s for o in outcomes]

    def share(flags: Sequence[bool]) -> float:
        return sum(flags) / n if n else 0.0

    both = [a and b for a, b in zip(ttft, tbt)]
    parts = tuple(sum(both[lo:hi]) for lo, hi in itertools.pairwise(third_cuts(n))) if thirds else ()
    return Attainment(n, share(both), share(ttft), share(tbt), sum(o.rejected for o in outcomes),
                      sum(o.failed for o in outcomes), parts)


def search(measure: Callable[[float], Attainment], lo: float, hi: float, probes: int, target: float) -> Search:
    """Bisect the rate on a log scale between `lo` and `hi` (neither is probed):
    each probe that meets `target` raises the lower bound, each that misses lowers
    the upper one. `probes` probes leave a bracket (hi/lo)^(1/2^probes) wide."""
    done: list[Probe] = []
    for _ in range(probes):
        rate = math.sqrt(lo * hi)
        done.append(Probe(rate, measure(rate)))
        lo, hi = (rate, hi) if done[-1].attainment.both >= target else (lo, rate)
    return Search(tuple(done), target)


def sweep(measure: Callable[[float], Attainment], rates: Sequence[float], target: float) -> Search:
    """Probe each rate, in the order given."""
    return Search(tuple(Probe(rate, measure(rate)) for rate in rates), target)


def ratio(capacity: float, colocated: float | None) -> float | None:
    """Capacity against colocated's (None where colocated was not run or served nothing)."""
    return capacity / colocated if colocated else None


def colocated_capacity(results: Sequence[ModeResult]) -> float | None:
    return next((r.search.capacity_rps for r in results if r.name == "colocated"), None)


def capacity_cell(s: Search) -> str:
    """The capacity; "< r" where it lies below every rate probed, "≥ r" where no
    faster probe missed (it may lie above the search's upper bound)."""
    if s.at_capacity is None:
        return f"< {min(p.rate_rps for p in s.probes):.2f}" if s.probes else "-"
    open_above = all(p.attainment.both >= s.target for p in s.probes if p.rate_rps > s.capacity_rps)
    return f"{'≥ ' if open_above else ''}{s.capacity_rps:.2f}"


def ratio_cell(s: Search, colocated: Search | None) -> str:
    """Capacity against colocated's; where colocated met the target at no rate
    probed, a lower bound (against the slowest rate it was probed at)."""
    if colocated is None or not colocated.probes or not s.probes:
        return "-"
    if colocated.capacity_rps:
        return f"{s.capacity_rps / colocated.capacity_rps:.2f}"
    slowest = min(p.rate_rps for p in colocated.probes)
    return f"> {s.capacity_rps / slowest:.1f}" if s.capacity_rps else "-"


HEADER = ("mode", "capacity req/s", "× colocated", "both SLOs", "TTFT", "TBT", "429s", "probes (req/s: both)")


def row(r: ModeResult, colocated: Search | None) -> list[str]:
    """A mode's row: capacity, its ratio to colocated, and the attainment at capacity."""
    best = r.search.at_capacity
    at = [f"{best.attainment.both:.0%}", f"{best.attainment.ttft:.0%}", f"{best.attainment.tbt:.0%}",
          str(best.attainment.rejected)] if best else ["-"] * 4
    probes = ", ".join(f"{p.rate_rps:.2f}: {p.attainment.both:.0%}" for p in sorted(r.search.probes,
                                                                                     key=lambda p: p.rate_rps))
    return [r.name, capacity_cell(r.search), ratio_cell(r.search, colocated), *at, probes]


def table(results: Sequence[ModeResult]) -> str:
    """A row per mode, columns aligned; attainment columns are at the capacity probe."""
    colocated = next((r.search for r in results if r.name == "colocated"), None)
    rows = [list(HEADER)] + [row(r, colocated) for r in results]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) if i in (0, len(HEADER) - 1) else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths))).rstrip() for r in rows]
    return "\n".join(lines)


def sweep_table(results: Sequence[ModeResult]) -> str:
    """A row per rate, a column per server: how many requests met both SLOs (and,
    where plain vLLM was measured, how many times its count)."""
    plain = next((r for r in results if r.name == PLAIN_VLLM), None)
    rates = sorted({p.rate_rps for r in results for p in r.search.probes})

    def good(r: ModeResult, rate: float) -> int | None:
        a = next((p.attainment for p in r.search.probes if p.rate_rps == rate), None)
        return round(a.both * a.requests) if a else None

    def cell(r: ModeResult, rate: float) -> str:
        n, base = good(r, rate), good(plain, rate) if plain and r is not plain else None
        if n is None:
            return "-"
        return f"{n} ({n / base:.2f}×)" if base else str(n)

    rows = [["req/s", *(r.name for r in results)]] + [[f"{rate:g}", *(cell(r, rate) for r in results)] for rate in rates]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def to_json(results: Sequence[ModeResult], spec: GoodputSpec, base_rps: float) -> dict:
    colocated = colocated_capacity(results)
    return {
        "spec": dataclasses.asdict(spec),
        "trace": {"name": "conversation", "requests": spec.requests, "rps_at_speed_1": base_rps},
        "modes": [{"name": r.name, "capacity_rps": r.search.capacity_rps,
                   "capacity_speed": r.search.capacity_rps / base_rps if base_rps else 0.0,
                   "ratio_to_colocated": ratio(r.search.capacity_rps, colocated), "deaths": r.deaths,
                   "notes": r.notes, "spans": r.spans, "role_changes": r.role_changes,
                   "at_capacity": dataclasses.asdict(r.search.at_capacity) if r.search.at_capacity else None,
                   "probes": [dataclasses.asdict(p) for p in r.search.probes]} for r in results],
    }


def plot(results: Sequence[ModeResult], target: float, path: str | Path) -> str:
    """Attainment of both SLOs against the offered rate, a line per mode (PNG)."""
    from yuebing.lab.plots import _pyplot, _save

    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter  # after _pyplot has chosen the file-only backend

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        probes = sorted(r.search.probes, key=lambda p: p.rate_rps)
        ax.plot([p.rate_rps for p in probes], [p.attainment.both for p in probes], marker="o", label=r.name)
    ax.axhline(target, color="grey", lw=0.8, ls="--", label=f"target {target:.0%}")
    ax.set(xscale="log", xlabel="offered rate (requests/s)", ylabel="share meeting TTFT and TBT SLOs",
           ylim=(-0.02, 1.02), title="SLO attainment against rate")
    plain = FuncFormatter(lambda value, _pos: f"{value:g}")  # 0.5, not 5×10⁻¹
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.legend(fontsize=8)
    return _save(fig, path)


# --- pure: the trace at a rate ---------------------------------------------------


def spread(trace: Sequence[TraceRequest]) -> list[TraceRequest]:
    """The requests of each timestamp spaced evenly until the next timestamp (the
    last group over the mean step), order kept."""
    groups = [list(g) for _, g in itertools.groupby(sorted(trace, key=lambda r: r.timestamp_ms),
                                                    key=lambda r: r.timestamp_ms)]
    starts = [g[0].timestamp_ms for g in groups]
    step = (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else 0.0
    out = []
    for i, group in enumerate(groups):
        width = (starts[i + 1] if i + 1 < len(starts) else starts[i] + step) - starts[i]
        out += [dataclasses.replace(r, timestamp_ms=starts[i] + width * k / len(group)) for k, r in enumerate(group)]
    return out


def at_rate(raw: Sequence[TraceRequest], spec: GoodputSpec, rate: float) -> list[TraceRequest]:
    """The raw (unscaled) slice replayed at `rate` requests/s, scaled to the model in
    one `rescale` (a second one would cut the scaled prompts' hash ids)."""
    from yuebing.bench.aiperf import CHAT_TEMPLATE_TOKENS

    template = CHAT_TEMPLATE_TOKENS if spec.client == "aiperf" else 0  # AIPerf sends chat: the template's tokens too
    return rescale(raw, speed=rate / base_rate(raw), length_factor=spec.length_factor,
                   max_input=spec.max_model_len - spec.max_output - template, max_output=spec.max_output)


def load_slice(spec: GoodputSpec) -> list[TraceRequest]:
    from yuebing.lab import data

    raw = load_trace(spec.trace or data.CONVERSATION_TRACE, spec.requests)
    if spec.shift:
        raw = shifting(raw, middle=Mix.parse(spec.shift), outer=Mix.parse(spec.outer) if spec.outer else Mix())
    return spread(raw) if spec.spread else raw


def warmup_trace(trace: Sequence[TraceRequest], n: int) -> list[TraceRequest]:
    """`n` of the trace's requests, half a second apart: the first prompts an engine
    sees pay for its allocations (2-3x slower, yuebing/bench/ttft.py)."""
    return [dataclasses.replace(r, timestamp_ms=500.0 * i) for i, r in enumerate(trace[:n])]


# --- pure: how each server is started ---------------------------------------------


def mode_name(mode: str, spec: GoodputSpec) -> str:
    return f"{mode}/{spec.conditional_rule}" if mode == "conditional" else mode


def cluster_flags(spec: GoodputSpec, model: Path, mode: str, otlp_endpoint: str = "") -> list[str]:
    """`yuebing up`'s flags for one mode: one prefill + one decode (colocated: as many
    colocated instances; pooled: two decode instances), the bench's SLOs, then `up_flags`."""
    rule = ["--conditional-rule", spec.conditional_rule] if mode == "conditional" else []
    chosen = SETUPS.get(mode, ["--mode", mode])
    if mode in TRACED:
        chosen = ["--otlp-endpoint", otlp_endpoint, *TRACED[mode]]
    split = ["--prefill", "0", "--decode", "2"] if mode == "pooled" else ["--prefill", "1", "--decode", "1"]
    return ["--model", str(model), "--max-model-len", str(spec.max_model_len), "--dtype", spec.dtype,
            *split, *chosen, *rule, "--slo-ttft-ms", f"{spec.slo_ttft_ms:g}",
            "--slo-tbt-ms", f"{spec.slo_tbt_ms:g}", *shlex.split(spec.up_flags)]


# --- live ------------------------------------------------------------------------


def replay_options(spec: GoodputSpec, model_name: str) -> ReplayOptions:
    from yuebing.lab.replay import ReplayOptions

    return ReplayOptions(model=model_name, block_tokens=round(TRACE_BLOCK_TOKENS * spec.length_factor),
                         slo_ttft_ms=spec.slo_ttft_ms, slo_tbt_ms=spec.slo_tbt_ms, progress=False,
                         api_key=os.environ.get("YUEBING_API_KEY") or None, salt=spec.prompt_seed * 1000)


async def replay_over(urls: Sequence[str], trace: Sequence[TraceRequest],
                      options: ReplayOptions) -> list[Outcome]:
    """`replay` against one server, or round-robin over several in arrival order
    (plain vLLM: the client spreads the load), outcomes in the trace's order."""
    from yuebing.lab.replay import replay

    order = sorted(range(len(trace)), key=lambda i: trace[i].timestamp_ms)
    shares = [order[n :: len(urls)] for n in range(len(urls))]
    runs = await asyncio.gather(*(replay(u, [trace[i] for i in share], options) for u, share in zip(urls, shares)))
    outcomes: list[Any] = [None] * len(trace)
    for share, (outs, _) in zip(shares, runs):
        for i, o in zip(share, outs):
            outcomes[i] = o
    return outcomes


@dataclass
class Driver:
    """Measures servers with the spec's workload: the same slice, prompts and SLOs for
    each, sent by the spec's client."""

    spec: GoodputSpec
    model: Path
    work: Path
    say: Callable[[str], None]
    bar: Any  # yuebing.progress: a bar over every probe of the run
    raw: list[TraceRequest] = field(init=False)

    def __post_init__(self) -> None:
        self.raw = load_slice(self.spec)

    def measure(self, name: str, urls: Sequence[str]) -> Search:
        """Warm the servers up, then probe the rates (or search them)."""
        options = replay_options(self.spec, self.model.name)
        if self.spec.warmup:
            warm = dataclasses.replace(options, salt=options.salt + 999)  # prompts no probe sends
            scaled = at_rate(self.raw, self.spec, base_rate(self.raw))
            asyncio.run(replay_over(urls, warmup_trace(scaled, self.spec.warmup), warm))
        numbers = itertools.count()

        def probe(rate: float) -> Attainment:
            # A new salt per probe: nothing an earlier probe cached helps it; the same
            # numbers in every mode, so each mode's n-th probe sends the same prompts.
            self.bar.set_description(f"{name} at {rate:.2f} req/s")
            got = self.probe(name, urls, rate, next(numbers), options)
            self.bar.update()
            self.say(probe_line(name, rate, got))
            return got

        s = self.spec
        return sweep(probe, s.rate_list, s.target) if s.rate_list else search(probe, s.min_rate, s.max_rate,
                                                                              s.probes, s.target)

    def probe(self, name: str, urls: Sequence[str], rate: float, number: int, options: ReplayOptions) -> Attainment:
        """The trace at `rate`, sent by the spec's client; its attainment."""
        from yuebing.bench import aiperf

        s = self.spec
        trace = at_rate(self.raw, s, rate)
        if s.client == "aiperf":
            run = aiperf.Run(tuple(urls), self.model.name, options.block_tokens, self.work / "aiperf",
                             seed=options.salt + number, api_key=options.api_key)
            slug = "".join(c if c.isalnum() else "-" for c in name)
            outcomes = aiperf.replay(run, trace, self.model, f"{slug}-{number}", s.slo_ttft_ms / 1e3, s.slo_tbt_ms / 1e3)
        else:
            outcomes = asyncio.run(replay_over(urls, trace, dataclasses.replace(options, salt=options.salt + number)))
        return attainment(outcomes, Slo(s.slo_ttft_ms / 1e3, s.slo_tbt_ms / 1e3), s.tbt_stat, thirds=bool(s.shift))


def probe_line(name: str, rate: float, a: Attainment) -> str:
    return (f"  {name}: {rate:.2f} req/s → both SLOs {a.both:.0%} (TTFT {a.ttft:.0%}, TBT {a.tbt:.0%}; "
            f"{a.rejected} rejected, {a.failed} failed of {a.requests})"
            + (f"; good by third {'/'.join(map(str, a.thirds))}" if a.thirds else ""))


def run_mode(driver: Driver, work: Path, model: Path, mode: str) -> ModeResult:
    """One mode's cluster up, its search, the cluster stopped (SIGINT, as Ctrl-C)."""
    from yuebing.bench.soak import deaths
    from yuebing.lab.otlp import receiving
    from yuebing.launcher import up_launcher

    name = mode_name(mode, driver.spec)
    with receiving(keep=False) if mode in TRACED else nullcontext() as spans:
        flags = cluster_flags(driver.spec, model, mode, spans.endpoint if spans else "")
        driver.say(f"{name}: yuebing up {' '.join(flags)}")
        with up_launcher(work, mode, *flags) as (url, _launcher):
            found = driver.measure(name, [url])
    died = deaths(work / f"{mode}.log")
    notes = [f"{died} processes died (see {work / mode}.log)"] if died else []
    moves = role_changes(work / mode / "conductor.log")
    for m in moves:
        driver.say(f"  {name}: role change {m}")
    return ModeResult(name, found, died, notes, spans.count if spans is not None else None, moves)


def role_changes(conductor_log: Path) -> list[str]:
    """The planner's moves in a Conductor's log: when, which instance, to what, why."""
    from yuebing.timeline import log_record

    if not conductor_log.is_file():
        return []
    records = (log_record(line) for line in conductor_log.read_text(errors="replace").splitlines()
               if '"role change"' in line)  # cheap, before parsing
    return [f"{e['timestamp'][11:19]} {e.get('instance_id')} → {e.get('to')} ({e.get('reason')})"
            for e in records if e is not None and e.get("event") == "role change"]


def run_plain_vllm(driver: Driver, work: Path, model: Path) -> ModeResult:
    driver.say(f"{PLAIN_VLLM}: python -m vllm.entrypoints.openai.api_server (2 servers, round-robin) …")
    from yuebing.bench import vllm_serve

    spec = driver.spec
    with vllm_serve.servers(work, model, spec.max_model_len, spec.dtype, count=2) as up:
        return ModeResult(PLAIN_VLLM, driver.measure(PLAIN_VLLM, [s.url for s in up]))
