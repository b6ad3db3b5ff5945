"""What the connector's scheduler half decides, as plain data and functions: which
prompt blocks a request can load, which of them a pin took, which blocks to save
after a step, and how long the run of blocks on their way to `kv_dest` is. No vLLM,
no sockets, no clock of its own (callers pass `now`); shared/kv/scheduler.py asks
the messenger and vLLM, and calls in here.

The request's `kv_transfer_params` (the contract is in shared/kv/connector.py)
become a `Tracked`: a `Send` for `kv_dest`, a `Wait` for incoming `kv_blocks`, or both.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.block_hash import block_hashes, tail_hash
from shared.kv.leading import leading_count, leading_run
from shared.kv.wire import NO_ROOM

# The request's kv_transfer_params keys.
KV_DEST = "kv_dest"
KV_BLOCKS = "kv_blocks"
KV_WAIT_S = "kv_wait_s"
KV_HASHES = "kv_hashes"  # the prompt's block hashes (hex) as the gateway computed them
KV_PROMPT_TOKENS = "kv_prompt_tokens"  # decode: the prompt's length, before the tokens prefill sampled
KV_TRACE = "kv_trace"  # the request's trace context (W3C headers): the messenger's push span joins it
TRACE_KEYS = ("traceparent", "tracestate")
TRACE_VALUE_CHARS = 512  # W3C caps tracestate at 512 characters
DEFAULT_WAIT_S = 2.0


@dataclass
class Send:
    """Prefill: save every prompt block (its tail too) into the node pool, streamed to `kv_dest`."""

    kv_dest: str  # "" or this node: kept in the node pool only
    trace: dict[str, str] = field(default_factory=dict)  # the request's trace context, for the messenger
    saved: int = 0  # leading blocks handed to the pool so far
    kv_blocks: int = 0  # leading blocks the pool took: on their way to kv_dest


@dataclass(frozen=True)
class Wait:
    """The first `kv_blocks` prompt blocks are on their way into this node's pool."""

    kv_blocks: int
    until: float  # monotonic time; after it, what has not arrived is computed


@dataclass(frozen=True)
class Match:
    """One scheduling step's answer for a request: load `blocks` prompt blocks from
    block `first` on, of which the request expected `expected` to arrive."""

    first: int
    blocks: int
    expected: int = 0


@dataclass
class Tracked:
    """The scheduler half's state of one request."""

    hashes: list[bytes]  # the prompt's blocks: every full one, then its tail, if it has one
    tail: int = 0  # tokens in the tail, the last of `hashes` (0: none; every block is full)
    send: Send | None = None
    wait: Wait | None = None
    seen_at: float = 0.0  # when the scheduler first saw it (how long it waited for blocks)
    match: Match | None = None  # the last answer given to vLLM, for the step that allocates
    # A block this step claimed did not load: the step computes the rest over KV that
    # is not there, vLLM reruns it from that block, and only the rerun's blocks save.
    load_failed: bool = False

    @property
    def full_blocks(self) -> int:
        return len(self.hashes) - (1 if self.tail else 0)

    def ends_in_tail(self, end: int) -> bool:
        """Whether blocks up to `end` (exclusive) take in the tail."""
        return bool(self.tail) and end == len(self.hashes)


@dataclass(frozen=True)
class Save:
    block_id: int  # vLLM block
    slot: int  # pool slot
    block_hash: bytes  # the block the slot was reserved for: the worker's note names it


@dataclass(frozen=True)
class Load:
    request_id: str
    block_ids: list[int]
    slots: list[int]
    # Its last block is a prompt's tail: the step writes its own first token's KV into
    # that block, and vLLM writes a layer's new KV before the connector's wait for that
    # layer, so the worker loads this step's blocks before the forward, not layer by layer.
    tail: bool = False


class PoolView(Protocol):
    """What the scheduler half knows of the node pool, from memory (shared/kv/client.py)."""

    @property
    def ready(self) -> Container[bytes]: ...

    @property
    def alive(self) -> bool: ...

    def has_failed(self, block_hash: bytes) -> bool: ...


def track(
    params: Mapping[str, Any] | None, prompt: list[int], block_size: int, salt: bytes, now: float
) -> Tracked | None:
    """The request's part in the KV plan; None when it asks for none."""
    params = params or {}
    if KV_DEST not in params and KV_BLOCKS not in params:
        return None
    prompt = prompt[: _prompt_tokens(params, len(prompt))]
    t = Tracked(hashes=prompt_hashes(params, prompt, block_size, salt), tail=len(prompt) % block_size, seen_at=now)
    if t.tail:
        t.hashes.append(tail_hash(prompt, block_size, salt, t.hashes))
    if KV_DEST in params:
        t.send = Send(kv_dest=str(params[KV_DEST]), trace=trace_context(params.get(KV_TRACE)))
    if KV_BLOCKS in params:
        wait_s = float(params.get(KV_WAIT_S, DEFAULT_WAIT_S))
        t.wait = Wait(kv_blocks=min(int(params[KV_BLOCKS]), len(t.hashes)), until=now + wait_s)
    return t


def trace_context(given: Any) -> dict[str, str]:
    """The W3C trace headers a request carries, and nothing else (it is passed on)."""
    if not isinstance(given, Mapping):
        return {}
    return {k: v for k in TRACE_KEYS if isinstance(v := given.get(k), str) and len(v) <= TRACE_VALUE_CHARS}


def _prompt_tokens(params: Mapping[str, Any], tokens: int) -> int:
    """The tokens whose KV the request's blocks name: a decode's prompt comes with the
    token prefill sampled, which no block holds."""
    given = params.get(KV_PROMPT_TOKENS)
    return min(given, tokens) if isinstance(given, int) and given >= 0 else tokens


def prompt_hashes(params: Mapping[str, Any], prompt: list[int], block_size: int, salt: bytes) -> list[bytes]:
    """The prompt's full-block hashes: those the request carries (the gateway hashes a
    prompt once for the whole cluster), or computed here when it carries none."""
    given = params.get(KV_HASHES)
    if isinstance(given, list) and len(given) == len(prompt) // block_size:
        return [bytes.fromhex(h) for h in given]
    return block_hashes(prompt, block_size, salt)


def match(
    t: Tracked, num_tokens: int, num_computed_tokens: int, block_size: int, pool: PoolView, now: float
) -> Match | None:
    """The leading blocks past what vLLM computed that the pool holds; None while
    blocks the request waits for are still on their way (vLLM asks again next step).
    Nothing waits past `Wait.until`, for a block that failed, or on a dead messenger."""
    last = claimable(t, num_tokens, block_size)
    first = num_computed_tokens // block_size
    if first >= last:
        return Match(first, 0)
    want = t.hashes[first:last]
    ready = leading_count(want, pool.ready)
    expected = max(0, min(t.wait.kv_blocks, last) - first) if t.wait else 0
    arriving = ready < expected and not any(pool.has_failed(h) for h in want[ready:expected])
    if arriving and pool.alive and t.wait is not None and now < t.wait.until:
        return None
    return Match(first, ready if pool.alive else 0, expected)


def claimable(t: Tracked, num_tokens: int, block_size: int) -> int:
    """The blocks that end before the request's last token: vLLM must compute at least
    one. A decode's tail ends there (the token after it is the one prefill sampled)."""
    ahead = num_tokens - 1  # tokens before the last
    if t.tail and t.full_blocks * block_size + t.tail <= ahead:
        return len(t.hashes)
    return min(t.full_blocks, ahead // block_size)


def matched_tokens(t: Tracked, m: Match, block_size: int) -> int:
    """The tokens the matched blocks hold: a tail holds fewer than a block."""
    with_tail = m.blocks and t.ends_in_tail(m.first + m.blocks)
    return m.blocks * block_size - (block_size - t.tail if with_tail else 0)


def claimed(t: Tracked, m: Match, num_external_tokens: int, block_size: int) -> int:
    """How many of the matched blocks vLLM allocated to load (it may take fewer)."""
    if m.blocks and num_external_tokens >= matched_tokens(t, m, block_size):
        return m.blocks
    return min(m.blocks, max(0, num_external_tokens) // block_size)


def plan_load(request_id: str, block_ids: list[int], pinned: list[int], tail: bool = False
              ) -> tuple[Load | None, list[int]]:
    """Claimed blocks whose leading run the pin took (`pinned`: their slots) load;
    the rest, evicted since the match or never pinned (no messenger), are reported
    as failed loads, so that vLLM computes them. `tail`: the last claimed block is the
    prompt's tail."""
    n = min(len(pinned), len(block_ids))
    load = Load(request_id, block_ids[:n], pinned[:n], tail and n == len(block_ids)) if n else None
    return load, block_ids[n:]


def blocks_complete(t: Tracked, computed_tokens: int, scheduled_tokens: int, block_size: int) -> int:
    """The prompt's blocks computed once this step has run: its tail with its last token."""
    done = computed_tokens + scheduled_tokens
    if t.tail and done >= t.full_blocks * block_size + t.tail:
        return len(t.hashes)
    return min(t.full_blocks, done // block_size)


def saves_due(
    tracked: Mapping[str, Tracked], computed: Mapping[str, int], scheduled: Mapping[str, int], block_size: int
) -> list[tuple[str, Tracked, int]]:
    """The saving requests this step completes blocks of: (request id, its state,
    full blocks once the step has run)."""
    due = []
    for req_id, tokens in scheduled.items():
        t = tracked.get(req_id)
        if t is None or t.send is None:
            continue
        if t.load_failed:
            t.load_failed = False
            continue
        done = blocks_complete(t, computed.get(req_id, 0), tokens, block_size)
        if done > t.send.saved:
            due.append((req_id, t, done))
    return due


def take_reserved(
    send: Send, done: int, block_ids: list[int], hashes: list[bytes], slots: list[int] | None
) -> list[Save]:
    """Blocks `send.saved` to `done` (`hashes`) were offered to the pool, which answered with
    `slots` (None: no answer). Returns what the worker copies into the pool. A block
    the pool had no room for (or no answer) ends the run on its way to kv_dest:
    decode computes it and every block after it."""
    unbroken = send.kv_blocks == send.saved
    send.saved = done
    if slots is None:
        return []
    if unbroken:
        send.kv_blocks += leading_run(slots, lambda s: s != NO_ROOM)
    return [Save(b, s, h) for b, s, h in zip(block_ids, slots, hashes) if s >= 0]


def finished_params(t: Tracked) -> dict[str, int] | None:
    """The connector's word on a finished request: how many leading prompt blocks
    are on their way to kv_dest, so decode waits for those and no others."""
    return {KV_BLOCKS: t.send.kv_blocks} if t.send is not None and t.send.kv_dest else None
