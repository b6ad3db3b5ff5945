"""How the live cluster's instances share their host, measured for the simulator
(`HostSharing`): each figure from a few requests of its own, never from the trace
under test. Prompts are fresh random tokens, so no cache helps.

`calibrate` runs five experiments in turn, each its own function here:

- `prefill_alone`: TTFT of a short and a long prompt alone, fitted as overhead +
  scale × the profile's prefill time (the profile times an engine alone in-process;
  the serving engine saves KV as it goes);
- `join_overhead`: long prompts sent at once prefill one after another; with
  max_tokens 2 each joins decode (KV load, tail, new sequence) while the next
  prefills, with max_tokens 1 none does: the widening of the gaps between their
  first tokens;
- `prefill_beside_decode`: one decode stream, and then `streams`, run while long
  prompts are prefilled one after another: the prefills' slowdown against alone (a
  fixed share while anything decodes, and a share per stream);
- `replay_burst`: groups of requests of varied lengths arriving at once
  (`calibration_burst`), replayed: step overhead (`step_overhead`: its decode gaps
  with no prefill beside them less the profile's step); decode beside a prefill (its
  gaps beside a prefill against those without one, batch size by batch size); joins
  (the steps where a request joined decode against the steps around them, and its
  first gap against that step: `yuebing.lab.gaps.join_costs`). Where the burst has
  too few gaps of a kind, lone decode streams (overhead) and the streams' gaps during
  the probes above (slowdown) stand in;
- `level_to_burst`: the prefill and decode scales at which the simulator, given all
  of the above, replays the burst with its live mean TTFT and mean TBT.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import aiohttp

from shared.predictor import Predictor
from yuebing import client
from yuebing.lab.gaps import (
    DecodeGap,
    burst_decode_slowdown,
    decode_gaps,
    decode_gaps_by_load,
    decode_joins,
    decode_slowdown_in_windows,
    join_costs,
)
from yuebing.lab.outcome import Outcome, summarize
from yuebing.lab.replay import ReplayOptions, connect, random_prompt, replay
from yuebing.lab.sim import simulate
from yuebing.lab.sim_config import HostSharing, SimConfig
from yuebing.lab.trace import TraceRequest

# The burst: groups of requests arriving at once, seconds apart; tokens each generates.
BURST_GROUPS, BURST_GROUP_SIZE, BURST_GROUP_GAP_S, BURST_TOKENS = 4, 8, 5.0, 64


@dataclass(frozen=True)
class ProbeSizes:
    """The sizes of the probes: prompts of `long_prompt` tokens (and a quarter of
    that), `streams` decode streams of `stream_tokens` tokens; each TTFT probe made
    `repeats` times, each experiment run in `rounds` rounds."""

    long_prompt: int = 2048
    streams: int = 3
    stream_tokens: int = 700
    repeats: int = 5
    rounds: int = 2


@dataclass
class Prober:
    """One calibration's requests to the cluster: fresh random prompts each."""

    session: aiohttp.ClientSession
    url: str
    options: ReplayOptions
    sizes: ProbeSizes
    rng: random.Random = field(default_factory=random.Random)

    async def stream(self, prompt_len: int, max_tokens: int) -> client.Streamed:
        body = client.completion_body(self.options.model, random_prompt(self.rng, prompt_len), max_tokens)
        return await client.stream(self.session, self.url, body)

    async def first_token(self, prompt_len: int) -> client.Streamed:
        """A prompt's prefill, timed to its first token; an error when none came."""
        streamed = await self.stream(prompt_len, 2)
        if not streamed.token_times:
            need = self.sizes.long_prompt + self.sizes.stream_tokens
            raise RuntimeError(f"calibration request of {prompt_len} tokens got no token from {self.url} (refused or "
                               f"failed: does the model's context hold {need} tokens?): {streamed.error}")
        return streamed

    async def ttfts(self, prompt_len: int) -> list[float]:
        """`repeats` prompts of `prompt_len` tokens, one after another: their TTFTs."""
        return [(await self.first_token(prompt_len)).ttft_s for _ in range(self.sizes.repeats)]


@dataclass(frozen=True)
class PrefillAlone:
    scale: float  # the serving engine's prefill time against the profile's
    overhead_s: float  # the serving path's, to the first token
    samples: list[float]  # TTFTs of long prompts alone


async def prefill_alone(prober: Prober, predictor: Predictor) -> PrefillAlone:
    """TTFT of a quarter-long and a long prompt, each alone: overhead + scale × the
    profile's prefill time."""
    lengths = (prober.sizes.long_prompt // 4, prober.sizes.long_prompt)
    t_short = statistics.median(await prober.ttfts(lengths[0]))
    samples = await prober.ttfts(lengths[1])
    t_long = statistics.median(samples)
    p_short, p_long = (predictor.prefill_s(n) for n in lengths)
    scale = max(0.5, (t_long - t_short) / (p_long - p_short))
    return PrefillAlone(scale, max(0.0, t_long - scale * p_long), samples)


async def join_overhead(prober: Prober, prompts: int = 5) -> float:
    """How much a request joining decode delays the prefill beside it: the gaps
    between the first tokens of long prompts sent at once, with a join (max_tokens 2)
    against without (max_tokens 1)."""

    async def first_token_gaps(max_tokens: int) -> list[float]:
        runs = await asyncio.gather(*(prober.stream(prober.sizes.long_prompt, max_tokens) for _ in range(prompts)))
        firsts = sorted(s.token_times[0] for s in runs if s.token_times)
        return [b - a for a, b in itertools.pairwise(firsts)]

    without, with_join = [], []
    for _ in range(prober.sizes.rounds):
        without += await first_token_gaps(1)
        with_join += await first_token_gaps(2)
    if not (without and with_join):
        return 0.0
    return max(0.0, statistics.median(with_join) - statistics.median(without))


@dataclass
class BesideDecode:
    ttfts: dict[int, list[float]]  # long prompts' TTFTs beside n decode streams, by n
    windows: list[tuple[float, float]] = field(default_factory=list)  # when those prefills ran
    decoded: list[list[float]] = field(default_factory=list)  # token times of the rounds of `streams` streams
    alone: list[float] = field(default_factory=list)  # long prompts' TTFTs alone, after each round


async def prefill_beside_decode(prober: Prober, alone_s: float) -> BesideDecode:
    """Prefills beside one decode stream and beside `streams`, in alternating rounds,
    each followed by prefills alone again (a shared machine's speed drifts)."""
    p = prober.sizes
    out = BesideDecode({1: [], p.streams: []})
    for n in [1, p.streams] * p.rounds:
        background = [asyncio.create_task(prober.stream(p.long_prompt, p.stream_tokens)) for _ in range(n)]
        await asyncio.sleep(0.5 + n * 2 * alone_s)  # their prefills, then some steps
        for _ in range(p.repeats):
            probe = await prober.first_token(p.long_prompt)
            out.ttfts[n].append(probe.ttft_s)
            out.windows.append((probe.sent_at, probe.token_times[0]))
        streamed = await asyncio.gather(*background)
        if n == p.streams:  # decode slowdown: a batch like the traces' (several streams)
            out.decoded += [s.token_times for s in streamed]
        out.alone += await prober.ttfts(p.long_prompt)
    return out


def prefill_slowdowns(alone: PrefillAlone, beside: BesideDecode, streams: int) -> tuple[float, float]:
    """(while anything decodes, per stream decoding): a prefill's slowdown beside 1
    and beside `streams` decode streams against alone, the serving path's overhead
    left out. Alone is timed before and after the rounds, so drift cancels."""
    alone_s = statistics.median(alone.samples + beside.alone)
    slowdown = {n: (statistics.median(t) - alone.overhead_s) / max(1e-9, alone_s - alone.overhead_s) - 1
                for n, t in beside.ttfts.items()}
    per_stream = max(0.0, (slowdown[streams] - slowdown[1]) / (streams - 1)) if streams > 1 else 0.0
    return max(0.0, slowdown[1] - per_stream), per_stream


def calibration_burst(rng: random.Random, long_prompt: int, block_tokens: int) -> list[TraceRequest]:
    """The calibration's own load: groups of requests arriving at once (as a trace's
    requests of one timestamp do), prompts of varied lengths, fresh blocks each."""
    burst, next_id = [], 0
    for group in range(BURST_GROUPS):
        for _ in range(BURST_GROUP_SIZE):
            n = rng.randrange(long_prompt // 8, long_prompt + 1)
            blocks = math.ceil(n / block_tokens)
            ids = tuple(range(next_id, next_id + blocks))
            burst.append(TraceRequest(group * BURST_GROUP_GAP_S * 1e3, n, BURST_TOKENS, ids))
            next_id += blocks
    return burst


async def replay_burst(prober: Prober) -> tuple[list[TraceRequest], list[Outcome]]:
    """Decode beside a prefill as a burst of varied requests meets it (prefills of
    several sizes queueing, requests joining decode, several streams relayed): the
    probes above see only part of that slowdown. The burst, and its live outcomes."""
    trace = calibration_burst(prober.rng, prober.sizes.long_prompt, prober.options.block_tokens)
    options = replace(prober.options, salt=prober.rng.getrandbits(32), progress=False)
    outcomes, _ = await replay(prober.url, trace, options)
    return trace, outcomes


async def step_overhead(prober: Prober, predictor: Predictor, gaps: Sequence[DecodeGap], min_gaps: int = 20) -> float:
    """The serving path's cost per decode step: the burst's steps with no prefill
    beside them against the profile's step for their batch and context, measured under
    the load the simulator will model. Too few such steps: lone streams instead,
    attending to long prompts as the traces' requests do."""
    idle = [g.seconds - predictor.decode_step_s(g.batch, g.context)
            for g in gaps if not (g.beside_prefill or g.joining)]
    if len(idle) < min_gaps:
        tokens = min(120, prober.sizes.stream_tokens)
        idle = []
        for _ in range(3):
            times = (await prober.stream(prober.sizes.long_prompt, tokens)).token_times[1:]
            step = statistics.mean(b - a for a, b in itertools.pairwise(times))
            idle.append(step - predictor.decode_step_s(1, prober.sizes.long_prompt + tokens // 2))  # at mid-stream
    return max(0.0, statistics.median(idle))


async def calibrate(
    url: str, options: ReplayOptions, predictor: Predictor, config: SimConfig, long_prompt: int = 2048,
    streams: int = 3, stream_tokens: int = 700,
) -> HostSharing:
    """The live cluster's `HostSharing`, from the experiments above in turn (module
    docstring), levelled on the burst for `config`'s simulator."""
    async with connect(options) as session:
        prober = Prober(session, url, options, ProbeSizes(long_prompt, streams, stream_tokens))
        for _ in range(2):  # warm-up: first requests pay one-off costs
            await prober.first_token(long_prompt)
        alone = await prefill_alone(prober, predictor)
        join_s = await join_overhead(prober)
        beside = await prefill_beside_decode(prober, statistics.median(alone.samples))
        burst_trace, burst = await replay_burst(prober)
        gaps = decode_gaps(burst)
        step_s = await step_overhead(prober, predictor, gaps)
    while_decoding, per_decoding = prefill_slowdowns(alone, beside, streams)
    decode_slowdown = burst_decode_slowdown(decode_gaps_by_load(gaps))
    if decode_slowdown is None:  # the burst had too few gaps of some kind: the probes' figure
        decode_slowdown = decode_slowdown_in_windows(beside.decoded, beside.windows)
    handoff, join_step = join_costs(decode_joins(burst))
    host = HostSharing(
        prefill_scale=alone.scale, prefill_slowdown_while_decoding=while_decoding,
        prefill_slowdown_per_decoding=per_decoding, decode_slowdown_per_prefill=max(0.0, decode_slowdown),
        first_token_overhead_s=alone.overhead_s, step_overhead_s=step_s, join_overhead_s=join_s, handoff_s=handoff,
        join_step_s=join_step,
    )
    return level_to_burst(host, burst_trace, burst, config, predictor)


def level_to_burst(host: HostSharing, trace: Sequence[TraceRequest], live: Sequence[Outcome], config: SimConfig,
                   predictor: Predictor, rounds: int = 4) -> HostSharing:
    """The probes measure how the instances slow each other; what they cannot pin
    down is the level of the whole, which drifts with the machine: so the prefill and
    decode scales are set so that the simulator, replaying the calibration burst,
    gives the mean TTFT and mean TBT that the live cluster gave it."""
    want = summarize(list(live), 1.0)
    if not want["completed"]:
        return host
    base = host.first_token_overhead_s
    for _ in range(rounds):
        got = simulate(trace, replace(config, host=host), predictor).result
        ttft_want, ttft_got = (max(1e-3, r["ttft_s"]["mean"] - base) for r in (want, got))
        tbt_want, tbt_got = want["tbt_mean_s"]["mean"], max(1e-6, got["tbt_mean_s"]["mean"])
        host = replace(host, prefill_scale=host.prefill_scale * ttft_want / ttft_got,
                       decode_scale=host.decode_scale * tbt_want / tbt_got)
    return host
