"""The CPU pipeline-stage fix (shared/engine/stages.py): a later stage's activation
buffer is allocated on its first step, as vLLM's skipped warm-up would have."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import torch

from shared.engine.stages import STAGES_ENV, allocate_stage_buffers_on_first_use


class Model:
    def __init__(self) -> None:
        self.made = 0

    def make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype, device: str) -> dict:
        self.made += 1
        return {"hidden_states": torch.zeros(batch_size, 4, dtype=dtype, device=device)}


def test_a_stage_without_its_buffer_gets_one_on_first_use_and_keeps_it(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setenv(STAGES_ENV, "2")  # a pipelined engine's process (build_engine sets it)
    allocate_stage_buffers_on_first_use()
    allocate_stage_buffers_on_first_use()  # vLLM may load plugins twice in a process: patched once
    runner = SimpleNamespace(intermediate_tensors=None, model=Model(), max_num_tokens=16,
                             model_config=SimpleNamespace(dtype=torch.float32), device="cpu")
    sent = {"hidden_states": torch.ones(3, 4)}
    got = GPUModelRunner.sync_and_gather_intermediate_tensors(runner, 3, sent, True)
    again = GPUModelRunner.sync_and_gather_intermediate_tensors(runner, 2, None, False)
    assert runner.model.made == 1 and runner.intermediate_tensors["hidden_states"].shape == (16, 4)
    assert torch.equal(got["hidden_states"], torch.ones(3, 4))  # the received activations, through vLLM's own copy
    assert again["hidden_states"].shape == (2, 4)


def test_vllm_loads_it_as_a_general_plugin():
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("yuebing_stage_buffers") == "shared.engine.stages:allocate_stage_buffers_on_first_use"


def test_an_engine_without_stages_imports_nothing_for_it():
    code = ("import sys; from shared.engine.stages import allocate_stage_buffers_on_first_use as f; f(); "
            "print('vllm.v1.worker.gpu_model_runner' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != STAGES_ENV})
    assert out.stdout.strip() == "False"
