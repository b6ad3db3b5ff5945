"""Every NATS subject and message schema of the cluster, in one place.

Messages are small JSON objects (msgspec structs). Each carries `v`, the schema
version; subjects carry it too, so that two versions can run side by side during a
rolling upgrade. Bulk KV bytes never travel here: they go messenger to messenger
over ZeroMQ.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import msgspec

from shared.tenants import DEFAULT_TENANT

SCHEMA_VERSION = 1
PREFIX = f"yb.v{SCHEMA_VERSION}"

# --- subjects -----------------------------------------------------------------
HEARTBEAT = f"{PREFIX}.heartbeat"  # every instance and messenger publishes here
SCHEDULE = f"{PREFIX}.conductor.schedule"  # request/reply, queue group "conductor"
CONDUCTOR_STATS = f"{PREFIX}.conductor.stats"  # request/reply: a ConductorStats
CANCEL = f"{PREFIX}.cancel"  # broadcast: whoever holds the request aborts it
KV_EVENTS = f"{PREFIX}.events.kv"  # blocks stored in / evicted from / removed from a node's pool
CONDUCTOR_QUEUE = "conductor"
# Broadcast among Conductors: what each one's books took in (a BookDigest), so that all
# of them hold the same books however the queue group spread the requests.
BOOK_DIGESTS = f"{PREFIX}.conductor.digests"


def updates_subject(conductor: str) -> str:
    """A request's progress (UpdateBatch), for the books of the Conductor that placed
    it (Placement.conductor): each Conductor reads its own share's updates."""
    return f"{PREFIX}.request.updates.{conductor}"


def prefill_subject(instance_id: str) -> str:
    return f"{PREFIX}.prefill.{instance_id}"


def decode_subject(instance_id: str) -> str:
    return f"{PREFIX}.decode.{instance_id}"


def messenger_subject(node: str) -> str:
    """A node messenger's control and stats (request/reply)."""
    return f"{PREFIX}.messenger.{node}"


def messenger_faults_subject(node: str) -> str:
    """A node messenger's fault switch (MessengerCommand "fault", request/reply): a
    subject of its own, so that NATS lets only the admin identity publish there."""
    return f"{PREFIX}.messenger.{node}.faults"


def stream_subject(gateway: str) -> str:
    """Where decode instances publish the tokens of one gateway's requests (TokenBatch):
    each gateway listens on its own, named at random when it starts."""
    return f"{PREFIX}.stream.{gateway}"


Role = Literal["prefill", "decode", "messenger"]
FinishReason = Literal["stop", "length", "abort"]


class Message(msgspec.Struct, kw_only=True):
    v: int = SCHEMA_VERSION


# --- liveness -----------------------------------------------------------------
class Heartbeat(Message):
    instance_id: str
    role: Role
    node: str
    pid: int
    seq: int
    sent_at: float
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    served_total: int = 0
    aborted_total: int = 0
    endpoint: str = ""  # messengers: where other messengers send blocks
    # Decode: its steps' observed time over the time model's (shared/calibration.py).
    slowdown: float = 1.0
    # Prefill: the pipeline stages of its engine; above 1 it is a CPP group (services/conductor/cpp.py).
    stages: int = 1
    # Stopping: it takes nothing new while its requests finish (shared/instance.py drain).
    draining: bool = False
    # When its NATS client last reconnected (unix time; 0: never): a message on the way
    # then may be lost, so a gateway waiting on it since before asks again
    # (services/gateway/pipeline.py).
    reconnected_at: float = 0.0


# --- scheduling ---------------------------------------------------------------
class ScheduleRequest(Message):
    request_id: str
    prompt_len: int
    block_hashes: list[str]  # the prompt's full blocks (shared/block_hash.py), hashed once by the gateway
    max_tokens: int
    deadline: float  # unix time after which nobody should work on the request
    slo_ttft_ms: float = 0.0  # 0: the cluster default
    slo_tbt_ms: float = 0.0
    # A retry (services/gateway/retry.py) asks again under a new request id, one per
    # attempt: `avoid` names the instances that failed the request so far, and
    # stage "decode" asks for a decode instance alone (the request's prefill is done:
    # its first decode refused it, or died under it); the Placement then has no prefill.
    avoid: list[str] = []
    stage: Literal["full", "decode"] = "full"
    tenant: str = DEFAULT_TENANT  # whose request (shared/tenants.py): its limits and class at admission


class Placement(Message):
    """Where one request runs, as the Conductor decided it; the gateway executes it.

    decode_node: the decode instance's node, where prefill streams the prompt's KV
    ("" when no decode runs: a one-token request ends at prefill). kv_blocks: the prompt's leading full blocks whose KV prefill sends to decode's
    node (0 when no decode runs). Remote reuse: prefill first pulls the first
    `pull_blocks` prompt blocks from node `pull_from`'s pool, but for the first
    `pull_skip`, which the prefill node's pool holds already. prefill_id is "" when
    only a decode instance was asked for (ScheduleRequest.stage "decode")."""

    prefill_id: str
    decode_id: str
    decode_node: str
    conductor: str  # the Conductor that placed it: the request's updates go to it (updates_subject)
    kv_blocks: int = 0
    pull_from: str = ""
    pull_blocks: int = 0
    pull_skip: int = 0
    # The decode instance prefills the prompt itself, in its decode batch (serving
    # mode colocated, or conditional's local choice: services/conductor/modes.py);
    # prefill_id is then "".
    local_prefill: bool = False


class ModeRecord(msgspec.Struct, kw_only=True):
    """Where a request's prefill runs and why, as the Conductor decided it: counted
    by the gateway (by mode, rule and reason) and shown in the response's `yuebing`
    field. mode: "disaggregated", "local" (on its decode instance) or "colocated"."""

    mode: str
    rule: str
    reason: str
    detail: str = ""
    predicted_ttft_ms: float = 0.0
    predicted_tbt_ms: float = 0.0


class ScheduleReply(Message):
    request_id: str
    accepted: bool
    placement: Placement | None = None  # when accepted
    predicted_ttft_ms: float = 0.0
    predicted_tbt_ms: float = 0.0
    # When not accepted: "overloaded" (HTTP 429), "quota" (HTTP 429: the tenant's
    # own limit, `quota` which) or "unavailable" (HTTP 503).
    rejection: Literal["", "overloaded", "quota", "unavailable"] = ""
    reason: str = ""
    retry_after_s: float = 0.0
    mode: ModeRecord | None = None  # when accepted
    # With a CPP group live: "cpp:faster", "single:short_input" or "single:group_slower_now" (policy.Route).
    route: str = ""
    quota: Literal["", "requests", "tokens", "streams"] = ""  # rejection "quota": the limit reached
    limits: list[RateLimit] = []  # the tenant's per-minute quotas after this request (none: no limits)


class Booking(Message):
    """A placement one Conductor made, for the other Conductors' books (each books its
    own as it decides). kind: "disaggregated" (prefill then decode), "local" (the
    decode instance prefills it itself) or "decode" (a decode instance alone, for a
    request already prefilled)."""

    conductor: str  # who placed it
    kind: Literal["disaggregated", "local", "decode"]
    request_id: str
    prompt_len: int
    max_tokens: int
    block_hashes: list[str]
    deadline: float  # unix time: the books forget it then, whatever updates come
    decode_id: str
    prefill_id: str = ""
    ttft_s: float = 0.0  # predicted
    tbt_s: float = 0.0
    cached_blocks: int = 0  # disaggregated: blocks its prefill does not compute
    pull_from: str = ""
    pull_blocks: int = 0
    uncached_tokens: int = 0  # local: the prompt tokens its decode instance computes
    age_s: float = 0.0  # in a BookDigest: how long ago it was booked


class Admission(Message):
    """A request one Conductor admitted against its tenant's quotas, for the others'
    counts (services/conductor/quotas.py)."""

    tenant: str
    request_id: str
    tokens: int  # prompt plus max_tokens, reserved
    deadline: float  # unix time: its stream counts until its end or then
    age_s: float = 0.0  # in a BookDigest: how long ago it was admitted


class RateLimit(Message):
    """One of a tenant's per-minute quotas as it stands: OpenAI's x-ratelimit-* headers."""

    name: Literal["requests", "tokens"]
    limit: int
    remaining: int
    reset_s: float


class BookDigest(Message):
    """What one Conductor's books took in since its last digest, for the others: its
    own placements, and the updates of its requests (which reach only it), each
    dated by its age. Sent every sync interval, and at least every heartbeat
    interval: a Conductor whose digests stop is gone (services/conductor/sync.py)."""

    conductor: str
    incarnation: str  # the sending process's, random at its start: a restart within the timeout is a new one
    bookings: list[Booking] = []
    updates: list[RequestUpdate] = []
    admissions: list[Admission] = []  # against tenants' quotas


class ConductorStats(Message):
    accepted: int
    rejected: int
    wasted_prefill: int
    pool_blocks: int  # distinct blocks in the cluster-wide pool index
    pool_nodes: list[str]  # nodes whose pools it indexes
    decode_time_ms: float = 0.0  # t_d its books use now (learned from completed decodes)
    # Per live instance, what its predicted times are multiplied by now (shared/calibration.py).
    slowdown: dict[str, float] = {}
    # Requests refused since it started, by cause (ttft_slo, tbt_slo, no_room, no_instance).
    rejections: dict[str, int] = {}
    # Serving-mode decisions since it started, by "mode:reason" (ModeRecord).
    modes: dict[str, int] = {}
    # With a CPP group live, where each prefill went and why, by "cpp|single:reason" (policy.Route).
    routes: dict[str, int] = {}
    # The planner's (services/conductor/roles.py): instances serving another role than
    # they were launched in, those moving (to their new role), and moves so far.
    roles: dict[str, str] = {}
    draining: dict[str, str] = {}
    role_changes: int = 0
    conductor: str = ""  # which Conductor answered (several may run)
    # Requests in its books, per instance (a prefill's queue, a decode's batch): the
    # same on every Conductor once their bookings have crossed.
    booked: dict[str, int] = {}
    peer_bookings: int = 0  # bookings taken from the other Conductors since it started


# --- generation ---------------------------------------------------------------
class Sampling(msgspec.Struct, kw_only=True):
    """A request's sampling as the client asked it, for the whole output (prefill and
    decode each derive their share: shared/engine/llm.py `sampling_params`)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    bad_words: list[str] = []
    allowed_token_ids: list[int] | None = None
    json_object: bool = False  # response_format json_object: the output is a JSON object
    json_schema: str = ""  # response_format json_schema: the schema (JSON text) the output follows
    structural_tag: str = ""  # tool calling's grammar (vLLM's structural tag, JSON text), as its parser set it
    logprobs: int | None = None  # each token's log probability and this many alternatives' (None: none)
    n: int = 1  # outputs to sample from the prompt (vLLM's parallel sampling, on decode)
    prompt_logprobs: int | None = None  # each prompt token's log probability, computed where it is prefilled
    priority: int = 0  # vLLM's: lower runs first in an engine's queue, then by arrival

    @property
    def history_dependent(self) -> bool:
        """Whether a token's distribution depends on the output before it (beyond what
        the prompt holds): presence/frequency penalties, multi-token bad words and
        structured output (a tool call's grammar included); and n > 1, where each output has its own first token.
        Decode then runs on the prompt alone for the whole output and the client's
        tokens all come from decode (the first token prefill made only warms the
        KV); otherwise decode continues from prefill's first token, which is exact
        for everything else (repetition_penalty counts prompt and output alike).
        This is the one place the rule is written."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.bad_words or self.json_object or self.json_schema
            or self.structural_tag or self.n > 1
        )


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One output token's log probabilities as vLLM's sampler gives them (a row of
    its LogprobsLists): the sampled token first, then the top alternatives in rank
    order (the sampled one again among them if it ranks there), and the sampled
    token's rank."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class PrefillRequest(Message):
    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[str]  # the prompt's, as the gateway hashed it (shared/block_hash.py)
    sampling: Sampling
    deadline: float
    placement: Placement
    tenant: str = DEFAULT_TENANT  # for its log lines
    cache_salt: str = ""  # vLLM's: its engine's prefix cache split as the block hashes are


class PrefillResult(Message):
    request_id: str
    ok: bool
    first_token_id: int = -1
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    # The placement's kv_blocks as it came out: the leading ones prefill's pool took
    # (a block it had no room for never reaches decode); -1: not known.
    kv_blocks: int = -1
    first_logprobs: TokenLogprobs | None = None  # when the request asks for logprobs
    prompt_logprobs: list[TokenLogprobs] = []  # the prompt's, from its second token on, when asked for
    error: str = ""
    # The engine refused the request itself (vLLM's client errors): the client's 400,
    # and no use asking another instance.
    invalid: bool = False


NO_TOKEN = -1  # DecodeRequest.first_token_id when no prefill ran: decode prefills the prompt itself


class DecodeRequest(Message):
    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int  # prefill's; NO_TOKEN: a local prefill (Placement.local_prefill)
    sampling: Sampling  # max_tokens counts the first token too
    deadline: float
    stream_subject: str  # the gateway's: each step's chunks go there in a TokenBatch
    stream_channel: str = ""  # the gateway's token channel, "tcp://host:port" ("": none; shared/token_channel.py)
    stream_key: bytes = b""  # its key (never logged)
    slo_tbt_ms: float = 0.0  # decode double-checks it on arrival; 0: no check
    block_hashes: list[str] = []  # the prompt's, as the gateway hashed them
    kv_blocks: int = 0  # the placement's, as prefill reported it: decode waits for these and computes the rest
    tenant: str = DEFAULT_TENANT  # for its log lines
    cache_salt: str = ""  # as PrefillRequest's


class DecodeAccept(Message):
    request_id: str
    ok: bool
    error: str = ""
    overloaded: bool = False  # refused because its TBT SLO would be missed


class RequestUpdate(Message):
    """prefill_done: its decode starts now; finished: it left the cluster (any way;
    `completed` when it decoded to its end); decode_refused: decode turned it away
    after prefill (wasted prefill)."""

    request_id: str
    kind: Literal["prefill_done", "finished", "decode_refused"]
    instance_id: str = ""
    completed: bool = False
    age_s: float = 0.0  # in a BookDigest: how long ago its Conductor took it
    tokens: int = -1  # finished: its prompt and the output tokens it streamed (-1: not known), for its tenant's quota


class UpdateBatch(Message):
    """The request updates one process had ready in one turn of its loop (a step's
    prefills done, a step's streams closed): one message for the Conductors to take
    rather than one per request."""

    updates: list[RequestUpdate]


class TokenChunk(Message):
    request_id: str
    seq: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str = ""
    logprobs: list[TokenLogprobs] = []  # one per token, when the request asks for them
    index: int = 0  # which of the request's n outputs these tokens extend
    prompt_logprobs: list[TokenLogprobs] = []  # a local prefill's first chunk, when asked for
    # First chunk only: prompt tokens whose KV decode loaded instead of computing.
    kv_loaded_tokens: int = 0


class TokenBatch(Message):
    """One engine step's chunks for one gateway, from one instance: a message per step
    rather than per token. Each chunk names its request (the gateway's attempt id)."""

    chunks: list[TokenChunk]


class Cancel(Message):
    request_id: str
    reason: str = ""


# --- messengers --------------------------------------------------------------
class MessengerCommand(Message):
    """stats: report counters; snapshot: list every block held (a KvSnapshot);
    send: push the leading `hashes` held here to `node` (what a prefill that pulls
    asks the holder), but for the first `skip`, which `node` holds already; fault
    (only on `messenger_faults_subject`, only to a messenger started with
    --fault-injection, else a MessengerAck refusal): corrupt the payload of the next
    `corrupt_next` layers sent, and refuse the next `no_room_next` blocks engines
    reserve as if the pool were full of pinned blocks (for tests and drills)."""

    op: Literal["stats", "snapshot", "send", "fault"]
    node: str = ""
    hashes: list[str] = []
    skip: int = 0
    corrupt_next: int = 0
    no_room_next: int = 0


class MessengerAck(Message):
    ok: bool
    error: str = ""
    blocks: int = 0  # send: blocks that are on their way


Tier = Literal["dram", "ssd"]


class KvEvent(Message):
    """stored: now in `tier`; evicted: left `tier` (it may still be in a lower one);
    removed: gone from the node."""

    node: str
    kind: Literal["stored", "evicted", "removed"]
    tier: Tier
    hashes: list[str]


class KvSnapshot(Message):
    node: str
    dram: list[str]
    ssd: list[str] = []


class MessengerStats(Message):
    node: str
    endpoint: str = ""
    peers: list[str] = []  # nodes whose messengers this one can send to
    pool_slots: int = 0
    ready: int = 0
    filling: int = 0
    pinned: int = 0
    layers_out: int = 0
    layers_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    blocks_received: int = 0
    checksum_failures: int = 0
    sends_dropped: int = 0
    corrupted_on_purpose: int = 0
    corrupt_pending: int = 0
    no_room_pending: int = 0
    ssd_blocks: int = 0
    hits_dram: int = 0
    hits_ssd: int = 0
    misses: int = 0
    evictions: int = 0
    spills: int = 0
    ssd_dropped: int = 0
    peer_layers_out: dict[str, int] = {}  # by the node sent to
    peer_bytes_out: dict[str, int] = {}


# --- codec --------------------------------------------------------------------
M = TypeVar("M", bound=Message)


class MessageError(ValueError):
    """A message that does not match its schema; log it and drop it."""


def encode(message: Message) -> bytes:
    return msgspec.json.encode(message)


def decode(data: bytes, kind: type[M]) -> M:
    try:
        message = msgspec.json.decode(data, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise MessageError(f"bad {kind.__name__}: {e}") from e
    if message.v != SCHEMA_VERSION:
        raise MessageError(f"{kind.__name__} has schema v{message.v}, expected v{SCHEMA_VERSION}")
    return message
