"""A vLLM general plugin (pyproject.toml) that lets a CPP prefill group (vLLM's
pipeline parallelism) run eagerly on the CPU.

A pipeline stage after the first receives the previous stage's activations into a
buffer that vLLM allocates during its warm-up forward pass. vLLM 0.32's CPU worker
skips that warm-up when the engine is eager (`enforce_eager`, as every Yuebing engine
is) and its KV cache size is given (VLLM_CPU_KVCACHE_SPACE), so the second stage's
first step fails on `assert self.intermediate_tensors is not None`. This allocates
the buffer on first use, exactly as vLLM's own warm-up (`_dummy_run`) would.

Only a pipelined engine needs it: `build_engine` sets STAGES_ENV for its processes,
and elsewhere the plugin imports nothing (vLLM's model runner takes 0.7 s to import
in a process that would not otherwise).
"""

from __future__ import annotations

import os
from typing import Any

STAGES_ENV = "YUEBING_PIPELINE_STAGES"


def allocate_stage_buffers_on_first_use() -> None:
    if int(os.environ.get(STAGES_ENV, "1")) <= 1:
        return
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # a vLLM without this runner has its own way
        return
    original = GPUModelRunner.sync_and_gather_intermediate_tensors
    if getattr(original, "yuebing_patched", False):  # plugins may load more than once in a process
        return

    def sync_and_gather_intermediate_tensors(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device
            )
        return original(self, *args, **kwargs)

    sync_and_gather_intermediate_tensors.yuebing_patched = True  # type: ignore[attr-defined]
    GPUModelRunner.sync_and_gather_intermediate_tensors = sync_and_gather_intermediate_tensors
