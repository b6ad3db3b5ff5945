"""Serving modes: where a request's prefill runs. Plain data in, a decision with its
rule and reason out, no I/O (the simulator and the live Conductor call the same code).

  adaptive       disaggregated while that serves a request within its SLOs; one it
                 would refuse (its prefill queue too long, or no decode batch with
                 room) runs both phases on whichever instance can serve it in time:
                 a decode instance's batch, or a prefill instance's own engine
  disaggregated  prefill on a prefill instance, decode on a decode instance (policy.py)
  colocated      every instance prefills and decodes in one engine, vLLM's chunked
                 prefill: each step mixes a prefill chunk into the decode batch
  conditional    disaggregated, except when a rule lets the prefill run on its decode
                 instance, inside the decode batch. Rules, by name:
    mooncake  unchunked (the uncached tokens fit one step's budget) AND the decode's
              predicted step with them added keeps the TBT SLO of those decoding there
    dynamo    fewer than N uncached tokens (Dynamo's disaggregated router)
    llmd      at most N uncached tokens on the chosen decode (llm-d's P/D threshold)

A mixed step's time (an assumption, documented where it is made: shared/predictor.py `mixed_step_s`):
its decode step plus its prefill chunks' marginal cost, the step's fixed cost (the
weights read once) paid once, the decode step's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from services.conductor.policy import Decision, Rejection, Request, joining_tbt_s, tbt_exceeded
from shared.predictor import Predictor, mixed_step_s, prefill_marginal_s, slo_step_tokens

MODES = ("adaptive", "disaggregated", "colocated", "conditional")


def step_budget(predictor: Predictor, step_tokens: int, batch: int, ctx_tokens: int, cached_tokens: int,
                slo_tbt_s: float) -> int:
    """Prefill tokens one step may compute beside `batch` decodes: the fixed budget
    less a token a decode (vLLM schedules decodes first), or with `step_tokens` 0
    the SLO-sized one."""
    if step_tokens:
        return step_tokens - batch
    return slo_step_tokens(predictor, batch, ctx_tokens, cached_tokens, slo_tbt_s)


# --- conditional disaggregation -----------------------------------------------
@dataclass(frozen=True)
class ModeParams:
    rule: str = "mooncake"
    step_tokens: int = 2048  # an engine step's token budget (vLLM's max_num_batched_tokens); 0: SLO-sized
    local_prefill_tokens: int = 1000  # dynamo / llmd: N, the threshold on uncached tokens


@dataclass(frozen=True)
class LocalPrefill:
    """The chosen decode instance as the rule sees it, for one request."""

    decode_id: str
    uncached_tokens: int  # prompt tokens it would compute (not in its own prefix cache)
    cached_tokens: int
    batch: int  # decoding there now
    ctx_tokens: int
    # The tightest TBT SLO of those decoding there (the request's own when the books
    # keep no SLO per request: a cluster with one SLO).
    slo_tbt_s: float
    slowdown: float = 1.0  # its steps observed over predicted (shared/calibration.py)
    remote_ttft_s: float = math.inf  # the disaggregated choice's predicted TTFT, for the record


@dataclass(frozen=True)
class ModeChoice:
    """Where the prefill runs, by which rule and why: what the Conductor counts and logs."""

    mode: Literal["disaggregated", "local", "colocated"]
    rule: str
    reason: str  # a counter's key: unchunked_within_tbt, would_chunk, breaks_tbt, below_threshold, above_threshold
    detail: str  # the figures compared, for the debug log and the response's `yuebing` field
    tbt_s: float = 0.0  # predicted step on the decode with the prefill in it (mooncake)
    ttft_s: float = 0.0  # predicted TTFT if it prefills there

    @property
    def local(self) -> bool:
        """Prefilled on its decode instance (conditional's local choice, or colocated)."""
        return self.mode != "disaggregated"

    @property
    def key(self) -> str:
        """The counter it adds to: decision and reason."""
        return f"{self.mode}:{self.reason}"

    def record(self) -> dict:
        """For the response's `yuebing` field and the debug log line."""
        return {"mode": self.mode, "rule": self.rule, "reason": self.reason, "detail": self.detail,
                "predicted_tbt_ms": round(self.tbt_s * 1e3, 1), "predicted_ttft_ms": round(self.ttft_s * 1e3, 1)}


ConditionalRule = Callable[[LocalPrefill, Predictor, ModeParams], ModeChoice]


def _local_ttft_s(x: LocalPrefill, predictor: Predictor) -> float:
    return x.slowdown * mixed_step_s(predictor, x.batch, x.ctx_tokens, [(x.uncached_tokens, x.cached_tokens)])


def mooncake_rule(x: LocalPrefill, predictor: Predictor, params: ModeParams) -> ModeChoice:
    """Mooncake's: on the decode only unchunked (one step computes it whole, the
    decodes' own tokens counted in the budget as vLLM schedules them first) and
    only if that step keeps the TBT SLO of those decoding there (with none decoding
    there, none is at stake)."""
    budget = step_budget(predictor, params.step_tokens, x.batch, x.ctx_tokens, x.cached_tokens, x.slo_tbt_s)
    if x.uncached_tokens > budget:
        return ModeChoice("disaggregated", "mooncake", "would_chunk",
                          f"{x.uncached_tokens} uncached tokens exceed the step budget of {budget} on {x.decode_id}")
    step = _local_ttft_s(x, predictor)
    if x.batch and step > x.slo_tbt_s:  # with nothing decoding there, no TBT is at stake
        return ModeChoice("disaggregated", "mooncake", "breaks_tbt",
                          f"predicted step {step * 1e3:.1f} ms on {x.decode_id} with the prefill exceeds "
                          f"the TBT SLO of {x.slo_tbt_s * 1e3:.1f} ms", tbt_s=step, ttft_s=step)
    return ModeChoice("local", "mooncake", "unchunked_within_tbt",
                      f"{x.uncached_tokens} tokens in one step of {step * 1e3:.1f} ms on {x.decode_id} "
                      f"(TBT SLO {x.slo_tbt_s * 1e3:.1f} ms; remote TTFT {x.remote_ttft_s * 1e3:.0f} ms)",
                      tbt_s=step, ttft_s=step)


def _threshold_rule(name: str, x: LocalPrefill, local: bool, bound: str) -> ModeChoice:
    detail = f"{x.uncached_tokens} uncached tokens on {x.decode_id} {bound}"
    if local:
        return ModeChoice("local", name, "below_threshold", detail)
    return ModeChoice("disaggregated", name, "above_threshold", detail)


def dynamo_rule(x: LocalPrefill, predictor: Predictor, params: ModeParams) -> ModeChoice:
    """Dynamo's disaggregated router: prefill remotely unless fewer than N tokens are
    left to compute after the decode worker's prefix hit. (Its early router also
    kept a request local when the global prefill queue was full; not modelled.)"""
    n = params.local_prefill_tokens
    local = x.uncached_tokens < n
    return _threshold_rule("dynamo", x, local, f"{'<' if local else '>='} {n}")


def llmd_rule(x: LocalPrefill, predictor: Predictor, params: ModeParams) -> ModeChoice:
    """llm-d's P/D decider: decode alone when the tokens the chosen decode does not
    hold are at most the threshold."""
    n = params.local_prefill_tokens
    local = x.uncached_tokens <= n
    return _threshold_rule("llmd", x, local, f"{'<=' if local else '>'} {n}")


CONDITIONAL_RULES: dict[str, ConditionalRule] = {"mooncake": mooncake_rule, "dynamo": dynamo_rule, "llmd": llmd_rule}


def choose_mode(x: LocalPrefill, predictor: Predictor, params: ModeParams) -> ModeChoice:
    """Conditional disaggregation: the named rule's answer for this request."""
    if params.rule not in CONDITIONAL_RULES:
        raise ValueError(f"unknown rule {params.rule!r}; choose from {', '.join(CONDITIONAL_RULES)}")
    return CONDITIONAL_RULES[params.rule](x, predictor, params)


DISAGGREGATED = ModeChoice("disaggregated", "disaggregated", "mode", "the cluster runs disaggregated")


# --- degraded: one role has no live instance ------------------------------------
Missing = Literal["died", "planner", "none"]


def fallback(missing: str, host_id: str, tbt_s: float = 0.0, ttft_s: float = 0.0, why: Missing = "died") -> ModeChoice:
    """While no instance of the `missing` role (prefill or decode) is live, an
    instance of the other (`host_id`) prefills and decodes the request on its one
    engine, as a colocated instance does, rather than the cluster refusing it. `why`
    none of the role is live: they died, the planner moved them all, or none was
    launched (adaptive mode's pooled fleet, `yuebing up --prefill 0`)."""
    other = "decode" if missing == "prefill" else "prefill"
    if why == "planner":
        return ModeChoice("local", "planner", f"no_{missing}_role", f"the planner moved every {missing} instance: "
                          f"{other} instance {host_id} serves it", tbt_s=tbt_s, ttft_s=ttft_s)
    if why == "none":
        return ModeChoice("local", "pooled", f"no_{missing}_instance", f"the cluster has no {missing} instance: "
                          f"{other} instance {host_id} serves it", tbt_s=tbt_s, ttft_s=ttft_s)
    return ModeChoice("local", "fallback", f"no_{missing}_live",
                      f"no live {missing} instance: {other} instance {host_id} serves it", tbt_s=tbt_s, ttft_s=ttft_s)


# Adaptive mode looks beyond the prefill instances once a prompt would wait this
# share of its TTFT SLO there: well before admission would refuse it, so that the
# other engines share a prefill-heavy load instead of the queue growing to the SLO.
SPILL_AT_TTFT_SHARE = 0.5
# ... and only where its prefill, with what is queued there, takes at most this many
# steps carrying chunks, each within the TBT SLO: a decode's TBT is judged on its
# slowest tenth of gaps, and a long prompt's chunks would fill many steps in a row.
# An engine that caps one prompt's chunk (ClusterConfig.decode_chunk_tokens) takes
# longer ones alone: each of its steps is then sized to the SLO.
SPILL_MIXED_STEPS = 2


def spills(disaggregated: Decision | Rejection, req: Request) -> bool:
    """Whether adaptive mode looks for another engine for `req`: disaggregation would
    refuse it, or keep it in a prefill queue past SPILL_AT_TTFT_SHARE of its TTFT SLO."""
    if isinstance(disaggregated, Rejection):
        return True
    return disaggregated.prefill.ttft_s > SPILL_AT_TTFT_SHARE * req.slo_ttft_s


def better_both(both: ColocatedChoice | Rejection, disaggregated: Decision | Rejection, req: Request) -> bool:
    """Whether a request is better off running both phases where colocated placement
    put it (`both`) than as disaggregation would serve it: there is such a place, its
    prefill takes a step or two there (any number of capped chunks, where the engine
    caps them), each within the TBT SLO of those decoding there (a spill must cost
    nobody their TBT), and disaggregation would refuse it or start it later."""
    if not isinstance(both, ColocatedChoice) or both.mixed_tbt_s > req.slo_tbt_s:
        return False
    if both.mixed_steps > SPILL_MIXED_STEPS and not both.chunked:
        return False
    return isinstance(disaggregated, Rejection) or both.ttft_s < disaggregated.prefill.ttft_s


def spill(host_id: str, why: str, tbt_s: float = 0.0, ttft_s: float = 0.0) -> ModeChoice:
    """Adaptive mode: a request disaggregation would refuse or keep waiting (`why`)
    runs both phases on `host_id`, which serves it sooner within its SLOs."""
    return ModeChoice("local", "adaptive", "spilled", f"disaggregated: {why}; {host_id} prefills and decodes it "
                      "sooner", tbt_s=tbt_s, ttft_s=ttft_s)


def missing_role(prefills: int, decodes: int) -> str | None:
    """The role a disaggregated request cannot find (None: both have a usable
    instance, or neither has: then nothing can serve it)."""
    if prefills and not decodes:
        return "decode"
    if decodes and not prefills:
        return "prefill"
    return None


# --- colocated instances -----------------------------------------------------
@dataclass(frozen=True)
class ColocatedLoad:
    """A colocated instance as placement sees it, for one request."""

    instance_id: str
    queued_tokens: int  # prompt tokens waiting to be prefilled there, ahead of this request
    prefix_blocks: int  # leading blocks of this request it holds
    batch: int  # decoding there now
    ctx_tokens: int
    capacity: int = 1 << 30  # requests its KV cache holds at once
    slowdown: float = 1.0
    queue_s: float = 0.0  # predicted work ahead besides `queued_tokens` (a prefill instance's own queue)
    decode_chunk_tokens: int = 0  # its engine's cap on one prompt's tokens per step (0: none)
    prefill_role: bool = False  # a prefill instance: its role's prompts keep coming, whatever it decodes
    # No prefill instance in the fleet (pooled, or none live): nothing joins its batch
    # from another engine's prefill, only spills, each judged with its queue.
    pooled: bool = False

    def cached_tokens(self, req: Request, block_size: int) -> int:
        """Prompt tokens of `req` it would not compute (at least one token always is)."""
        return min(self.prefix_blocks * block_size, req.prompt_len - 1)

    @property
    def chunked(self) -> bool:
        """A prompt joining here is prefilled alone, in capped chunks beside the batch:
        each step it adds keeps the cap's SLO however many it takes. (vLLM caps each
        prompt: beside another prompt's chunks a step could carry two caps' worth.)"""
        return bool(self.decode_chunk_tokens) and self.batch > 0 and self.queued_tokens == 0


@dataclass(frozen=True)
class ColocatedChoice:
    instance_id: str
    ttft_s: float  # predicted: the chunked prefill of what is queued and of this request
    cached_blocks: int
    tbt_s: float  # predicted decode step once it joins (no chunk beside it)
    mixed_tbt_s: float  # ... and the fullest step its prefill (after what is queued there) puts there
    mixed_steps: int = 1  # steps there that carry prefill chunks until its own is done
    chunked: bool = False  # ... each holding a capped chunk of its prompt alone (ColocatedLoad.chunked)

    def choice(self) -> ModeChoice:
        """As a serving-mode decision, for the counters and the response."""
        return ModeChoice("colocated", "colocated", "least_delay",
                          f"least predicted TTFT plus stall of the decodes running on {self.instance_id}",
                          tbt_s=self.tbt_s, ttft_s=self.ttft_s)


def colocated_ttft_s(load: ColocatedLoad, req: Request, predictor: Predictor, block_size: int, step_tokens: int) -> float:
    """Chunked prefill of the queue and then of this request's uncached tokens, each
    step beside the running decodes: as many steps as the budget (less one token per
    decode) needs, each costing the decode step, plus the tokens' marginal cost
    (counted as whole prompts: chunking moves attention between the n·p and n² terms,
    which the profile prices alike)."""
    cached = load.cached_tokens(req, block_size)
    new = req.prompt_len - cached
    steps = colocated_steps(load, req, predictor, block_size, step_tokens)
    fixed = predictor.decode_step_s(load.batch, load.ctx_tokens) if load.batch else predictor.prefill_coef[0] / 1e3
    work = prefill_marginal_s(predictor, [(load.queued_tokens, 0)]) + prefill_marginal_s(predictor, [(new, cached)])
    return load.queue_s + load.slowdown * (steps * fixed + work)


def colocated_steps(load: ColocatedLoad, req: Request, predictor: Predictor, block_size: int, step_tokens: int) -> int:
    """Steps that carry prefill chunks there until this request's prefill is done: the
    queue's uncomputed tokens and its own, a step's budget at a time."""
    cached = load.cached_tokens(req, block_size)
    budget = step_budget(predictor, step_tokens, load.batch, load.ctx_tokens, cached, req.slo_tbt_s)
    return math.ceil((load.queued_tokens + req.prompt_len - cached) / max(1, _capped(load, budget)))


def _capped(load: ColocatedLoad, budget: int) -> int:
    """A step's prefill tokens there: its budget, or the engine's cap on one prompt's
    chunk where this prompt is the only one prefilling beside a batch."""
    return min(budget, load.decode_chunk_tokens) if load.chunked else budget


def fullest_step_s(load: ColocatedLoad, req: Request, predictor: Predictor, block_size: int, step_tokens: int) -> float:
    """The longest step this prompt's prefill puts there: the batch with it joined, and
    a chunk of the queue's and its own uncomputed tokens, a step's budget at the most.
    A short prompt's one step costs far less than a full chunk's (on the development
    machine's CPU profile, 256 tokens 22 ms beside a batch of 4, 2,048 tokens 259 ms).

    On a prefill instance the request then decodes beside its role's prompts, which
    keep coming: any of its steps may carry a full budget of them. Priced as its own
    prompt's chunk instead, spills onto a prefill instance were admitted live (2 CPU
    engines, conversation trace at 12 req/s) and 15 of 18 missed the TBT SLO, mean
    token gaps up to 436 ms; all 22 spilled onto the decode instance kept it."""
    cached = load.cached_tokens(req, block_size)
    joined = (load.batch + 1, load.ctx_tokens + req.prompt_len)
    if _alone(load, req.prompt_len - cached, step_tokens):
        return load.slowdown * predictor.decode_step_s(*joined)
    budget = max(0, _capped(load, step_budget(predictor, step_tokens, *joined, 0, req.slo_tbt_s)))
    chunk = budget if load.prefill_role else min(budget, load.queued_tokens + req.prompt_len - cached)
    return load.slowdown * mixed_step_s(predictor, *joined, [(chunk, 0)])


def _alone(load: ColocatedLoad, new_tokens: int, step_tokens: int) -> bool:
    """Whether the prompt is all an idle engine of a pooled fleet runs, in one step: vLLM
    caps a prompt's chunk only beside other requests, and nobody decodes or prefills
    there to wait the step out. (Beside prefill instances, a transferred request could
    join meanwhile and wait out the whole step: its TBT is not judged against it, so
    there the step is priced as before, beside the joined batch.)"""
    idle = load.pooled and not (load.batch or load.queued_tokens or load.prefill_role)
    return idle and 0 < step_tokens and new_tokens <= step_tokens


def colocated_stall_s(load: ColocatedLoad, req: Request, predictor: Predictor, block_size: int) -> float:
    """Decode-seconds this prompt's prefill takes from the decodes running there: each
    of them waits out its chunks' marginal cost."""
    cached = load.cached_tokens(req, block_size)
    return load.slowdown * load.batch * prefill_marginal_s(predictor, [(req.prompt_len - cached, cached)])


def place_colocated(
    req: Request, loads: Sequence[ColocatedLoad], predictor: Predictor, block_size: int, step_tokens: int,
    admission: str = "none",
) -> ColocatedChoice | Rejection:
    """Cache- and interference-aware placement across colocated instances: the least
    delay in all, this request's predicted TTFT plus the stall its prefill puts on the
    decodes running there, among those with room. TTFT alone spreads prefill chunks
    into every batch in turn, and each one stalls all the decodes it lands beside
    (docs/benchmarks/_history_serving.md, "Goodput": 85 % within both SLOs where round robin met 97.5 %).
    With admission (any mode but "none", judged now: the prefill runs on the decode
    instance itself) a predicted TTFT or joining decode step over its SLO is refused."""
    loads = [x for x in loads if x.instance_id not in req.avoid and x.batch < x.capacity]
    if not loads:
        return Rejection("unavailable", "no colocated instance with room", retry_after_s=1.0)
    scored = [(colocated_ttft_s(x, req, predictor, block_size, step_tokens), x) for x in loads]
    ttft, best = min(scored, key=lambda t: (t[0] + colocated_stall_s(t[1], req, predictor, block_size), t[1].instance_id))
    tbt = best.slowdown * joining_tbt_s(predictor, best.batch, best.ctx_tokens, req.prompt_len)
    mixed = fullest_step_s(best, req, predictor, block_size, step_tokens)
    if admission != "none" and ttft > req.slo_ttft_s:
        return Rejection("overloaded", f"predicted TTFT {ttft * 1e3:.0f} ms exceeds the SLO of "
                         f"{req.slo_ttft_s * 1e3:.0f} ms", retry_after_s=ttft - req.slo_ttft_s, cause="ttft_slo")
    if admission != "none" and tbt > req.slo_tbt_s:
        return Rejection("overloaded", tbt_exceeded(tbt, req.slo_tbt_s, best.instance_id), retry_after_s=1.0,
                         cause="tbt_slo")
    return ColocatedChoice(best.instance_id, ttft, best.prefix_blocks, tbt, mixed,
                           colocated_steps(best, req, predictor, block_size, step_tokens), best.chunked)
