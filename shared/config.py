"""The one cluster configuration that every service reads.

`yuebing up` writes it to a JSON file and passes `--config PATH` to every child; a
container deployment mounts the same file. Per-process identity (instance id, node,
ports) comes from command-line flags, never from this file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgspec

ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
REQUEST_TIMEOUT_S = 300.0  # a request's deadline, from the gateway on (the simulator's clients too)


class ClusterConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    nats_url: str = "nats://127.0.0.1:4222"
    # Model folder (Hugging Face format) and the name the API serves it under.
    model: str = ""
    model_name: str = ""
    max_model_len: int = 4096
    dtype: str = "float32"
    # Tokens per pool block; the unit of block hashes (a multiple of vLLM's block size).
    block_size: int = 128
    # KV cache each vLLM CPU engine reserves, GiB, and its compute threads (CPU).
    kv_cache_gib: int = 1
    engine_threads: int = 1
    # Tokens one engine step computes at most (vLLM's max_num_batched_tokens): a long
    # prompt is prefilled in chunks, and the step that ends one prompt starts the next.
    step_tokens: int = 2048
    # How long vLLM's processes busy-wait for the next message (vLLM: 1 s); see
    # shared/engine.py limit_idle_spin.
    engine_spin_s: float = 0.002
    heartbeat_interval_s: float = 0.5
    # An instance silent for this long is treated as gone.
    liveness_timeout_s: float = 2.0
    schedule_timeout_s: float = 2.0
    request_timeout_s: float = REQUEST_TIMEOUT_S
    # Scheduling (see services/conductor/policy.py for the names).
    policy: str = "round_robin"
    admission: str = "none"
    # Default SLOs; a request may set its own (x-yuebing-slo-ttft-ms / -tbt-ms headers).
    slo_ttft_ms: float = 10_000.0
    slo_tbt_ms: float = 1_000.0
    # Time-model profile (`yuebing profile`); empty: the one shipped for the default model.
    profile: str = ""
    # Predictive admission's t_d: how long a request is assumed to decode.
    decode_time_s: float = 10.0
    # Learn t_d from the decodes that complete (decode_time_s is where it starts).
    learn_decode_time: bool = True
    # Blocks the Conductor assumes each prefill engine's prefix cache holds.
    index_capacity_blocks: int = 2048
    # KV transfer. kv_dir: where each node's messenger puts its pool file and local
    # sockets (shared memory; empty: /dev/shm/yuebing-<uid>); pool_bytes: each node
    # pool's size; kv_wait_s: how long decode waits for blocks still in transit
    # before computing them; kv_stream_layers: send each layer as prefill computes
    # it (False: send a block after its last layer, for comparison).
    kv_dir: str = ""
    pool_bytes: int = 512 << 20
    # Node pools: eviction policy ("lru" or "lfu"), and an optional SSD tier: each
    # node's messenger keeps up to ssd_bytes of DRAM-evicted blocks in ssd_dir/<node>.
    eviction: str = "lru"
    ssd_dir: str = ""
    ssd_bytes: int = 0
    kv_wait_s: float = 2.0
    kv_stream_layers: bool = True
    # vLLM's own prefix cache in each engine. Off, every reuse goes through the node
    # pools (what `yuebing bench reuse` measures).
    engine_prefix_caching: bool = True
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.step_tokens < self.block_size:
            raise ValueError(f"step_tokens must hold at least one block ({self.block_size}), got {self.step_tokens}")
        if self.heartbeat_interval_s <= 0 or self.liveness_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("liveness_timeout_s must exceed heartbeat_interval_s > 0")
        if self.request_timeout_s <= 0 or self.schedule_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.slo_ttft_ms <= 0 or self.slo_tbt_ms <= 0 or self.decode_time_s <= 0:
            raise ValueError("SLOs and decode_time_s must be positive")
        if self.index_capacity_blocks <= 0:
            raise ValueError("index_capacity_blocks must be positive")
        if self.pool_bytes <= 0 or self.kv_wait_s < 0 or self.ssd_bytes < 0:
            raise ValueError("pool_bytes must be positive, kv_wait_s and ssd_bytes not negative")
        if self.eviction not in ("lru", "lfu"):
            raise ValueError(f"eviction must be lru or lfu, got {self.eviction!r}")

    @property
    def served_model_name(self) -> str:
        return self.model_name or Path(self.model).name

    @property
    def kv_root(self) -> str:
        return self.kv_dir or f"/dev/shm/yuebing-{os.getuid()}"

    @property
    def model_salt(self) -> bytes:
        """Folded into block hashes so that two models never share a block name."""
        return self.served_model_name.encode()


DEFAULT_PROFILE = Path(__file__).with_name("profiles") / "yuebing-tiny-cpu.json"


def profile_path(config: ClusterConfig) -> Path:
    return Path(config.profile) if config.profile else DEFAULT_PROFILE


def load_config(path: str | os.PathLike[str]) -> ClusterConfig:
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read config {path}: {e}") from e
    try:
        return msgspec.json.decode(raw, type=ClusterConfig)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
        raise ValueError(f"invalid config {path}: {e}") from e


def save_config(config: ClusterConfig, path: str | os.PathLike[str]) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(config), indent=2))


def check_id(value: str, what: str = "id") -> str:
    """Instance and node ids become NATS subject tokens: keep them to a safe alphabet."""
    if not ID_PATTERN.match(value):
        raise ValueError(f"{what} {value!r} must match {ID_PATTERN.pattern}")
    return value
