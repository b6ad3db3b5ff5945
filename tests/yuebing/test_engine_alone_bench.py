"""`yuebing.bench.engine_alone --raw` drives vLLM's engine below AsyncLLM's front end:
its engine-core client and input processor, with AsyncLLM's own output task stopped.
A vLLM that moved those parts fails here, without an engine started."""

from __future__ import annotations

import inspect

from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import AsyncMPClient
from vllm.v1.engine.input_processor import InputProcessor


def test_the_raw_clients_reach_parts_vllms_async_llm_still_has():
    made = inspect.getsource(AsyncLLM.__init__) + inspect.getsource(AsyncLLM._run_output_handler)
    assert all(f"self.{part} =" in made for part in ("engine_core", "input_processor", "output_handler"))
    assert all(callable(getattr(AsyncMPClient, m, None)) for m in ("get_output_async", "add_request_async"))
    assert all(callable(getattr(InputProcessor, m, None)) for m in ("process_inputs", "assign_request_id"))
    assert callable(getattr(AsyncLLM, "get_supported_tasks", None))
