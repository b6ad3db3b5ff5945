"""`yuebing bench connector`: what the connector's copies cost the forward, measured
on the real copy machinery (shared/kv/copier.py, which the worker half wraps) driven
by a LLaMA-shaped torch forward, without vLLM, into a real node pool file in shared
memory.

Per prompt length, in one run:
- prefill alone: the forward writing each layer's K/V into a cache in vLLM's
  FlashAttention layout (2, blocks, block size, KV heads, head size);
- prefill with saves: the same, handing each layer to the copier as soon as it is
  written, as vLLM's `save_kv_layer` does (and the ratio to prefill alone);
- noted after the end: from the forward's end until the last layer's copies have
  landed and been checksummed, when the worker tells the messenger;
- load: every layer copied back from the pool, each waited for as the forward would
  (`wait_layer`): GB/s, and its time over prefill alone's (what recomputing costs);
- the machine's bare copy bandwidth, each way, the limit of both.
The loaded blocks are checked equal to those saved. Runs without vLLM, so that a GPU
machine with only PyTorch measures it: `python -m yuebing.bench.connector`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.kv.copier import (
    COPY_PATHS,
    Copier,
    LayerLoad,
    LayerSave,
    MappedPool,
    StreamCopier,
    blocks_first,
    copier_for,
    geometry_of,
)
from shared.kv.pool_file import PoolFile, PoolSlots, checksum
from yuebing.bench.connector_config import GPU_BAR, SHAPES, ConnectorBench
from yuebing.shapes import ModelShape


def resolve(cfg: ConnectorBench) -> tuple[torch.device, ModelShape, str]:
    """The device, the model shape and its name, `auto` settled and bad values refused."""
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu, cuda or auto, got {cfg.device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device answers (torch.cuda.is_available() is false)")
    name = cfg.model_shape if cfg.model_shape != "auto" else ("llama3-8b" if device == "cuda" else "tiny")
    if name not in SHAPES:
        raise ValueError(f"--model-shape must be one of {', '.join(SHAPES)} or auto, got {cfg.model_shape!r}")
    check_flags(cfg, SHAPES[name].block_size)
    index = torch.cuda.current_device() if device == "cuda" else None
    return torch.device(device, index), SHAPES[name], name


def check_flags(cfg: ConnectorBench, block_size: int) -> None:
    if not cfg.tokens or min(cfg.tokens) < block_size or cfg.repeats < 1 or cfg.warmup < 0:
        raise ValueError(f"--tokens must each be at least one block ({block_size}), "
                         "--repeats at least 1, --warmup at least 0")
    if cfg.save_copies not in COPY_PATHS or cfg.load_copies not in COPY_PATHS:
        raise ValueError(f"--save-copies and --load-copies must each be {' or '.join(COPY_PATHS)}")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
                 platform.processor() or "CPU")
    return f"{model} ({os.cpu_count()} cores)"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


class Model:
    """A LLaMA-shaped decoder (RMSNorm, GQA attention, SwiGLU) with one set of weights
    shared by every layer: the FLOPs of the real model in a fraction of its memory."""

    def __init__(self, shape: ModelShape, device: torch.device, dtype: torch.dtype, max_tokens: int) -> None:
        s, g = shape, torch.Generator(device="cpu").manual_seed(0)
        self.shape, self.device = s, device

        def weight(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=g) / rows**0.5).to(device, dtype)

        self.qkv = weight(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim)
        self.out = weight(s.heads * s.head_dim, s.hidden)
        self.gate_up = weight(s.hidden, 2 * s.intermediate)
        self.down = weight(s.intermediate, s.hidden)
        self.blocks = -(-max_tokens // s.block_size)
        # vLLM's FlashAttention layout: (K/V, blocks, block size, KV heads, head size).
        self.caches = [torch.zeros(2, self.blocks, s.block_size, s.kv_heads, s.head_dim, device=device, dtype=dtype)
                       for _ in range(s.layers)]

    def forward(self, x: torch.Tensor, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        for index in range(self.shape.layers):
            x = self._layer(x, index)
            if after_layer is not None:
                after_layer(index)
        return x

    def _layer(self, x: torch.Tensor, index: int) -> torch.Tensor:
        s, tokens = self.shape, x.shape[0]
        q, k, v = (_rms(x) @ self.qkv).split([s.heads * s.head_dim, s.kv_heads * s.head_dim,
                                              s.kv_heads * s.head_dim], dim=-1)
        k, v = k.view(tokens, s.kv_heads, s.head_dim), v.view(tokens, s.kv_heads, s.head_dim)
        cache = self.caches[index].view(2, -1, s.kv_heads, s.head_dim)
        cache[0, :tokens].copy_(k)
        cache[1, :tokens].copy_(v)
        x = x + _attention(q.view(tokens, s.heads, s.head_dim), k, v).reshape(tokens, -1) @ self.out
        gate, up = (_rms(x) @ self.gate_up).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ self.down


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention on (tokens, heads, head size) tensors, as (batch, heads,
    tokens, head size) with K/V heads repeated: the shape PyTorch's flash kernel takes
    (in 3-D, or with enable_gqa, it falls back to a quadratic-memory path ~10x slower)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, is_causal=True)
    return out.squeeze(0).transpose(0, 1)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)


def _stream_synced(device: torch.device) -> Callable[[], None]:
    """Waits for the compute stream only (the forward's end), never the copy streams."""
    if device.type == "cuda":
        return lambda: torch.cuda.current_stream(device).synchronize()
    return lambda: None


def median_s(fn: Callable[[], float], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(fn() for _ in range(repeats))


def timed(fn: Callable[[], Any], synced: Callable[[], None]) -> float:
    synced()
    start = time.perf_counter()
    fn()
    synced()
    return time.perf_counter() - start


@dataclass
class Rig:
    """One bench's parts: the model, the pool its blocks go to, the copier between them."""

    model: Model
    pool: MappedPool
    copier: Copier
    synced: Callable[[], None]

    @property
    def caches(self) -> list[torch.Tensor]:
        return [blocks_first(c, self.model.blocks) for c in self.model.caches]


def saving_run(rig: Rig, x: torch.Tensor, blocks: int) -> tuple[float, float]:
    """One forward handing each layer to the copier: (seconds to the forward's end,
    seconds from then until the last layer was noted)."""
    caches, stamps = rig.caches, []
    ids = list(range(blocks))

    def save(index: int) -> None:
        rig.copier.save(rig.pool, caches[index], LayerSave(index, ids, ids), lambda sums: stamps.append(time.perf_counter()))

    rig.synced()
    start = time.perf_counter()
    rig.model.forward(x, save)
    rig.synced()
    end = time.perf_counter()
    if not rig.copier.settle() or len(stamps) != len(caches):
        raise RuntimeError(f"only {len(stamps)} of {len(caches)} layers were noted")
    return end - start, max(0.0, max(stamps) - end)


def load_run(rig: Rig, blocks: int) -> float:
    """Every layer's blocks back from the pool, waited for layer by layer: seconds."""
    for cache in rig.model.caches:
        cache.zero_()
    caches, ids = rig.caches, list(range(blocks))
    rig.synced()
    start = time.perf_counter()
    job = rig.copier.load(rig.pool, caches, list(range(len(caches))), LayerLoad(ids, ids), lambda: None)
    if not all(rig.copier.wait_layer(job, index) for index in range(len(caches))):
        raise RuntimeError("a load failed")
    rig.synced()
    return time.perf_counter() - start


def case(rig: Rig, tokens: int, cfg: ConnectorBench) -> dict:
    s = rig.model.shape
    x = torch.randn(tokens, s.hidden, device=rig.model.device).to(rig.model.caches[0].dtype)
    blocks = tokens // s.block_size  # full blocks: what prefill saves
    alone = median_s(lambda: timed(lambda: rig.model.forward(x), rig.synced), cfg.repeats, cfg.warmup)
    runs = [saving_run(rig, x, blocks) for _ in range(cfg.warmup + cfg.repeats)][cfg.warmup:]
    check_landed(rig, blocks)
    saved = [c[:blocks].clone() for c in (rig.caches[0], rig.caches[-1])]
    load = median_s(lambda: load_run(rig, blocks), cfg.repeats, cfg.warmup)
    if not all(torch.equal(a, b[:blocks]) for a, b in zip(saved, (rig.caches[0], rig.caches[-1]))):
        raise RuntimeError("the blocks loaded back differ from those saved")
    with_saves = statistics.median(r[0] for r in runs)
    moved = blocks * rig.pool.slots.geometry.layer_bytes * s.layers
    return {"tokens": tokens, "blocks": blocks, "prefill_ms": alone * 1e3, "with_saves_ms": with_saves * 1e3,
            "ratio": with_saves / alone, "noted_after_end_ms": statistics.median(r[1] for r in runs) * 1e3,
            "load_ms": load * 1e3, "load_gbps": moved / load / 1e9, "load_over_recompute": load / alone}


def check_landed(rig: Rig, blocks: int) -> None:
    """The saved bytes are in the pool file itself (the host's bytes, not a copy of them):
    the first and last block of the first and last layer."""
    caches = rig.caches
    for layer, block in ((0, 0), (len(caches) - 1, blocks - 1)):
        cache = caches[layer]
        part = rig.pool.layer(block, layer, cache.dtype).view(cache[block].shape)
        if not torch.equal(part, cache[block].cpu()):
            raise RuntimeError(f"layer {layer}, block {block}: the pool file does not hold what was saved")


def bare_gbps(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> dict[str, float]:
    """The machine's plain copy bandwidth: pinned host ↔ GPU each way, or memcpy on a CPU."""
    if device.type != "cuda":
        a, b = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        return {"memcpy": nbytes / median_s(lambda: timed(lambda: b.copy_(a), lambda: None), repeats, 1) / 1e9,
                "checksum_one_thread": checksum_gbps(a.numpy(), repeats)}
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sync = lambda: torch.cuda.synchronize(device)
    return {
        "host_to_device": nbytes / median_s(lambda: timed(lambda: gpu.copy_(host, non_blocking=True), sync),
                                            repeats, 1) / 1e9,
        "device_to_host": nbytes / median_s(lambda: timed(lambda: host.copy_(gpu, non_blocking=True), sync),
                                            repeats, 1) / 1e9,
        "checksum_one_thread": checksum_gbps(host.numpy(), repeats),
    }


def checksum_gbps(data: Any, repeats: int) -> float:
    """xxh3 (the layer checksum) over `data` on one thread: what the checksums of saved
    layers cost a core, per GB."""
    view = memoryview(data).cast("B")
    return view.nbytes / median_s(lambda: timed(lambda: checksum(view), lambda: None), repeats, 1) / 1e9


def pool_for(caches: list[torch.Tensor], blocks: int, folder: Path) -> MappedPool:
    """A node pool file holding `blocks` blocks of these caches, as a messenger makes one."""
    geometry = geometry_of([blocks_first(c, blocks) for c in caches])
    file = PoolFile(folder / "bench.pool", blocks * geometry.slot_bytes, create=True)
    return MappedPool.of("bench", PoolSlots(file, geometry))


def run(cfg: ConnectorBench, progress: Callable[[str], None] = print) -> dict:
    device, shape, shape_name = resolve(cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Model(shape, device, dtype, max(cfg.tokens))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="yuebing-bench-", dir=shm) as folder:
        pool = pool_for(model.caches, model.blocks, Path(folder))
        copier = copier_for(device, cfg.checksum_threads, cfg.save_copies, cfg.load_copies)
        try:
            copier.adopt(pool)
            copies = (f"saves by {copier.path(pool, copier.saves_by)}, loads by {copier.path(pool, copier.loads_by)}"
                      if isinstance(copier, StreamCopier) else "a copy thread")
            rig = Rig(model, pool, copier, _stream_synced(device))
            rows = []
            for tokens in cfg.tokens:
                progress(f"{tokens} tokens ...")
                rows.append(case(rig, tokens, cfg))
        finally:
            copier.close()
            pool.close()
    return {"benchmark": "connector", "device": device_name(device), "device_type": device.type,
            "model_shape": shape_name, "dtype": str(dtype).removeprefix("torch."), "copies": copies,
            "rows": rows, "bare_gbps": bare_gbps(device)}


def table(result: dict) -> str:
    head = (f"{'device':<28} {'tokens':>7} {'prefill ms':>10} {'w/ saves ms':>11} {'ratio':>6} "
            f"{'noted +ms':>9} {'load ms':>8} {'load GB/s':>9} {'load/recompute':>14}")
    lines = [f"model shape {result['model_shape']} ({result['dtype']}), copies: {result['copies']}", head]
    for r in result["rows"]:
        lines.append(f"{result['device'][:28]:<28} {r['tokens']:>7} {r['prefill_ms']:>10.1f} {r['with_saves_ms']:>11.1f} "
                     f"{r['ratio']:>6.3f} {r['noted_after_end_ms']:>9.2f} {r['load_ms']:>8.1f} "
                     f"{r['load_gbps']:>9.1f} {r['load_over_recompute']:>14.3f}")
    bare = ", ".join(f"{k.replace('_', ' ')} {v:.1f} GB/s" for k, v in result["bare_gbps"].items())
    lines.append(f"bare copy on {result['device']}: {bare}")
    if result["device_type"] == "cuda":
        lines.append(verdict(result["rows"]))
    return "\n".join(lines)


def verdict(rows: list[dict]) -> str:
    ok = [r["ratio"] <= GPU_BAR["ratio"] and r["load_gbps"] >= GPU_BAR["load_gbps"]
          and r["noted_after_end_ms"] <= GPU_BAR["noted_ms"] for r in rows]
    return (f"bar (ratio <= {GPU_BAR['ratio']}, noted within {GPU_BAR['noted_ms']:.0f} ms, "
            f"load >= {GPU_BAR['load_gbps']:.0f} GB/s): " + ", ".join(
                f"{r['tokens']}: {'met' if good else 'missed'}" for r, good in zip(rows, ok)))


def main(argv: list[str] | None = None) -> int:
    """The bench without the rest of yuebing's command (a GPU box with only PyTorch)."""
    from yuebing.flags import add_flags, from_args

    parser = argparse.ArgumentParser(prog="python -m yuebing.bench.connector", description=__doc__.split("\n")[0])
    add_flags(parser, ConnectorBench)
    parser.add_argument("--json", metavar="PATH", help="also write the result here")
    args = parser.parse_args(argv)
    result = run(from_args(ConnectorBench, args))
    print(table(result))
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
