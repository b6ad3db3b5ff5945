"""Replay a trace against a live gateway (`yuebing bench replay`) and measure it the
way the simulator reports (`yuebing.lab.outcome`).

Prompts are built so that equal hash ids give equal token blocks: the tokens of a
trace block are drawn from a generator seeded by its hash id, so two requests that
share a prefix in the trace share it token for token here, and the engines' prefix
caches really hit. Prompts go as token ids to `/v1/completions` through
`yuebing.client` (streaming, with `return_token_ids`, so every token's arrival is
seen even where its text is held back), with `ignore_eos` so each request generates
its trace's output length.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from yuebing import client
from yuebing.lab.outcome import Outcome, gap_stats
from yuebing.lab.trace import TraceRequest
from yuebing.progress import progress as progress_bar

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
        tokens += random_prompt(random.Random(f"{salt}:{h}"), block_tokens)
    return tokens[: req.input_length]


def random_prompt(rng: random.Random, n: int) -> list[int]:
    """`n` printable token ids."""
    return [rng.randrange(*PRINTABLE) for _ in range(n)]


def connect(options: ReplayOptions, connections: int = 100) -> aiohttp.ClientSession:
    """A client session to the gateway, carrying the options' key and SLO headers."""
    headers = {}
    if options.slo_ttft_ms:
        headers["x-yuebing-slo-ttft-ms"] = str(options.slo_ttft_ms)
    if options.slo_tbt_ms:
        headers["x-yuebing-slo-tbt-ms"] = str(options.slo_tbt_ms)
    return client.session(options.api_key, timeout_s=options.timeout_s, connections=connections, headers=headers)


async def replay(url: str, trace: Sequence[TraceRequest], options: ReplayOptions) -> tuple[list[Outcome], float]:
    """Send every request at its timestamp; returns the outcomes and the wall time."""
    limit = asyncio.Semaphore(options.concurrency)
    bar = progress_bar(total=len(trace), desc="replay", unit="req", enabled=options.progress)
    # aiohttp's default pool of 100 connections would queue requests behind our own
    # limit and hide that wait from the measured TTFT.
    async with connect(options, connections=options.concurrency) as session:
        start = time.monotonic()

        async def run(req: TraceRequest) -> Outcome:
            async with limit:
                outcome = await _one(session, url, req, options, start)
            bar.update()
            return outcome

        # Requests of one timestamp reach the gateway in trace order, as the simulator
        # serves them, because one loop starts them in that order (tasks that each
        # sleep to the same instant wake in no set order: that shuffled whole groups).
        tasks: dict[int, asyncio.Task[Outcome]] = {}
        try:
            for i in sorted(range(len(trace)), key=lambda i: trace[i].timestamp_ms):
                await asyncio.sleep(max(0.0, start + trace[i].timestamp_ms / 1e3 - time.monotonic()))
                tasks[i] = asyncio.create_task(run(trace[i]))
            outcomes = await asyncio.gather(*(tasks[i] for i in range(len(trace))))
        finally:
            for task in tasks.values():
                task.cancel()
        wall = time.monotonic() - start
    bar.close()
    return list(outcomes), wall


async def _one(
    session: aiohttp.ClientSession, url: str, req: TraceRequest, options: ReplayOptions, start: float,
) -> Outcome:
    slo_ttft = (options.slo_ttft_ms or float("inf")) / 1e3
    slo_tbt = (options.slo_tbt_ms or float("inf")) / 1e3
    outcome = Outcome(req.timestamp_ms / 1e3, req.input_length, req.output_length, slo_ttft, slo_tbt)
    prompt = prompt_tokens(req, options.block_tokens, options.salt)
    streamed = await client.stream(session, url, client.completion_body(options.model, prompt, req.output_length))
    outcome.sent_at, outcome.token_times = streamed.sent_at, streamed.token_times
    outcome.cached_tokens = streamed.cached_tokens
    outcome.rejected = streamed.rejected  # a 429: admission control turned it away
    outcome.failed = not streamed.rejected and not (streamed.ok and streamed.token_times)
    if outcome.rejected or outcome.failed:
        return outcome
    # TTFT counts from the trace's arrival time, not from the send: a request that
    # waited on the client side (the concurrency limit, a late event loop) waited for
    # its first token all the same, and the simulator counts it from arrival.
    token_times = streamed.token_times
    outcome.ttft_s = token_times[0] - (start + req.timestamp_ms / 1e3)
    outcome.end_s = token_times[-1] - start
    gaps = [b - a for a, b in itertools.pairwise(token_times)]
    outcome.tbt_mean_s, outcome.tbt_p90_s, outcome.tbt_tail_s = gap_stats(gaps)
    return outcome
