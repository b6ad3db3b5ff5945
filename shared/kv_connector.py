"""The Yuebing KV connector: vLLM's v1 connector API wired to the node pool.

vLLM builds this class twice per engine: once in the scheduler process (role
SCHEDULER: decides which blocks to save and load) and once in each worker (role
WORKER: copies bytes between vLLM's KV cache and the pool). The two halves share
nothing but the per-step `YuebingMeta` that the scheduler half builds.

A request says what it wants through `SamplingParams.extra_args["kv_transfer_params"]`:
- `{"yb_dest": node}` (prefill) — save every full prompt block into the node pool as
  each layer is computed; the messenger streams each layer on to `node`'s messenger;
- `{"yb_expect": n, "yb_wait_s": s}` (decode; prefill after a pull) — the first n
  prompt blocks are on their way: wait up to s seconds for them to be ready in the
  node pool.
Either way, the leading prompt blocks that are in the node pool (whoever computed
them, from DRAM or SSD) are loaded layer by layer while the rest is computed.

The prompt's tail that does not fill a block, and the first token (which prefill
sampled but never ran through the model), are computed by decode: at most
block_size - 1 prompt tokens plus one. A block that is missing, late past the wait
or failed its checksum is computed too; nothing waits past the wait.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from shared.block_hash import block_hashes
from shared.kv_client import MessengerClient, PoolFollower
from shared.kv_pool import Geometry, PoolFile, checksum
from shared.kv_wire import NO_ROOM, Hello, Pin, Release, Reserve, Written

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Options:
    """`kv_connector_extra_config`, as shared/engine.py writes it."""

    kv_dir: str
    node: str
    block_size: int
    salt: bytes
    model: str
    timeout_s: float = 1.0

    @staticmethod
    def parse(extra: dict[str, Any]) -> Options:
        try:
            return Options(
                kv_dir=str(extra["kv_dir"]),
                node=str(extra["node"]),
                block_size=int(extra["block_size"]),
                salt=str(extra["salt"]).encode(),
                model=str(extra["model"]),
                timeout_s=float(extra.get("timeout_s", 1.0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"Yuebing connector: bad kv_connector_extra_config {extra!r}: {e}") from e


# --- the per-step metadata, scheduler → worker ----------------------------------------
@dataclass(frozen=True)
class Save:
    block_id: int  # vLLM block
    slot: int  # pool slot


@dataclass(frozen=True)
class Load:
    request_id: str
    block_ids: list[int]
    slots: list[int]


@dataclass
class YuebingMeta(KVConnectorMetadata):
    pool_id: str = ""
    saves: list[Save] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)


# --- scheduler-side state of one request ---------------------------------------------
@dataclass
class Tracked:
    hashes: list[bytes]  # the prompt's full blocks
    dest: str | None = None  # save, streaming to this node ("" = keep local)
    saved: int = 0  # blocks handed to the worker so far
    coming: int = 0  # save: the leading blocks the pool took, so on their way to `dest`
    expect: int = 0  # load: blocks prefill is sending
    wait_until: float = 0.0
    seen_at: float = 0.0  # when the scheduler first saw it (how long it waited for its blocks)
    asks: int = 0  # scheduler steps that asked for its blocks
    load_first: int = 0
    load_slots: list[int] = field(default_factory=list)


class YuebingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.opts = Options.parse(self._kv_transfer_config.kv_connector_extra_config)
        vllm_block = vllm_config.cache_config.block_size
        if vllm_block != self.opts.block_size:
            raise ValueError(f"pool block size {self.opts.block_size} must equal vLLM's block size {vllm_block}")
        self.client = MessengerClient(self.opts.kv_dir, self.opts.node, self.opts.timeout_s)
        # scheduler side
        self.tracked: dict[str, Tracked] = {}
        self.pending_loads: list[Load] = []
        self.pool_id = ""
        self.follower = PoolFollower(self.opts.kv_dir, self.opts.node, self.client) if role == KVConnectorRole.SCHEDULER else None
        # worker side
        self.layers: dict[str, int] = {}  # layer name → index
        self.caches: list[torch.Tensor] = []  # per layer, block dim first
        self.pool: PoolFile | None = None
        self.pool_bytes: torch.Tensor | None = None
        self.gone_pool_id = ""  # a pool a step named that is not this node's any more
        self.geometry: Geometry | None = None
        self._load_thread: threading.Thread | None = None
        self._layer_loaded: list[threading.Event] = []
        self._load_errors: set[int] = set()

    # ================================ scheduler side ================================
    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params or {}
        if "yb_dest" not in params and "yb_expect" not in params:
            return
        hashes = block_hashes(request.prompt_token_ids or [], self.opts.block_size, self.opts.salt)
        t = Tracked(hashes=hashes, seen_at=time.monotonic())
        if "yb_dest" in params:
            t.dest = str(params["yb_dest"])
        if "yb_expect" in params:
            t.expect = min(int(params["yb_expect"]), len(hashes))
            t.wait_until = time.monotonic() + float(params.get("yb_wait_s", 2.0))
        self.tracked[request.request_id] = t

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        t = self.tracked.get(request.request_id)
        if t is None or self.follower is None:
            return 0, False
        bs = self.opts.block_size
        # Never claim the block holding the last token: vLLM must compute at least one.
        last = min(len(t.hashes), (request.num_tokens - 1) // bs)
        first = num_computed_tokens // bs
        if first >= last:
            return 0, False
        want = t.hashes[first:last]
        ready = self.follower.leading_ready(want)
        expected = min(t.expect, last) - first
        waiting = ready < expected and not self.follower.any_failed(want[ready:expected])
        t.asks += 1
        if waiting and self.follower.alive and time.monotonic() < t.wait_until:
            return None, False  # asked again next step
        pin = ready and self.follower.alive
        reply = self.client.call(Pin(owner=request.request_id, hashes=want[:ready])) if pin else None
        t.load_first, t.load_slots = first, (reply.slots if reply is not None and reply.ok else [])
        if reply is not None:
            self.pool_id = reply.pool_id
        waited_ms = round((time.monotonic() - t.seen_at) * 1e3, 1)
        if len(t.load_slots) < expected:
            log.info("kv blocks missing, computing them", request_id=request.request_id, waited_ms=waited_ms,
                     loaded=len(t.load_slots), missing=expected - len(t.load_slots), messenger_alive=self.follower.alive)
        elif expected:
            log.info("kv blocks claimed", request_id=request.request_id, blocks=len(t.load_slots), waited_ms=waited_ms,
                     steps=t.asks)
        return len(t.load_slots) * bs, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        t = self.tracked.get(request.request_id)
        if t is None or num_external_tokens <= 0 or not t.load_slots:
            return
        ids = blocks.get_block_ids()[0][t.load_first : t.load_first + len(t.load_slots)]
        self.pending_loads.append(Load(request.request_id, list(ids), list(t.load_slots)))
        t.load_slots = []

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = YuebingMeta(loads=self.pending_loads)
        self.pending_loads = []
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            t = self.tracked.get(req_id)
            if t is None or t.dest is None:
                continue
            done = min(len(t.hashes), (computed.get(req_id, 0) + scheduled) // self.opts.block_size)
            if done > t.saved:
                meta.saves.extend(self._reserve(req_id, t, done))
        meta.pool_id = self.pool_id
        return meta

    def _reserve(self, req_id: str, t: Tracked, done: int) -> list[Save]:
        """Pool slots for the blocks that are complete after this step."""
        hashes = t.hashes[t.saved : done]
        assert self._kv_cache_manager is not None
        block_ids = self._kv_cache_manager.get_block_ids(req_id)[0][t.saved : done]
        unbroken, t.saved = t.coming == t.saved, done
        if self.follower is not None and not self.follower.alive:
            return []  # no messenger: nothing to save into; decode computes these blocks
        reply = self.client.call(Reserve(owner=req_id, hashes=hashes, dest=t.dest or ""))
        if reply is None or not reply.ok:
            return []  # decode will compute these blocks
        self.pool_id = reply.pool_id
        if unbroken:  # a block the pool had no room for ends the run that decode can load
            t.coming += next((i for i, s in enumerate(reply.slots) if s == NO_ROOM), len(reply.slots))
        return [Save(b, s) for b, s in zip(block_ids, reply.slots) if s >= 0]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves are copied into the pool inside the step, so vLLM's blocks are free to go.
        t = self.tracked.pop(request.request_id, None)
        if t is None:
            return False, None
        self.client.note(Release(owner=request.request_id))
        # vLLM hands this back in the request's last output: prefill tells decode how
        # many blocks to wait for, so that it never waits kv_wait_s for blocks the pool
        # had no room for (or that no messenger took).
        return False, ({"yb_coming": t.coming} if t.dest else None)

    # ================================= worker side =================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        for index, (name, cache) in enumerate(kv_caches.items()):
            # vLLM's logical layout puts blocks in dim 0, possibly split into kernel
            # blocks; older layouts (e.g. FlashAttention's (2, blocks, ...)) elsewhere.
            if cache.shape[0] != num_blocks:
                if cache.shape[0] % num_blocks == 0:
                    cache = cache.unflatten(0, (num_blocks, -1))
                else:
                    cache = cache.movedim(list(cache.shape).index(num_blocks), 0)
            self.layers[name] = index
            self.caches.append(cache)
        block = self.caches[0][0]
        shape = (int(torch.tensor(block.shape[:-2]).prod()), block.shape[-2], block.shape[-1])
        order = sorted(range(self.caches[0].dim()), key=lambda d: -self.caches[0].stride(d))
        self.geometry = Geometry(
            layers=len(self.caches),
            shape=shape,
            dtype=str(block.dtype).removeprefix("torch."),
            itemsize=block.element_size(),
            layout="dims" + "".join(map(str, order)),
        )
        self._map_pool()

    def _map_pool(self) -> bool:
        assert self.geometry is not None
        reply = self.client.call(Hello(geometry=self.geometry, model=self.opts.model))
        if reply is None or not reply.ok:
            log.warning("node pool unavailable: this engine computes everything", node=self.opts.node,
                        error=reply.error if reply else "no answer")
            return False
        if self.pool is not None:
            self.pool.close()
        self.pool = PoolFile(reply.pool_path, self.geometry, reply.pool_slots, create=False)
        self.pool_bytes = torch.frombuffer(self.pool.view, dtype=torch.uint8)
        self.pool_id = reply.pool_id
        log.info("node pool mapped", node=self.opts.node, slots=reply.pool_slots, pool_id=reply.pool_id,
                 block_bytes=self.geometry.slot_bytes)
        return True

    def _pool_ready(self, pool_id: str) -> bool:
        """Whether this step's slots are in the pool mapped here (mapping the node's pool
        again if its messenger restarted). A pool found gone is remembered: a step asks
        once, not once per layer, and each ask may wait `timeout_s` on a dead messenger."""
        if not pool_id or pool_id == self.gone_pool_id:
            return False
        if pool_id == self.pool_id or (self._map_pool() and pool_id == self.pool_id):
            return True
        self.gone_pool_id = pool_id
        return False

    def _slot_layer(self, slot: int, layer: int) -> torch.Tensor:
        assert self.pool is not None and self.pool_bytes is not None and self.geometry is not None
        g = self.geometry
        start = slot * g.slot_bytes + g.layer_offset(layer)
        return self.pool_bytes[start : start + g.layer_bytes].view(self.caches[layer].dtype)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, YuebingMeta)
        if not meta.loads:
            return
        if not self._pool_ready(meta.pool_id):
            self._load_errors.update(b for load in meta.loads for b in load.block_ids)
            return
        self._layer_loaded = [threading.Event() for _ in self.caches]
        self._load_thread = threading.Thread(target=self._load, args=(meta.loads,), name="yuebing-load", daemon=True)
        self._load_thread.start()

    def _load(self, loads: list[Load]) -> None:
        """Fill vLLM's blocks from the pool, layer by layer, while the model runs."""
        try:
            for layer, cache in enumerate(self.caches):
                for load in loads:
                    for block_id, slot in zip(load.block_ids, load.slots):
                        block = cache[block_id]
                        block.copy_(self._slot_layer(slot, layer).view(block.shape))
                self._layer_loaded[layer].set()
        except Exception:
            log.exception("kv load failed")
            self._load_errors.update(b for load in loads for b in load.block_ids)
        finally:
            for event in self._layer_loaded:
                event.set()
            for load in loads:
                self.client.note(Release(owner=load.request_id))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load_thread is not None:
            self._layer_loaded[self.layers[layer_name]].wait()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, YuebingMeta)
        if not meta.saves or not self._pool_ready(meta.pool_id):
            return
        assert self.pool is not None
        layer = self.layers[layer_name]
        cache = self.caches[layer]
        sums = []
        for save in meta.saves:
            block = cache[save.block_id]
            self._slot_layer(save.slot, layer).view(block.shape).copy_(block)
            sums.append(checksum(self.pool.layer(save.slot, layer)))
        # The messenger streams this layer on at once (layer-wise transfer).
        self.client.note(Written(pool_id=meta.pool_id, layer=layer, slots=[s.slot for s in meta.saves], checksums=sums))

    def wait_for_save(self) -> None:
        if self._load_thread is not None:
            self._load_thread.join()
            self._load_thread = None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.follower is not None:
            self.follower.close()
        self.client.close()
