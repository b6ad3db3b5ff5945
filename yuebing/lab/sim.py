"""A discrete-event simulation of a Yuebing cluster (`yuebing sim`).

Requests from a trace arrive at their timestamps; the Conductor's own code
(`services.conductor`: Scheduler, ClusterState, PrefixIndex) places them; prefill
instances work through their queues in engine steps (prefill time, and pull time for
blocks copied from another node, from the profile's time models): a whole prompt a
step, or with a step budget the queue's prompts in order as vLLM's chunked prefill
schedules them, so one step may end a prompt, compute short ones beside it and
start the next; decode instances run continuous batching, one step for the whole
batch, re-checking the TBT SLO when a request arrives (a refusal there is a wasted
prefill).

Decode is simulated in segments rather than token by token: between two changes of
a batch (a request joins or finishes) every step takes the same time, so a segment
of k steps is one event. That is what lets 23k requests replay in seconds.

Serving modes (`SimConfig.mode`, services/conductor/modes.py): a decode instance
also runs prefills itself, chunked into its steps as vLLM's chunked prefill does
(each step's time `mixed_step_s`, shared/predictor.py): every request on a colocated instance
(placed by `modes.place_colocated`), and under conditional disaggregation those the
rule keeps on their decode (`modes.choose_mode`, after the Scheduler's decision).

Shared hosts: on the local CPU cluster every instance shares one machine's cores,
so a prefill runs slower while decode batches run and decode steps slow while a
prefill runs, and the serving path (gateway, Conductor, NATS) adds a little to every
first token and step. `HostSharing` (yuebing/lab/sim_config.py) holds those figures,
measured on the live cluster (yuebing/lab/calibration.py); its defaults are separate
GPUs: no effect.

Caches: each prefill instance holds the blocks it computed (and those it pulled) in
its share of the node's DRAM, LRU-evicted at `pool_blocks`. The Conductor's index
*is* that cache here, as it is in the live system once the store publishes KV
events. `cache_aware` uses only a request's own instance's cache ("local");
`kvcentric` may pull from any instance ("global pool").
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from services.conductor import fairness, modes
from services.conductor.index import PrefixIndex
from services.conductor.planner import Arrival, PlannerParams
from services.conductor.policy import Decision, DecodeLoad, Params, Rejection, Request, Scheduler
from services.conductor.quotas import Quotas
from services.conductor.roles import DRAIN_POLL_S
from services.conductor.state import ClusterState
from shared.config import PLANNER_MODES
from shared.predictor import MOST_STEP_TOKENS, Predictor, default_decode_chunk_tokens, mixed_step_s
from shared.tenants import Tenant
from yuebing.lab.outcome import Outcome, segment_stats, summarize
from yuebing.lab.roles import RolePlan
from yuebing.lab.sim_config import SimConfig
from yuebing.lab.trace import TraceRequest, base_rate
from yuebing.progress import progress as progress_bar


@dataclass
class Tenancy:
    """The trace's tenants (SimConfig.tenants): whose each request is, drawn by share,
    and each one's load, which the Conductor's fairness judges by
    (services/conductor/fairness.py), in the Conductor's own books (its quotas')."""

    shares: list[tuple[Tenant, float]]
    rng: random.Random
    mark: float
    books: Quotas = field(default_factory=Quotas)

    def draw(self) -> str:
        if not self.shares:
            return ""
        return self.rng.choices([t.id for t, _ in self.shares], weights=[s for _, s in self.shares])[0]

    def judge(self, r: SimRequest, out: Decision | Rejection, now: float) -> Decision | Rejection:
        """`out`, or the refusal fairness makes of it; an admitted request is booked."""
        if not self.shares or not isinstance(out, Decision):
            return out
        tenants = {t.id: t for t, _ in self.shares}
        req = r.request
        pressure = max(out.prefill.ttft_s / req.slo_ttft_s, out.tbt_s / req.slo_tbt_s)
        loads = self.books.loads(now)
        refused = fairness.judge(tenants[r.outcome.tenant], pressure, loads,
                                 {t: tenants[t].weight for t in loads}, self.mark)
        if refused is not None:
            return Rejection("overloaded", refused.reason, 1.0, cause=refused.cause)
        tokens = r.trace.input_length + r.trace.output_length  # the sim knows what it will take
        self.books.admitted(r.outcome.tenant, r.rid, tokens, now, math.inf)
        return out

    def settled(self, rid: str) -> None:
        self.books.finished(rid)


@dataclass(slots=True)
class SimRequest:
    rid: str
    trace: TraceRequest
    arrival: float
    hashes: list[int]
    request: Request
    outcome: Outcome
    prefill_id: str = ""
    decode_id: str = ""
    pull_blocks: int = 0
    cached_tokens: int = 0  # reused, from its own cache or pulled
    prefilled: int = 0  # prompt tokens computed so far (chunked prefill)
    local_cached_tokens: int = 0  # reused from its own cache only
    local: bool = False  # prefilled on its decode (colocated) instance, inside the decode batch
    first_token_at: float = 0.0
    # Decode progress: tokens still to make, context attended, and the step times
    # it saw as (step seconds, steps) segments.
    remaining: int = 0
    ctx: int = 0
    segments: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class PrefillInstance:
    iid: str
    queue: deque[SimRequest] = field(default_factory=deque)  # its requests, the one(s) in the step first
    busy_s: float = 0.0
    step: list[tuple[SimRequest, int]] = field(default_factory=list)  # the step in progress: (request, tokens)
    done_at: float = 0.0  # when it ends
    version: int = 0  # invalidates a scheduled end when a join on the host delays it

    @property
    def busy(self) -> bool:
        return bool(self.step)


@dataclass
class DecodeInstance:
    iid: str
    batch: list[SimRequest] = field(default_factory=list)
    waiting: deque[SimRequest] = field(default_factory=deque)
    seg_start: float = 0.0
    seg_steps: int = 0
    step_s: float = 0.0
    version: int = 0  # invalidates a scheduled segment end when the batch changes
    join_s: float = 0.0  # prompt tails that joining requests compute in the next step
    pred_s: float = 0.0  # the running segment's step as the time model predicts it (no tails, no host)
    # Prefills it runs itself (colocated, or conditional's local ones), in order, and
    # the chunks of them the step in progress computes beside the batch.
    prefill_queue: deque[SimRequest] = field(default_factory=deque)
    step: list[tuple[SimRequest, int]] = field(default_factory=list)

    @property
    def busy(self) -> bool:
        """A segment is running: a batch decoding, or a step prefilling."""
        return bool(self.batch or self.step)


class Simulation:
    def __init__(self, config: SimConfig, predictor: Predictor) -> None:
        self.config = config
        self.predictor = Predictor(
            predictor.prefill_coef,
            predictor.decode_coef,
            kv_bytes_per_token=config.kv_bytes_per_token,
            transfer_bytes_per_s=config.bandwidth_gbps * 1e9,
        )
        params = Params(block_size=config.block_tokens, decode_time_s=config.decode_time_s,
                        learn_decode_time=config.learn_decode_time, shortlist=config.shortlist)
        self.scheduler = Scheduler(config.policy, config.admission, self.predictor, params, seed=config.seed)
        self.index = PrefixIndex(config.pool_blocks)
        self.state = ClusterState(self.predictor, params, self.index, decode_capacity=config.max_batch)
        if config.mode not in modes.MODES:
            raise ValueError(f"unknown mode {config.mode!r}; choose from {', '.join(modes.MODES)}")
        self.mode_params = modes.ModeParams(config.conditional_rule, config.step_tokens, config.local_prefill_tokens)
        self.mode_counts: Counter[str] = Counter()  # conditional: decisions by mode and reason
        self.decision_s: list[float] = []  # wall time of each disaggregated decision (loads, policy, admission)
        # What each decode instance holds in its own prefix cache (conditional's rules
        # ask how much of a prompt the chosen decode would compute).
        self.decode_index = PrefixIndex(config.pool_blocks)
        if config.mode == "colocated":  # as many instances (GPUs), each running both phases
            self.prefills = {}
            self.decodes = {f"c{i}": DecodeInstance(f"c{i}") for i in range(config.prefill + config.decode)}
        else:
            self.prefills = {f"p{i}": PrefillInstance(f"p{i}") for i in range(config.prefill)}
            self.decodes = {f"d{i}": DecodeInstance(f"d{i}") for i in range(config.decode)}
        for iid in self.prefills:
            self.state.add_instance("prefill", iid)
        for iid in self.decodes:
            self.state.add_instance("decode", iid)
        self.events: list[tuple[float, int, str, object, int]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.samples: list[dict] = []
        self.requests: list[SimRequest] = []
        self.unsettled = 0  # requests whose outcome is not final yet (arrived or not)
        self.max_model_len = 0
        self.decode_chunk_tokens = 0  # decode engines' cap on one prompt's chunk, as ClusterConfig.prompt_chunk_tokens
        if config.planner and config.mode not in PLANNER_MODES:
            raise ValueError("the planner moves instances between prefill and decode: adaptive or disaggregated mode")
        self.plan: RolePlan | None = None  # with config.planner, made in `run` (it needs the chunk cap)
        self.tenancy = Tenancy(config.tenant_shares, random.Random(config.seed), config.fair_share_mark)

    def _decode_chunk_tokens(self) -> int:
        """As the live cluster sizes it (0 where decode instances prefill nothing, or
        chunk as vLLM does by default): for a TBT SLO relative to each request, the
        SLO of a request of half the longest context."""
        c = self.config
        if c.mode not in ("adaptive", "conditional"):
            return 0
        if c.decode_chunk_tokens:
            return c.decode_chunk_tokens
        slo = c.slo_tbt_x * self.predictor.decode_step_s(1, self.max_model_len // 2) if c.slo_tbt_x else c.slo_tbt_s
        return default_decode_chunk_tokens(self.predictor, slo, self.max_model_len, c.step_tokens or MOST_STEP_TOKENS,
                                           c.block_tokens)

    # --- event queue --------------------------------------------------------
    def at(self, t: float, kind: str, obj: object, version: int = 0) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, obj, version))

    def run(self, trace: Sequence[TraceRequest], progress: bool = False) -> list[Outcome]:
        requests = self.requests = [self._request(i, r) for i, r in enumerate(trace)]
        # vLLM's max_model_len: the longest request it must serve, here the trace's.
        self.max_model_len = max((r.input_length + r.output_length for r in trace), default=0)
        self.decode_chunk_tokens = self._decode_chunk_tokens()
        if self.config.planner:
            self.plan = RolePlan.of(self.predictor, PlannerParams(
                max_batch=self.config.max_batch, empty_prefill=self.config.mode == "adaptive",
                step_tokens=self.config.step_tokens, chunk_tokens=self.decode_chunk_tokens))
        self.unsettled = len(requests)
        for r in requests:
            self.at(r.arrival, "arrive", r)
        if requests:
            self.at(0.0, "sample", None)
        if requests and self.plan is not None:
            self.at(self.plan.params.interval_s, "plan", None)
        bar = progress_bar(total=len(requests), desc=f"sim {self.config.policy}/{self.config.admission}", unit="req",
                           leave=False, enabled=progress)
        handlers = {
            "arrive": self._arrive,
            "prefill_done": self._prefill_done,
            "join": self._join,
            "segment_end": self._segment_end,
            "sample": self._sample,
            "deadline": self._deadline,
            "plan": self._plan,
            "drain": self._drain,
        }
        while self.events:
            t, _, kind, obj, version = heapq.heappop(self.events)
            self.now = t
            if kind == "arrive":
                bar.update()
            handlers[kind](obj, version)
        bar.close()
        return [r.outcome for r in requests]

    # --- requests -----------------------------------------------------------
    def _request(self, i: int, tr: TraceRequest) -> SimRequest:
        c = self.config
        full_blocks = tr.input_length // c.block_tokens
        hashes = list(tr.hash_ids[:full_blocks])
        ttft_slo = c.slo_ttft_x * self.predictor.prefill_s(tr.input_length) if c.slo_ttft_x else c.slo_ttft_s
        tbt_slo = c.slo_tbt_x * self.predictor.decode_step_s(1, tr.input_length) if c.slo_tbt_x else c.slo_tbt_s
        arrival = tr.timestamp_ms / 1e3 / c.speed
        req = Request(f"r{i}", tr.input_length, len(hashes), tr.output_length, ttft_slo, tbt_slo)
        outcome = Outcome(arrival, tr.input_length, tr.output_length, ttft_slo, tbt_slo, tenant=self.tenancy.draw())
        return SimRequest(f"r{i}", tr, arrival, hashes, req, outcome, remaining=tr.output_length - 1)

    def _arrive(self, r: SimRequest, _v: int) -> None:
        if self.config.mode == "colocated":
            self._arrive_colocated(r)
            return
        k, started = self.scheduler.shortlist, time.perf_counter()
        loads = self.state.prefill_loads(r.hashes, self.now, shortlist=k,
                                         skip=lambda iid: iid not in self.prefills or self._draining(iid))
        decode_loads = self.state.decode_loads(self.now, shortlist=k, skip=self._draining)
        out = self.tenancy.judge(r, self.scheduler.schedule(r.request, loads, decode_loads, self.now,
                                                            self.state.decode_time_s), self.now)
        self.decision_s.append(time.perf_counter() - started)  # the Conductor's own share of the wall time
        if self._elsewhere(r, out, decode_loads):
            return
        assert isinstance(out, Decision)
        prefix = next(x.prefix_blocks for x in loads if x.instance_id == out.prefill.instance_id)
        if out.prefill.pull_from:  # replication: the pulled blocks now live on the chosen instance too
            self.index.insert(out.prefill.instance_id, r.hashes[: out.prefill.cached_blocks])
        r.prefill_id, r.decode_id = out.prefill.instance_id, out.decode_id
        r.pull_blocks = out.prefill.pull_blocks
        reused = max(prefix, out.prefill.cached_blocks)
        r.cached_tokens = min(reused * self.config.block_tokens, r.trace.input_length - 1)
        r.local_cached_tokens = min(prefix * self.config.block_tokens, r.trace.input_length - 1)
        self._arrived(r)
        self.state.assign(r.request, r.hashes, out, self.now)
        if self.config.request_timeout_s:
            self.at(r.arrival + self.config.request_timeout_s, "deadline", r)
        inst = self.prefills[r.prefill_id]
        inst.queue.append(r)
        if not inst.busy:
            self._start_step(inst)
            self._host_changed()  # one more prefill running

    def _elsewhere(self, r: SimRequest, out: Decision | Rejection, decode_loads: Sequence[DecodeLoad]) -> bool:
        """Whether the request was refused, or placed other than disaggregated by the
        serving mode (adaptive's spill, conditional's rule): then it is settled here."""
        if self.config.mode == "adaptive" and modes.spills(out, r.request) and self._spill(r, out):
            return True
        if not isinstance(out, Decision):
            self._rejected(r, out)
            return True
        return self.config.mode == "conditional" and self._prefill_on_decode(r, out, decode_loads)

    def _rejected(self, r: SimRequest, out: Rejection) -> None:
        r.outcome.rejected = True
        self._arrived(r)
        if self.plan is not None and out.decode:
            self.plan.roles.refused_for_decode(self.now)
        self._settle(r)

    # --- roles that follow the load (yuebing/lab/roles.py) ---------------------
    def _draining(self, iid: str) -> bool:
        return self.plan is not None and iid in self.plan.draining

    def _arrived(self, r: SimRequest) -> None:
        """The planner's demand: what the request needed computed, and its lengths."""
        if self.plan is not None:
            t = r.trace
            self.plan.arrived(Arrival(self.now, t.input_length - r.cached_tokens, t.input_length, t.output_length),
                              r.request.slo_tbt_s)

    def _plan(self, _obj: object, _v: int) -> None:
        assert self.plan is not None
        roles = {**dict.fromkeys(self.prefills, "prefill"), **dict.fromkeys(self.decodes, "decode")}
        batches = {iid: len(d.batch) + len(d.waiting) for iid, d in self.decodes.items()}
        queues = {x.instance_id: x.queue_s for x in self.state.prefill_loads([], self.now)}
        if self.plan.decide(self.now, roles, batches, queues):
            self._drain(None, 0)
        self.plan.record(self.now, len(self.prefills))
        if self.unsettled:
            self.at(self.now + self.plan.params.interval_s, "plan", None)

    def _drain(self, _obj: object, poll: int) -> None:
        """Each draining instance whose old work is done takes its new role; checked
        again every DRAIN_POLL_S while one drains (`poll`: this call is that check)."""
        assert self.plan is not None
        self.plan.polling = self.plan.polling and not poll
        for iid, to in list(self.plan.draining.items()):
            if to == "prefill" and not self.state.decode.get(iid) and not self.decodes[iid].busy:
                del self.decodes[iid]
                self.state.remove_instance(iid)
                self.prefills[iid] = PrefillInstance(iid)
            elif to == "decode" and not self.prefills[iid].queue and not self.prefills[iid].busy:
                del self.prefills[iid]
                self.state.remove_instance(iid)
                self.decodes[iid] = DecodeInstance(iid)
            else:
                continue
            self.state.add_instance(to, iid)
            del self.plan.draining[iid]
        if self.plan.draining and not self.plan.polling:
            self.plan.polling = True
            self.at(self.now + DRAIN_POLL_S, "drain", None, 1)

    def _arrive_colocated(self, r: SimRequest) -> None:
        """Placed by `modes.place_colocated` on what each instance reports (its queue
        of prompt tokens, its batch), as a heartbeat would."""
        prefixes = self.index.prefix_blocks(r.hashes, self.decodes) if self.config.prefix_caching else {}
        loads = [self._colocated_load(inst, prefixes.get(iid, 0)) for iid, inst in self.decodes.items()]
        out = modes.place_colocated(r.request, loads, self.predictor, self.config.block_tokens, self.config.step_tokens,
                                    self.config.admission)
        if not isinstance(out, modes.ColocatedChoice):
            r.outcome.rejected = True
            self._settle(r)
            return
        self.mode_counts[out.choice().key] += 1
        self.index.insert(out.instance_id, r.hashes)  # its engine keeps the blocks it computes
        cached = min(out.cached_blocks * self.config.block_tokens, r.trace.input_length - 1)
        self._prefill_locally(r, out.instance_id, cached)

    def _colocated_load(self, inst: DecodeInstance, prefix_blocks: int) -> modes.ColocatedLoad:
        decoding = [*inst.batch, *inst.waiting]
        return modes.ColocatedLoad(inst.iid, sum(self._uncomputed(x) for x in inst.prefill_queue), prefix_blocks,
                                   len(decoding), sum(x.ctx for x in decoding), capacity=self.config.max_batch,
                                   decode_chunk_tokens=self.decode_chunk_tokens, pooled=not self.prefills)

    def _spill(self, r: SimRequest, out: Decision | Rejection) -> bool:
        """Adaptive mode, as the Conductor's (`modes.spills`, `modes.sooner`): a request
        disaggregation would refuse, or keep waiting, runs both phases on a decode
        instance that serves it in time (the simulator's prefill instances do not
        decode: only the live Conductor also spills onto them)."""
        prefixes = self.decode_index.prefix_blocks(r.hashes, self.decodes) if self.config.prefix_caching else {}
        loads = [self._colocated_load(inst, prefixes.get(iid, 0)) for iid, inst in self.decodes.items()
                 if not self._draining(iid)]
        both = modes.place_colocated(r.request, loads, self.predictor, self.config.block_tokens,
                                     self.config.step_tokens, self.config.admission)
        if not isinstance(both, modes.ColocatedChoice) or not modes.better_both(both, out, r.request):
            return False
        self.mode_counts["local:spilled"] += 1
        self._arrived(r)
        self._prefill_locally(r, both.instance_id, min(both.cached_blocks * self.config.block_tokens,
                                                       r.trace.input_length - 1))
        return True

    def _prefill_on_decode(self, r: SimRequest, out: Decision, decode_loads: Sequence[DecodeLoad]) -> bool:
        """Conditional disaggregation: the rule (`modes.choose_mode`) judges the chosen
        decode as the books see it now; a local prefill leaves the prefill books alone."""
        batch, tokens = next(x for x in decode_loads if x.instance_id == out.decode_id).at(self.now)
        prefix = self.decode_index.prefix_blocks(r.hashes, [out.decode_id])[out.decode_id]
        cached = min(prefix * self.config.block_tokens, r.trace.input_length - 1)
        x = modes.LocalPrefill(out.decode_id, r.trace.input_length - cached, cached, batch, tokens,
                               r.request.slo_tbt_s, remote_ttft_s=out.prefill.ttft_s)
        choice = modes.choose_mode(x, self.predictor, self.mode_params)
        self.mode_counts[choice.key] += 1
        if choice.local:
            self._prefill_locally(r, out.decode_id, cached)
        return choice.local

    def _prefill_locally(self, r: SimRequest, decode_id: str, cached_tokens: int) -> None:
        r.decode_id, r.local = decode_id, True
        r.cached_tokens = r.local_cached_tokens = cached_tokens
        self.state.assign_decode(r.request, decode_id, self.now)
        if self.config.request_timeout_s:
            self.at(r.arrival + self.config.request_timeout_s, "deadline", r)
        inst = self.decodes[decode_id]
        inst.prefill_queue.append(r)
        if inst.busy:
            self._cut_segment(inst)  # its first chunk goes into the next step
        else:
            self._start_segment(inst)

    # --- prefill ------------------------------------------------------------
    def _step_chunks(self, inst: PrefillInstance) -> list[tuple[SimRequest, int]]:
        """What the next engine step computes, as vLLM's scheduler picks it: with a
        step budget (chunk_tokens, vLLM's chunked prefill) the queue's requests in
        order, each as much of its prompt as the budget has left, so one step may end
        one prompt, compute a whole short one and start the next; without one, the
        head's whole prompt."""
        if not self.config.chunk_tokens:
            r = inst.queue[0]
            return [(r, self._uncomputed(r))]
        return fill_step(inst.queue, self.config.chunk_tokens, self._uncomputed)

    def _uncomputed(self, r: SimRequest) -> int:
        return r.trace.input_length - r.cached_tokens - r.prefilled

    def _start_step(self, inst: PrefillInstance) -> None:
        inst.step = self._step_chunks(inst)
        # A request's pulled blocks arrive before its first tokens are computed.
        pulls = sum(r.pull_blocks for r, _ in inst.step if not r.prefilled) * self.config.block_tokens
        seconds = self.predictor.prefill_step_s([(n, r.cached_tokens + r.prefilled) for r, n in inst.step])
        host = self.config.host
        decoding = sum(len(d.batch) for d in self.decodes.values())
        if decoding:
            seconds *= 1 + host.prefill_slowdown_while_decoding + host.prefill_slowdown_per_decoding * decoding
        seconds = seconds * host.prefill_scale + self.predictor.transfer_s(pulls)
        inst.busy_s += seconds
        inst.done_at, inst.version = self.now + seconds, inst.version + 1
        self.at(inst.done_at, "prefill_done", inst, inst.version)

    def _deadline(self, r: SimRequest, _v: int) -> None:
        """Its client gave up before the first token: the request leaves its prefill
        instance's queue. A step that computes only it stops (the work done so far
        is lost); a step it shares with others runs on without it."""
        if r.first_token_at or r.outcome.wasted_prefill:
            return
        if r.local:  # a step computing a chunk of it runs on (the batch is in it too)
            self.decodes[r.decode_id].prefill_queue.remove(r)
            r.outcome.failed = True
            self._settle(r)
            return
        inst = self.prefills[r.prefill_id]
        inst.queue.remove(r)
        if [x for x, _ in inst.step] == [r]:
            inst.busy_s -= inst.done_at - self.now
            inst.step, inst.version = [], inst.version + 1  # its prefill_done no longer counts
            if inst.queue:
                self._start_step(inst)
            else:
                self._host_changed()
        r.outcome.failed = True
        self._settle(r)

    def _delay_prefills(self, seconds: float) -> None:
        for inst in self.prefills.values():
            if inst.busy:
                inst.done_at, inst.busy_s = inst.done_at + seconds, inst.busy_s + seconds
                inst.version += 1
                self.at(inst.done_at, "prefill_done", inst, inst.version)

    def _prefill_done(self, inst: PrefillInstance, version: int) -> None:
        if version != inst.version:
            return  # delayed by a join on the host, and rescheduled
        step, inst.step = inst.step, []
        done = self._computed(step, inst.queue)
        if inst.queue:
            self._start_step(inst)
        else:
            self._host_changed()  # one prefill fewer
        for r in done:
            self._first_token(r)

    def _first_token(self, r: SimRequest) -> None:
        self.state.prefill_done(r.rid, self.now)
        r.first_token_at = self.now
        r.outcome.ttft_s = self.now - r.arrival + self.config.host.first_token_overhead_s
        r.outcome.cached_tokens = r.cached_tokens
        if r.local:  # its KV is where it decodes: it joins the batch's next step
            self._enter(self.decodes[r.decode_id], r)
            return
        # With layer-wise streaming only the last layer's KV is left to send now.
        delay = self.predictor.transfer_s(r.trace.input_length) / (32 if self.config.layerwise else 1)
        self.at(self.now + delay + self.config.host.handoff_s, "join", r)

    # --- decode -------------------------------------------------------------
    def _join(self, r: SimRequest, _v: int) -> None:
        inst = self.decodes[r.decode_id]
        batch, tokens = len(inst.batch) + 1, sum(x.ctx for x in inst.batch) + r.trace.input_length
        full = len(inst.batch) + len(inst.waiting) >= self.config.max_batch
        if full or self.predictor.decode_step_s(batch, tokens) > r.request.slo_tbt_s:  # the decode double-check
            if self.plan is not None:
                self.plan.roles.refused_for_decode(self.now)
            r.outcome.wasted_prefill = True
            r.outcome.ttft_s = None
            self._settle(r)
            return
        if r.remaining > 0 and self.config.host.join_overhead_s:
            self._delay_prefills(self.config.host.join_overhead_s)
        # Decode loads the request's KV from the pool (its prompt's tail too) and computes
        # its first token in its next step: that step is longer for the whole batch.
        if r.remaining > 0:
            inst.join_s += self.config.host.join_step_s
        if self._enter(inst, r):
            if not inst.busy:
                self._start_segment(inst)
            else:
                self._cut_segment(inst)

    def _enter(self, inst: DecodeInstance, r: SimRequest) -> bool:
        """It waits for the batch's next step (False: a one-token request, done).
        A request prefilled where it decodes skips the double check: the engine that
        prefilled it holds its KV, and waits for room as vLLM does."""
        if self.config.mode in ("conditional", "adaptive"):  # the decode's own prefix cache keeps its prompt
            self.decode_index.insert(inst.iid, r.hashes)
        if r.remaining <= 0:
            self._finish(r)
            return False
        r.ctx = r.trace.input_length + 1
        inst.waiting.append(r)
        return True

    def _start_segment(self, inst: DecodeInstance) -> None:
        while inst.waiting and len(inst.batch) < self.config.max_batch:
            inst.batch.append(inst.waiting.popleft())
        inst.step = self._local_prefills(inst)
        if inst.step:
            self._start_mixed_step(inst)
            return
        if not inst.batch:
            return
        steps = min(r.remaining for r in inst.batch)
        tokens = sum(r.ctx for r in inst.batch) + len(inst.batch) * steps // 2  # context at mid-segment
        host = self.config.host
        inst.pred_s = self.predictor.decode_step_s(len(inst.batch), tokens)
        inst.step_s = host.decode_scale * inst.pred_s + host.step_overhead_s
        if host.decode_slowdown_per_prefill:  # else not worth a look at every prefill instance
            inst.step_s *= 1 + host.decode_slowdown_per_prefill * self._prefilling()
        if inst.join_s:  # one longer step that carries the joiners' tails
            steps, inst.step_s, inst.join_s = 1, inst.step_s + inst.join_s, 0.0
        inst.seg_start, inst.seg_steps = self.now, steps
        inst.version += 1
        self.at(self.now + steps * inst.step_s, "segment_end", inst, inst.version)

    def _local_prefills(self, inst: DecodeInstance) -> list[tuple[SimRequest, int]]:
        """The prompts this step computes beside the batch. vLLM schedules the decodes
        first, a token each, then prefills in order, while its running requests (the
        batch, those waiting to join it and those prefilling) number under max_batch
        (vLLM's max_num_seqs: at 1, one request at a time). Chunked, as much of each
        as the step budget has left; unchunked (the paper's vLLM baseline), whole
        prompts, the batch waiting for the step."""
        room = self.config.max_batch - len(inst.batch) - len(inst.waiting)
        queue = list(itertools.islice(inst.prefill_queue, max(0, room)))
        if self.config.unchunked:  # vLLM's max_num_batched_tokens: at least the longest request
            return fill_step(queue, self.max_model_len, self._uncomputed, whole=True)
        others = len(inst.batch) + len(inst.waiting) + len(inst.prefill_queue) > 1  # vLLM caps only then
        return fill_step(queue, self._step_budget(inst), self._uncomputed, cap=self.decode_chunk_tokens if others else 0)

    def _step_budget(self, inst: DecodeInstance) -> int:
        if not inst.prefill_queue:
            return 0
        head = inst.prefill_queue[0]
        return modes.step_budget(self.predictor, self.config.step_tokens, len(inst.batch), sum(r.ctx for r in inst.batch),
                                 head.cached_tokens + head.prefilled, head.request.slo_tbt_s)

    def _start_mixed_step(self, inst: DecodeInstance) -> None:
        """One step: prefill chunks beside the batch, its time `mixed_step_s`
        (the shared-host figures are the disaggregated CPU cluster's, not applied)."""
        chunks = [(n, r.cached_tokens + r.prefilled) for r, n in inst.step]
        tokens = sum(r.ctx for r in inst.batch)
        inst.step_s = mixed_step_s(self.predictor, len(inst.batch), tokens, chunks) + inst.join_s
        inst.join_s = 0.0
        inst.seg_start, inst.seg_steps = self.now, 1
        inst.version += 1
        self.at(self.now + inst.step_s, "segment_end", inst, inst.version)

    def _prefilling(self) -> int:
        return sum(p.busy for p in self.prefills.values())

    def _host_changed(self) -> None:
        """A prefill started or stopped on a shared host: decode steps change speed."""
        if self.config.host.decode_slowdown_per_prefill:
            for inst in self.decodes.values():
                if inst.batch:
                    self._cut_segment(inst)

    def _cut_segment(self, inst: DecodeInstance) -> None:
        """A request is waiting to join: end the running segment after the step in progress."""
        done = math.ceil((self.now - inst.seg_start) / inst.step_s - 1e-9)
        if 0 < done < inst.seg_steps:
            inst.seg_steps = done
            inst.version += 1
            self.at(inst.seg_start + done * inst.step_s, "segment_end", inst, inst.version)

    def _segment_end(self, inst: DecodeInstance, version: int) -> None:
        if version != inst.version:
            return  # this segment was cut short and rescheduled
        k, still = inst.seg_steps, []
        if self.plan is not None and inst.pred_s and not inst.step:  # the planner's calibration: decode steps alone
            self.plan.paces.append((self.now, k * inst.step_s, k * inst.pred_s))
        for r in inst.batch:
            if not r.segments:  # the first decode token's gap: the wait since the first token
                r.segments.append((self.now - (k - 1) * inst.step_s - r.first_token_at, 1))
                if k > 1:
                    r.segments.append((inst.step_s, k - 1))
            else:
                r.segments.append((inst.step_s, k))
            r.remaining -= k
            r.ctx += k
            if r.remaining > 0:
                still.append(r)
            else:
                self._finish(r)
        inst.batch = still
        self._end_local_chunks(inst)
        self._start_segment(inst)

    def _end_local_chunks(self, inst: DecodeInstance) -> None:
        """The step's prefill chunks are computed: prompts that are done give their
        first token and wait for the next step."""
        step, inst.step = inst.step, []
        for r in self._computed(step, inst.prefill_queue):
            self._first_token(r)

    def _computed(self, step: list[tuple[SimRequest, int]], queue: deque[SimRequest]) -> list[SimRequest]:
        """A step's chunks are computed: the requests whose prompts are now done,
        out of the queue."""
        done = []
        for r, n in step:
            if r.outcome.failed:
                continue  # its client gave up during the step
            r.prefilled += n
            if not self._uncomputed(r):
                queue.remove(r)
                done.append(r)
        return done

    def _finish(self, r: SimRequest) -> None:
        o = r.outcome
        o.end_s = self.now
        o.tbt_mean_s, o.tbt_p90_s, o.tbt_tail_s = segment_stats(r.segments)
        self._settle(r, completed=True)

    def _settle(self, r: SimRequest, completed: bool = False) -> None:
        """Its outcome is final (served, refused or timed out): it leaves the books."""
        self.unsettled -= 1
        self.tenancy.settled(r.rid)
        self.state.finished(r.rid, self.now, completed)

    # --- load over time -----------------------------------------------------
    def _sample(self, _obj: object, _v: int) -> None:
        queue_s = [max(0.0, load.queue_s) for load in self.state.prefill_loads([], self.now)]
        tbts = [self.predictor.decode_step_s(len(d.batch), sum(r.ctx for r in d.batch)) for d in self.decodes.values()]
        self.samples.append(
            {
                "t": self.now,
                "prefill_queue_s": sum(queue_s) / len(queue_s) if queue_s else 0.0,  # none: colocated
                "decode_batch": sum(len(d.batch) for d in self.decodes.values()) / len(self.decodes),
                "decode_tbt_s": sum(tbts) / len(tbts) if tbts else 0.0,
                "prefill_instances": len(self.prefills),
            }
        )
        # Sample while any request is unsettled; not while only the deadlines of
        # served requests are left (no-ops that would draw a flat tail).
        if self.unsettled:
            self.at(self.now + self.config.sample_every_s, "sample", None)

    def replicas(self) -> dict[str, float]:
        """How many instances hold each indexed block: hot blocks spread (kvcentric)."""
        counts = self.index.holder_counts()
        if not counts:
            return {"blocks": 0, "mean": 0.0, "max": 0}
        return {"blocks": len(counts), "mean": sum(counts) / len(counts), "max": max(counts)}


def fill_step(queue: Iterable[SimRequest], budget: int, uncomputed: Callable[[SimRequest], int],
              whole: bool = False, cap: int = 0) -> list[tuple[SimRequest, int]]:
    """An engine step's prefill chunks as vLLM schedules them: the queue's requests in
    order, each as much of its prompt as the budget (and `cap`, vLLM's
    long_prefill_token_threshold) has left (chunked prefill); or, `whole` (no chunked
    prefill), whole prompts while they fit, the head's always."""
    chunks: list[tuple[SimRequest, int]] = []
    for r in queue:
        n = uncomputed(r)
        if budget <= 0 or (whole and chunks and n > budget):
            break
        chunks.append((r, n if whole else min(budget, n, cap or n)))
        budget -= chunks[-1][1]
    return chunks


@dataclass
class SimRun:
    result: dict  # the documented result object (what --json writes)
    outcomes: list[Outcome]  # one per request, for plots


def _tenant_summary(outcomes: Sequence[Outcome], duration_s: float) -> dict:
    s = summarize(outcomes, duration_s)
    return {k: s[k] for k in ("requests", "rejected", "slo_attainment", "goodput_rps")}


def simulate(trace: Sequence[TraceRequest], config: SimConfig, predictor: Predictor, progress: bool = False) -> SimRun:
    """Run one configuration."""
    sim = Simulation(config, predictor)
    started = time.perf_counter()
    outcomes = sim.run(trace, progress)
    wall = time.perf_counter() - started
    duration = max((o.end_s for o in outcomes), default=0.0) or max(o.arrival_s for o in outcomes)
    result = summarize(outcomes, duration)
    result.update(
        {
            "policy": config.policy,
            "admission": config.admission,
            "mode": mode_name(config),
            "mode_decisions": dict(sim.mode_counts),  # conditional: by decision and reason
            "prefill": config.prefill,
            "decode": config.decode,
            "speed": config.speed,
            "prefill_busy_s": sum(p.busy_s for p in sim.prefills.values()),
            **_hit_rates([r for r in sim.requests if r.prefill_id]),
            "replicas": sim.replicas(),
            "simulated_requests_per_s": len(trace) / wall if wall else 0.0,
            "decision_us": _decision_us(sim.decision_s),
            "wall_s": wall,
            "load_over_time": sim.samples,
            "decode_time_s": sim.state.decode_time_s,  # t_d at the end (learned with --learn-decode-time)
            "load_spread": load_spread(sim.samples, max((o.arrival_s for o in outcomes), default=0.0)),
            # --planner: its moves, and the prefill instances (draining ones counted in their new role) over time
            "planner_moves": sim.plan.roles.changes if sim.plan else 0,
            "planner_split": sim.plan.split if sim.plan else [],
            # --tenants: each tenant's share of the outcomes, summarized alike
            "tenants": {t.id: _tenant_summary([o for o in outcomes if o.tenant == t.id], duration)
                        for t, _ in config.tenant_shares},
        }
    )
    return SimRun(result, outcomes)


def _decision_us(seconds: list[float]) -> dict[str, float]:
    """The Conductor's decisions' wall time, µs: mean, p50 and p99."""
    if not seconds:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ordered = sorted(seconds)
    return {"mean": statistics.fmean(ordered) * 1e6, "p50": ordered[len(ordered) // 2] * 1e6,
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6}


def mode_name(config: SimConfig) -> str:
    """The serving mode as a table shows it: conditional with its rule, colocated
    without chunked prefill as the paper's baseline."""
    if config.mode == "conditional":
        return f"conditional/{config.conditional_rule}"
    return "colocated/unchunked" if config.mode == "colocated" and config.unchunked else config.mode


def _hit_rates(admitted: Sequence[SimRequest]) -> dict[str, float]:
    """Of prompt tokens of admitted requests: reused from the instance's own cache
    ("local"), and reused at all, pulls from other instances included ("global")."""
    prompt = max(1, sum(r.trace.input_length for r in admitted))
    return {
        "hit_rate_local": sum(r.local_cached_tokens for r in admitted) / prompt,
        "hit_rate_global": sum(r.cached_tokens for r in admitted) / prompt,
    }


def load_spread(samples: Sequence[dict], last_arrival_s: float) -> dict[str, float]:
    """Mean and standard deviation of the prefill queue and the decode batch over the
    middle 80 % of the arrival span (warm-up and drain left out): how much admission
    lets the load swing (Mooncake §7's oscillation under early rejection)."""
    window = [s for s in samples if 0.1 * last_arrival_s <= s["t"] <= 0.9 * last_arrival_s]
    out = {}
    for key in ("prefill_queue_s", "decode_batch"):
        values = [s[key] for s in window] or [0.0]
        out[f"{key}_mean"], out[f"{key}_std"] = statistics.fmean(values), statistics.pstdev(values)
    return out


def find_capacity(
    trace: Sequence[TraceRequest], config: SimConfig, predictor: Predictor, target: float = 0.9,
    lo: float = 0.05, hi: float = 64.0, steps: int = 12, on_probe: Callable[[dict], None] | None = None,
) -> dict:
    """The highest replay speed at which `target` of requests meet both SLOs (binary
    search on a log scale), as DistServe and Mooncake compare systems. `on_probe` sees
    each probe as it is made (a search takes a while)."""

    def attainment(speed: float) -> float:
        return simulate(trace, replace(config, speed=speed), predictor).result["slo_attainment"]

    found = {"policy": config.policy, "admission": config.admission, "mode": mode_name(config),
             "slo_tbt_s": config.slo_tbt_s, "target": target}
    if attainment(lo) < target:
        return found | {"capacity_speed": 0.0}
    probes: list[dict] = []

    def meets(speed: float) -> bool:
        probes.append({"speed": speed, "slo_attainment": attainment(speed)})
        if on_probe:
            on_probe(found | probes[-1])
        return probes[-1]["slo_attainment"] >= target

    lo, _ = log_bisect(lo, hi, steps, meets)
    return found | {"capacity_speed": lo, "capacity_rps": base_rate(trace) * lo, "probes": probes}


def log_bisect(lo: float, hi: float, steps: int, holds: Callable[[float], bool]) -> tuple[float, float]:
    """Narrow [lo, hi] on a log scale, `steps` probes, around where `holds` (true at
    `lo`, false at `hi`: attainment falls as the replay speeds up) turns false."""
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo, hi
