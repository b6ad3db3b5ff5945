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
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from shared.config import ClusterConfig
from shared.engine import engine_environment
from yuebing.launcher import free_port

WARMUP = 3  # prompts each deployment serves before it is measured


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


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(32, 127) for _ in range(length)] for _ in range(count)]


async def measure_one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times: list[float] = []
    loaded, cached, prefill = None, 0, ""
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            for choice in chunk.get("choices", []):
                times.extend([now] * len(choice.get("token_ids") or []))
            report = chunk.get("yuebing") or {}
            loaded = report.get("decode_kv_loaded_tokens", loaded)
            prefill = report.get("prefill_instance", prefill)
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached) or 0
    if len(times) < 2:
        raise RuntimeError(f"{url}: fewer than two tokens came back")
    return Sample(times[0] - start, times[1] - start, loaded, cached, prefill)


async def measure(url: str, model: str, batch: list[list[int]], warmup: list[list[int]]) -> list[Sample]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for p in warmup:  # first long prompts pay for allocations (measured: 2-3× slower)
            await measure_one(session, url, model, p)
        return [await measure_one(session, url, model, p) for p in batch]


class Server:
    """A serving process started in its own session; `url` once it answers."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str], ready: Path | None = None) -> None:
        self.log = log
        self.ready = ready
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait(self, url: str, timeout_s: float = 600) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log}")
            if self.ready is not None:
                if self.ready.exists():
                    return json.loads(self.ready.read_text())["url"]
            else:
                try:
                    import urllib.request

                    with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                        return url
                except OSError:
                    pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout_s:.0f}s; see {self.log}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run_colocated(model: Path, max_model_len: int, work: Path, batch, warmup: list[list[int]]) -> list[Sample]:
    port = free_port()
    env = {**os.environ, **engine_environment(ClusterConfig()), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", model.name, "--port", str(port), "--max-model-len", str(max_model_len),
            "--dtype", "float32", "--enforce-eager", "--seed", "0"]
    server = Server(argv, work / "vllm.log", env)
    try:
        url = server.wait(f"http://127.0.0.1:{port}")
        return asyncio.run(measure(url, model.name, batch, warmup))
    finally:
        server.stop()


def run_cluster(model: Path, max_model_len: int, work: Path, streaming: bool, batch, warmup: list[list[int]]) -> list[Sample]:
    name = "stream" if streaming else "nostream"
    ready = work / f"{name}.ready.json"
    argv = [sys.executable, "-m", "yuebing", "up", "--model", str(model), "--nodes", "2", "--port", str(free_port()),
            "--max-model-len", str(max_model_len), "--run-dir", str(work / name), "--ready-file", str(ready)]
    if not streaming:
        argv.append("--no-kv-streaming")
    server = Server(argv, work / f"{name}.log", {**os.environ, "PYTHONUNBUFFERED": "1"}, ready)
    try:
        url = server.wait("")
        return asyncio.run(measure(url, model.name, batch, warmup))
    finally:
        server.stop()


def summarize(mode: str, samples: list[Sample], base: tuple[float, float] | None) -> ModeResult:
    ttft = statistics.median(s.ttft_s for s in samples) * 1e3
    tt2t = statistics.median(s.tt2t_s for s in samples) * 1e3
    b_ttft, b_tt2t = base or (ttft, tt2t)
    loaded = samples[0].kv_loaded_tokens
    gap = statistics.median(s.tt2t_s - s.ttft_s for s in samples) * 1e3
    return ModeResult(mode, ttft, tt2t, ttft / b_ttft, tt2t / b_tt2t, gap, loaded, samples)


def run(model: Path, prompt_tokens: int, repeats: int, max_model_len: int, progress=print) -> list[ModeResult]:
    batch = prompts(repeats, prompt_tokens, seed=1)
    results: list[ModeResult] = []
    with tempfile.TemporaryDirectory(prefix="yuebing-ttft-") as tmp:
        work = Path(tmp)
        # A different warm-up prompt per deployment: nothing is cached across them.
        progress("colocated: plain vLLM OpenAI server …")
        base_samples = run_colocated(model, max_model_len, work, batch, prompts(WARMUP, prompt_tokens, seed=2))
        base = summarize("colocated vLLM", base_samples, None)
        results.append(base)
        for streaming in (True, False):
            label = "disaggregated, layer-wise streaming" if streaming else "disaggregated, streaming off"
            progress(f"{label}: yuebing up --nodes 2 …")
            warmup = prompts(WARMUP, prompt_tokens, seed=3 + streaming)
            samples = run_cluster(model, max_model_len, work, streaming, batch, warmup)
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
