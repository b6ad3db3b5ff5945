"""`yuebing bench replay`: replay a trace against a live gateway and measure it the
way the simulator reports (yuebing/metrics.py).

Prompts are built so that equal hash ids give equal token blocks: the tokens of a
trace block are drawn from a generator seeded by its hash id, so two requests that
share a prefix in the trace share it token for token here, and the engines' prefix
caches really hit. Prompts go as token ids to `/v1/completions` (streaming, with
`return_token_ids`, so every token's arrival is seen even where its text is held
back), with `ignore_eos` so each request generates its trace's output length.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from yuebing.metrics import Outcome, gap_stats
from yuebing.trace import TraceRequest

PRINTABLE = (32, 127)  # token ids of printable bytes in the default byte-level tokenizer


@dataclass(frozen=True)
class ReplayOptions:
    model: str = "yuebing-tiny"
    block_tokens: int = 128  # tokens of one trace block after rescaling
    slo_ttft_ms: float = 0.0  # 0: the cluster's default
    slo_tbt_ms: float = 0.0
    timeout_s: float = 300.0
    concurrency: int = 256
    api_key: str | None = None
    progress: bool = True
    # Folded into every block's tokens: a new salt gives prompts no engine has cached
    # yet, while equal hash ids within a run still share their blocks.
    salt: int = 0


def prompt_tokens(req: TraceRequest, block_tokens: int, salt: int = 0) -> list[int]:
    """The request's prompt: block i is a function of hash id i (and the salt) alone."""
    tokens: list[int] = []
    for h in req.hash_ids:
        rng = random.Random(f"{salt}:{h}")
        tokens.extend(rng.randrange(*PRINTABLE) for _ in range(block_tokens))
    return tokens[: req.input_length]


async def replay(url: str, trace: Sequence[TraceRequest], options: ReplayOptions) -> tuple[list[Outcome], float]:
    """Send every request at its timestamp; returns the outcomes and the wall time."""
    from tqdm import tqdm

    headers = {"Content-Type": "application/json"}
    if options.api_key:
        headers["Authorization"] = f"Bearer {options.api_key}"
    if options.slo_ttft_ms:
        headers["x-yuebing-slo-ttft-ms"] = str(options.slo_ttft_ms)
    if options.slo_tbt_ms:
        headers["x-yuebing-slo-tbt-ms"] = str(options.slo_tbt_ms)
    limit = asyncio.Semaphore(options.concurrency)
    bar = tqdm(total=len(trace), desc="replay", unit="req", disable=not options.progress)
    timeout = aiohttp.ClientTimeout(total=options.timeout_s)
    # aiohttp's default pool of 100 connections would queue requests behind our own
    # limit and hide that wait from the measured TTFT.
    connector = aiohttp.TCPConnector(limit=options.concurrency)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        start = time.monotonic()

        async def run(req: TraceRequest) -> Outcome:
            await asyncio.sleep(max(0.0, start + req.timestamp_ms / 1e3 - time.monotonic()))
            async with limit:
                outcome = await _one(session, url, req, options, start)
            bar.update()
            return outcome

        outcomes = await asyncio.gather(*(run(r) for r in trace))
        wall = time.monotonic() - start
    bar.close()
    return list(outcomes), wall


async def _one(session: aiohttp.ClientSession, url: str, req: TraceRequest, options: ReplayOptions, start: float) -> Outcome:
    slo_ttft = (options.slo_ttft_ms or float("inf")) / 1e3
    slo_tbt = (options.slo_tbt_ms or float("inf")) / 1e3
    outcome = Outcome(req.timestamp_ms / 1e3, req.input_length, req.output_length, slo_ttft, slo_tbt)
    body = {
        "model": options.model,
        "prompt": prompt_tokens(req, options.block_tokens, options.salt),
        "max_tokens": req.output_length,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    # TTFT counts from the trace's arrival time, not from the send: a request that
    # waited on the client side (the concurrency limit, a late event loop) waited for
    # its first token all the same, and the simulator counts it from arrival.
    arrival = start + req.timestamp_ms / 1e3
    token_times: list[float] = []
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status == 429:
                outcome.rejected = True
                return outcome
            if r.status != 200:
                outcome.failed = True
                return outcome
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome.failed = True
                    return outcome
                if chunk.get("usage"):
                    outcome.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                for choice in chunk.get("choices", []):
                    now = time.monotonic()
                    token_times.extend([now] * len(choice.get("token_ids", [])))
    except (aiohttp.ClientError, TimeoutError):
        outcome.failed = True
        return outcome
    if not token_times:
        outcome.failed = True
        return outcome
    outcome.ttft_s = token_times[0] - arrival
    outcome.end_s = token_times[-1] - start
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    outcome.tbt_mean_s, outcome.tbt_p90_s, outcome.tbt_tail_s = gap_stats(gaps)
    return outcome


def fidelity(url: str, trace: Sequence[TraceRequest], options: ReplayOptions, sim_config, predictor) -> dict:
    """The same trace on the live cluster and in the simulator: mean TTFT and TBT side by side."""
    from yuebing.metrics import summarize
    from yuebing.sim import simulate

    outcomes, wall = asyncio.run(replay(url, trace, options))
    live = summarize(outcomes, wall)
    simulated = simulate(trace, sim_config, predictor).result
    compare = {}
    for key, live_value, sim_value in (
        ("ttft_mean_s", live["ttft_s"]["mean"], simulated["ttft_s"]["mean"]),
        ("tbt_mean_s", live["tbt_mean_s"]["mean"], simulated["tbt_mean_s"]["mean"]),
    ):
        compare[key] = {"live": live_value, "sim": sim_value, "sim_over_live": sim_value / live_value if live_value else 0.0}
    simulated.pop("load_over_time")
    return {"live": live, "sim": simulated, "compare": compare, "requests": len(trace)}
