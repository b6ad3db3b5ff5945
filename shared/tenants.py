"""Tenants: who may call the API, which KV cache their prompts share, and the limits
and class admission gives them.

One owner-only JSON file (`yuebing up --tenants PATH`), read by every gateway (keys,
cache groups) and every Conductor (limits, classes), and read again when it changes:
a bad file leaves the last good one in force. Keys are kept as SHA-256 digests only.
Without a file the single-key settings are one tenant, `default`, whose cache is the
cluster's one cache, as before tenants existed.

A cache group's salt (`cache_salt`) comes from the cluster's cache key and the
group's name: it is folded into the first block's hash at the gateway and handed to
each engine as vLLM's own `cache_salt`, so every index, pool, tier and transfer, and
vLLM's prefix cache inside each engine, keep groups apart (docs/tenants.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec
from msgspec import Meta
import structlog

from shared.private_file import read_private

log = structlog.get_logger(__name__)

Priority = Literal["critical", "standard", "sheddable"]
PRIORITIES: tuple[Priority, ...] = ("critical", "standard", "sheddable")  # refused last to first
DEFAULT_TENANT = "default"  # the single-key settings' one tenant
TENANTS_ENV = "YUEBING_TENANTS_FILE"  # where the gateways and Conductors find the file, without a flag
# Tenant ids reach metrics labels, log lines and subjects' payloads: a short, plain name.
TENANT_ID = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
MAX_CLIENT_SALT = 128  # vLLM's bound on `cache_salt`
CLIENT_SALT_FORBIDDEN = "@/\\\0"  # vLLM's: a salt names cache files in some backends


class TenantEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One tenant as the file writes it (the configuration reference's table is made from this)."""

    id: Annotated[str, Meta(description="its name in logs, spans and metrics: 1-63 of a-z 0-9 _ . -")]
    key_sha256: Annotated[
        str | list[str], Meta(description="a key's SHA-256 (lowercase hex), or a list of them while a key is "
                                          "rotated; none only for the anonymous tenant")
    ] = []
    cache_group: Annotated[
        str, Meta(description="tenants naming one group share its KV cache (empty: the tenant's own, its id)")
    ] = ""
    requests_per_minute: Annotated[int, Meta(description="requests admitted in any minute (0: no limit)")] = 0
    tokens_per_minute: Annotated[
        int, Meta(description="prompt plus max_tokens tokens admitted in any minute (0: no limit)")
    ] = 0
    max_streams: Annotated[int, Meta(description="requests in flight at once (0: no limit)")] = 0
    priority: Annotated[str, Meta(description="its class under overload: critical, standard or sheddable")] = "standard"
    weight: Annotated[float, Meta(description="its share of its class's admission under overload")] = 1.0
    metrics: Annotated[
        bool, Meta(description="its keys may read the gateway's /metrics (every tenant's figures): an operator's")
    ] = False
    anonymous: Annotated[
        bool, Meta(description="requests sending no key are its (at most one tenant: a public tier)")
    ] = False


class TenantsFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    tenants: list[TenantEntry]


@dataclass(frozen=True)
class Tenant:
    id: str
    keys: tuple[bytes, ...] = ()  # SHA-256 digests of the keys it may send
    cache_group: str = ""  # "": the cluster's one unsalted cache (the single-key settings)
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_streams: int = 0
    priority: Priority = "standard"
    weight: float = 1.0
    metrics: bool = False
    anonymous: bool = False


@dataclass(frozen=True)
class Tenants:
    """Every tenant by id; `open`: no key is asked, every request is `default`'s."""

    by_id: dict[str, Tenant] = field(default_factory=lambda: {DEFAULT_TENANT: Tenant(DEFAULT_TENANT)})
    open: bool = True

    @property
    def anonymous(self) -> Tenant | None:
        """Whose a request sending no key is (None: nobody's, a 401)."""
        return next((t for t in self.by_id.values() if t.anonymous), None)

    def authenticate(self, key: bytes) -> Tenant | None:
        """The tenant `key` belongs to (None: nobody's). Every digest is compared, in
        constant time each, so the time taken says nothing of which tenant matched."""
        if self.open:
            return self.by_id[DEFAULT_TENANT]
        if not key:
            return self.anonymous  # a wrong key is never the anonymous tenant's: a mistake, and a 401
        digest = hashlib.sha256(key).digest()
        found = None
        for tenant in self.by_id.values():
            for known in tenant.keys:
                if hmac.compare_digest(digest, known):
                    found = tenant
        return found

    def get(self, tenant_id: str) -> Tenant:
        """The tenant of that id; one the file no longer names gets no limits beyond the
        defaults (its requests in flight finish)."""
        return self.by_id.get(tenant_id) or Tenant(tenant_id)


def single(key: str | None) -> Tenants:
    """The single-key settings as tenants: `default`, holding that key (None: open)."""
    if not key:
        return Tenants()
    digest = hashlib.sha256(key.encode()).digest()
    return Tenants({DEFAULT_TENANT: Tenant(DEFAULT_TENANT, (digest,), metrics=True)}, open=False)


def parse(raw: bytes) -> Tenants:
    """A tenants file's contents, checked; ValueError says what is wrong, and where."""
    try:
        entries = msgspec.json.decode(raw, type=TenantsFile).tenants
    except msgspec.DecodeError as e:  # ValidationError included: its text names the field
        raise ValueError(f"not a tenants file: {e}") from None
    if not entries:
        raise ValueError("no tenants: the file must name at least one")
    tenants = [_tenant(i, e) for i, e in enumerate(entries)]
    ids = [t.id for t in tenants]
    if len(set(ids)) < len(ids):
        raise ValueError(f"tenant ids must be unique: {sorted({i for i in ids if ids.count(i) > 1})}")
    if sum(t.anonymous for t in tenants) > 1:
        raise ValueError("at most one tenant may be anonymous")
    keys = [k for t in tenants for k in t.keys]
    if len(set(keys)) < len(keys):
        raise ValueError("a key digest is listed for two tenants (or twice for one)")
    return Tenants({t.id: t for t in tenants}, open=False)


def _tenant(i: int, e: TenantEntry) -> Tenant:
    where = f"tenants[{i}]"
    if not TENANT_ID.fullmatch(e.id):
        raise ValueError(f"{where}.id must be 1-63 of a-z 0-9 _ . - (starting with a letter or digit), got {e.id[:64]!r}")
    digests = [e.key_sha256] if isinstance(e.key_sha256, str) else e.key_sha256
    if not (digests or e.anonymous) or not all(SHA256_HEX.fullmatch(d) for d in digests):
        raise ValueError(f"{where}.key_sha256 must be a key's SHA-256 in lowercase hex, or a list of them "
                         "(none only for the anonymous tenant)")
    if e.anonymous and e.metrics:
        raise ValueError(f"{where}: the anonymous tenant cannot read /metrics (every tenant's figures)")
    group = e.cache_group or e.id
    if not TENANT_ID.fullmatch(group):
        raise ValueError(f"{where}.cache_group must be a name like a tenant id, got {group[:64]!r}")
    _check_admission(where, e)
    return Tenant(e.id, tuple(bytes.fromhex(d) for d in digests), group, e.requests_per_minute,
                  e.tokens_per_minute, e.max_streams, e.priority, e.weight, e.metrics,  # type: ignore[arg-type]
                  e.anonymous)


def _check_admission(where: str, e: TenantEntry) -> None:
    """The entry's limits and class, as admission takes them."""
    if e.priority not in PRIORITIES:
        raise ValueError(f"{where}.priority must be one of {', '.join(PRIORITIES)}, got {e.priority[:32]!r}")
    limits = {"requests_per_minute": e.requests_per_minute, "tokens_per_minute": e.tokens_per_minute,
              "max_streams": e.max_streams}
    for name, value in limits.items():
        if value < 0:
            raise ValueError(f"{where}.{name} must not be negative (0: no limit)")
    if not 0 < e.weight < 1e6:
        raise ValueError(f"{where}.weight must be positive")


def load(path: str) -> Tenants:
    """The tenants file at `path` (owner-only, like every secret here). A symlink is
    followed to the file it names: a Kubernetes Secret mounted as a folder (the
    way it is updated in place) is a chain of them, swapped at once on an update."""
    return parse(read_private(os.path.realpath(path)))


RELOAD_S = 1.0  # how often the file's stat is looked at


@dataclass
class Watched:
    """The tenants in force: the file's last good contents, read again when it changes."""

    path: str
    current: Tenants
    seen: tuple[int, int, int] | None = None  # the version read last (good or bad): mtime, size, inode

    @classmethod
    def open(cls, path: str) -> Watched:
        """The file as it is now; a bad one at start is fatal (ValueError, PermissionError)."""
        seen = _version(path)
        return cls(path, load(path), seen)

    def refresh(self) -> bool:
        """Read the file again if it changed; whether the tenants did. A bad version
        (or none: the file gone) keeps the last good one in force and says why in
        one line, once per version."""
        try:
            version: tuple[int, int, int] | None = _version(self.path)
        except OSError:
            version = None
        if version == self.seen:
            return False
        self.seen = version
        try:
            fresh = load(self.path)
        except (OSError, ValueError) as e:
            log.error("tenants file refused: the last good one stays in force", path=self.path, error=str(e))
            return False
        self.current = fresh
        log.info("tenants file read", path=self.path, tenants=len(fresh.by_id))
        return True

    async def watch(self, stop: asyncio.Event, every_s: float = RELOAD_S) -> None:
        """Refresh every `every_s` until `stop`."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except TimeoutError:
                self.refresh()


def in_force(source: Watched | Tenants) -> Tenants:
    """The tenants a watched file holds now, or fixed ones."""
    return source.current if isinstance(source, Watched) else source


def _version(path: str) -> tuple[int, int, int]:
    st = os.stat(path)  # through a symlink: a Secret's update swaps the link's target
    return st.st_mtime_ns, st.st_size, st.st_ino


def key_sha256(key: str) -> str:
    """What the file lists for `key` (`yuebing tenants key` prints it)."""
    return hashlib.sha256(key.encode()).hexdigest()


def check_client_salt(salt: object) -> str:
    """A request's own `cache_salt`, as vLLM checks it; ValueError says why not."""
    if not isinstance(salt, str) or not salt:
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    if len(salt) > MAX_CLIENT_SALT or any(c in CLIENT_SALT_FORBIDDEN for c in salt):
        raise ValueError(f"Parameter 'cache_salt' must be at most {MAX_CLIENT_SALT} characters and must not "
                         "contain '@', '/', '\\\\', or NUL.")
    return salt


def cache_salt(cache_key: bytes, group: str, client_salt: str | None = None) -> str:
    """The salt a request's blocks are hashed under: "" for the cluster's one cache
    (no group, no salt of its own); else a keyed digest of the group's name and the
    client's salt, so that nobody without the cache key can name a group's salt, and
    a client's salt splits its own group's cache but never reaches another's."""
    if not group and not client_salt:
        return ""
    message = group.encode() + b"\0" + (client_salt or "").encode("utf-8", "surrogatepass")
    return hmac.new(cache_key, message, hashlib.sha256).hexdigest()[:32]
