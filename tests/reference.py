"""Plain vLLM, the reference every greedy comparison is made against: one engine on
the same model, no disaggregation, at a pinned dtype."""

from __future__ import annotations

import os
from pathlib import Path

from shared.config import ClusterConfig
from shared.engine.llm import engine_environment

# Pinned on both sides of every greedy comparison: a cluster's default is vLLM's own
# choice ("auto"), which may differ from what the reference engine picks.
DTYPE = "float32"
# The reference takes prompts up to the model's limit (tests/e2e/test_long_context.py).
MAX_MODEL_LEN = 4096


class Reference:
    def __init__(self, model_dir: Path) -> None:
        for key, value in engine_environment(ClusterConfig(kv_cache_gib=1)).items():
            os.environ.setdefault(key, value)
        from vllm import LLM

        self.llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, dtype=DTYPE, enforce_eager=True, seed=0)

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        """Stop its engine (once: a second call does nothing)."""
        if self.llm is not None and hasattr(self.llm.llm_engine, "engine_core"):
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
