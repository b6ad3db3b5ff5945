"""The connector's worker half, in each vLLM worker: copies bytes between vLLM's KV
cache and the node pool, as the step's `YuebingMeta` says. Loads run on a thread,
layer by layer, while the model runs; saves copy each layer into its pool slots as
soon as the model has computed it and tell the messenger, which streams it on.

A load that cannot complete (the pool is gone, a copy fails, a claimed block was
never pinned) is reported through `load_errors`, and vLLM computes those blocks.

In a pipeline-parallel engine (a CPP prefill group) each stage's worker holds only
its stage's layers: it names each by the model's layer number, not its place here,
and carves the pool for the whole model, so a pool block becomes ready once every
stage has written its layers.

A messenger that restarts holds no pool until an engine says hello: a `HelloWatch`
says it again as soon as the new messenger ticks, and the first step that names the
new pool maps its (new) file here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import structlog
import torch

from shared.kv.client import HelloWatch, MessengerClient
from shared.kv.meta import YuebingMeta
from shared.kv.options import Options
from shared.kv.plan import Load
from shared.kv.pool_file import Geometry, PoolSlots, checksum
from shared.kv.wire import Hello, Release, Written

log = structlog.get_logger(__name__)


def blocks_first(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A layer's KV cache as a view with vLLM blocks in dim 0. vLLM's logical layout
    puts blocks there, possibly split into kernel blocks; older layouts (e.g.
    FlashAttention's (2, blocks, ...)) elsewhere."""
    if cache.shape[0] == num_blocks:
        return cache
    if cache.shape[0] % num_blocks == 0:
        return cache.unflatten(0, (num_blocks, -1))
    return cache.movedim(list(cache.shape).index(num_blocks), 0)


def geometry_of(caches: list[torch.Tensor], layers: int = 0) -> Geometry:
    """One pool block of these (blocks-first) layer caches, of `layers` layers in all
    (default: these)."""
    block = caches[0][0]
    shape = (int(torch.tensor(block.shape[:-2]).prod()), block.shape[-2], block.shape[-1])
    order = sorted(range(caches[0].dim()), key=lambda d: -caches[0].stride(d))
    return Geometry(
        layers=layers or len(caches),
        shape=shape,
        dtype=str(block.dtype).removeprefix("torch."),
        itemsize=block.element_size(),
        layout="dims" + "".join(map(str, order)),
    )


def model_layer(name: str, index: int, model_layers: int) -> int:
    """The model's number for layer `name` (the `index`-th here): vLLM names attention
    layers `...layers.<n>...`. Only a worker holding every layer may fall back on its
    own order."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return extract_layer_index(name)
    except (AssertionError, ValueError):
        if model_layers:
            raise ValueError(f"cannot tell which of the model's layers {name!r} is") from None
        return index


@dataclass
class MappedPool:
    """The node's pool as this worker maps it."""

    pool_id: str
    slots: PoolSlots
    data: torch.Tensor  # the whole file, as bytes

    def layer(self, slot: int, layer: int, dtype: torch.dtype) -> torch.Tensor:
        g = self.slots.geometry
        start = slot * g.slot_bytes + g.layer_offset(layer)
        return self.data[start : start + g.layer_bytes].view(dtype)


class ConnectorWorker:
    def __init__(self, opts: Options, num_blocks: int, client: MessengerClient | None = None,
                 model_layers: int = 0) -> None:
        self.opts = opts
        self.num_blocks = num_blocks
        self.client = client or MessengerClient(opts.kv_dir, opts.node, opts.timeout_s)
        self.model_layers = model_layers  # the whole model's (0: the layers here are all of them)
        self.layers: dict[str, int] = {}  # layer name → index here
        self.layer_ids: list[int] = []  # index here → the model's layer number (its place in a pool block)
        self.caches: list[torch.Tensor] = []  # per layer here, blocks first
        self.pool: MappedPool | None = None  # None: no messenger answered; everything is computed
        self.gone_pool_id = ""  # a pool a step named that is not this node's any more
        self.load_errors: set[int] = set()
        self._load_thread: threading.Thread | None = None
        self._layer_loaded: list[threading.Event] = []
        self.watch: HelloWatch | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for index, (name, cache) in enumerate(kv_caches.items()):
            self.layers[name] = index
            self.layer_ids.append(model_layer(name, index, self.model_layers))
            self.caches.append(blocks_first(cache, self.num_blocks))
        self._map_pool()
        self.watch = HelloWatch(self.opts.kv_dir, self.opts.node, self._hello)

    def _hello(self) -> bool:
        """Carve the node's pool with our geometry if nobody has (its messenger restarted);
        mapping it waits for a step that names it, on the worker's own thread."""
        reply = self.client.call(Hello(geometry=self.geometry(), model=self.opts.model))
        if reply is None or not reply.ok:
            log.warning("hello to the messenger unanswered", node=self.opts.node,
                        error=reply.error if reply else "no answer")
            return False
        log.info("node pool carved again", node=self.opts.node, pool_id=reply.pool_id)
        return True

    def geometry(self) -> Geometry:
        return geometry_of(self.caches, self.model_layers)

    def _map_pool(self) -> bool:
        """Say hello to the messenger and map the pool it answers with."""
        geometry = self.geometry()
        reply = self.client.call(Hello(geometry=geometry, model=self.opts.model))
        if reply is None or not reply.ok:
            log.warning("node pool unavailable: this engine computes everything", node=self.opts.node,
                        error=reply.error if reply else "no answer")
            return False
        if self.pool is not None:
            self.pool.slots.close()
        slots = PoolSlots.open(reply.pool_path, geometry, reply.pool_slots)
        self.pool = MappedPool(reply.pool_id, slots, torch.frombuffer(slots.view, dtype=torch.uint8))
        log.info("node pool mapped", node=self.opts.node, slots=reply.pool_slots, pool_id=reply.pool_id,
                 block_bytes=geometry.slot_bytes)
        return True

    def _pool_ready(self, pool_id: str) -> MappedPool | None:
        """The pool mapped here if it is the one this step's slots are in (mapping the
        node's pool again if its messenger restarted). A pool found gone is remembered:
        a step asks once, not once per layer, and each ask may wait `timeout_s` on a
        dead messenger."""
        if not pool_id or pool_id == self.gone_pool_id:
            return None
        if self.pool is not None and self.pool.pool_id == pool_id:
            return self.pool
        if self._map_pool() and self.pool is not None and self.pool.pool_id == pool_id:
            return self.pool
        self.gone_pool_id = pool_id
        return None

    def start_load_kv(self, meta: YuebingMeta) -> None:
        self.load_errors.update(meta.failed)
        if not meta.loads:
            return
        pool = self._pool_ready(meta.pool_id)
        if pool is None:
            self.load_errors.update(b for load in meta.loads for b in load.block_ids)
            return
        self._layer_loaded = [threading.Event() for _ in self.caches]
        self._load_thread = threading.Thread(target=self._load, args=(pool, meta.loads), name="yuebing-load",
                                             daemon=True)
        self._load_thread.start()

    def _load(self, pool: MappedPool, loads: list[Load]) -> None:
        """Fill vLLM's blocks from the pool, layer by layer, while the model runs."""
        try:
            for index, cache in enumerate(self.caches):
                layer = self.layer_ids[index]
                for load in loads:
                    for block_id, slot in zip(load.block_ids, load.slots):
                        block = cache[block_id]
                        block.copy_(pool.layer(slot, layer, cache.dtype).view(block.shape))
                self._layer_loaded[index].set()
        except Exception:
            for load in loads:
                log.exception("kv load failed: vLLM computes its blocks", request_id=load.request_id)
            self.load_errors.update(b for load in loads for b in load.block_ids)
        finally:
            for event in self._layer_loaded:
                event.set()
            for load in loads:
                self.client.note(Release(owner=load.request_id))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load_thread is not None:
            self._layer_loaded[self.layers[layer_name]].wait()

    def save_kv_layer(self, meta: YuebingMeta, layer_name: str) -> None:
        if not meta.saves:
            return
        pool = self._pool_ready(meta.pool_id)
        if pool is None:
            return
        index = self.layers[layer_name]
        layer, cache = self.layer_ids[index], self.caches[index]
        sums = []
        for save in meta.saves:
            block = cache[save.block_id]
            pool.layer(save.slot, layer, cache.dtype).view(block.shape).copy_(block)
            sums.append(checksum(pool.slots.layer(save.slot, layer)))
        # The messenger streams this layer on at once (layer-wise transfer).
        self.client.note(Written(pool_id=meta.pool_id, layer=layer, slots=[s.slot for s in meta.saves],
                                 hashes=[s.block_hash for s in meta.saves], checksums=sums))

    def wait_for_save(self) -> None:
        if self._load_thread is not None:
            self._load_thread.join()
            self._load_thread = None

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.watch is not None:
            self.watch.close()
        self.client.close()
