"""`yuebing sim --find-capacity` across serving modes: capacity per mode and TBT SLO,
each against colocated, beside Mooncake's figures (FAST '25, §8: 10 prefill + 10
decode instances against 20 colocated vLLM instances, LLaMA2-70B)."""

from __future__ import annotations

from collections.abc import Sequence

from yuebing.lab.paper import FIG11_GAIN_PCT as PAPER_GAIN_PCT
from yuebing.lab.paper import FIG13

PAPER_REAL_TRACE = f"+{FIG13['gain_pct']} % requests on the real trace"


def capacity_table(found: Sequence[dict], trace: str) -> str:
    """A row per TBT SLO: capacity (req/s) per mode, each with its gain over
    colocated, and the paper's figure for this workload (all workloads' when the
    trace is none of the paper's)."""
    modes = list(dict.fromkeys(f["mode"] for f in found))
    slos = sorted({f["slo_tbt_s"] for f in found})
    rps = {(f["mode"], f["slo_tbt_s"]): f.get("capacity_rps", 0.0) for f in found}
    header = ["TBT SLO", *modes, *_paper_header(trace)]
    rows = []
    for slo in slos:
        base = rps.get(("colocated", slo), 0.0)
        cells = [f"{slo * 1e3:.0f} ms"] + [_cell(rps.get((m, slo), 0.0), base, m) for m in modes]
        rows.append(cells + _paper_cells(trace, round(slo * 1e3)))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["capacity, req/s (gain over colocated):", "  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"paper: Mooncake (10P+10D) against vLLM (20 colocated), LLaMA2-70B; {PAPER_REAL_TRACE}")
    return "\n".join(lines)


def _cell(rps: float, colocated: float, mode: str) -> str:
    if mode == "colocated" or not colocated:
        return f"{rps:.2f}" if mode == "colocated" or not rps else f"{rps:.2f} (colocated 0)"
    return f"{rps:.2f} ({(rps / colocated - 1) * 100:+.0f} %)"


def _paper_header(trace: str) -> list[str]:
    names = [trace] if trace in PAPER_GAIN_PCT else list(PAPER_GAIN_PCT)
    return [f"paper {name}" for name in names]


def _paper_cells(trace: str, slo_ms: int) -> list[str]:
    names = [trace] if trace in PAPER_GAIN_PCT else list(PAPER_GAIN_PCT)
    return [f"{PAPER_GAIN_PCT[n][slo_ms]:+d} %" if slo_ms in PAPER_GAIN_PCT[n] else "-" for n in names]
