"""The connector's settings: vLLM's `kv_connector_extra_config`, as
shared/engine writes it (kv_dir, node, block_size, salt, model; timeout_s and checksum_threads optional)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Options:
    kv_dir: str  # where the node's pool file and sockets live
    node: str  # whose messenger this engine talks to
    block_size: int  # tokens per pool block: vLLM's block size
    salt: bytes  # the cluster's block-hash salt (shared/block_hash.py)
    model: str  # served model name: a pool holds one model's blocks
    timeout_s: float = 1.0  # longest wait for a messenger's answer
    checksum_threads: int = 0  # threads summing saved layers off the forward path (0: one per core, up to 8)

    @staticmethod
    def parse(extra: dict[str, Any]) -> Options:
        try:
            return Options(
                kv_dir=str(extra["kv_dir"]),
                node=str(extra["node"]),
                block_size=int(extra["block_size"]),
                salt=str(extra["salt"]).encode(),
                model=str(extra["model"]),
                timeout_s=float(extra.get("timeout_s", 1.0)),
                checksum_threads=int(extra.get("checksum_threads", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"Yuebing connector: bad kv_connector_extra_config {extra!r}: {e}") from e
