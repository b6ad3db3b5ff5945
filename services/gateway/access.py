"""Who may call the gateway, as which tenant, and the cache salt each request gets.

The tenants in force are the tenants file's (watched: shared/tenants.py), or the
single-key settings' one tenant. A key is looked up by its SHA-256 digest; a
request without a known key on a guarded path is a 401 and never learns whether
some tenant exists. /metrics carries every tenant's figures: with a tenants file
only an operator's key (`"metrics": true`) reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from shared.bearer import client_key
from shared.private_file import read_private
from shared.tenants import Tenant, Tenants, Watched, cache_salt, in_force, single

GUARDED_OUTSIDE_V1 = ("/tokenize", "/detokenize")  # vLLM's paths, outside /v1, behind the key all the same
CACHE_KEY_BYTES = 32
CACHE_KEY_ENV = "YUEBING_CACHE_KEY_FILE"


@dataclass
class Access:
    source: Watched | Tenants
    cache_key: bytes = b""  # the cluster's: every gateway derives the same group salts from it
    metrics_require_key: bool = False  # also on /metrics (always, with a tenants file)

    @classmethod
    def single(cls, api_key: str | None, metrics_require_key: bool = False) -> Access:
        """The single-key settings: one tenant, `default`, on the cluster's one cache."""
        return cls(single(api_key), metrics_require_key=metrics_require_key)

    @classmethod
    def from_files(cls, api_key: str | None, tenants_path: str | None, cache_key_path: str | None,
                   metrics_require_key: bool = False) -> Access:
        """The gateway's: the tenants file when there is one (it needs the cache key),
        else the single key. A bad file raises (ValueError, OSError): never served."""
        if tenants_path is None:
            return cls.single(api_key, metrics_require_key)
        if api_key:
            raise ValueError("give either a tenants file or an API key, not both (the key is a tenant's in the file)")
        if cache_key_path is None:
            raise ValueError("a tenants file needs the cluster's cache key (--cache-key-file): its groups' salts "
                             "come from it")
        return cls(Watched.open(tenants_path), load_cache_key(cache_key_path), metrics_require_key=True)

    @property
    def tenants(self) -> Tenants:
        return in_force(self.source)

    def guarded(self, path: str) -> bool:
        return path.startswith("/v1/") or path in GUARDED_OUTSIDE_V1 or (
            self.metrics_require_key and path == "/metrics")

    def tenant(self, request: web.Request) -> Tenant | None:
        """The caller's tenant (None: no known key). On /metrics, an operator's only."""
        tenants = self.tenants
        tenant = tenants.authenticate(client_key(request))
        if tenant is not None and request.path == "/metrics" and not (tenants.open or tenant.metrics):
            return None
        return tenant

    def priority(self, tenant: Tenant, asked: int) -> int:
        """The queue priority a request gets: as asked (vLLM's: lower first), except that
        among several tenants only a critical one may go before the default, 0; the
        others may only defer themselves (one tenant's clients are one trust domain)."""
        if asked >= 0 or len(self.tenants.by_id) == 1 or tenant.priority == "critical":
            return asked
        return 0

    def salt(self, tenant: Tenant, client_salt: str | None) -> str:
        """The salt the request's blocks are hashed under (shared/tenants.py)."""
        return cache_salt(self.cache_key, tenant.cache_group, client_salt)


def load_cache_key(path: str) -> bytes:
    key = read_private(path).strip()
    if len(key) < CACHE_KEY_BYTES:
        raise ValueError(f"cache key {path} is too short: at least {CACHE_KEY_BYTES} bytes")
    return key
