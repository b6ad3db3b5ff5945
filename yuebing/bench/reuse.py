"""`yuebing bench reuse`: what a prefix found in the store saves, live.

One cluster, `yuebing up --prefill 2 --nodes 3 --policy round_robin
--no-engine-prefix-cache` (prefill-0 on node-0, prefill-1 on node-1, decode on
node-2; vLLM's own prefix cache off, so every reuse goes through the node pools).
For each case, a warm-up request with the wanted share of the prompt's blocks runs
first, then the measured prompt:
- cold: nothing cached;
- local 50 % / 90 %: the warm-up ran on the same prefill instance, so the blocks are
  in its node's pool (round robin is steered there with one filler request);
- remote 90 %: the warm-up ran on the other prefill instance; the Conductor has the
  measured request's node pull the blocks from a node that holds them.
Each case is repeated with fresh prompts; medians of TTFT and the ratio to cold.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from yuebing import client
from yuebing.bench.ttft import WARMUP, LiveBench, Sample, cluster_flags, measure_one, prompts
from yuebing.launcher import up_process

BLOCK = 128
# One cluster for every case: cases differ only in what their warm-up request cached.
CLUSTER = ("--prefill", "2", "--nodes", "3", "--policy", "round_robin", "--no-engine-prefix-cache")


@dataclass(frozen=True)
class Case:
    name: str
    share: float  # of the prompt's blocks cached beforehand
    remote: bool


CASES = [Case("cold", 0.0, False), Case("local 50%", 0.5, False), Case("local 90%", 0.9, False),
         Case("remote 90%", 0.9, True)]


@dataclass(frozen=True)
class CaseResult:
    case: str
    ttft_ms: float  # median
    ratio: float  # to cold
    cached_tokens: int  # median reported by the API
    samples: list[Sample]


async def run_case(
    session: aiohttp.ClientSession, url: str, model: str, case: Case, spec: LiveBench, rnd: random.Random,
) -> list[Sample]:
    samples = []
    for _ in range(spec.repeats):
        prompt = prompts(1, spec.prompt_tokens, rnd)[0]
        cached_blocks = int(spec.prompt_tokens // BLOCK * case.share)
        if cached_blocks:
            await measure_one(session, url, model, prompt[: cached_blocks * BLOCK] + prompts(1, BLOCK // 2, rnd)[0])
            if not case.remote:  # one filler so that round robin comes back to the warm-up's instance
                await measure_one(session, url, model, prompts(1, BLOCK // 2, rnd)[0])
        samples.append(await measure_one(session, url, model, prompt))
    return samples


async def measure_cases(url: str, spec: LiveBench, say) -> list[CaseResult]:
    rnd = random.Random(7)
    model = spec.model.name
    results: list[CaseResult] = []
    async with client.session() as session:
        for p in prompts(WARMUP, spec.prompt_tokens, rnd):  # first long prompts pay for allocations
            await measure_one(session, url, model, p)
        for case in CASES:
            samples = await run_case(session, url, model, case, spec, rnd)
            ttft = statistics.median(s.ttft_s for s in samples) * 1e3
            cold = results[0].ttft_ms if results else ttft
            cached = int(statistics.median(s.cached_tokens for s in samples))
            results.append(CaseResult(case.name, ttft, ttft / cold, cached, samples))
            say(f"  {case.name:>11}: TTFT {ttft:7.1f} ms  ({ttft / cold:.2f} × cold), cached tokens {cached}")
    return results


def run(spec: LiveBench, say=print) -> list[CaseResult]:
    with tempfile.TemporaryDirectory(prefix="yuebing-reuse-") as tmp:
        say(f"starting yuebing up {' '.join(CLUSTER)} …")
        with up_process(Path(tmp), "up", *cluster_flags(spec, *CLUSTER)) as url:
            return asyncio.run(measure_cases(url, spec, say))


def table(results: list[CaseResult], prompt_tokens: int) -> str:
    lines = [f"{prompt_tokens}-token prompts, medians:",
             "| cached beforehand | TTFT ms | × cold | cached tokens reported |",
             "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.case} | {r.ttft_ms:.1f} | {r.ratio:.2f} | {r.cached_tokens} |")
    return "\n".join(lines)


def to_json(results: list[CaseResult], prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "cases": [asdict(r) for r in results]}
