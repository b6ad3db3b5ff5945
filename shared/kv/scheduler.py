"""The connector's scheduler half, in vLLM's scheduler process: what each step loads
from and saves into the node pool. The decisions are shared/kv/plan.py's; this
class feeds them vLLM's requests and the followed pool, and asks the node's
messenger for the pins and slots they need (each call bounded by a timeout).

vLLM's hooks, in the order a request meets them (v1/core/sched/scheduler.py):
`on_new_request`; `get_num_new_matched_tokens` on every step it waits, with no side
effects (so it may be asked again, or its answer dropped when there is no room);
`update_state_after_alloc` once the step has allocated its blocks, where the claimed
blocks are pinned; `build_connector_meta` once a step; `request_finished`.

Pins are leases (shared/kv/wire.py): `build_connector_meta`, once a step, renews the
pins of every request still tracked with one non-blocking note (at most every
`RENEW_S`, or a quarter of the messenger's lease if shorter), and `shutdown` says
Bye, so a crashed or stopped engine's pins do not outlive it for long.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import structlog

from shared.block_hash import request_salt
from shared.kv.chunk_cap import ChunkCaps
from shared.kv.client import MessengerClient, PoolFollower
from shared.kv.meta import YuebingMeta
from shared.kv.options import Options
from shared.kv.plan import (
    Match,
    Save,
    Tracked,
    claimed,
    finished_params,
    match,
    matched_tokens,
    plan_load,
    saves_due,
    take_reserved,
    track,
)
from shared.kv.stats import Counts
from shared.kv.wire import Bye, Control, Pin, Release, Renew, Reserve

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = structlog.get_logger(__name__)
RENEW_S = 1.0  # how often the pins of running requests are renewed, at most


class ConnectorScheduler:
    def __init__(
        self, opts: Options, client: MessengerClient | None = None, follower: PoolFollower | None = None,
        scheduler_config: Any = None,
    ) -> None:
        self.opts = opts
        # vLLM's own scheduler config (None in unit tests): the prompt chunk cap is set there.
        self.scheduler_config = scheduler_config
        self.chunk_caps = ChunkCaps(launched=scheduler_config.long_prefill_token_threshold if scheduler_config else 0)
        self.client = client or MessengerClient(opts.kv_dir, opts.node, opts.timeout_s)
        self.follower = follower or PoolFollower(opts.kv_dir, opts.node, self.client)
        self.tracked: dict[str, Tracked] = {}
        self.next_meta = YuebingMeta()  # loads pinned since the last step
        self.pool_id = ""  # the pool the last pin or reservation was made in
        self.kv_cache_manager: KVCacheManager | None = None
        self.engine = uuid.uuid4().hex[:12]  # names this engine's pins to the messenger
        self.renew_s = RENEW_S  # shortened to a quarter of the messenger's lease if that is shorter
        self.renewed_at = float("-inf")
        self.counts = Counts()  # what this half saw, until the connector gives it to vLLM

    def on_new_request(self, request: Request) -> None:
        if self.chunk_caps.add(request.request_id, request.kv_transfer_params):
            self._set_chunk_cap()
        # Hashed here only where the request carries no hashes: under its own cache's
        # salt (vLLM's cache_salt, a tenant's group), as the gateway hashes it.
        salt = request_salt(self.opts.salt, request.cache_salt or "")
        t = track(request.kv_transfer_params, list(request.prompt_token_ids or []), self.opts.block_size, salt,
                  time.monotonic())
        if t is not None:
            self.tracked[request.request_id] = t

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        t = self.tracked.get(request.request_id)
        if t is None:
            return 0, False
        # Remembered for update_state_after_alloc; a later ask replaces it.
        now = time.monotonic()
        t.match = match(t, request.num_tokens, num_computed_tokens, self.opts.block_size, self.follower, now)
        return (None, False) if t.match is None else (matched_tokens(t, t.match, self.opts.block_size), False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Pin what the step claimed. A claimed block the pin no longer finds is loaded
        as failed: the worker reports it and vLLM computes it (policy "recompute")."""
        t = self.tracked.get(request.request_id)
        if t is None or t.match is None:
            return
        m, t.match = t.match, None
        n = claimed(t, m, num_external_tokens, self.opts.block_size)
        block_ids = list(blocks.get_block_ids()[0][m.first : m.first + n])
        pin = Pin(owner=request.request_id, hashes=t.hashes[m.first : m.first + n], engine=self.engine)
        pinned = self._slots(pin) if n else []
        load, failed = plan_load(request.request_id, block_ids, pinned or [], t.ends_in_tail(m.first + n))
        if load is not None:
            self.next_meta.loads.append(load)
        self.next_meta.failed.extend(failed)
        if failed:
            self.counts.failed("gone_before_pinned", len(failed))
        t.load_failed = bool(failed)
        self._log_claim(request.request_id, t, m, loaded=n - len(failed), failed=len(failed))

    def _log_claim(self, request_id: str, t: Tracked, m: Match, loaded: int, failed: int) -> None:
        waited_ms = round((time.monotonic() - t.seen_at) * 1e3, 1)
        if failed:
            log.warning("kv blocks gone before they were pinned: computing them", request_id=request_id, blocks=failed)
        if loaded < m.expected:
            log.info("kv blocks missing, computing them", request_id=request_id, waited_ms=waited_ms, loaded=loaded,
                     missing=m.expected - loaded, messenger_alive=self.follower.alive)
        elif m.expected:
            log.info("kv blocks claimed", request_id=request_id, blocks=loaded, waited_ms=waited_ms)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> YuebingMeta:
        meta, self.next_meta = self.next_meta, YuebingMeta()
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, t, done in saves_due(self.tracked, computed, scheduled, self.opts.block_size):
            meta.saves.extend(self._reserve(req_id, t, done))
        meta.pool_id = self.pool_id
        self._renew(time.monotonic())
        return meta

    def _renew(self, now: float) -> None:
        """Keep the pins of the requests still here (a fire-and-forget note: never waits)."""
        if not self.tracked or now - self.renewed_at < self.renew_s:
            return
        self.renewed_at = now
        self.client.note(Renew(engine=self.engine, owners=list(self.tracked)))

    def _reserve(self, req_id: str, t: Tracked, done: int) -> list[Save]:
        """Pool slots for the blocks that are complete after this step."""
        assert t.send is not None and self.kv_cache_manager is not None
        start = t.send.saved
        block_ids = self.kv_cache_manager.get_block_ids(req_id)[0][start:done]
        # No messenger: nothing to save into, and decode computes these blocks.
        reserve = Reserve(owner=req_id, hashes=t.hashes[start:done], dest=t.send.kv_dest, engine=self.engine,
                          trace=t.send.trace if start == 0 else {})
        slots = self._slots(reserve) if self.follower.alive else None
        return take_reserved(t.send, done, list(block_ids), reserve.hashes, slots)

    def _slots(self, call: Control) -> list[int] | None:
        """The slots a pin or a reservation answered with; None without an answer."""
        reply = self.client.call(call)
        if reply is None or not reply.ok:
            return None
        self.pool_id = reply.pool_id
        if reply.lease_s > 0:
            self.renew_s = min(RENEW_S, reply.lease_s / 4)
        return reply.slots

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.chunk_caps.remove(request.request_id):
            self._set_chunk_cap()
        # Saves are copied into the pool inside the step, so vLLM's blocks are free to go.
        t = self.tracked.pop(request.request_id, None)
        if t is None:
            return False, None
        self.client.note(Release(owner=request.request_id))
        # vLLM hands this back in the request's last output: prefill tells decode how
        # many blocks to wait for, so that it never waits kv_wait_s for blocks the pool
        # had no room for (or that no messenger took).
        return False, finished_params(t)

    def _set_chunk_cap(self) -> None:
        """vLLM reads the threshold at every step (shared/kv/chunk_cap.py says why it moves)."""
        if self.scheduler_config is not None:
            self.scheduler_config.long_prefill_token_threshold = self.chunk_caps.threshold()

    def shutdown(self) -> None:
        self.client.note(Bye(engine=self.engine))  # our pins go now, not at lease expiry
        self.follower.close()
        self.client.close()
