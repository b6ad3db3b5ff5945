"""Long prompts (8k–128k tokens) on a pool of prefill instances: plain single-instance
prefill against Mooncake's chunked pipeline parallelism (CPP, §5.1) and LoongServe's
elastic sequence parallelism (ESP), in TTFT and in instance-seconds per request
(`yuebing sim-long-context`).

Every strategy runs the same seeded Poisson stream of prompts of one length, FIFO:
- `single`: a prompt on one instance, chunk by chunk (`cpp.chunked_prefill_s`), on
  the instance that frees first.
- `cpp-S`: instances // S pipeline groups of S stages (services/conductor/cpp.py);
  each group's stage free-times carry from prompt to prompt (`cpp.run_pipeline`), so
  a prompt's first chunks fill the stages the last one's final chunks leave. A prompt
  goes to the group that would finish it first: that is the TTFT-minimising choice
  Mooncake's Conductor makes among prefill instances, and it sees a group's whole
  pipeline state, where "stage 0 frees first" ignores a backed-up last stage.
- `esp`: a prompt takes D instances and splits its sequence across them, unchunked, as
  LoongServe prefills (arXiv 2404.09526, SOSP '24; github.com/LoongServe/LoongServe).
  D is what LoongServe's scheduler picks (router/manager.py `_schedule_new_req_list`
  with longserve_c_scheduler's DP, which minimises Σ batch time × Σ 1/input_len over
  the idle instances): for one waiting prompt, the D ≤ idle with the least predicted
  time; for q waiting prompts of one length, the idle instances shared evenly (the
  DP's optimum for equal lengths when each prompt is its own batch).

ESP's time on D instances (`esp_prefill_s`), from the single-instance fit
  prefill(n, p) = a + b·n + c·n·p + d·n² (shared/predictor.py): each instance runs
  l/D tokens' linear layers, and per layer D ring steps of striped attention while
  the KV block it just used goes to the next instance (LoongServe's
  longserve_transformer_layer_infer.py `_context_attention_kernel`: the send on a
  comm stream, overlapped with the next step's attention). The prompt's attention is
  D causal diagonal blocks (d·(l/D)² each, as a prompt's own tokens) and D(D−1)/2
  blocks of queries over earlier keys (c·(l/D)² each, as a chunk over its cached
  prefix: the profile's own price of that, the same price chunked single and CPP pay),
  which striping shares evenly, so one ring step on one instance is
    s = (D·d + D(D−1)/2·c)·(l/D)² / D²,   comm = (l/D)·kv_bytes / link,
    T(l, D) = a + b·l/D + s + (D−1)·max(s, comm)
  all layers at once (kv_bytes covers all layers, as the coefficients do): every step
  after the first waits for its block, so comm over compute is exposed. T(l, 1) is
  the profile's unchunked prefill(l). LoongServe fits A_D + B_D·Σl + C_D·Σl² per D
  from measurement (test/longserve/2-find-time-function-prefill.py,
  router/profiler.py); with one instance's profile, the per-D terms are derived here.
  Scale-down: proactive migration (§4 of the paper; `_get_batch_prefill_migration_plan`
  and `destindex_copy_and_register_kv` in the code) has each instance that keeps KV
  for decoding copy its share as the blocks pass it in the ring, which already carries
  every block to every instance; so the migration costs no transfer beyond the ring,
  and what is not hidden is the ring's exposed comm above. LoongServe releases the
  instances that keep nothing when the prefill ends; the study charges all D until
  then and none after (the KV's way on to decode is the same for every strategy and
  not modelled).

Instance-seconds per request: the instances a request holds × how long. A group (or
an ESP set, or one instance) is charged from when the request starts or the group's
previous request finished, whichever is later, to the request's finish: pipeline
fill and drain are charged to the request that leaves them idle, never twice.
Bytes between instances per request: CPP's (S−1)·l·hidden·2 at the stage
boundaries, ESP's (D−1)·l·kv_bytes (every KV block visits every other instance).

Pure: no I/O; yuebing/commands/sim_long_context.py loads the profile and prints.
"""

from __future__ import annotations

import heapq
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.conductor.cpp import PipelineGroup, chunked_prefill_s, pipeline_prefill_s, run_pipeline
from shared.predictor import Predictor
from yuebing.lab.outcome import percentile
from yuebing.shapes import BF16_BYTES, ModelShape


@dataclass(frozen=True, slots=True)
class Setup:
    shape: ModelShape
    instances: int = 8
    chunk_tokens: int = 8192
    link_bytes_per_s: float = 25e9  # one 200 Gbps RDMA NIC per instance, as the simulator's KV link
    esp_max: int = 0  # most instances one ESP prompt takes (0: all)

    def __post_init__(self) -> None:
        if self.instances < 1 or self.chunk_tokens < 1 or self.link_bytes_per_s <= 0:
            raise ValueError(f"need instances ≥ 1, chunk_tokens ≥ 1 and a positive link, got {self}")

    def group(self, stages: int) -> PipelineGroup:
        return PipelineGroup(stages, self.chunk_tokens, self.shape.hidden * BF16_BYTES, self.link_bytes_per_s)


@dataclass(frozen=True, slots=True)
class Served:
    arrival: float
    start: float
    finish: float
    instance_s: float
    degree: int = 1  # instances it ran on (ESP's D, CPP's S)
    link_bytes: float = 0.0  # what it sent between instances

    @property
    def ttft(self) -> float:
        return self.finish - self.arrival


def poisson_arrivals(rate_per_s: float, requests: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(requests):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def lone_arrivals(requests: int, gap_s: float) -> list[float]:
    """One prompt at a time: each arrives after the last has surely finished."""
    return [i * gap_s for i in range(requests)]


def run_single(predictor: Predictor, setup: Setup, tokens: int, arrivals: Sequence[float]) -> list[Served]:
    took = chunked_prefill_s(predictor, tokens, 0, setup.chunk_tokens)
    free = [0.0] * setup.instances
    out = []
    for arrival in arrivals:
        start = max(arrival, heapq.heappop(free))
        heapq.heappush(free, start + took)
        out.append(Served(arrival, start, start + took, took))
    return out


def run_cpp(predictor: Predictor, setup: Setup, stages: int, tokens: int, arrivals: Sequence[float]) -> list[Served]:
    group = setup.group(stages)
    groups = setup.instances // stages
    if groups < 1:
        raise ValueError(f"cpp-{stages} needs at least {stages} instances, got {setup.instances}")
    free = [(0.0,) * stages for _ in range(groups)]
    last_finish = [0.0] * groups
    out = []
    for arrival in arrivals:
        starts = [tuple(max(arrival, f) for f in g) for g in free]
        ends = [run_pipeline(predictor, group, tokens, 0, s) for s in starts]
        g = min(range(groups), key=lambda i: ends[i][-1])
        start, finish = starts[g][0], ends[g][-1]
        sent = (stages - 1) * tokens * group.boundary_bytes_per_token
        out.append(Served(arrival, start, finish, stages * (finish - max(start, last_finish[g])), stages, sent))
        free[g], last_finish[g] = ends[g], finish
    return out


def esp_prefill_s(predictor: Predictor, setup: Setup, tokens: int, degree: int) -> tuple[float, float]:
    """(seconds, of which exposed ring communication) for one prompt on `degree`
    instances, by the model in the module docstring."""
    a, b, c, d = (k / 1e3 for k in predictor.prefill_coef)  # s
    per = tokens / degree
    # D diagonal blocks (causal, as a prompt's own tokens) and D(D−1)/2 blocks of
    # queries over earlier tokens' keys (as a chunk over its cached prefix), shared
    # evenly by striping: one instance's share of one ring step, all layers.
    step = (degree * d + degree * (degree - 1) / 2 * c) * per * per / degree**2
    comm = per * setup.shape.kv_bytes_per_token / setup.link_bytes_per_s
    exposed = (degree - 1) * max(0.0, comm - step)
    return max(predictor.floor_s, a + b * per + degree * step + exposed), exposed


def esp_degree(predictor: Predictor, setup: Setup, tokens: int, idle: int, waiting: int) -> int:
    """LoongServe's choice for the head of the queue: the idle instances shared among
    the waiting prompts, and of those the count with the least predicted time."""
    cap = max(1, idle // max(1, waiting))
    if setup.esp_max:
        cap = min(cap, setup.esp_max)
    return min(range(1, cap + 1), key=lambda d: (esp_prefill_s(predictor, setup, tokens, d)[0], d))


def run_esp(predictor: Predictor, setup: Setup, tokens: int, arrivals: Sequence[float]) -> list[Served]:
    free = [0.0] * setup.instances
    out = []
    for i, arrival in enumerate(arrivals):
        start = max(arrival, min(free))
        idle = sorted(range(setup.instances), key=lambda k: free[k])
        idle = [k for k in idle if free[k] <= start]
        waiting = sum(1 for t in arrivals[i:] if t <= start)
        degree = esp_degree(predictor, setup, tokens, len(idle), waiting)
        took, _ = esp_prefill_s(predictor, setup, tokens, degree)
        for k in idle[:degree]:
            free[k] = start + took
        sent = (degree - 1) * tokens * setup.shape.kv_bytes_per_token  # every KV block visits every other instance
        out.append(Served(arrival, start, start + took, degree * took, degree, sent))
    return out


Runner = Callable[[Predictor, Setup, int, Sequence[float]], list[Served]]


def strategies(stages: Sequence[int], instances: int) -> dict[str, Runner]:
    """The strategies compared, by name, in the table's order: `single`, `cpp-S` for
    each S that fits the instances, `esp`."""
    out: dict[str, Runner] = {"single": run_single}
    for s in stages:
        if s <= instances:
            out[f"cpp-{s}"] = lambda p, st, n, arr, s=s: run_cpp(p, st, s, n, arr)
    out["esp"] = run_esp
    return out


def summary(served: Sequence[Served]) -> dict[str, float]:
    ttfts = sorted(s.ttft for s in served)
    return {
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p90_s": percentile(ttfts, 90),
        "instance_s": statistics.fmean(s.instance_s for s in served),
        "degree_mean": statistics.fmean(s.degree for s in served),
        "link_gb": statistics.fmean(s.link_bytes for s in served) / 1e9,
    }


def lone_times(predictor: Predictor, setup: Setup, tokens: int, stages: Sequence[int]) -> dict[str, float]:
    """Each strategy's time for one prompt on idle instances (ESP on all it may take)."""
    out = {"single": chunked_prefill_s(predictor, tokens, 0, setup.chunk_tokens)}
    out |= {f"cpp-{s}": pipeline_prefill_s(predictor, setup.group(s), tokens) for s in stages if s <= setup.instances}
    out["esp"] = esp_prefill_s(predictor, setup, tokens, esp_degree(predictor, setup, tokens, setup.instances, 1))[0]
    return out


def run_all(predictor: Predictor, setup: Setup, tokens: int, stages: Sequence[int],
            arrivals: Sequence[float]) -> dict[str, dict[str, float]]:
    return {name: summary(run(predictor, setup, tokens, arrivals))
            for name, run in strategies(stages, setup.instances).items()}


def study(predictor: Predictor, setup: Setup, lengths: Sequence[int], stages: Sequence[int], load: float,
          requests: int, seed: int) -> list[dict]:
    """Per input length: each strategy alone (one prompt at a time) and loaded (Poisson
    arrivals at `load` × single's capacity, instances / single's prefill time)."""
    rows = []
    for tokens in lengths:
        lone = lone_times(predictor, setup, tokens, stages)
        rate = load * setup.instances / lone["single"]
        rows.append({
            "tokens": tokens,
            "rate_per_s": rate,
            "lone": run_all(predictor, setup, tokens, stages, lone_arrivals(3, 2 * max(lone.values()))),
            "loaded": run_all(predictor, setup, tokens, stages, poisson_arrivals(rate, requests, seed)),
        })
    return rows


def winners(rows: Sequence[dict], load: str, metric: str, tie: float = 0.005) -> list[tuple[str, list[int]]]:
    """Which strategy has the least `metric` under `load` ("lone" or "loaded"), as
    (strategy, its input lengths) runs in the rows' order; strategies within `tie`
    (relative) of the least share a win, as "single=esp"."""
    out: list[tuple[str, list[int]]] = []
    for row in rows:
        results = row[load]
        least = min(r[metric] for r in results.values())
        best = "=".join(name for name, r in results.items() if r[metric] <= least * (1 + tie))
        if out and out[-1][0] == best:
            out[-1][1].append(row["tokens"])
        else:
            out.append((best, [row["tokens"]]))
    return out
