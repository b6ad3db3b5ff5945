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
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from yuebing.launcher import free_port
from yuebing.ttft_bench import Sample, Server, measure_one

BLOCK = 128


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


async def run_case(session, url: str, model: str, case: Case, prompt_tokens: int, repeats: int, rnd: random.Random) -> list[Sample]:
    samples = []
    for _ in range(repeats):
        prompt = [rnd.randrange(32, 127) for _ in range(prompt_tokens)]
        cached_blocks = int(prompt_tokens // BLOCK * case.share)
        if cached_blocks:
            warm = prompt[: cached_blocks * BLOCK] + [rnd.randrange(32, 127) for _ in range(BLOCK // 2)]
            await measure_one(session, url, model, warm)
            if not case.remote:  # one filler so that round robin comes back to the warm-up's instance
                filler = [rnd.randrange(32, 127) for _ in range(BLOCK // 2)]
                await measure_one(session, url, model, filler)
        samples.append(await measure_one(session, url, model, prompt))
    return samples


async def measure_cases(url: str, model: str, prompt_tokens: int, repeats: int, progress) -> list[CaseResult]:
    rnd = random.Random(7)
    results: list[CaseResult] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for _ in range(3):  # warm-up: first long prompts pay for allocations
            await measure_one(session, url, model, [rnd.randrange(32, 127) for _ in range(prompt_tokens)])
        for case in CASES:
            samples = await run_case(session, url, model, case, prompt_tokens, repeats, rnd)
            ttft = statistics.median(s.ttft_s for s in samples) * 1e3
            cold = results[0].ttft_ms if results else ttft
            cached = int(statistics.median(s.cached_tokens for s in samples))
            results.append(CaseResult(case.name, ttft, ttft / cold, cached, samples))
            progress(f"  {case.name:>11}: TTFT {ttft:7.1f} ms  ({ttft / cold:.2f} × cold), cached tokens {cached}")
    return results


def run(model: Path, prompt_tokens: int, repeats: int, max_model_len: int, progress=print) -> list[CaseResult]:
    with tempfile.TemporaryDirectory(prefix="yuebing-reuse-") as tmp:
        work = Path(tmp)
        ready = work / "ready.json"
        argv = [sys.executable, "-m", "yuebing", "up", "--model", str(model), "--prefill", "2", "--nodes", "3",
                "--policy", "round_robin", "--no-engine-prefix-cache", "--port", str(free_port()),
                "--max-model-len", str(max_model_len), "--run-dir", str(work / "run"), "--ready-file", str(ready)]
        progress("starting yuebing up --prefill 2 --nodes 3 --policy round_robin --no-engine-prefix-cache …")
        server = Server(argv, work / "up.log", None, ready)
        try:
            url = server.wait("")
            return asyncio.run(measure_cases(url, model.name, prompt_tokens, repeats, progress))
        finally:
            server.stop()


def table(results: list[CaseResult], prompt_tokens: int) -> str:
    lines = [f"{prompt_tokens}-token prompts, medians:", "| cached beforehand | TTFT ms | × cold | cached tokens reported |",
             "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.case} | {r.ttft_ms:.1f} | {r.ratio:.2f} | {r.cached_tokens} |")
    return "\n".join(lines)


def to_json(results: list[CaseResult], prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "cases": [asdict(r) for r in results]}
