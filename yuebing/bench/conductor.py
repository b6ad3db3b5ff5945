"""`yuebing bench conductor`: decisions per second and decision latency of the
Conductor's full decision path (loads from the books and the prefix index, policy,
admission, bookkeeping), without NATS, for several cluster sizes over a large block
index. Time models are the H100 LLaMA-8B profile's, so loads look realistic. Each
size runs with the Conductor's shortlist, then (the baseline, same requests) with
every instance scored.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Annotated

from msgspec import Meta

from services.conductor.index import PrefixIndex
from services.conductor.policy import Decision, Params, Request, Scheduler
from services.conductor.state import ClusterState
from shared.config import SHORTLIST, SHORTLIST_DESCRIPTION
from shared.predictor import Predictor, load_predictor
from yuebing.progress import progress

BLOCK_TOKENS = 512
IN_FLIGHT = 200  # requests kept in flight: each decision finishes the one this many before it
WARMUP = 500  # decisions made before the timed ones: a live Conductor's code paths and caches are warm


@dataclass(frozen=True)
class ConductorBench:
    """What to measure; each field is also a flag of `yuebing bench conductor`."""

    sizes: Annotated[
        tuple[int, ...], Meta(description="instance counts (of prefill, and as many decode)")
    ] = (8, 64, 256)
    indexed_blocks: Annotated[int, Meta(description="blocks in the prefix index")] = 1_000_000
    decisions: Annotated[int, Meta(description="decisions timed per size")] = 3000
    chain_blocks: Annotated[int, Meta(description="blocks per indexed prompt")] = 32
    policy: Annotated[str, Meta(description="prefill scheduling policy")] = "kvcentric"
    admission: Annotated[str, Meta(description="early rejection mode")] = "predictive"
    seed: Annotated[int, Meta(description="seed of the requests")] = 0
    shortlist: Annotated[int, Meta(description=SHORTLIST_DESCRIPTION)] = SHORTLIST
    baseline: Annotated[
        bool, Meta(description="also time every instance scored (shortlist 0), on the same requests")
    ] = True


def h100_llama8b() -> Predictor:
    """The GPU profile's LLaMA-8B time models, with its KV size and a 25 GB/s network."""
    from yuebing.lab.data import GPU_PROFILE

    return replace(load_predictor(GPU_PROFILE, "llama3-8b"), kv_bytes_per_token=131072, transfer_bytes_per_s=25e9)


def _hashes(rng: random.Random, n: int) -> list[str]:
    return [f"{rng.getrandbits(128):032x}" for _ in range(n)]


def build(
    instances: int, cfg: ConductorBench, rng: random.Random, predictor: Predictor,
) -> tuple[ClusterState, Scheduler, list[list[str]]]:
    params = Params(block_size=BLOCK_TOKENS, decode_time_s=20.0, shortlist=cfg.shortlist)
    per_instance = cfg.indexed_blocks // instances
    state = ClusterState(predictor, params, PrefixIndex(capacity_blocks=per_instance + cfg.chain_blocks * 4))
    for i in range(instances):
        state.add_instance("prefill", f"p{i}")
        state.add_instance("decode", f"d{i}")
    chains = []
    for c in range(cfg.indexed_blocks // cfg.chain_blocks):
        chain = _hashes(rng, cfg.chain_blocks)
        state.index.insert(f"p{c % instances}", chain)
        if c % 16 == 0:
            chains.append(chain)  # prefixes later requests will share
    return state, Scheduler(cfg.policy, cfg.admission, predictor, params, seed=cfg.seed), chains


def measure(instances: int, cfg: ConductorBench, rng: random.Random, predictor: Predictor, show: bool) -> dict:
    """Time `cfg.decisions` decisions on a cluster of `instances`."""
    state, scheduler, chains = build(instances, cfg, rng, predictor)
    tracked, pause_ms = collector_load()

    def decide(k: int) -> tuple[bool, float]:
        """Request k placed (accepted?, seconds taken); the one IN_FLIGHT before it finishes."""
        hashes = rng.choice(chains)[: rng.randrange(cfg.chain_blocks)] + _hashes(rng, rng.randrange(1, 24))
        req = Request(f"r{k}", len(hashes) * BLOCK_TOKENS, len(hashes), BLOCK_TOKENS, slo_ttft_s=30.0, slo_tbt_s=0.1)
        now = k * 0.05
        start = time.perf_counter()
        short = scheduler.shortlist
        out = scheduler.schedule(req, state.prefill_loads(hashes, now, shortlist=short), state.decode_loads(now, short),
                                 now)
        if isinstance(out, Decision):
            state.assign(req, hashes, out, now)
        taken = time.perf_counter() - start
        if k >= IN_FLIGHT:
            state.finished(f"r{k - IN_FLIGHT}", now)
        return isinstance(out, Decision), taken

    for k in range(WARMUP):
        decide(k)
    timed = [decide(k) for k in progress(range(WARMUP, WARMUP + cfg.decisions), desc=f"{instances} instances",
                                         leave=False, enabled=show)]
    accepted = sum(ok for ok, _ in timed)
    latencies = sorted(taken for _, taken in timed)
    return {
        "instances": instances,
        "indexed_blocks": len(state.index),
        "decisions": cfg.decisions,
        "accepted": accepted,
        "decisions_per_s": cfg.decisions / sum(latencies),
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[int(0.99 * len(latencies)) - 1] * 1e3,
        "gc_tracked": tracked,
        "gc_full_ms": pause_ms,
    }


def collector_load() -> tuple[int, float]:
    """Objects the cyclic garbage collector tracks now (the index's among them, if it
    keeps containers per block), and how long a full collection of them pauses the
    process, ms: what a live Conductor stops for now and then."""
    start = time.perf_counter()
    gc.collect()
    return len(gc.get_objects()), (time.perf_counter() - start) * 1e3


def run(cfg: ConductorBench, show_progress: bool = True) -> dict:
    """Each size with the shortlist, then (`baseline`) with every instance scored, on
    the same cluster and requests (the same seed)."""
    predictor = h100_llama8b()
    results = []
    for n in cfg.sizes:
        result = measure(n, cfg, random.Random(cfg.seed + n), predictor, show_progress)
        if cfg.baseline and cfg.shortlist:
            exact = measure(n, replace(cfg, shortlist=0), random.Random(cfg.seed + n), predictor, show_progress)
            result["baseline"] = exact
            result["speedup"] = result["decisions_per_s"] / exact["decisions_per_s"]
        results.append(result)
    return {"benchmark": "conductor", "policy": cfg.policy, "admission": cfg.admission,
            "shortlist": cfg.shortlist, "results": results}


def table(result: dict) -> str:
    k = result.get("shortlist", 0)
    scored = f"shortlist {k}" if k else "every instance scored"
    lines = [f"Conductor decision path ({result['policy']} + {result['admission']}, {scored}), one core:",
             f"{'instances':>10} {'indexed':>10} {'gc tracked':>11} {'full gc ms':>11} {'decisions/s':>12}"
             f" {'p50 ms':>8} {'p99 ms':>8} {'all scored/s':>13} {'p99 ms':>8} {'speed-up':>9}"]
    for r in result["results"]:
        line = (f"{r['instances']:>10} {r['indexed_blocks']:>10} {r['gc_tracked']:>11} {r['gc_full_ms']:>11.0f} "
                f"{r['decisions_per_s']:>12.0f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f}")
        if "baseline" in r:
            b = r["baseline"]
            line += f" {b['decisions_per_s']:>13.0f} {b['p99_ms']:>8.3f} {r['speedup']:>8.1f}x"
        lines.append(line)
    return "\n".join(lines)
