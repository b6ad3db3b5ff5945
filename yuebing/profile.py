"""`yuebing profile`: measure the real engine and fit the Conductor's time models.

Runs an in-process vLLM engine over a grid of (new tokens, cached prefix tokens) for
prefill and (batch, context per sequence) for decode, measures the KV transport's
bandwidth, fits the models of shared/predictor.py on part of the grid, prints their
error on the held-out rest, and writes every measured row to a profile file that the
Conductor and the simulator load.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from shared.config import ClusterConfig
from shared.engine.llm import engine_environment
from shared.predictor import Predictor, Row, fit, mape
from yuebing.profile_cache import engine_version
from yuebing.progress import progress


@dataclass(frozen=True)
class Grid:
    block_size: int = 128  # the engine's; prefixes are whole blocks so they really hit
    prefill_totals: tuple[int, ...] = (128, 256, 512, 768, 1024, 1536, 2048, 3072)
    prefix_shares: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    contexts: tuple[int, ...] = (128, 512, 1024, 2048)
    max_batch_tokens: int = 16384
    repeats: int = 3
    steps: tuple[int, int] = (4, 20)  # decode step time = ΔT / Δsteps
    warm_each: bool = True  # an untimed run before each point's (else one before all)

    def prefill_points(self) -> list[tuple[int, int]]:
        points = []
        for total in self.prefill_totals:
            for share in self.prefix_shares:
                p = int(total * share) // self.block_size * self.block_size
                points.append((total - p, p))
        return sorted(set(points))

    def decode_points(self) -> list[tuple[int, int]]:
        return [(b, c) for b in self.batches for c in self.contexts if b * c <= self.max_batch_tokens]


# A short pass for a model no profile describes yet (`yuebing up` runs it once per
# model and machine, yuebing/profile_cache.py): enough points to fit each phase's four
# terms and hold a quarter out, one timed run each.
QUICK = Grid(prefill_totals=(128, 512, 1024, 2048), prefix_shares=(0.0, 0.5), batches=(1, 4, 8),
             contexts=(128, 1024), repeats=1, warm_each=False)


class Engine:
    """A plain in-process vLLM engine, with unique random prompts so nothing is
    cached unless a measurement caches it on purpose."""

    def __init__(self, model: str, max_model_len: int, dtype: str = "float32") -> None:
        for key, value in engine_environment(ClusterConfig(kv_cache_gib=4)).items():
            os.environ.setdefault(key, value)
        from vllm import LLM

        self.llm = LLM(model=model, max_model_len=max_model_len, dtype=dtype, enforce_eager=True, seed=0)
        self.vocab = 256  # ids every tokenizer has; any ids work for timing
        self.rng = random.Random(0)
        self.decode_prompts: dict[tuple[int, int], list[list[int]]] = {}

    def close(self) -> None:
        """Stop the engine-core process now, not whenever the garbage collector runs."""
        self.llm.llm_engine.engine_core.shutdown()

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def run(self, prompts: list[list[int]], max_tokens: int) -> float:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return (time.perf_counter() - start) * 1e3

    def prefill_ms(self, n: int, p: int) -> float:
        prompt = self.prompt(n + p)
        if p:
            self.run([prompt[:p]], 1)  # puts the prefix's blocks in the prefix cache
        return self.run([prompt], 1)

    def decode_step_ms(self, batch: int, ctx: int, steps: tuple[int, int]) -> float:
        # The same prompts for every repeat of a point: the timed runs are of cached
        # prompts anyway, and a batch's prefill is most of a decode point's cost.
        if (batch, ctx) not in self.decode_prompts:
            self.decode_prompts[batch, ctx] = [self.prompt(ctx) for _ in range(batch)]
        prompts = self.decode_prompts[batch, ctx]
        self.run(prompts, 1)  # cached from now on: the timed runs below are (nearly) all decode
        short, long = (self.run(prompts, s) for s in steps)
        return (long - short) / (steps[1] - steps[0])


EXTRA_TRIES = 4  # timings more, at most, where none of the repeats was positive


def measure(engine: Engine, grid: Grid, model_name: str) -> list[dict]:
    rows = []
    prefill, decode = grid.prefill_points(), grid.decode_points()
    warm = int(grid.warm_each)
    with progress(total=(len(prefill) + len(decode)) * (grid.repeats + warm), desc="profiling", unit="run") as bar:

        def best(measure_once: Callable[[], float]) -> float:
            return fastest(measure_once, grid.repeats, lambda: bar.update(), warm=grid.warm_each)

        if not grid.warm_each:
            engine.run([engine.prompt(grid.block_size)], grid.steps[1])  # the one-off costs, once

        for n, p in prefill:
            rows.append(_row(model_name, "prefill", n, p, 1, n + p, best(lambda: engine.prefill_ms(n, p))))
        for batch, ctx in decode:
            ms = best(lambda: engine.decode_step_ms(batch, ctx, grid.steps))
            rows.append(_row(model_name, "decode", 1, ctx, batch, ctx, ms))
    return rows


def fastest(measure_once: Callable[[], float], repeats: int, tick: Callable[[], None], warm: bool = True) -> float:
    """The least of `repeats` timings, after one untimed run where `warm` (else the
    caller warmed the engine once): the first run of a new
    shape pays one-off costs (kernel selection, allocations), and on a shared machine
    noise only ever adds time. A timing that is not positive is noise too (a decode
    step is the difference of two runs: a hiccup in the shorter one makes it
    negative): where no repeat is positive, up to EXTRA_TRIES more are taken."""
    if warm:
        measure_once()
        tick()
    times: list[float] = []
    while len(times) < repeats or (not any(t > 0 for t in times) and len(times) < repeats + EXTRA_TRIES):
        times.append(measure_once())
        tick()
    positive = [t for t in times if t > 0]
    if not positive:
        raise RuntimeError(f"no positive timing in {len(times)} tries: the machine is too busy to profile on")
    return min(positive)


def _row(model: str, phase: str, n: int, p: int, batch: int, ctx: int, ms: float) -> dict:
    return {"model": model, "phase": phase, "n": n, "p": p, "batch": batch, "ctx": ctx, "ms": round(ms, 4)}


def transport_bandwidth_gbps(seconds: float = 1.0, frame_bytes: int = 4 << 20) -> float:
    """ZeroMQ PUSH→PULL over TCP loopback, the KV transport's path between nodes."""
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    payload = bytearray(frame_bytes)
    stop = threading.Event()

    def send() -> None:
        while not stop.is_set():
            push.send(payload, copy=False)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    pull.recv(copy=False)  # connected and flowing
    received, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        received += len(pull.recv(copy=False))
    elapsed = time.perf_counter() - start
    stop.set()
    while sender.is_alive():
        try:
            pull.recv(flags=zmq.NOBLOCK)
        except zmq.Again:
            time.sleep(0.01)
    ctx.destroy(linger=0)
    return received / elapsed / 1e9


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * dtype_bytes


def held_out_error(rows: list[Row]) -> dict[str, float]:
    """Fit on three quarters of each phase's rows, report MAPE (%) on the other quarter."""
    test = [r for phase in ("prefill", "decode") for r in [x for x in rows if x.phase == phase][1::4]]
    train = [r for r in rows if r not in test]
    predictor = Predictor(fit(train, "prefill"), fit(train, "decode"))
    return {phase: mape(predictor, [r for r in test if r.phase == phase]) for phase in ("prefill", "decode")}


def profile(model_dir: Path, out: Path, grid: Grid, max_model_len: int = 4096, dtype: str = "float32") -> dict:
    model_dir = model_dir.resolve()
    started = time.perf_counter()
    engine = Engine(str(model_dir), max_model_len, dtype)
    served_dtype = engine.llm.llm_engine.model_config.dtype  # what "auto" became
    try:
        rows = measure(engine, grid, model_dir.name)
    finally:
        engine.close()
    typed = [Row(r["phase"], r["n"], r["p"], r["batch"], r["ctx"], r["ms"]) for r in rows]
    errors = held_out_error(typed)
    meta = {
        "model": model_dir.name,
        "dtype": dtype,
        "served_dtype": str(served_dtype).removeprefix("torch."),
        "method": "in-process vLLM (greedy, ignore_eos); prefill: TTFT of one request after caching its prefix; "
        f"decode: (T({grid.steps[1]} steps) - T({grid.steps[0]} steps)) / {grid.steps[1] - grid.steps[0]} on cached prompts; "
        + ("minimum of repeats after one untimed run" if grid.warm_each else "one untimed run, then each point once"),
        "engine": f"vllm {engine_version()}",
        "kv_bytes_per_token": kv_bytes_per_token(model_dir, served_dtype.itemsize),
        "transfer_GBps": round(transport_bandwidth_gbps(), 3),
        "held_out_mape_percent": {k: round(v, 2) for k, v in errors.items()},
        "grid": asdict(grid),
        "seconds": round(time.perf_counter() - started, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return meta
