"""`yuebing bench ...`: benchmarks with a printed table and a JSON result.

conductor: decisions per second and decision latency of the Conductor's full
decision path (loads from the books and the prefix index, policy, admission,
bookkeeping), without NATS, for several cluster sizes over a large block index.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from services.conductor.index import PrefixIndex
from services.conductor.policy import Decision, Params, Request, Scheduler
from services.conductor.state import ClusterState
from shared.predictor import Predictor

# H100-shaped time models (LLaMA-8B, from ../shared/profiles), so loads look realistic.
H100_8B = Predictor(
    prefill_coef=(7.15, 0.0156, 2.1e-06, 7.65e-07), decode_coef=(10.6, -0.0076, 4.0e-05), kv_bytes_per_token=131072, transfer_bytes_per_s=25e9
)


@dataclass(frozen=True)
class ConductorBench:
    sizes: tuple[int, ...] = (8, 64, 256)
    indexed_blocks: int = 1_000_000
    decisions: int = 3000
    chain_blocks: int = 32  # blocks per indexed prompt
    policy: str = "kvcentric"
    admission: str = "predictive"
    seed: int = 0


def _hashes(rng: random.Random, n: int) -> list[str]:
    return [f"{rng.getrandbits(128):032x}" for _ in range(n)]


def build(instances: int, cfg: ConductorBench, rng: random.Random) -> tuple[ClusterState, Scheduler, list[list[str]]]:
    params = Params(block_size=512, decode_time_s=20.0)
    per_instance = cfg.indexed_blocks // instances
    state = ClusterState(H100_8B, params, PrefixIndex(capacity_blocks=per_instance + cfg.chain_blocks * 4))
    for i in range(instances):
        state.add_instance("prefill", f"p{i}")
        state.add_instance("decode", f"d{i}")
    chains = []
    for c in range(cfg.indexed_blocks // cfg.chain_blocks):
        chain = _hashes(rng, cfg.chain_blocks)
        state.index.insert(f"p{c % instances}", chain)
        if c % 16 == 0:
            chains.append(chain)  # prefixes later requests will share
    return state, Scheduler(cfg.policy, cfg.admission, H100_8B, params, seed=cfg.seed), chains


def run_conductor(cfg: ConductorBench, progress: bool = True) -> dict:
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    results = []
    for n in cfg.sizes:
        state, scheduler, chains = build(n, cfg, rng)
        latencies = []
        now = 0.0
        accepted = 0
        for k in tqdm(range(cfg.decisions), desc=f"{n} instances", disable=not progress, leave=False):
            shared_prefix = rng.choice(chains)[: rng.randrange(cfg.chain_blocks)]
            hashes = shared_prefix + _hashes(rng, rng.randrange(1, 24))
            req = Request(f"r{k}", len(hashes) * 512, len(hashes), 512, slo_ttft_s=30.0, slo_tbt_s=0.1)
            now += 0.05
            start = time.perf_counter()
            out = scheduler.schedule(req, state.prefill_loads(hashes, now), state.decode_loads(now), now)
            if isinstance(out, Decision):
                state.assign(req, hashes, out, now)
                accepted += 1
            latencies.append(time.perf_counter() - start)
            if k >= 200:  # keep a steady population of requests in flight
                state.finished(f"r{k - 200}", now)
        latencies.sort()
        results.append(
            {
                "instances": n,
                "indexed_blocks": len(state.index),
                "decisions": cfg.decisions,
                "accepted": accepted,
                "decisions_per_s": cfg.decisions / sum(latencies),
                "p50_ms": statistics.median(latencies) * 1e3,
                "p99_ms": latencies[int(0.99 * len(latencies)) - 1] * 1e3,
            }
        )
    return {"benchmark": "conductor", "policy": cfg.policy, "admission": cfg.admission, "results": results}


def print_conductor(result: dict) -> None:
    print(f"Conductor decision path ({result['policy']} + {result['admission']}), one core:")
    print(f"{'instances':>10} {'indexed':>10} {'decisions/s':>12} {'p50 ms':>8} {'p99 ms':>8}")
    for r in result["results"]:
        print(f"{r['instances']:>10} {r['indexed_blocks']:>10} {r['decisions_per_s']:>12.0f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f}")


def write_json(result: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
