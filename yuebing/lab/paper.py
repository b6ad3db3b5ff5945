"""Mooncake's end-to-end experiments (FAST '25, §8) as simulator setups, with the
paper's figures as its text states them: read, not fitted.

The paper's instance is a node of 8 A800-80GB GPUs on NVLink serving LLaMA2-70B by
tensor parallelism; each node is one prefill, one decode or one colocated vLLM
instance. Its vLLM baseline prefills whole prompts, interrupting the decode batch (no
chunked prefill), and on the long-context data processes one request at a time. Each
experiment here runs that baseline and, beside it, today's vLLM (chunked prefill).

- Fig. 11 (capacity per TBT SLO, conversation trace): 10P+10D against 20M.
- Fig. 12 (long-context synthetic data): 3P+1D and 2P+2D against 4M.
- Fig. 13 (the real trace): 10P+10D against 20M, TTFT ≤ 30 s, TBT ≤ 0.1 s a token.
- Table 3 (rejections at 2× replay): 8P+8D, none against early and predictive
  rejection.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from shared.predictor import TBT_SLO_FACTOR, TTFT_SLO_FACTOR, Predictor
from yuebing.lab.outcome import Outcome
from yuebing.lab.sim import find_capacity, log_bisect, simulate
from yuebing.lab.sim_config import SimConfig
from yuebing.lab.tensor_parallel import GPUS, LINKS, InstanceShape, kv_capacity_requests
from yuebing.lab.trace import SyntheticSpec, TraceRequest, synthetic
from yuebing.shapes import SHAPES

MODEL = "llama2-70b"
INSTANCE = InstanceShape(gpus=8, link=LINKS["a800-nvlink"], gpu=GPUS["a800"])  # §8: a node of 8 A800-SXM4-80GB
TBT_SLOS_MS = (100, 200, 300)

# What the paper says, in its words' numbers.
FIG11_GAIN_PCT = {  # capacity gain over vLLM, % more requests within the SLOs, per TBT SLO (ms)
    "conversation": {100: 498, 200: 157, 300: 59},
    "tool&agent": {100: 64, 200: 42, 300: 22},
    "synthetic": {100: 62, 200: 40, 300: 28},
}
FIG12_GAIN_PCT = (50, 525)  # long-context synthetic data: the range over its lengths and setups
FIG13 = {"tbt_attainment": {"Mooncake": 1.00, "vLLM": 0.57}, "gain_pct": 75, "slo_ttft_s": 30.0, "slo_tbt_s": 0.1}
TABLE3_REJECTED = {"none": 4183, "early_reject": 3771, "predictive": 3589}

LONG_CONTEXT_LENGTHS = (16384, 32768, 65536, 131072)
LONG_CONTEXT_OUTPUT = 512
# The paper's SLOs on its synthetic data: multiples of a lone request's TTFT and TBT.
TTFT_X, TBT_X = TTFT_SLO_FACTOR, TBT_SLO_FACTOR


@dataclass(frozen=True)
class Setup:
    """One system of a figure: a name as the paper writes it, a simulated cluster."""

    name: str
    config: SimConfig

    @property
    def colocated(self) -> bool:  # a vLLM baseline, which Mooncake's gains are measured against
        return self.config.mode == "colocated"


def mean_context(trace: Sequence[TraceRequest]) -> int:
    """A request's mean context (prompt and output): what sizes a batch to the memory."""
    return round(sum(r.input_length + r.output_length for r in trace) / len(trace))


def base_config(context_tokens: int) -> SimConfig:
    """The paper's instance: LLaMA2-70B's KV, and as many requests a batch as the node's
    memory holds at this context (none over vLLM's default max_num_seqs of 256)."""
    model = SHAPES[MODEL]
    batch = min(256, kv_capacity_requests(model, INSTANCE, context_tokens))
    return SimConfig(kv_bytes_per_token=model.kv_bytes_per_token, max_batch=batch)


def versus_colocated(disaggregated: Sequence[tuple[int, int]], base: SimConfig, one_at_a_time: bool = False,
                     without_prefix_cache: bool = False) -> list[Setup]:
    """Mooncake at each P+D split, against as many colocated instances run as the
    paper's vLLM (unchunked; one request at a time on long context), optionally that
    without prefix caching, and as today's vLLM (chunked)."""
    total = disaggregated[0][0] + disaggregated[0][1]
    setups = [Setup(f"Mooncake-[{p}P+{d}D]", replace(base, prefill=p, decode=d)) for p, d in disaggregated]
    colocated = replace(setups[0].config, mode="colocated")  # as many instances, each running both phases
    paper = replace(colocated, unchunked=True, max_batch=1 if one_at_a_time else colocated.max_batch)
    setups.append(Setup(f"vLLM-[{total}M] paper", paper))
    if without_prefix_cache:
        setups.append(Setup(f"vLLM-[{total}M] paper, no prefix cache", replace(paper, prefix_caching=False)))
    return [*setups, Setup(f"vLLM-[{total}M] chunked", colocated)]


def conversation_setups(context_tokens: int) -> list[Setup]:
    base = replace(base_config(context_tokens), slo_ttft_s=FIG13["slo_ttft_s"])
    return versus_colocated([(10, 10)], base, without_prefix_cache=True)


def long_context_setups(length: int) -> list[Setup]:
    base = replace(base_config(length + LONG_CONTEXT_OUTPUT), slo_ttft_x=TTFT_X, slo_tbt_x=TBT_X)
    return versus_colocated([(3, 1), (2, 2)], base, one_at_a_time=True)


def long_context_trace(length: int, requests: int, seed: int = 0) -> list[TraceRequest]:
    """The paper's simulated data: prompts of one length, 512 output tokens, half of
    each prompt a prefix shared with others (its 50 % cache ratio), Poisson arrivals
    (at 1 a second: replay speed scales them)."""
    return synthetic(SyntheticSpec(requests=requests, rate_per_s=1.0, input_mean=length,
                                   output_mean=LONG_CONTEXT_OUTPUT, length_sigma=0.05, shared_prefix_ratio=1.0,
                                   prefixes=4, prefix_share_of_input=0.5, seed=seed))


def capacities(trace: Sequence[TraceRequest], setups: Sequence[Setup], predictor: Predictor, probes: int,
               on_probe: Callable[[dict], None] | None = None) -> list[dict]:
    """Each setup's capacity (req/s with 90 % of requests within both SLOs), with its
    gain over each vLLM baseline."""
    found = {s.name: find_capacity(trace, s.config, predictor, steps=probes, on_probe=on_probe).get("capacity_rps", 0.0)
             for s in setups}
    baselines = [s.name for s in setups if s.colocated]
    return [{"setup": s.name, "capacity_rps": found[s.name],
             "gain_over": {b: gain(found[s.name], found[b]) for b in baselines}} for s in setups]


def capacities_per_tbt(trace: Sequence[TraceRequest], setups: Sequence[Setup], predictor: Predictor, probes: int,
                       on_probe: Callable[[dict], None] | None = None) -> list[dict]:
    """`capacities` at each of the paper's TBT SLOs (Fig. 11)."""
    rows = []
    for ms in TBT_SLOS_MS:
        at = [replace(s, config=replace(s.config, slo_tbt_s=ms / 1e3)) for s in setups]
        rows += [r | {"tbt_slo_ms": ms} for r in capacities(trace, at, predictor, probes, on_probe)]
    return rows


def gain(rps: float, baseline: float) -> float:
    """Relative gain; infinite where the baseline serves nothing within the SLOs."""
    if baseline <= 0:
        return math.inf if rps > 0 else 0.0
    return rps / baseline - 1


@dataclass(frozen=True)
class Attainment:
    """Fig. 13's measure: of all requests, the share within each SLO."""

    setup: str
    ttft: float
    tbt: float
    both: float
    outcomes: list[Outcome]


def attainment(trace: Sequence[TraceRequest], setups: Sequence[Setup], predictor: Predictor,
               speed: float) -> list[Attainment]:
    """Every setup replaying the trace at one speed, at Fig. 13's SLOs."""
    out = []
    for s in setups:
        config = replace(s.config, speed=speed, slo_ttft_s=FIG13["slo_ttft_s"], slo_tbt_s=FIG13["slo_tbt_s"])
        outcomes = simulate(trace, config, predictor).outcomes
        done = [o for o in outcomes if o.completed]
        n = max(1, len(outcomes))
        out.append(Attainment(s.name, sum(o.ttft_s <= o.slo_ttft_s for o in done) / n,
                              sum(o.tbt_tail_s <= o.slo_tbt_s for o in done) / n,
                              sum(o.within_slo for o in done) / n, outcomes))
    return out


def speed_at_tbt_attainment(trace: Sequence[TraceRequest], setup: Setup, predictor: Predictor, share: float,
                            lo: float, hi: float, steps: int = 8) -> float:
    """The replay speed in [lo, hi] at which `setup` meets Fig. 13's TBT SLO for
    `share` of requests (bisection: attainment falls as load rises)."""
    lo, hi = log_bisect(lo, hi, steps, lambda speed: attainment(trace, [setup], predictor, speed)[0].tbt >= share)
    return math.sqrt(lo * hi)
