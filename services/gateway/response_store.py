"""Stored Responses API responses, which every gateway reads: one bucket of NATS
JetStream's key-value store (the cluster's nats-server keeps it on its disk), its
entries expiring after `responses_ttl_s` and the bucket bounded by
`responses_max_bytes` (the oldest go first). A key is the tenant's digest and the
response's id, so another tenant's id is simply not found; an id is checked before
it becomes a key."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError

from shared.bus import Link, servers
from shared.config import ClusterConfig
from shared.identity import RESPONSES_BUCKET

log = structlog.get_logger(__name__)
BUCKET = RESPONSES_BUCKET
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")  # the gateway's own ids: anything else was never stored
MAX_VALUE_BYTES = 900 << 10  # under nats-server's 1 MiB payload, with room for the headers
TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Stored:
    """A response as kept: itself, and the conversation its request rendered."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]

    def history(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """What a later turn starts from: the messages, and this response's output items."""
        return self.messages, self.response.get("output", [])

    def encode(self) -> bytes:
        return msgspec.json.encode({"response": self.response, "messages": self.messages})

    @classmethod
    def decode(cls, data: bytes) -> Stored:
        raw = msgspec.json.decode(data)
        return cls(raw["response"], raw["messages"])


def key(tenant: str, response_id: str) -> str:
    """The entry's key: tenant ids come from the tenants file, so they are hashed into the key's alphabet."""
    return f"{hashlib.sha256(tenant.encode()).hexdigest()[:32]}.{response_id}"


class ResponseStore:
    def __init__(self, link: Link, ttl_s: float, max_bytes: int, replicas: int = 1) -> None:
        self.link, self.ttl_s, self.max_bytes = link, ttl_s, max_bytes
        self.replicas = replicas  # copies JetStream keeps, each on another server of a NATS cluster
        self._kv: Any = None
        self._client: Any = None  # the NATS client the bucket handle was made on (the link remakes clients)

    @classmethod
    def from_config(cls, link: Link, config: ClusterConfig) -> ResponseStore:
        # On a NATS cluster, three copies (JetStream's most): stored responses outlive a server.
        return cls(link, config.responses_ttl_s, config.responses_max_bytes, min(3, len(servers(config.nats_url))))

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        if not RESPONSE_ID.fullmatch(response_id):
            return None
        try:
            entry = await (await self._bucket()).get(key(tenant, response_id))
        except (KeyNotFoundError, NotFoundError):
            return None
        return Stored.decode(entry.value) if entry.value else None

    async def put(self, tenant: str, stored: Stored) -> None:
        data = stored.encode()
        if len(data) > MAX_VALUE_BYTES:
            raise ValueError(f"a stored response holds at most {MAX_VALUE_BYTES} bytes, this one {len(data)}")
        await (await self._bucket()).put(key(tenant, stored.response["id"]), data)

    async def _bucket(self) -> Any:
        """The bucket, made by the first gateway that needs it (the same settings from every one)."""
        nc = self.link.client
        if self._kv is None or self._client is not nc:
            js = nc.jetstream(timeout=TIMEOUT_S)
            try:
                self._kv = await js.key_value(BUCKET)
            except BucketNotFoundError:
                self._kv = await js.create_key_value(KeyValueConfig(
                    bucket=BUCKET, ttl=self.ttl_s, max_bytes=self.max_bytes, max_value_size=MAX_VALUE_BYTES,
                    history=1, storage=StorageType.FILE, replicas=self.replicas))
                log.info("responses bucket made", bucket=BUCKET, ttl_s=self.ttl_s, max_bytes=self.max_bytes,
                         replicas=self.replicas)
            self._client = nc
        return self._kv
