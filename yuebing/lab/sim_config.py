"""What the simulator simulates (yuebing/lab/sim.py): `SimConfig`, the cluster and its
clients, and `HostSharing`, how instances that share one machine slow each other.
Light to import: `yuebing sim` builds its flags from `SimConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from shared.config import FAIR_SHARE_MARK, REQUEST_TIMEOUT_S, SHORTLIST, SHORTLIST_DESCRIPTION
from shared.tenants import PRIORITIES, TENANT_ID, Tenant
from yuebing.lab.trace import TRACE_BLOCK_TOKENS


@dataclass(frozen=True)
class HostSharing:
    # A prefill runs slower while the host decodes: by a fixed share while anything
    # decodes (the decode engine's own thread takes a core) and by a share per
    # request decoding (its tokens are relayed by processes on the same cores).
    # Each running prefill slows decode steps by a share.
    prefill_slowdown_while_decoding: float = 0.0
    prefill_slowdown_per_decoding: float = 0.0
    decode_slowdown_per_prefill: float = 0.0
    prefill_scale: float = 1.0  # the serving engine's prefill time against the profile's
    decode_scale: float = 1.0  # the serving engine's decode step against the profile's
    first_token_overhead_s: float = 0.0  # serving path: arrival to prefill, first token back
    step_overhead_s: float = 0.0  # serving path: per decode step, token relay
    # A request joining decode (its KV loaded, its tail computed, a new sequence set
    # up, in processes beside the prefill engine's) delays the prefills running then.
    join_overhead_s: float = 0.0
    # The hand-off to decode: from the first token to the request reaching decode's
    # scheduler (the gateway's round trip to decode, the engine taking the request).
    handoff_s: float = 0.0
    # The step a request joins decode in is this much longer, for the whole batch,
    # than its prompt tail's compute: the request's KV loaded from the node pool into
    # the engine, its sequence set up.
    join_step_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prefill_scale <= 0 or self.decode_scale <= 0:
            raise ValueError("prefill_scale and decode_scale must be positive")
        if min(self.prefill_slowdown_while_decoding, self.prefill_slowdown_per_decoding,
               self.decode_slowdown_per_prefill, self.first_token_overhead_s, self.step_overhead_s,
               self.join_overhead_s, self.handoff_s, self.join_step_s) < 0:
            raise ValueError("host-sharing slowdowns and overheads cannot be negative")


@dataclass(frozen=True)
class SimConfig:
    """One simulated cluster and its clients. Fields with a description are
    `yuebing sim`'s flags (yuebing/flags.py)."""

    prefill: Annotated[int, Meta(description="prefill instances (0 in adaptive mode: a pooled fleet, each decode "
                                             "instance prefilling its own requests)")] = 8
    decode: Annotated[int, Meta(description="decode instances")] = 8
    policy: str = "kvcentric"
    admission: str = "none"
    shortlist: Annotated[int, Meta(description=SHORTLIST_DESCRIPTION)] = SHORTLIST
    # SLOs: absolute, or (when the *_x field is set) multiples of the request's own
    # unloaded time (prefill alone; one decode step alone), as in the paper.
    slo_ttft_s: float = 30.0
    slo_tbt_s: float = 0.1
    slo_ttft_x: Annotated[float, Meta(description="TTFT SLO as a multiple of the unloaded prefill time")] = 0.0
    slo_tbt_x: Annotated[float, Meta(description="TBT SLO as a multiple of the unloaded step time")] = 0.0
    block_tokens: int = TRACE_BLOCK_TOKENS
    pool_blocks: Annotated[int, Meta(description="KV blocks per prefill instance's DRAM share")] = 20_000
    kv_bytes_per_token: Annotated[int, Meta(description="KV bytes per token (LLaMA-8B, bf16)")] = 131_072
    bandwidth_gbps: Annotated[float, Meta(description="node-to-node KV bandwidth, GB/s")] = 25.0
    layerwise: Annotated[bool, Meta(
        description="KV streams to decode while prefill computes (--no-layerwise: sent after the last layer)")] = True
    chunk_tokens: Annotated[int, Meta(
        description="a prefill step's token budget, as vLLM's chunked prefill (0: a whole prompt a step)")] = 0
    max_batch: Annotated[int, Meta(
        description="requests an instance runs at once, as vLLM's max_num_seqs (a decode instance's batch; on one "
                    "that prefills too, its prefilling requests count)")] = 128
    # Where prefill runs (services/conductor/modes.py): disaggregated; colocated, the
    # prefill + decode instances all running both in one engine (as many GPUs);
    # conditional, disaggregated unless `conditional_rule` lets decode prefill it.
    mode: str = "disaggregated"
    conditional_rule: Annotated[str, Meta(
        description="conditional mode's rule: mooncake (unchunked and within the TBT SLO), dynamo or llmd")] = "mooncake"
    prefix_caching: Annotated[bool, Meta(
        description="colocated instances reuse the prefixes they computed (vLLM's automatic prefix caching, off by "
                    "default before its V1 engine)")] = True
    unchunked: Annotated[bool, Meta(
        description="colocated and local prefills compute whole prompts while the decode batch waits, as vLLM "
                    "without chunked prefill (the paper's vLLM baseline)")] = False
    step_tokens: Annotated[int, Meta(
        description="an engine step's token budget on decode and colocated instances (vLLM's max_num_batched_tokens; "
                    "0: sized each step to the TBT SLO)",
    )] = 2048
    decode_chunk_tokens: Annotated[int, Meta(
        description="on decode instances of adaptive and conditional modes, one prompt's tokens per step at the most "
                    "while others run, as the live cluster's (0: sized to the TBT SLO)")] = 0
    local_prefill_tokens: Annotated[int, Meta(
        description="dynamo and llmd rules' N: a decode instance prefills fewer than N uncached tokens itself "
                    "(dynamo), or at most N (llmd)")] = 1000
    decode_time_s: Annotated[float, Meta(description="predictive admission's t_d, s")] = 10.0
    learn_decode_time: Annotated[bool, Meta(
        description="learn t_d from completed decodes, starting at --decode-time (as the live Conductor does)")] = False
    speed: Annotated[float, Meta(description="replay speed factor")] = 1.0
    # A client that has no first token this long after sending gives up, as the live
    # gateway's request deadline makes it (a decode outlasting it is rare: 2,000
    # tokens at 100 ms is 200 s).
    request_timeout_s: Annotated[float, Meta(
        description="a client with no first token after this many s gives up (0: never), as the gateway's deadline",
    )] = REQUEST_TIMEOUT_S
    planner: Annotated[bool, Meta(
        description="move instances between prefill and decode as the load shifts (services/conductor/planner.py); "
                    "--prefill and --decode are then the starting split")] = False
    tenants: Annotated[str, Meta(
        description="tenants sharing the trace, name:share[:priority] comma-separated (e.g. steady:1,flood:4): each "
                    "request drawn to one by share, admitted with the Conductor's fairness (empty: none)")] = ""
    fair_share_mark: Annotated[float, Meta(
        description="with --tenants: past this share of a request's SLOs, fairness refuses (as the Conductor's)",
    )] = FAIR_SHARE_MARK
    sample_every_s: float = 10.0  # load-over-time sampling
    seed: int = 0
    host: HostSharing = HostSharing()

    @property
    def tenant_shares(self) -> list[tuple[Tenant, float]]:
        """`tenants` parsed: each tenant (its class) and its share of the requests."""
        out = []
        for item in filter(None, (part.strip() for part in self.tenants.split(","))):
            try:
                name, share, *priority = item.split(":")
                tenant = Tenant(name, priority=priority[0] if priority else "standard")  # type: ignore[arg-type]
                out.append((tenant, float(share)))
            except (ValueError, IndexError):
                raise ValueError(f"--tenants takes name:share[:priority], comma-separated; got {item!r}") from None
            if not TENANT_ID.fullmatch(name) or float(share) <= 0 or tenant.priority not in PRIORITIES:
                raise ValueError(f"--tenants: {item!r}: a tenant id, a positive share, a class of "
                                 f"{', '.join(PRIORITIES)}")
        return out

    @property
    def fewest_prefill(self) -> int:
        """Adaptive mode's decode instances prefill what no prefill instance takes: its
        fleet may be pooled, as `yuebing up --prefill 0` runs it."""
        return 0 if self.mode == "adaptive" else 1

    def __post_init__(self) -> None:
        self.tenant_shares  # noqa: B018 (checked at start: a bad --tenants fails before the run)
        if self.decode < 1 or self.prefill < self.fewest_prefill:
            raise ValueError("need at least one decode instance, and one prefill instance but in adaptive mode")
        if self.speed <= 0 or self.bandwidth_gbps <= 0 or self.pool_blocks <= 0:
            raise ValueError("speed, bandwidth and pool size must be positive")
        if self.shortlist < 0:
            raise ValueError("shortlist cannot be negative (0: every instance scored)")
        if self.decode_chunk_tokens < 0:
            raise ValueError("decode_chunk_tokens cannot be negative (0: sized to the TBT SLO)")
        if self.step_tokens < 0:
            raise ValueError("step_tokens cannot be negative (0: sized to the TBT SLO)")
        if self.request_timeout_s < 0:
            raise ValueError("request_timeout_s cannot be negative (0: no timeout)")
