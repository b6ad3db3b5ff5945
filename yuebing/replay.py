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
import bisect
import dataclasses
import itertools
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from shared.predictor import Predictor
from yuebing.metrics import Outcome, gap_stats
from yuebing.sim import HostSharing, SimConfig, tail_compute_s
from yuebing.trace import TraceRequest

PRINTABLE = (32, 127)  # token ids of printable bytes in the default byte-level tokenizer
# calibrate's burst: groups of requests arriving at once, seconds apart; tokens each generates
BURST_GROUPS, BURST_GROUP_SIZE, BURST_GROUP_GAP_S, BURST_TOKENS = 4, 8, 5.0, 64


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

    limit = asyncio.Semaphore(options.concurrency)
    bar = tqdm(total=len(trace), desc="replay", unit="req", disable=not options.progress)
    timeout = aiohttp.ClientTimeout(total=options.timeout_s)
    # aiohttp's default pool of 100 connections would queue requests behind our own
    # limit and hide that wait from the measured TTFT.
    connector = aiohttp.TCPConnector(limit=options.concurrency)
    async with aiohttp.ClientSession(headers=_headers(options), timeout=timeout, connector=connector) as session:
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


async def _one(session: aiohttp.ClientSession, url: str, req: TraceRequest, options: ReplayOptions, start: float) -> Outcome:
    slo_ttft = (options.slo_ttft_ms or float("inf")) / 1e3
    slo_tbt = (options.slo_tbt_ms or float("inf")) / 1e3
    outcome = Outcome(req.timestamp_ms / 1e3, req.input_length, req.output_length, slo_ttft, slo_tbt)
    body = _body(options, prompt_tokens(req, options.block_tokens, options.salt), req.output_length)
    # TTFT counts from the trace's arrival time, not from the send: a request that
    # waited on the client side (the concurrency limit, a late event loop) waited for
    # its first token all the same, and the simulator counts it from arrival.
    arrival = start + req.timestamp_ms / 1e3
    outcome.sent_at = time.monotonic()
    try:
        token_times = outcome.token_times = await _stream(session, url, body, outcome)
    except (aiohttp.ClientError, TimeoutError):
        outcome.failed = True
        return outcome
    if not token_times and not outcome.rejected:
        outcome.failed = True
    if outcome.rejected or outcome.failed:
        return outcome
    outcome.ttft_s = token_times[0] - arrival
    outcome.end_s = token_times[-1] - start
    gaps = [b - a for a, b in itertools.pairwise(token_times)]
    outcome.tbt_mean_s, outcome.tbt_p90_s, outcome.tbt_tail_s = gap_stats(gaps)
    return outcome


def _headers(options: ReplayOptions) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if options.api_key:
        headers["Authorization"] = f"Bearer {options.api_key}"
    if options.slo_ttft_ms:
        headers["x-yuebing-slo-ttft-ms"] = str(options.slo_ttft_ms)
    if options.slo_tbt_ms:
        headers["x-yuebing-slo-tbt-ms"] = str(options.slo_tbt_ms)
    return headers


def _body(options: ReplayOptions, prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": options.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, outcome: Outcome | None = None) -> list[float]:
    """Send one streaming completion; the arrival time of every generated token.
    A 429 or another error marks `outcome` (rejected, failed) and returns what came."""
    token_times: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            if outcome is not None:
                outcome.rejected, outcome.failed = r.status == 429, r.status != 429
            return token_times
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                if outcome is not None:
                    outcome.failed = True
                return token_times
            if chunk.get("usage") and outcome is not None:
                outcome.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk.get("choices", []):
                now = time.monotonic()
                token_times.extend([now] * len(choice.get("token_ids", [])))
    return token_times


async def calibrate(
    url: str, options: ReplayOptions, predictor: Predictor, config: SimConfig, long_prompt: int = 2048, streams: int = 3,
    stream_tokens: int = 700,
) -> HostSharing:
    """How the live cluster's instances share their host, for the simulator: each
    figure from a few requests of its own, never from the trace under test.

    - prefill scale and first-token overhead: TTFT of a short and a long prompt
      alone, fitted as overhead + scale × the profile's prefill time (the profile
      times an engine alone in-process; the serving engine saves KV as it goes);
    - join overhead: long prompts sent at once prefill one after another; with
      max_tokens 2 each joins decode (KV load, tail, new sequence) while the next
      prefills, with max_tokens 1 none does: the widening of the gaps between their
      first tokens;
    - then one decode stream, and then `streams`, run while long prompts are
      prefilled one after another: the prefills' slowdown against alone (a fixed
      share while anything decodes, and a share per stream);
    - then a burst, groups of requests of varied lengths arriving at once
      (calibration_burst), replayed: step overhead, its decode gaps with no prefill
      beside them less the profile's step; decode beside a prefill, its gaps beside a
      prefill against those without one, batch size by batch size; joins, the steps
      where a request joined decode against the steps around them (join step) and its
      first gap against that step (hand-off: join_costs). Where the burst has too few
      gaps of a kind, lone decode streams (overhead) and the streams' gaps during the
      probes above (slowdown) stand in;
    - last the level: the prefill and decode scales at which the simulator, given
      all of the above, replays the burst with its live mean TTFT and mean TBT
      (level_to_burst).
    Prompts are fresh random tokens, so no cache helps."""
    rng = random.Random()
    repeats, rounds = 5, 2

    def prompt(n: int) -> list[int]:
        return [rng.randrange(*PRINTABLE) for _ in range(n)]

    async def ttft(session: aiohttp.ClientSession, n: int) -> float:
        sent = time.monotonic()
        times = await _stream(session, url, _body(options, prompt(n), 2))
        if not times:
            raise RuntimeError(f"calibration request of {n} tokens got no token from {url} (refused or failed: "
                               f"does the model's context hold {long_prompt + stream_tokens} tokens?)")
        return times[0] - sent

    async def burst_gaps(session: aiohttp.ClientSession, max_tokens: int, n: int = 5) -> list[float]:
        bodies = [_body(options, prompt(long_prompt), max_tokens) for _ in range(n)]
        runs = await asyncio.gather(*(_stream(session, url, b) for b in bodies))
        firsts = sorted(times[0] for times in runs if times)
        return [b - a for a, b in itertools.pairwise(firsts)]

    timeout = aiohttp.ClientTimeout(total=options.timeout_s)
    async with aiohttp.ClientSession(headers=_headers(options), timeout=timeout) as session:
        for _ in range(2):  # warm-up: first requests pay one-off costs
            await ttft(session, long_prompt)
        sizes = (long_prompt // 4, long_prompt)
        t_short = statistics.median([await ttft(session, sizes[0]) for _ in range(repeats)])
        alone_samples = [await ttft(session, sizes[1]) for _ in range(repeats)]
        alone = statistics.median(alone_samples)
        p_short, p_long = (predictor.prefill_s(n) for n in sizes)
        scale = max(0.5, (alone - t_short) / (p_long - p_short))
        overhead = max(0.0, alone - scale * p_long)
        without, with_join = [], []
        for _ in range(rounds):
            without += await burst_gaps(session, 1)
            with_join += await burst_gaps(session, 2)
        join_overhead = statistics.median(with_join) - statistics.median(without) if without and with_join else 0.0
        # Prefills beside one decode stream and beside `streams`, in alternating
        # rounds, each followed by prefills alone again (a shared machine's speed
        # drifts): a fixed slowdown while anything decodes, and a share per stream;
        # and the `streams` streams' gaps during a prefill against their gaps outside.
        windows, decoded, alone_again = [], [], []
        beside: dict[int, list[float]] = {1: [], streams: []}
        for n in [1, streams] * rounds:
            background = [asyncio.create_task(_stream(session, url, _body(options, prompt(long_prompt), stream_tokens)))
                          for _ in range(n)]
            await asyncio.sleep(0.5 + n * 2 * alone)  # their prefills, then some steps
            for _ in range(repeats):
                sent = time.monotonic()
                beside[n].append(await ttft(session, long_prompt))
                windows.append((sent, sent + beside[n][-1]))
            streamed = await asyncio.gather(*background)
            if n == streams:  # decode slowdown: a batch like the traces' (several streams)
                decoded += streamed
            alone_again += [await ttft(session, long_prompt) for _ in range(repeats)]

        # Decode beside a prefill as a burst of varied requests meets it (prefills of
        # several sizes queueing, requests joining decode, several streams relayed):
        # the probes above see only part of that slowdown.
        burst_trace = calibration_burst(rng, long_prompt, options.block_tokens)
        burst, _ = await replay(url, burst_trace, dataclasses.replace(options, salt=rng.getrandbits(32), progress=False))
        gaps = decode_gaps(burst)

        # The serving path's cost per step: the burst's steps with no prefill beside
        # them against the profile's step for their batch and context, measured under
        # the load the simulator will model. Too few such steps: lone streams instead,
        # attending to long prompts as the traces' requests do.
        idle = [g.seconds - predictor.decode_step_s(g.batch, g.context) for g in gaps
                if not (g.beside_prefill or g.joining)]
        if len(idle) < 20:
            idle = []
            for _ in range(3):
                stream = await _stream(session, url, _body(options, prompt(long_prompt), min(120, stream_tokens)))
                idle.append(statistics.mean(b - a for a, b in itertools.pairwise(stream[1:]))
                            - predictor.decode_step_s(1, long_prompt + 60))
        step_overhead = max(0.0, statistics.median(idle))
        handoff, join_step = join_costs(decode_joins(burst, predictor, options.block_tokens))
    alone_all = statistics.median(alone_samples + alone_again)  # before and after the rounds: drift cancels
    slowdown = {n: (statistics.median(t) - overhead) / max(1e-9, alone_all - overhead) - 1 for n, t in beside.items()}
    per_stream = max(0.0, (slowdown[streams] - slowdown[1]) / (streams - 1)) if streams > 1 else 0.0
    decode_slowdown = burst_decode_slowdown(decode_gaps_by_load(gaps))
    if decode_slowdown is None:  # the burst had too few gaps of some kind: the probes' figure
        decode_slowdown = _probe_decode_slowdown(decoded, windows)
    host = HostSharing(
        prefill_scale=scale,
        prefill_slowdown_while_decoding=max(0.0, slowdown[1] - per_stream),
        prefill_slowdown_per_decoding=per_stream,
        decode_slowdown_per_prefill=max(0.0, decode_slowdown),
        first_token_overhead_s=overhead,
        step_overhead_s=step_overhead,
        join_overhead_s=max(0.0, join_overhead),
        handoff_s=handoff,
        join_step_s=join_step,
    )
    return level_to_burst(host, burst_trace, burst, config, predictor)


def calibration_burst(rng: random.Random, long_prompt: int, block_tokens: int) -> list[TraceRequest]:
    """The calibration's own load: groups of requests arriving at once (as a trace's
    requests of one timestamp do), prompts of varied lengths, fresh blocks each."""
    burst, next_id = [], 0
    for group in range(BURST_GROUPS):
        for _ in range(BURST_GROUP_SIZE):
            n = rng.randrange(long_prompt // 8, long_prompt + 1)
            blocks = math.ceil(n / block_tokens)
            burst.append(TraceRequest(group * BURST_GROUP_GAP_S * 1e3, n, BURST_TOKENS, tuple(range(next_id, next_id + blocks))))
            next_id += blocks
    return burst


def level_to_burst(host: HostSharing, trace: Sequence[TraceRequest], live: Sequence[Outcome], config: SimConfig,
                   predictor: Predictor, rounds: int = 4) -> HostSharing:
    """The probes measure how the instances slow each other; what they cannot pin
    down is the level of the whole, which drifts with the machine: so the prefill and
    decode scales are set so that the simulator, replaying the calibration burst,
    gives the mean TTFT and mean TBT that the live cluster gave it."""
    from yuebing.metrics import summarize
    from yuebing.sim import simulate

    want = summarize(list(live), 1.0)
    if not want["completed"]:
        return host
    base = host.first_token_overhead_s
    for _ in range(rounds):
        got = simulate(trace, dataclasses.replace(config, host=host), predictor).result
        host = dataclasses.replace(
            host,
            prefill_scale=host.prefill_scale * max(1e-3, want["ttft_s"]["mean"] - base) / max(1e-3, got["ttft_s"]["mean"] - base),
            decode_scale=host.decode_scale * want["tbt_mean_s"]["mean"] / max(1e-6, got["tbt_mean_s"]["mean"]),
        )
    return host


def _probe_decode_slowdown(decoded: list[list[float]], windows: list[tuple[float, float]]) -> float:
    """The streams' gaps inside a probe's prefill against their gaps well outside one."""
    inside, outside = [], []
    for times in decoded:
        for a, b in itertools.pairwise(times):
            if any(s <= a and b <= e for s, e in windows):
                inside.append(b - a)
            elif not any(a < e + 0.1 and s < b for s, e in windows):  # nor the step where the probe joins decode
                outside.append(b - a)
    return statistics.mean(inside) / statistics.mean(outside) - 1 if inside and outside else 0.0


@dataclass(frozen=True)
class DecodeGap:
    """One gap between two decode tokens of a live request, and the load around it."""

    seconds: float
    batch: int  # requests decoding at its middle
    context: int  # their tokens then (prompts and what they had generated)
    beside_prefill: bool  # a request was waiting for its first token meanwhile
    joining: bool = False  # another request joined decode in this step (its first decode token ends it)


# Tokens of one decode step reach the client within this of each other.
SAME_STEP_S = 0.002


def decode_gaps(outcomes: Sequence[Outcome]) -> list[DecodeGap]:
    """A live run's decode gaps: each request's after its hand-off to decode. With one
    prefill instance, a request waiting for its first token means a prefill running
    (or queued)."""
    decoding = [o for o in outcomes if len(o.token_times) > 2]
    waiting = [(o.sent_at, o.token_times[0]) for o in outcomes if o.token_times]
    gaps = []
    for o in decoding:
        for a, b in itertools.pairwise(o.token_times[1:]):
            mid = (a + b) / 2
            batch = [x for x in decoding if x.token_times[1] <= mid <= x.token_times[-1]]
            context = sum(x.input_len + bisect.bisect(x.token_times, mid) for x in batch)
            busy = any(s < b and a < e for s, e in waiting)
            joining = any(x is not o and abs(x.token_times[1] - b) < SAME_STEP_S for x in decoding)
            gaps.append(DecodeGap(b - a, len(batch), context, busy, joining))
    return gaps


@dataclass(frozen=True)
class DecodeJoin:
    """A live request joining decode while others decode, seen from both sides."""

    first_gap: float  # its first token to its second (its first from decode)
    step: float  # the others' step that ends with its second token: the step it joined in
    step_before: float  # their step before that one, and after it
    step_after: float
    tail_s: float  # the profile's cost of computing its prompt tail in that step


def decode_joins(outcomes: Sequence[Outcome], predictor: Predictor, block_tokens: int) -> list[DecodeJoin]:
    """Every request of a live run that joined decode beside requests already decoding."""
    decoding = [o for o in outcomes if len(o.token_times) > 2]
    joins = []
    for j in decoding:
        second = j.token_times[1]
        seen = [(t[k] - t[k - 1], t[k - 1] - t[k - 2], t[k + 1] - t[k])
                for t in (o.token_times for o in decoding if o is not j)
                for k in range(3, len(t) - 1) if abs(t[k] - second) < SAME_STEP_S]
        if seen:
            step, before, after = (statistics.fmean(x) for x in zip(*seen))
            joins.append(DecodeJoin(second - j.token_times[0], step, before, after,
                                    tail_compute_s(predictor, j.input_len, block_tokens)))
    return joins


def join_costs(joins: Sequence[DecodeJoin], min_joins: int = 5) -> tuple[float, float]:
    """(handoff_s, join_step_s) for HostSharing from `decode_joins`: how much longer
    the step a request joins in is than the steps around it, beyond its tail's
    compute; and what its first gap holds besides that step and the wait for the step
    in progress when it came (half that step, on average). (0, 0) with too few joins."""
    if len(joins) < min_joins:
        return 0.0, 0.0
    join_step = statistics.fmean(j.step - (j.step_before + j.step_after) / 2 - j.tail_s for j in joins)
    handoff = statistics.fmean(j.first_gap - j.step - j.step_before / 2 for j in joins)
    return max(0.0, handoff), max(0.0, join_step)


def decode_gaps_by_load(gaps: Sequence[DecodeGap], max_batch: int = 6) -> dict[str, dict[str, float]]:
    """`decode_gaps` grouped by how many requests were decoding ("3/...", capped at
    `max_batch`) and whether a prefill ran beside ("/prefill", else "/idle"): what the
    simulator's step model can be checked against, condition by condition."""
    groups: dict[str, list[float]] = {}
    for g in gaps:
        if g.joining:  # a step another request joined in: join_costs models those
            continue
        groups.setdefault(f"{min(max_batch, g.batch)}/{'prefill' if g.beside_prefill else 'idle'}", []).append(g.seconds)
    return {k: {"gaps": len(v), "mean_ms": statistics.fmean(v) * 1e3} for k, v in sorted(groups.items())}


def burst_decode_slowdown(groups: dict[str, dict[str, float]], min_gaps: int = 20) -> float | None:
    """How much slower decode steps are while a prefill runs, from `decode_gaps_by_load`
    groups: per batch size, beside a prefill against idle, weighted by the gaps beside
    a prefill; None when no batch size has `min_gaps` of both."""
    pairs = []
    for key, busy in groups.items():
        batch, kind = key.split("/")
        idle = groups.get(f"{batch}/idle")
        if kind == "prefill" and idle and min(busy["gaps"], idle["gaps"]) >= min_gaps:
            pairs.append((busy["gaps"], busy["mean_ms"] / idle["mean_ms"] - 1))
    return sum(w * r for w, r in pairs) / sum(w for w, _ in pairs) if pairs else None


@dataclasses.dataclass
class Fidelity:
    result: dict  # what --json writes: per run and over the runs, live and simulated means, their ratios
    live: list[Outcome]  # per request, in trace order, run after run
    simulated: list[Outcome]


def fidelity(url: str, trace: Sequence[TraceRequest], options: ReplayOptions, sim_config: SimConfig, predictor: Predictor,
             repeats: int = 1) -> Fidelity:
    """The same trace on the live cluster and in the simulator: mean TTFT and TBT
    side by side. Each run calibrates anew (the simulator gets the host-sharing
    figures `calibrate` measures) and replays the trace with fresh prompts, so no
    cache carries over; over several runs the means of the runs' means are compared,
    since one live run on a shared machine moves by several per cent."""
    from yuebing.metrics import summarize
    from yuebing.sim import simulate

    runs, live_all, sim_all = [], [], []
    for i in range(repeats):
        run_options = dataclasses.replace(options, salt=options.salt + i)
        host = asyncio.run(calibrate(url, run_options, predictor, sim_config))
        outcomes, wall = asyncio.run(replay(url, trace, run_options))
        sim = simulate(trace, dataclasses.replace(sim_config, host=host), predictor)
        live, simulated = summarize(outcomes, wall), sim.result
        simulated.pop("load_over_time")
        runs.append({"live": live, "sim": simulated, "compare": _compare([live], [simulated]), "host": dataclasses.asdict(host),
                     "live_decode_gaps": decode_gaps_by_load(decode_gaps(outcomes))})
        live_all += outcomes
        sim_all += sim.outcomes
    result = {"requests": len(trace), "repeats": repeats, "runs": runs,
              "compare": _compare([r["live"] for r in runs], [r["sim"] for r in runs])}
    return Fidelity(result, live_all, sim_all)


def _compare(live: Sequence[dict], sim: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Mean TTFT and mean TBT, live against simulated, each the mean over runs."""
    compare = {}
    for key, field_ in (("ttft_mean_s", "ttft_s"), ("tbt_mean_s", "tbt_mean_s")):
        a, b = (statistics.fmean(r[field_]["mean"] for r in runs) for runs in (live, sim))
        compare[key] = {"live": a, "sim": b, "sim_over_live": b / a if a else 0.0}
    return compare


def plot_pairs(f: Fidelity, path: str) -> str:
    """Each request's TTFT and mean TBT, simulated against live: points off the
    diagonal show where (in which requests, at which load) the simulator errs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [(a, b) for a, b in zip(f.live, f.simulated) if a.completed and b.completed]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (name, scale, get) in zip(axes, (("TTFT (s)", 1.0, lambda o: o.ttft_s), ("mean TBT (ms)", 1e3, lambda o: o.tbt_mean_s))):
        xs = [get(a) * scale for a, _ in pairs]
        ys = [get(b) * scale for _, b in pairs]
        top = max(xs + ys, default=1.0) * 1.05
        ax.scatter(xs, ys, s=12, c=[a.arrival_s for a, _ in pairs], cmap="viridis")
        ax.plot([0, top], [0, top], color="grey", lw=0.8)
        for k in (0.85, 1.15):
            ax.plot([0, top], [0, top * k], color="grey", lw=0.5, ls=":")
        ax.set(xlabel=f"live {name}", ylabel=f"simulated {name}", xlim=(0, top), ylim=(0, top),
               title=f"{name.split(' (')[0]}: per request (colour: arrival), ±15 % dotted")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
