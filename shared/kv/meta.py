"""What the connector's scheduler half hands its worker half for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from shared.kv.plan import Load, Save


@dataclass
class YuebingMeta(KVConnectorMetadata):
    pool_id: str = ""  # the pool the slots below are in
    saves: list[Save] = field(default_factory=list)  # blocks to copy into the pool, layer by layer
    loads: list[Load] = field(default_factory=list)  # blocks to fill from pinned slots
    failed: list[int] = field(default_factory=list)  # claimed blocks that cannot be loaded: report them
