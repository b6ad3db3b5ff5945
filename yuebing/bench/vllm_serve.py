"""Plain `vllm serve` beside a cluster, for the benchmarks that compare with it: vLLM's
OpenAI server on the same model, with the settings the cluster's engines run with
(shared/engine/llm.py: block size, step tokens, eager, one engine thread)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Server:
    url: str
    pid: int  # the API server's process (its engine core runs in a child of it)


def argv(model: Path, port: int, max_model_len: int, dtype: str) -> list[str]:
    """vLLM's OpenAI server with the cluster engines' settings."""
    from shared.config import ClusterConfig

    c = ClusterConfig()
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", model.name, "--port", str(port), "--max-model-len", str(max_model_len),
            "--dtype", dtype, "--block-size", str(c.block_size), "--max-num-batched-tokens", str(c.step_tokens),
            "--enforce-eager", "--seed", "0"]


@contextmanager
def servers(work: Path, model: Path, max_model_len: int, dtype: str, count: int = 1) -> Iterator[list[Server]]:
    """`count` plain vLLM OpenAI servers, ready; stopped on leaving. Logs: work/vllm-N.log."""
    from shared.config import ClusterConfig
    from shared.engine.llm import engine_environment
    from yuebing import process
    from yuebing.bench.ttft import _answers

    env = {**os.environ, **engine_environment(ClusterConfig()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs, up = [], []
    try:
        for n in range(count):
            port = process.free_port()
            procs.append(process.spawn(argv(model, port, max_model_len, dtype), work / f"vllm-{n}.log", env))
            up.append(Server(f"http://127.0.0.1:{port}", procs[-1].pid))
        for n, (proc, server) in enumerate(zip(procs, up, strict=True)):
            process.wait_until(lambda url=server.url: _answers(url), proc, 600.0,
                               f"vLLM server {n} (see {work}/vllm-{n}.log)")
        yield up
    finally:
        process.stop(procs, grace_s=60.0, sig=signal.SIGINT)
