"""`yuebing bench ttft`: what disaggregation costs a long prompt, live.

Runs the same long prompts (distinct, so no prefix cache helps) through three
deployments, one at a time so they never share the CPU:
- colocated: plain vLLM's own OpenAI server, one engine doing prefill and decode;
- disaggregated: `yuebing up --nodes 2` (prefill on node-0, decode on node-1), KV
  streamed layer by layer while prefill computes;
- disaggregated, streaming off: each block is sent after its last layer.
For each it prints median time to the first token (TTFT) and to the second token
(TT2T: the first token decode produces, so it includes any wait for KV), with ratios
to colocated. The client is the same streaming HTTP client for all three.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import aiohttp
from msgspec import Meta

from shared.config import ClusterConfig
from shared.engine.llm import engine_environment
from yuebing import client, process
from yuebing.launcher import up_process
from yuebing.model import default_model_dir

WARMUP = 3  # prompts each deployment serves before it is measured


@dataclass(frozen=True)
class LiveBench:
    """A live benchmark's run (`bench ttft`, `bench reuse`); each field is also a flag."""

    model: Annotated[Path, Meta(description="the model folder")] = field(default_factory=default_model_dir)
    prompt_tokens: Annotated[int, Meta(description="tokens of each measured prompt")] = 2048
    repeats: Annotated[int, Meta(description="measured prompts per deployment or case (medians are reported)")] = 11
    max_model_len: Annotated[int, Meta(description="the engines' context limit, tokens")] = 4096
    # Pinned on every side: a comparison between engines computing in other dtypes says nothing.
    dtype: Annotated[str, Meta(description="the engines' dtype, colocated and disaggregated alike")] = "float32"


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    tt2t_s: float
    kv_loaded_tokens: int | None  # decode's loaded prompt tokens (Yuebing only)
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    prefill_instance: str = ""  # Yuebing only


@dataclass(frozen=True)
class ModeResult:
    mode: str
    ttft_ms: float  # medians
    tt2t_ms: float
    ttft_ratio: float  # to colocated
    tt2t_ratio: float
    gap_ms: float  # median TT2T - TTFT: decode's start, including any wait for KV
    kv_loaded_tokens: int | None
    samples: list[Sample]


def prompts(count: int, length: int, rnd: random.Random) -> list[list[int]]:
    """`count` prompts of printable byte tokens, none sharing a block with another."""
    return [[rnd.randrange(32, 127) for _ in range(length)] for _ in range(count)]


async def measure_one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> Sample:
    """One prompt's time to its first and second token; raises if the request failed."""
    got = (await client.stream(session, url, client.completion_body(model, prompt, max_tokens=4))).check()
    if got.tokens < 2:
        raise RuntimeError(f"{url}: fewer than two tokens came back")
    report = got.yuebing or {}
    first, second = (t - got.sent_at for t in got.token_times[:2])
    return Sample(first, second, report.get("decode_kv_loaded_tokens"), got.cached_tokens,
                  report.get("prefill_instance") or "")


async def measure(url: str, model: str, batch: list[list[int]], warmup: list[list[int]]) -> list[Sample]:
    async with client.session() as session:
        for p in warmup:  # first long prompts pay for allocations (measured: 2-3× slower)
            await measure_one(session, url, model, p)
        return [await measure_one(session, url, model, p) for p in batch]


@contextmanager
def colocated_server(spec: LiveBench, work: Path) -> Iterator[str]:
    """Plain vLLM's OpenAI server on the model, as a child process; yields its URL."""
    port = process.free_port()
    env = {**os.environ, **engine_environment(ClusterConfig()), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(spec.model),
            "--served-model-name", spec.model.name, "--port", str(port), "--max-model-len", str(spec.max_model_len),
            "--dtype", spec.dtype, "--enforce-eager", "--seed", "0"]
    log = work / "vllm.log"
    proc = process.spawn(argv, log, env)
    url = f"http://127.0.0.1:{port}"
    try:
        yield process.wait_until(lambda: _answers(url), proc, 600.0, f"vLLM's server (see {log})")
    finally:
        process.stop([proc], grace_s=60.0, sig=signal.SIGINT)


def _answers(url: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
            return url
    except OSError:
        return None


def cluster_flags(spec: LiveBench, *flags: str) -> list[str]:
    """`yuebing up`'s flags for serving `spec`'s model, and `flags`."""
    return ["--model", str(spec.model), "--max-model-len", str(spec.max_model_len), "--dtype", spec.dtype, *flags]


def summarize(mode: str, samples: list[Sample], base: tuple[float, float] | None) -> ModeResult:
    ttft = statistics.median(s.ttft_s for s in samples) * 1e3
    tt2t = statistics.median(s.tt2t_s for s in samples) * 1e3
    b_ttft, b_tt2t = base or (ttft, tt2t)
    loaded = samples[0].kv_loaded_tokens
    gap = statistics.median(s.tt2t_s - s.ttft_s for s in samples) * 1e3
    return ModeResult(mode, ttft, tt2t, ttft / b_ttft, tt2t / b_tt2t, gap, loaded, samples)


def run(spec: LiveBench, say=print) -> list[ModeResult]:
    batch = prompts(spec.repeats, spec.prompt_tokens, random.Random(1))
    with tempfile.TemporaryDirectory(prefix="yuebing-ttft-") as tmp:
        work = Path(tmp)
        # A different warm-up prompt per deployment: nothing is cached across them.
        say("colocated: plain vLLM OpenAI server …")
        with colocated_server(spec, work) as url:
            warmup = prompts(WARMUP, spec.prompt_tokens, random.Random(2))
            samples = asyncio.run(measure(url, spec.model.name, batch, warmup))
        base = summarize("colocated vLLM", samples, None)
        results = [base]
        for streaming in (True, False):
            label = "disaggregated, layer-wise streaming" if streaming else "disaggregated, streaming off"
            say(f"{label}: yuebing up --nodes 2 …")
            flags = cluster_flags(spec, "--nodes", "2", "--kv-streaming" if streaming else "--no-kv-streaming")
            warmup = prompts(WARMUP, spec.prompt_tokens, random.Random(3 + streaming))
            with up_process(work, "stream" if streaming else "nostream", *flags) as url:
                samples = asyncio.run(measure(url, spec.model.name, batch, warmup))
            results.append(summarize(label, samples, (base.ttft_ms, base.tt2t_ms)))
    return results


def table(results: list[ModeResult], prompt_tokens: int) -> str:
    lines = [f"{prompt_tokens}-token prompts, medians:",
             "| deployment | TTFT ms | × colocated | 2nd token ms | × colocated | 2nd − 1st ms | decode loaded tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        loaded = "-" if r.kv_loaded_tokens is None else str(r.kv_loaded_tokens)
        lines.append(f"| {r.mode} | {r.ttft_ms:.1f} | {r.ttft_ratio:.2f} | {r.tt2t_ms:.1f} | {r.tt2t_ratio:.2f} "
                     f"| {r.gap_ms:.1f} | {loaded} |")
    return "\n".join(lines)


def to_json(results: list[ModeResult], prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "modes": [asdict(r) for r in results]}
