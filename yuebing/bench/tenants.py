"""`yuebing bench tenants`: does a steady tenant keep its goodput while another floods?

One cluster with two tenants (a tenants file the bench writes): `steady` sends the
conversation trace at a rate below capacity, `flood` sends it at several times the
cluster's capacity, both at once. In one run, three phases on the same cluster:

- alone: steady by itself, its goodput (requests within both SLOs, per second) the
  baseline;
- fair: both, as `standard` tenants (the Conductor's fairness holds flood to its
  share once the cluster is loaded: services/conductor/fairness.py);
- unfair: both again, as `critical` tenants, which fairness never holds back (the
  file rewritten in place: the cluster reads it again), so admission is first come,
  first served.

The pure parts (the spec, the file, the table) come first; the live driver after.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from msgspec import Meta

from shared.private_file import write_private
from shared.tenants import key_sha256
from yuebing.bench.goodput import TBT_SLO, GoodputSpec, Workload, at_rate, attainment, load_slice, replay_options
from yuebing.bench.soak import Slo

PHASES = ("alone", "fair", "unfair")
TENANTS = ("steady", "flood")


@dataclass(frozen=True)
class TenantsSpec(Workload):
    """What `yuebing bench tenants` measures; each field is also its flag (yuebing/flags.py)."""

    # The goodput bench's TBT SLO is 25 ms; on a slow day this host's engines miss it
    # with the steady tenant alone (40-60 % within it), and a share of nothing is
    # nothing: here it is doubled. At 50 ms, one prefill and one decode CPU engine
    # serve about 4 req/s of this workload within both SLOs (`yuebing bench goodput
    # --modes default --requests 60 --rates 1,2,4,8 --slo-tbt-ms 50`: 100 %, 95 %,
    # 90 %, 20 % on the 2-core development machine).
    slo_tbt_ms: Annotated[float, TBT_SLO] = 50.0
    steady_rps: Annotated[float, Meta(description="the steady tenant's rate, requests/s (below capacity)")] = 1.0
    capacity_rps: Annotated[float, Meta(description="the cluster's capacity, requests/s (yuebing bench goodput "
                                                    "measures it): flood sends --flood-factor times it")] = 4.0
    flood_factor: Annotated[float, Meta(description="flood's rate over the capacity")] = 4.0
    seconds: Annotated[float, Meta(description="each phase's length, s")] = 30.0

    def __post_init__(self) -> None:
        if min(self.steady_rps, self.capacity_rps, self.flood_factor, self.seconds) <= 0:
            raise ValueError("--steady-rps, --capacity-rps, --flood-factor and --seconds must be positive")

    @property
    def flood_rps(self) -> float:
        return self.capacity_rps * self.flood_factor

    def workload(self, rps: float) -> GoodputSpec:
        """The goodput bench's workload at `rps` for `seconds` (its trace, scaled alike)."""
        workload = {f.name: getattr(self, f.name) for f in dataclasses.fields(Workload)}
        return GoodputSpec(**workload, requests=max(2, round(rps * self.seconds)), max_rate=max(4.0, rps * 2))


@dataclass(frozen=True)
class PhaseResult:
    phase: str
    goodput_rps: dict[str, float]  # each tenant's requests within both SLOs, per second of the phase
    rejected: dict[str, int]
    within: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)  # (TTFT, TBT) attainment
    # the median over completed requests of each one's TBT (mean of its longest 10 % of gaps)
    tbt_ms: dict[str, float] = dataclasses.field(default_factory=dict)


def tenants_json(keys: dict[str, str], priority: str) -> bytes:
    """The bench's tenants file: each tenant its key, one class for both."""
    return json.dumps({"tenants": [{"id": t, "key_sha256": key_sha256(k), "priority": priority}
                                   for t, k in keys.items()]}).encode()


def write_tenants(path: Path, keys: dict[str, str], priority: str) -> None:
    """Whole, then renamed into place: the cluster never reads half a file."""
    new = path.with_suffix(".new")
    new.unlink(missing_ok=True)
    write_private(new, tenants_json(keys, priority))
    new.replace(path)


def table(results: Sequence[PhaseResult]) -> str:
    """Each phase's goodput per tenant, steady's beside its goodput alone."""
    alone = next((r.goodput_rps["steady"] for r in results if r.phase == "alone"), 0.0)
    lines = [f"{'phase':8} {'steady good/s':>14} {'× alone':>8} {'steady TTFT, TBT':>17} {'flood good/s':>13} "
             f"{'refused (steady, flood)':>24} {'steady TBT p50':>15}"]
    for r in results:
        ratio = f"{r.goodput_rps['steady'] / alone:.2f}" if alone else "—"
        flood = f"{r.goodput_rps.get('flood', 0.0):.2f}" if r.phase != "alone" else "—"
        refused = f"{r.rejected.get('steady', 0)}, {r.rejected.get('flood', 0)}"
        ttft, tbt = r.within.get("steady", (0.0, 0.0))
        steady_tbt = r.tbt_ms.get("steady", 0.0)
        lines.append(f"{r.phase:8} {r.goodput_rps['steady']:>14.2f} {ratio:>8} {f'{ttft:.0%}, {tbt:.0%}':>17} "
                     f"{flood:>13} {refused:>24} {f'{steady_tbt:.1f} ms':>15}")
    return "\n".join(lines)


def to_json(results: Sequence[PhaseResult], spec: TenantsSpec) -> dict:
    return {"spec": dataclasses.asdict(spec), "phases": [dataclasses.asdict(r) for r in results]}


# --- live ----------------------------------------------------------------------------


async def _phase(url: str, spec: TenantsSpec, model_name: str, keys: dict[str, str], who: Sequence[str],
                 number: int, work_dir: Path) -> PhaseResult:
    """Each tenant in `who` replaying its own prompts at its rate, all at once; every
    request's outcome (its token times too) into work_dir/outcomes-PHASE.json."""
    from yuebing.lab.replay import replay

    rates = {"steady": spec.steady_rps, "flood": spec.flood_rps}
    runs = []
    for n, tenant in enumerate(who):
        work = spec.workload(rates[tenant])
        trace = at_rate(load_slice(work), work, rates[tenant])
        options = dataclasses.replace(replay_options(work, model_name), api_key=keys[tenant],
                                      salt=1000 * number + n)  # nothing another phase or tenant cached
        runs.append(replay(url, trace, options))
    done = await asyncio.gather(*runs)
    outcomes_file = work_dir / f"outcomes-{PHASES[number]}.json"
    outcomes_file.write_text(json.dumps({t: [dataclasses.asdict(o) for o in out] for t, (out, _) in zip(who, done)}))
    slo = Slo(spec.slo_ttft_ms / 1e3, spec.slo_tbt_ms / 1e3)
    good, refused, within, tbt = {}, {}, {}, {}
    for tenant, (outcomes, _) in zip(who, done):
        a = attainment(outcomes, slo)
        good[tenant] = a.both * len(outcomes) / spec.seconds
        refused[tenant], within[tenant] = a.rejected, (a.ttft, a.tbt)
        tails = [o.tbt_tail_s * 1e3 for o in outcomes if o.completed]
        tbt[tenant] = statistics.median(tails) if tails else 0.0
    return PhaseResult(PHASES[number], good, refused, within, tbt)


def run(spec: TenantsSpec, model: Path, work: Path, say: Callable[[str], None]) -> list[PhaseResult]:
    """The three phases on one cluster (started and stopped here)."""
    from yuebing.launcher import up_launcher

    keys = {t: secrets.token_urlsafe(24) for t in TENANTS}
    tenants_file = work / "tenants.json"
    write_tenants(tenants_file, keys, "standard")
    flags = ["--model", str(model), "--max-model-len", str(spec.max_model_len), "--dtype", spec.dtype,
             "--slo-ttft-ms", f"{spec.slo_ttft_ms:g}", "--slo-tbt-ms", f"{spec.slo_tbt_ms:g}",
             "--tenants", str(tenants_file), *spec.up_flags.split()]
    say(f"yuebing up {' '.join(flags)}")
    results = []
    with up_launcher(work, "tenants", *flags) as (url, _launcher):
        for number, phase in enumerate(PHASES):
            if phase == "unfair":
                write_tenants(tenants_file, keys, "critical")
                time.sleep(3)  # read again within a second (shared/tenants.py RELOAD_S)
            who = ("steady",) if phase == "alone" else TENANTS
            say(f"{phase}: {' and '.join(who)} for {spec.seconds:g} s …")
            results.append(asyncio.run(_phase(url, spec, model.name, keys, who, number, work)))
            say(table(results[-1:]))
    return results
