"""vLLM's own share of a decode service's CPU: the same engine, alone.

`yuebing bench control-plane --step-ms 0` measures the decode service's process, and
with real engines that process also runs vLLM's AsyncLLM front end (its output
processing, per-request queues and stats). This runs that front end with nothing of
Yuebing around it: an engine built from a layout's own cluster config, as the decode
service builds it, `streams` requests of `max_tokens` each back to back, and this
process's CPU over the tokens of one window. Run as its own process (the engine must
not share one with a cluster's client):

    python -m yuebing.bench.engine_alone CLUSTER_JSON --streams 8 --max-tokens 256 --seconds 40
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


async def measure(config_path: str, streams: int, max_tokens: int, warmup_s: float, seconds: float) -> dict[str, Any]:
    from shared.config import load_config

    config = load_config(config_path)  # before vLLM's import: a bad path fails in a moment
    from shared.engine.llm import build_engine, sampling_params
    from shared.messages import Sampling

    engine, _ = build_engine(config, None, role="decode")
    # vLLM's parameters as decode makes them (token ids only, each output its new tokens).
    params = sampling_params(Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), max_tokens)
    window = {"counting": False, "tokens": 0}

    async def client(i: int) -> None:
        for n in itertools.count():
            async for out in engine.generate({"prompt_token_ids": PROMPT_TOKEN_IDS}, params, f"r{i}-{n}"):
                if window["counting"]:
                    window["tokens"] += sum(len(c.token_ids) for c in out.outputs)

    tasks = [asyncio.create_task(client(i)) for i in range(streams)]
    await asyncio.sleep(warmup_s)
    start, before = time.monotonic(), cpu_s(os.getpid())
    window["counting"] = True
    await asyncio.sleep(seconds)
    window["counting"] = False
    span, used = time.monotonic() - start, cpu_s(os.getpid()) - before
    for task in tasks:
        task.cancel()
    engine.shutdown()
    tokens = max(1, int(window["tokens"]))
    return {"tokens_per_s": tokens / span, "us_per_token": 1e6 * used / tokens}


def run(config_path: Path, streams: int, max_tokens: int, warmup_s: float, seconds: float) -> dict[str, Any]:
    """Measure in a process of its own; its result, from the last line it prints."""
    argv = [sys.executable, "-m", "yuebing.bench.engine_alone", str(config_path), "--streams", str(streams),
            "--max-tokens", str(max_tokens), "--warmup-s", str(warmup_s), "--seconds", str(seconds)]
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
    a = p.parse_args()
    result = uvloop.run(measure(a.config, a.streams, a.max_tokens, a.warmup_s, a.seconds))
    print(json.dumps(result), flush=True)
    os._exit(0)  # vLLM's engine-core process is gone; its atexit hooks would wait on it


if __name__ == "__main__":
    main()
