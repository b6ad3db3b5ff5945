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


class ClusterConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    nats_url: str = "nats://127.0.0.1:4222"
    # Model folder (Hugging Face format) and the name the API serves it under.
    model: str = ""
    model_name: str = ""
    max_model_len: int = 4096
    dtype: str = "float32"
    # Tokens per pool block; the unit of block hashes (a multiple of vLLM's block size).
    block_size: int = 128
    # KV cache each vLLM CPU engine reserves, GiB.
    kv_cache_gib: int = 1
    heartbeat_interval_s: float = 0.5
    # An instance silent for this long is treated as gone.
    liveness_timeout_s: float = 2.0
    schedule_timeout_s: float = 2.0
    request_timeout_s: float = 300.0
    policy: str = "round_robin"
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.heartbeat_interval_s <= 0 or self.liveness_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("liveness_timeout_s must exceed heartbeat_interval_s > 0")
        if self.request_timeout_s <= 0 or self.schedule_timeout_s <= 0:
            raise ValueError("timeouts must be positive")

    @property
    def served_model_name(self) -> str:
        return self.model_name or Path(self.model).name

    @property
    def model_salt(self) -> bytes:
        """Folded into block hashes so that two models never share a block name."""
        return self.served_model_name.encode()


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
