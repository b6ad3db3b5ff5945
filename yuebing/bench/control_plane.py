"""`yuebing bench control-plane`: what the control plane itself costs, with the
engines out of the way.

Each layout (gateways × Conductors) is a real `yuebing up` cluster whose prefill and
decode instances run the fake engine (shared/engine/fake.py: no model, a fixed token
stream, one token per request a step): the gateway, the Conductor, NATS and the
instances' services are the real processes. Clients hold `streams` streaming
completions open, spread over the gateways; or, with `rate_per_conductor`, start
requests on a fixed schedule (open loop), that rate for each Conductor of the layout.
After a warm-up, a window of `seconds` is measured: requests and tokens the clients
received, their inter-token gaps, and each process's CPU time from /proc, per request
and per streamed token. Then, the streams done, a window of `idle_s` with no load:
what each process spends doing nothing (heartbeats, timers, its loop), which, spread
over few tokens (real engines on a small machine stream a tenth of what the fake one
does), can be most of a figure per token. The load's own cost is the window's CPU
less that idle rate over the window, per token ("over idle").

A Conductor's capacity is read from its CPU: the decisions of the window over the
CPU seconds of the busiest Conductor, i.e. decisions per second with a core each.
On a machine whose cores the whole cluster shares, that is the figure to compare
across Conductor counts; the requests per second measured are the machine's.
A Conductor's CPU per decision falls as its load rises (more messages per wake of its
loop), so compare Conductor counts at the same load on each Conductor: that is what
`rate_per_conductor` offers. Back-to-back clients give every layout the same total
load, which the machine's cores bound, and so half as much to each of two Conductors.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from msgspec import Meta

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
LENIENT_SLOS = ("--slo-ttft-ms", "60000", "--slo-tbt-ms", "1000")
PROMPT = "Summarise the control plane's cost per request and per token. " * 2


@dataclass(frozen=True)
class ControlPlaneBench:
    """What to measure; each field is also a flag of `yuebing bench control-plane`."""

    gateways: Annotated[tuple[int, ...], Meta(description="gateway counts to run")] = (1, 2)
    conductors: Annotated[tuple[int, ...], Meta(description="Conductor counts to run")] = (1, 2)
    streams: Annotated[int, Meta(description="streaming completions the clients keep open")] = 32
    max_tokens: Annotated[int, Meta(description="tokens each completion streams")] = 256
    seconds: Annotated[float, Meta(description="the measured window of each layout, s")] = 20.0
    warmup_s: Annotated[float, Meta(description="load before the window, s")] = 5.0
    step_ms: Annotated[float, Meta(description="the fake engine's step: one token per request this often; "
                                         "0: real vLLM engines of the model, which then count too")] = 20.0
    prefill: Annotated[int, Meta(description="prefill instances")] = 1
    decode: Annotated[int, Meta(description="decode instances")] = 2
    rate_per_conductor: Annotated[
        float, Meta(description="open loop: requests/s started for each Conductor of a layout, at most `streams` "
                                "at once (an arrival finding them all busy is shed); 0: `streams` back to back")
    ] = 0.0
    conductor_sync_ms: Annotated[
        float, Meta(description="the cluster's --conductor-sync-ms (0: its default)")
    ] = 0.0
    idle_s: Annotated[
        float, Meta(description="a window with no load after the streams, s: each process's idle CPU, taken off "
                                "its figure per token as 'over idle' (0: none)")
    ] = 10.0
    against_vllm: Annotated[
        bool, Meta(description="with real engines (--step-ms 0): `vllm serve` on the same model too, alternated with "
                               "the first layout's cluster --rounds times; prints all of Yuebing's processes' CPU per "
                               "token over vLLM's API server's")
    ] = False
    rounds: Annotated[int, Meta(description="--against-vllm: the cluster and vllm serve, alternated, this many times")] = 2
    floor: Annotated[
        bool, Meta(description="--against-vllm: then vLLM's engine alone, as decode builds it, and its engine-core "
                               "client alone; prints the least Yuebing could spend a token: that client, vLLM's "
                               "server over its AsyncLLM, and the other processes as measured")
    ] = False

    def __post_init__(self) -> None:
        if min(self.gateways + self.conductors, default=0) < 1 or self.streams < 1 or self.max_tokens < 2:
            raise ValueError("gateways and conductors at least 1, streams at least 1, max_tokens at least 2")
        if self.seconds <= 0 or min(self.warmup_s, self.step_ms, self.rate_per_conductor, self.conductor_sync_ms,
                                    self.idle_s) < 0:
            raise ValueError("seconds must be positive; warmup_s, step_ms, rate_per_conductor, conductor_sync_ms "
                             "and idle_s not negative")
        if self.against_vllm and (self.step_ms or self.rounds < 1):
            raise ValueError("--against-vllm runs real engines (--step-ms 0), at least one round")
        if self.floor and not self.against_vllm:
            raise ValueError("--floor is a part of --against-vllm")


@dataclass
class Stream:
    """One completion as a client saw it."""

    started: float
    ended: float = 0.0
    token_times: list[float] = field(default_factory=list)
    ok: bool = False


@dataclass
class Clients:
    """Clients streaming completions over the gateways in turn: `streams` of them back
    to back, or, at a `rate` (requests/s), one started on each tick of a fixed schedule
    while fewer than `streams` are open."""

    urls: list[str]
    model: str
    spec: ControlPlaneBench
    rate: float = 0.0
    done: list[Stream] = field(default_factory=list)
    errors: int = 0
    shed: int = 0  # open loop: arrivals (warm-up included) that found `streams` requests in flight
    in_flight: int = 0

    async def run(self, until: float) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            if self.rate:
                await self._arrivals(session, until)
            else:
                await asyncio.gather(*(self._client(session, i, until) for i in range(self.spec.streams)))

    async def _client(self, session: Any, i: int, until: float) -> None:
        while time.monotonic() < until:
            await self._one(session, i)

    async def _arrivals(self, session: Any, until: float) -> None:
        """Open loop: a request every 1/rate s, whatever the ones before are doing."""
        started, first = 0, time.monotonic()
        tasks: set[asyncio.Task[None]] = set()
        while (due := first + started / self.rate) < until:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if self.in_flight < self.spec.streams:
                task = asyncio.create_task(self._one(session, started))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            else:
                self.shed += 1
            started += 1
        await asyncio.gather(*tasks)

    async def _one(self, session: Any, i: int) -> None:
        # ignore_eos: a real engine's streams run to max_tokens, as the fake engine's do.
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": self.spec.max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}
        s = Stream(time.monotonic())
        self.in_flight += 1
        try:
            async with session.post(f"{self.urls[i % len(self.urls)]}/v1/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        s.token_times.append(time.monotonic())
                s.ok = r.status == 200
        except Exception:  # counted, not fatal: the figures say how many failed
            s.ok = False
        finally:
            self.in_flight -= 1
        s.ended = time.monotonic()
        if s.ok:
            self.done.append(s)
        else:
            self.errors += 1


def cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system), s."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def role_of(process_name: str) -> str:
    """gateway-1 → gateway, decode-0 → decode, nats → nats."""
    return process_name.split("-")[0]


def window(streams: list[Stream], start: float, end: float) -> dict[str, Any]:
    """What the clients received inside [start, end): requests ended, tokens, gaps."""
    ended = [s for s in streams if start <= s.ended < end]
    tokens = sum(1 for s in streams for t in s.token_times if start <= t < end)
    gaps = sorted(b - a for s in ended for a, b in zip(s.token_times[1:], s.token_times[2:], strict=False))
    first = sorted(s.token_times[0] - s.started for s in ended if s.token_times)
    span = end - start
    return {
        "requests": len(ended), "tokens": tokens, "requests_per_s": len(ended) / span, "tokens_per_s": tokens / span,
        "itl_p50_ms": 1e3 * statistics.median(gaps) if gaps else 0.0,
        "itl_p99_ms": 1e3 * gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0,
        "ttft_p50_ms": 1e3 * statistics.median(first) if first else 0.0,
    }


def cpu_costs(before: dict[str, float], after: dict[str, float], requests: int, tokens: int,
              idle: dict[str, float] | None = None, seconds: float = 0.0) -> dict[str, Any]:
    """Each role's CPU (its processes summed): µs per request, per token, cores busy;
    with `idle` (each process's idle CPU, cores), also per token over what the role
    would have spent idle in the window's `seconds`."""
    roles: dict[str, list[float]] = {}
    for name in before:
        roles.setdefault(role_of(name), []).append(after[name] - before[name])
    per_req, per_tok = 1e6 / max(1, requests), 1e6 / max(1, tokens)
    costs = {role: {"us_per_request": per_req * sum(used), "us_per_token": per_tok * sum(used),
                    "busiest_s": max(used), "processes": len(used)} for role, used in sorted(roles.items())}
    if idle is not None:
        for role, c in costs.items():
            c["idle_cores"] = sum(cores for name, cores in idle.items() if role_of(name) == role)
            c["us_per_token_over_idle"] = per_tok * max(0.0, sum(roles[role]) - c["idle_cores"] * seconds)
    return costs


def cpu_all(pids: dict[str, int]) -> dict[str, float]:
    """Every process's CPU time so far, s."""
    return {name: cpu_s(pid) for name, pid in pids.items()}


async def idle_cores(pids: dict[str, int], seconds: float) -> dict[str, float] | None:
    """Each process's CPU over `seconds` with no load, in cores (None: no window)."""
    if seconds <= 0:
        return None
    before = cpu_all(pids)
    await asyncio.sleep(seconds)
    return {name: (used - before[name]) / seconds for name, used in cpu_all(pids).items()}


async def measure(urls: list[str], model: str, pids: dict[str, int], spec: ControlPlaneBench,
                  conductors: int = 1) -> dict[str, Any]:
    """Load the cluster, and measure one window after the warm-up."""
    clients = Clients(urls, model, spec, rate=spec.rate_per_conductor * conductors)
    start = time.monotonic() + spec.warmup_s
    end = start + spec.seconds
    load = asyncio.create_task(clients.run(end))
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    before = cpu_all(pids)
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    after = cpu_all(pids)
    await load  # the streams open at the end finish (outside the window)
    idle = await idle_cores(pids, spec.idle_s)
    seen = window(clients.done, start, end)
    costs = cpu_costs(before, after, seen["requests"], seen["tokens"], idle, spec.seconds)
    busiest = costs.get("conductor", {}).get("busiest_s", 0.0)
    return {**seen, "errors": clients.errors, "shed": clients.shed, "cpu": costs,
            "conductor_decisions_per_core_s": seen["requests"] / busiest if busiest else 0.0}


def conductor_counts(metrics: dict[str, str]) -> dict[str, int]:
    """Over the run, summed across the Conductors (each counts what it placed): the
    requests accepted, and the decode refusals, where decode's own check arbitrated
    two Conductors' placements onto the same headroom (or the books were wrong)."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    counts = {"accepted": 0, "decode_refusals": 0}
    for name, url in metrics.items():
        if role_of(name) != "conductor":
            continue
        with urlopen(url, timeout=5) as page:  # noqa: S310 (the launcher's own loopback URL)
            families = text_string_to_metric_families(page.read().decode())
        for sample in (x for family in families for x in family.samples):
            if sample.name == "yuebing_conductor_requests_total" and sample.labels.get("outcome") == "accepted":
                counts["accepted"] += int(sample.value)
            elif sample.name == "yuebing_conductor_wasted_prefills_total":
                counts["decode_refusals"] += int(sample.value)
    return counts


def cluster_flags(spec: ControlPlaneBench, gateways: int, conductors: int) -> list[str]:
    # Real engines: SLOs no closed loop of `streams` breaks, or admission's 429s (sent
    # again at once) would be what the window measures, not the streams.
    engines = ["--fake-engine-step-ms", str(spec.step_ms)] if spec.step_ms else [*LENIENT_SLOS]
    sync = ["--conductor-sync-ms", str(spec.conductor_sync_ms)] if spec.conductor_sync_ms else []
    return [*engines, *sync, "--prefill", str(spec.prefill), "--decode", str(spec.decode),
            "--gateways", str(gateways), "--conductors", str(conductors), "--gpus", "none"]


def run(spec: ControlPlaneBench, model: Path, work: Path, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every layout in turn, each on a cluster of its own."""
    from yuebing.launcher import up_launcher

    results, configs = [], []
    for gateways in spec.gateways:
        for conductors in spec.conductors:
            name = f"g{gateways}c{conductors}"
            configs.append(work / name / "cluster.json")
            say(f"{gateways} gateway(s), {conductors} Conductor(s): starting")
            with up_launcher(work, name, "--model", str(model), *cluster_flags(spec, gateways, conductors)):
                ready = json.loads((work / f"{name}.ready.json").read_text())
                pids = {n: p for n, p in ready["pids"].items() if not n.startswith("messenger")}
                result = asyncio.run(measure(ready["urls"], model.name, pids, spec, conductors))
                result.update(conductor_counts(ready["metrics"]))
            results.append({"gateways": gateways, "conductors": conductors, **result})
            say(line(results[-1]))
    if not spec.step_ms:  # real engines: how much of decode's figure is vLLM's own front end
        add_engine_alone(results, spec, configs[0], say)
    return results


def add_engine_alone(rows: list[dict[str, Any]], spec: ControlPlaneBench, config: Path,
                     say: Callable[[str], None]) -> None:
    """vLLM's engine built from `config` as decode builds it, measured alone and below its
    front end (yuebing/bench/engine_alone.py), added to every row."""
    from yuebing.bench import engine_alone

    say("vLLM's engine alone, as decode builds it: starting")
    streams = max(1, spec.streams // spec.decode)
    alone = engine_alone.run(config, streams, spec.max_tokens, spec.warmup_s, spec.seconds)
    say("... and its engine-core client alone, below AsyncLLM's front end: starting")
    core = engine_alone.run(config, streams, spec.max_tokens, spec.warmup_s, spec.seconds, raw=True)
    for r in rows:
        r["vllm_alone"], r["core_alone"] = alone, core


def against_vllm(spec: ControlPlaneBench, model: Path, work: Path, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """The first layout's cluster and `vllm serve` on the same model and settings, one
    after the other, `rounds` times, the same clients against each. Every one of the
    cluster's processes counts (its engines' cores run in children, as vLLM's does);
    of vLLM's, its API server's (HTTP, detokenization, AsyncLLM's front end)."""
    from shared.config import load_config
    from yuebing.bench import vllm_serve
    from yuebing.launcher import up_launcher

    gateways, conductors = spec.gateways[0], spec.conductors[0]
    rows: list[dict[str, Any]] = []
    for n in range(1, spec.rounds + 1):
        name = f"round{n}"
        say(f"round {n}: Yuebing, {gateways} gateway(s), {conductors} Conductor(s) …")
        with up_launcher(work, name, "--model", str(model), *cluster_flags(spec, gateways, conductors)):
            ready = json.loads((work / f"{name}.ready.json").read_text())
            config = load_config(str(work / name / "cluster.json"))
            rows.append({"system": "yuebing", "round": n,
                         **asyncio.run(measure(ready["urls"], model.name, ready["pids"], spec, conductors))})
        say(comparison_line(rows[-1]))
        say(f"round {n}: vllm serve …")
        with vllm_serve.servers(work / name, model, config.max_model_len, config.dtype) as (server,):
            pids = {"vllm": server.pid}
            rows.append({"system": "vllm serve", "round": n,
                         **asyncio.run(measure([server.url], model.name, pids, spec))})
        say(comparison_line(rows[-1]))
    if spec.floor:
        add_engine_alone([r for r in rows if r["system"] == "yuebing"], spec, work / name / "cluster.json", say)
    return rows


def floor(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """The least Yuebing's processes could spend a token, from one --against-vllm --floor
    run (means over its rounds): decode doing nothing but take its engine core's outputs
    (its engine-core client alone), a gateway spending exactly what vLLM's server spends
    over its AsyncLLM (HTTP, detokenization, the API's chunks: `vllm serve` less vLLM's
    engine alone), and the Conductor, messenger, prefill service and nats-server as
    measured. None without the engine-alone figures."""
    ours = [r for r in rows if r["system"] == "yuebing" and "core_alone" in r]
    theirs = [total_per_token(r) for r in rows if r["system"] == "vllm serve"]
    if not ours or not theirs:
        return None
    vllm = sum(theirs) / len(theirs)
    core, alone = ours[0]["core_alone"]["us_per_token"], ours[0]["vllm_alone"]["us_per_token"]
    others = sum(total_per_token(r) - sum(r["cpu"][role]["us_per_token"] for role in ("decode", "gateway"))
                 for r in ours) / len(ours)
    total = core + (vllm - alone) + others
    return {"core_client": core, "server_over_asyncllm": vllm - alone, "others": others, "total": total,
            "vllm": vllm, "ratio": total / vllm}


def floor_line(f: dict[str, float]) -> str:
    return (f"floor: decode's engine-core client alone {f['core_client']:.0f} + vLLM's server over its AsyncLLM "
            f"{f['server_over_asyncllm']:.0f} + Conductor, messenger, prefill and nats {f['others']:.0f} "
            f"= {f['total']:.0f} µs/token, {f['ratio']:.2f}× vLLM's API server ({f['vllm']:.0f})")


def total_per_token(row: dict[str, Any]) -> float:
    """All of a run's measured processes together, µs per streamed token."""
    return sum(c["us_per_token"] for c in row["cpu"].values())


def comparison_line(row: dict[str, Any]) -> str:
    roles = ", ".join(f"{role} {c['us_per_token']:.0f}" for role, c in row["cpu"].items())
    return (f"{row['system']} (round {row['round']}): {total_per_token(row):.0f} µs/token ({roles}), "
            f"{row['tokens_per_s']:.0f} tokens/s, ITL p50 {row['itl_p50_ms']:.1f} ms p99 {row['itl_p99_ms']:.1f} ms, "
            f"{row['errors']} failed")


def comparison_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: each round's Yuebing against vllm serve, by process and in all."""
    roles = sorted({role for r in rows if r["system"] == "yuebing" for role in r["cpu"]})
    head = ("| round | system | tokens/s | ITL p50 / p99 ms | " + " | ".join(f"{r} µs/token" for r in roles)
            + " | all µs/token | × vLLM's API server |")
    out = [head, "|" + "---|" * (6 + len(roles))]
    for n in sorted({r["round"] for r in rows}):
        pair = {r["system"]: r for r in rows if r["round"] == n}
        vllm = total_per_token(pair["vllm serve"]) if "vllm serve" in pair else 0.0
        for system, r in pair.items():
            cells = " | ".join(f"{r['cpu'][role]['us_per_token']:.0f}" if role in r["cpu"] else "—" for role in roles)
            ratio = f"{total_per_token(r) / vllm:.2f}" if vllm else "—"
            out.append(f"| {n} | {system} | {r['tokens_per_s']:.0f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} "
                       f"| {cells} | {total_per_token(r):.0f} | {ratio} |")
    return "\n".join(out)


def per_token(cost: dict[str, Any]) -> str:
    """A role's µs per token, and over its idle CPU where that was measured: '111 (95)'."""
    over = cost.get("us_per_token_over_idle")
    return f"{cost['us_per_token']:.0f}" + (f" ({over:.0f})" if over is not None else "")


def line(r: dict[str, Any]) -> str:
    cpu = r["cpu"]
    return (f"{r['gateways']}G {r['conductors']}C: {r['requests_per_s']:.1f} req/s, {r['tokens_per_s']:.0f} tokens/s, "
            f"ITL p50 {r['itl_p50_ms']:.1f} ms p99 {r['itl_p99_ms']:.1f} ms, gateway {per_token(cpu['gateway'])} "
            f"µs/token, decode {per_token(cpu['decode'])} µs/token (over idle), Conductor "
            f"{cpu['conductor']['us_per_request']:.0f} µs/request, {r['errors']} failed, {r['shed']} shed, "
            f"{r.get('decode_refusals', 0)} decode refusals of {r.get('accepted', 0)} placed")


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per layout, CPU per token (and over idle) and per request by process."""
    head = ("| gateways | Conductors | req/s | tokens/s | ITL p50 / p99 ms | gateway µs/token (over idle) "
            "| decode µs/token (over idle) | nats µs/token (over idle) "
            "| Conductor µs/request | prefill µs/request | Conductor decisions/s (a core each) | failed "
            "| shed | decode refusals / placed |")
    rows = [head, "|" + "---|" * 14]
    for r in results:
        c = r["cpu"]
        rows.append(
            f"| {r['gateways']} | {r['conductors']} | {r['requests_per_s']:.1f} | {r['tokens_per_s']:.0f} "
            f"| {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {per_token(c['gateway'])} "
            f"| {per_token(c['decode'])} | {per_token(c['nats'])} "
            f"| {c['conductor']['us_per_request']:.0f} | {c['prefill']['us_per_request']:.0f} "
            f"| {r['conductor_decisions_per_core_s']:.0f} | {r['errors']} | {r['shed']} "
            f"| {r.get('decode_refusals', 0)} / {r.get('accepted', 0)} |")
    alone = results[0].get("vllm_alone") if results else None
    if alone:
        rows.append(f"\nvLLM's AsyncLLM alone (the decode engine's config, {alone['tokens_per_s']:.0f} tokens/s, no "
                    f"Yuebing): {alone['us_per_token']:.0f} µs/token of its process, within decode's µs/token above")
    core = results[0].get("core_alone") if results else None
    if core:
        rows.append(f"its engine-core client alone (no output processor, {core['tokens_per_s']:.0f} tokens/s): "
                    f"{core['us_per_token']:.0f} µs/token; the difference is AsyncLLM's front end")
    return "\n".join(rows)
