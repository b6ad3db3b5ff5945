"""The Yuebing KV connector: vLLM's v1 connector API wired to the node pool.

vLLM loads it by name (`kv_connector_module_path="shared.kv.connector"`,
`kv_connector="YuebingConnector"`) and builds it once in the scheduler process (role
SCHEDULER: `ConnectorScheduler` decides which blocks to save and load) and once in
each worker (role WORKER: `ConnectorWorker` copies bytes between vLLM's KV cache and
the pool). This class only builds the half for its role and hands each hook to it;
the halves share nothing but the per-step `YuebingMeta`.

The contract, in the request's `SamplingParams.extra_args["kv_transfer_params"]`:
- `kv_dest: str` (prefill) — save every prompt block into this node's pool as each
  layer is computed, the last partial one (its tail) with the prompt's last token; this node's messenger streams each layer on to the
  messenger of node `kv_dest` ("" or this node: keep the blocks here);
- `kv_blocks: int` with `kv_wait_s: float` (decode; prefill after a pull) — the first
  `kv_blocks` prompt blocks are on their way into this node's pool: wait up to
  `kv_wait_s` seconds (default 2) for them before computing what has not arrived;
- `kv_chunk_cap: int` (decode) — while this request is on the engine, a prompt
  beside other requests computes at most this many tokens a step, whatever role the
  engine launched in (shared/kv/chunk_cap.py);
- `kv_hashes: list[str]` (both) — the prompt's full-block hashes (hex) as the gateway
  computed them, so the prompt is hashed once in the cluster (computed here if absent);
- `kv_prompt_tokens: int` (decode) — the prompt's length: the tokens after it (the one
  prefill sampled, any decoded before a migration) are in no block, and the tail's
  hash (shared/block_hash.py `tail_hash`) covers the prompt's last tokens up to it.
Either way, the leading prompt blocks that are in the node pool (whoever computed
them, from DRAM or SSD) are loaded layer by layer while the rest is computed.

The connector's word on a finished request that had a `kv_dest`, in the request's
last output: `{"kv_blocks": n}`, the leading prompt blocks the pool took and so are
on their way to `kv_dest`. Decode is asked to wait for exactly those.

The first token (which prefill sampled but never ran through the model) is computed
by decode, and nothing else of the prompt: its tail, a partial block, travels as a
block of its own, so that a request joining a decode batch costs that batch one
token, not up to block_size (measured: docs/benchmarks/goodput.md). A block that is
missing, late past the wait, evicted before it was pinned, or failed its checksum is
computed; nothing waits past the wait.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from shared.kv.meta import YuebingMeta
from shared.kv.options import Options
from shared.kv.scheduler import ConnectorScheduler
from shared.kv.stats import KVPromMetrics, KVStats
from shared.kv.worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def _tensor_parallel_rank(parallel: Any) -> int:
    if parallel.tensor_parallel_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class YuebingConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        opts = Options.parse(self._kv_transfer_config.kv_connector_extra_config)
        vllm_block = vllm_config.cache_config.block_size
        if vllm_block != opts.block_size:
            raise ValueError(f"pool block size {opts.block_size} must equal vLLM's block size {vllm_block}")
        self.scheduler: ConnectorScheduler | None = None
        self.worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = ConnectorScheduler(opts, scheduler_config=vllm_config.scheduler_config)
        else:
            # A pipeline stage holds some layers, a tensor-parallel rank a share of each
            # layer's KV heads; the pool block holds the whole model's, one part per
            # (layer, rank).
            parallel = vllm_config.parallel_config
            sharded = parallel.pipeline_parallel_size > 1 or parallel.tensor_parallel_size > 1
            model_layers = vllm_config.model_config.get_total_num_hidden_layers() if sharded else 0
            self.worker = ConnectorWorker(opts, self._kv_cache_config.num_blocks, model_layers=model_layers,
                                          shards=parallel.tensor_parallel_size, shard=_tensor_parallel_rank(parallel))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise saves and loads run inside each attention call, which a full CUDA
        graph replays without Python: vLLM then captures piecewise graphs only."""
        return True

    def _meta(self) -> YuebingMeta:
        meta = self._get_connector_metadata()
        assert isinstance(meta, YuebingMeta)
        return meta

    # --- scheduler side -----------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self.scheduler is not None
        self.scheduler.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    # --- worker side --------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.save_kv_layer(self._meta(), layer_name)

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.take_load_errors()

    # --- counts, for the instance's /metrics page (shared/kv/stats.py) ---------------
    def get_kv_connector_stats(self) -> KVStats | None:
        half = self.scheduler or self.worker
        assert half is not None
        return half.counts.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStats:
        return KVStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVPromMetrics:
        return KVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for half in (self.scheduler, self.worker):
            if half is not None:
                half.shutdown()
