"""The connector's worker half, in each vLLM worker: moves bytes between vLLM's KV
cache and the node pool, as the step's `YuebingMeta` says, through a `Copier`
(shared/kv/copier.py: copy streams on a GPU, a copy thread on a CPU). Loads run layer
by layer while the model runs; each layer's saves are handed over as soon as the
model has computed it, and once its copies have landed the messenger is told, and
streams it on. The forward never waits for a save.

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

import time

import structlog
import torch

from shared.kv.client import HelloWatch, MessengerClient
from shared.kv.copier import (
    Copier,
    LayerLoad,
    LayerSave,
    LoadJob,
    MappedPool,
    blocks_first,
    copier_for,
    geometry_of,
)
from shared.kv.meta import YuebingMeta
from shared.kv.options import Options
from shared.kv.plan import Load, Save
from shared.kv.pool_file import Geometry, PoolSlots
from shared.kv.stats import Counts
from shared.kv.wire import Hello, Release, Written

log = structlog.get_logger(__name__)


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


class ConnectorWorker:
    def __init__(self, opts: Options, num_blocks: int, client: MessengerClient | None = None,
                 model_layers: int = 0, shards: int = 1, shard: int = 0) -> None:
        self.opts = opts
        self.num_blocks = num_blocks
        self.client = client or MessengerClient(opts.kv_dir, opts.node, opts.timeout_s)
        self.model_layers = model_layers  # the whole model's (0: the layers here are all of them)
        # Tensor parallelism: this worker holds rank `shard` of `shards` of each layer's KV
        # heads, and a pool block one part per (layer, rank), so ranks never write over each other.
        self.shards, self.shard = shards, shard
        self.layers: dict[str, int] = {}  # layer name → index here
        self.layer_ids: list[int] = []  # index here → this rank's part of that layer in a pool block
        self.caches: list[torch.Tensor] = []  # per layer here, blocks first
        self.copier: Copier | None = None  # made with the caches: their device chooses it
        self.pool: MappedPool | None = None  # None: no messenger answered; everything is computed
        self.gone_pool_id = ""  # a pool a step named that is not this node's any more
        self.load_errors: set[int] = set()
        self._loading: tuple[LoadJob, list[int], int] | None = None  # this step's loads: their blocks, bytes
        self._load_wait_s = 0.0  # this step's forward waiting on its loads
        self._saved_this_step = False
        self.counts = Counts()  # what this worker did, until the connector gives it to vLLM
        self.counts_blocks = True  # one worker of a sharded engine counts blocks (all count bytes)
        self._step_saves: tuple[list[Save], list[int], list[int], list[bytes]] | None = None
        self.watch: HelloWatch | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for index, (name, cache) in enumerate(kv_caches.items()):
            self.layers[name] = index
            self.layer_ids.append(model_layer(name, index, self.model_layers) * self.shards + self.shard)
            self.caches.append(blocks_first(cache, self.num_blocks))
        self.counts_blocks = 0 in self.layer_ids  # the worker holding the model's first layer (rank 0)
        self.copier = copier_for(self.caches[0].device, self.opts.checksum_threads)
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
        return geometry_of(self.caches, (self.model_layers or len(self.caches)) * self.shards)

    def _map_pool(self) -> bool:
        """Say hello to the messenger and map the pool it answers with (pinned for a GPU's copies)."""
        geometry = self.geometry()
        reply = self.client.call(Hello(geometry=geometry, model=self.opts.model))
        if reply is None or not reply.ok:
            log.warning("node pool unavailable: this engine computes everything", node=self.opts.node,
                        error=reply.error if reply else "no answer")
            return False
        self._unmap_pool()
        self.pool = MappedPool.of(reply.pool_id, PoolSlots.open(reply.pool_path, geometry, reply.pool_slots))
        if self.copier is not None:
            self.copier.adopt(self.pool)
        log.info("node pool mapped", node=self.opts.node, slots=reply.pool_slots, pool_id=reply.pool_id,
                 block_bytes=geometry.slot_bytes, pinned=self.pool.pinned)
        return True

    def _unmap_pool(self) -> None:
        """Let go of the old pool once no copy of ours is still reading or writing it."""
        if self.pool is None:
            return
        if self.copier is not None:
            self.copier.settle()
        self.pool.close()
        self.pool = None

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
        block_ids = [b for load in meta.loads for b in load.block_ids]
        pool = self._pool_ready(meta.pool_id)
        if pool is None or self.copier is None:
            self.load_errors.update(block_ids)
            self._failed("pool_unavailable", block_ids)
            return
        job = LayerLoad(block_ids, [s for load in meta.loads for s in load.slots])
        started = self.copier.load(pool, self.caches, self.layer_ids, job, lambda: self._release(meta.loads))
        self._loading = (started, block_ids, len(block_ids) * len(self.caches) * pool.slots.geometry.layer_bytes)
        if any(load.tail for load in meta.loads):  # in before the forward writes into a tail (Load.tail)
            for index in range(len(self.caches)):
                self.wait_for_layer_index(index)

    def wait_for_layer_index(self, index: int) -> None:
        if self._loading is not None and self.copier is not None:
            started = time.perf_counter()
            self.copier.wait_layer(self._loading[0], index)
            self._load_wait_s += time.perf_counter() - started

    def _release(self, loads: list[Load]) -> None:
        for load in loads:
            self.client.note(Release(owner=load.request_id))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.wait_for_layer_index(self.layers[layer_name])

    def save_kv_layer(self, meta: YuebingMeta, layer_name: str) -> None:
        if not meta.saves or self.copier is None:
            return
        pool = self._pool_ready(meta.pool_id)
        if pool is None:
            return
        index = self.layers[layer_name]
        layer = self.layer_ids[index]
        block_ids, slots, hashes = self._saves_of(meta.saves)
        self.counts.add("saved_bytes", len(slots) * pool.slots.geometry.layer_bytes)
        if layer == 0:  # the model's first layer, rank 0: one worker counts the blocks
            self.counts.add("saved_blocks", len(slots))
        self._saved_this_step = True

        def noted(checksums: list[int]) -> None:
            # The messenger streams this layer on at once (layer-wise transfer).
            self.client.note(Written(pool_id=pool.pool_id, layer=layer, slots=slots, hashes=hashes,
                                     checksums=checksums))

        self.copier.save(pool, self.caches[index], LayerSave(layer, block_ids, slots), noted)

    def _saves_of(self, saves: list[Save]) -> tuple[list[int], list[int], list[bytes]]:
        """The step's saves as columns, made once per step (every layer saves the same blocks)."""
        if self._step_saves is None or self._step_saves[0] is not saves:
            self._step_saves = (saves, [s.block_id for s in saves], [s.slot for s in saves],
                                [s.block_hash for s in saves])
        return self._step_saves[1:]

    def wait_for_save(self) -> None:
        """The step's end: its saves have read their blocks, its loads are in (or reported)."""
        started = time.perf_counter()
        if self.copier is not None and not self.copier.flush():
            log.error("kv saves still reading vLLM's blocks at the step's end", node=self.opts.node)
        if self._saved_this_step:
            self.counts.timed("save_flush_s", time.perf_counter() - started)
            self._saved_this_step = False
        if self._loading is not None:
            self._finish_loads(*self._loading)
            self._loading = None

    def _finish_loads(self, job: LoadJob, block_ids: list[int], nbytes: int) -> None:
        self.counts.timed("load_wait_s", self._load_wait_s)
        self._load_wait_s = 0.0
        if all(job.wait(i) for i in range(job.layers)):
            self.counts.add("loaded_bytes", nbytes)
            if self.counts_blocks:
                self.counts.add("loaded_blocks", len(block_ids))
            return
        log.error("kv load failed: vLLM computes its blocks", node=self.opts.node, blocks=len(block_ids))
        self.load_errors.update(block_ids)
        self._failed("copy_failed", block_ids)

    def _failed(self, cause: str, block_ids: list[int]) -> None:
        if self.counts_blocks:
            self.counts.failed(cause, len(block_ids))

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.watch is not None:
            self.watch.close()
        if self.copier is not None:
            self.copier.settle(timeout_s=2.0)  # the last notes leave before the client closes
            self.copier.close()
        self.client.close()
