"""vLLM's own share of a decode service's CPU: the same engine, alone.

`yuebing bench control-plane --step-ms 0` measures the decode service's process, and
with real engines that process also runs vLLM's AsyncLLM front end (its output
processing, per-request queues and stats). This runs that front end with nothing of
Yuebing around it: an engine built from a layout's own cluster config, as the decode
service builds it, `streams` requests of `max_tokens` each back to back, and this
process's CPU over the tokens of one window. Run as its own process (the engine must
not share one with a cluster's client):

    python -m yuebing.bench.engine_alone CLUSTER_JSON --streams 8 --max-tokens 256 --seconds 40

`--raw` drives the same engine below AsyncLLM's front end: requests go straight to
its engine-core client and one task reads the core's outputs, with no output
processor, no RequestOutput and no per-request queue. The difference between the two
is what that front end costs a token, the most a decode service could save by taking
the core's outputs itself.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from yuebing.bench.control_plane import cpu_s

PROMPT_TOKEN_IDS = list(range(100, 125))  # about the control-plane bench's prompt's length


async def measure(config_path: str, streams: int, max_tokens: int, warmup_s: float, seconds: float,
                  raw: bool = False) -> dict[str, Any]:
    from shared.config import load_config

    config = load_config(config_path)  # before vLLM's import: a bad path fails in a moment
    from shared.engine.llm import build_engine, sampling_params
    from shared.messages import Sampling

    engine, _ = build_engine(config, None, role="decode")
    # vLLM's parameters as decode makes them (token ids only, each output its new tokens).
    params = sampling_params(Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), max_tokens)
    window = {"counting": False, "tokens": 0}
    tasks = (raw_clients if raw else asyncllm_clients)(engine, params, streams, window)
    await asyncio.sleep(warmup_s)
    start, before = time.monotonic(), cpu_s(os.getpid())
    window["counting"] = True
    await asyncio.sleep(seconds)
    window["counting"] = False
    span, used = time.monotonic() - start, cpu_s(os.getpid()) - before
    for task in tasks:
        task.cancel()
    engine.shutdown()
    tokens = int(window["tokens"])
    return {"tokens": tokens, "tokens_per_s": tokens / span, "us_per_token": 1e6 * used / max(1, tokens)}


def asyncllm_clients(engine: Any, params: Any, streams: int, window: dict[str, Any]) -> list[asyncio.Task]:
    """`streams` requests back to back through AsyncLLM's `generate`, as decode sends them."""

    async def client(i: int) -> None:
        for n in itertools.count():
            async for out in engine.generate({"prompt_token_ids": PROMPT_TOKEN_IDS}, params, f"r{i}-{n}"):
                if window["counting"]:
                    window["tokens"] += sum(len(c.token_ids) for c in out.outputs)

    return [asyncio.create_task(client(i)) for i in range(streams)]


def raw_clients(engine: Any, params: Any, streams: int, window: dict[str, Any]) -> list[asyncio.Task]:
    """`streams` requests back to back on the engine-core client itself, and the one
    task that reads the core's outputs (AsyncLLM's own reader is stopped: it would
    drop outputs of requests its output processor does not know)."""
    engine.output_handler.cancel()
    finished: dict[str, asyncio.Future] = {}

    async def reader() -> None:
        while True:
            for out in (await engine.engine_core.get_output_async()).outputs:
                if window["counting"]:
                    window["tokens"] += len(out.new_token_ids)
                if out.finish_reason is not None and out.request_id in finished:
                    finished.pop(out.request_id).set_result(None)

    async def client(i: int) -> None:
        tasks = await engine.get_supported_tasks()
        for n in itertools.count():
            request = engine.input_processor.process_inputs(
                f"r{i}-{n}", {"prompt_token_ids": PROMPT_TOKEN_IDS}, params, supported_tasks=tasks)
            engine.input_processor.assign_request_id(request)
            done = finished[request.request_id] = asyncio.get_running_loop().create_future()
            await engine.engine_core.add_request_async(request)
            await done

    return [asyncio.create_task(reader()), *(asyncio.create_task(client(i)) for i in range(streams))]


def run(config_path: Path, streams: int, max_tokens: int, warmup_s: float, seconds: float,
        raw: bool = False) -> dict[str, Any]:
    """Measure in a process of its own; its result, from the last line it prints."""
    argv = [sys.executable, "-m", "yuebing.bench.engine_alone", str(config_path), "--streams", str(streams),
            "--max-tokens", str(max_tokens), "--warmup-s", str(warmup_s), "--seconds", str(seconds),
            *(["--raw"] if raw else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=warmup_s + seconds + 300, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the engine alone failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    import uvloop  # the loop the services run on

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--warmup-s", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--raw", action="store_true", help="below AsyncLLM's front end: the engine-core client itself")
    a = p.parse_args()
    result = uvloop.run(measure(a.config, a.streams, a.max_tokens, a.warmup_s, a.seconds, a.raw))
    print(json.dumps(result), flush=True)
    os._exit(0)  # vLLM's engine-core process is gone; its atexit hooks would wait on it


if __name__ == "__main__":
    main()
