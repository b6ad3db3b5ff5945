"""A cluster's secrets, generated: one NATS identity per process, nats-server's
configuration granting each only what shared/identity.py allows it, the messengers'
KV-plane key, the gateways' cache key, and (with TLS) a certificate authority and the server's certificate.

Everything goes into one owner-only folder, one owner-only file per secret, so a
process is handed exactly its own file (a path on its command line, never the
secret itself). `yuebing up` makes a fresh set for every run; `yuebing secrets`
makes one for compose and for deployments. Rotating is making a new set and
restarting the cluster with it.
"""

from __future__ import annotations

import base64
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

import msgspec

from shared.identity import Identity, NatsCredentials, permissions
from shared.kv.keys import write_keys
from shared.nats_jwt import KeyPair
from shared.private_file import private_dir, write_private

NATS_CONFIG = "nats-server.conf"
AUTH_USER = "nats-auth"  # the auth callout's own login (services/nats_auth/)
AUTH_SEED = "nats-auth.seed"  # the account key it signs with, which nats-server trusts
MAX_CONTROL_LINE = 4096  # nats-server's default; subjects we build stay far below it
# JetStream holds one bucket, the stored Responses (shared/config.py responses_max_bytes
# bounds it, at 256 MiB by default): room for it on disk, a little in memory.
JETSTREAM_FILE_BYTES = 1 << 30
JETSTREAM_MEMORY_BYTES = 64 << 20
CONTAINER_JETSTREAM_DIR = Path("/data/jetstream")  # the NATS container's volume (compose, Kubernetes)


@dataclass(frozen=True)
class Layout:
    """Which processes a cluster runs: the same names `yuebing up` gives them. With
    `engine_nodes` every engine is a node of its own, named after it, whose messenger
    is `messenger-<engine>` (a Kubernetes pod: the engine with its messenger beside it)."""

    prefill: int = 1
    decode: int = 1
    nodes: int = 1
    engine_nodes: bool = False
    conductors: int = 1  # sharing the schedule requests and their books
    # Engine pods log in with their Kubernetes ServiceAccount tokens, which the NATS auth
    # callout (services/nats_auth/) checks, instead of with a password made for each:
    # nothing per replica is made, and the engines scale freely.
    engines_by_token: bool = False

    def conductor_names(self) -> list[str]:
        """`conductor`, then `conductor-1`, `conductor-2`... for each further one."""
        return ["conductor", *(f"conductor-{i}" for i in range(1, self.conductors))]

    def engines(self) -> list[Identity]:
        return [*(Identity(f"prefill-{i}", "prefill") for i in range(self.prefill)),
                *(Identity(f"decode-{i}", "decode") for i in range(self.decode))]

    def messengers(self) -> list[Identity]:
        if self.engine_nodes:
            return [Identity(f"messenger-{e.name}", "messenger", node=e.name) for e in self.engines()]
        return [Identity(f"messenger-{n}", "messenger", node=f"node-{n}") for n in range(self.nodes)]

    def identities(self) -> list[Identity]:
        """Every identity that logs in with a password (all, unless engines use tokens)."""
        conductors = [Identity(name, "conductor") for name in self.conductor_names()]
        services = [Identity("gateway", "gateway"), *conductors, Identity("admin", "admin")]
        if self.engines_by_token:
            return [*services, Identity(AUTH_USER, "auth")]
        return [*services, *self.engines(), *self.messengers()]


@dataclass(frozen=True)
class Peer:
    """One server of a NATS cluster: where clients reach it, and where the other servers do."""

    host: str
    port: int = 4222
    route_port: int = 6222


# What a cluster's servers take from their environment: every server reads the one
# configuration file, and each is told its own name, ports and JetStream folder
# (server_environment; compose and Kubernetes set them in their files).
SERVER_VARIABLES = ("NATS_SERVER_NAME", "NATS_PORT", "NATS_ROUTE_PORT", "NATS_STORE_DIR")
ROUTE_USER = "route"  # the servers' own login to each other's route port
# compose/kubernetes/nats.yaml: a StatefulSet of three behind the headless service nats-cluster.
KUBERNETES_NATS = tuple(Peer(f"nats-{i}.nats-cluster") for i in range(3))
CLUSTER_NAME = "yuebing"


@dataclass(frozen=True)
class Listen:
    host: str = "127.0.0.1"  # loopback unless a deployment says otherwise
    port: int = 4222
    tls: bool = False
    tls_names: tuple[str, ...] = ("localhost", "127.0.0.1")  # what the server's certificate names
    cluster: tuple[Peer, ...] = ()  # a NATS cluster's servers (none: the one server on `port`)

    @property
    def url(self) -> str:
        """Every server clients may reach, comma-separated (shared/bus.py servers)."""
        scheme = "tls" if self.tls else "nats"
        peers = self.cluster or (Peer(self.host, self.port),)
        return ",".join(f"{scheme}://{p.host}:{p.port}" for p in peers)


def server_environment(peer: Peer, name: str, store_dir: Path) -> dict[str, str]:
    """What one server of a cluster is told through its environment (SERVER_VARIABLES)."""
    values = (name, str(peer.port), str(peer.route_port), str(store_dir))
    return dict(zip(SERVER_VARIABLES, values, strict=True))


@dataclass(frozen=True)
class Secrets:
    """Where a generated set lies."""

    folder: Path
    nats_url: str
    api_key: Path | None = None  # the gateway's key file, when clients must send one

    @property
    def nats_config(self) -> Path:
        return self.folder / NATS_CONFIG

    def credentials(self, name: str) -> Path:
        return self.folder / f"{name}.nats.json"

    @property
    def cache_key(self) -> Path:
        """The gateways' cache key: every tenant's cache salt comes from it (shared/tenants.py)."""
        return self.folder / "cache.key"

    @property
    def kv_key(self) -> Path:
        """The messengers' shared KV-plane key (shared/kv/keys.py): only they get it."""
        return self.folder / "kv.key"


def generate(folder: Path, layout: Layout, listen: Listen, mounted_at: Path | None = None) -> Secrets:
    """A new set in `folder` (created owner-only; files already there are never
    overwritten). Files name each other as they will be seen: under `mounted_at`
    where the set is mounted elsewhere (/run/secrets in a container)."""
    private_dir(folder)
    out = Secrets(folder, listen.url)
    seen = mounted_at or folder
    ca_file = str(seen / _write_tls(folder, listen.tls_names).name) if listen.tls else ""
    users = []
    for identity in layout.identities():
        creds = NatsCredentials(user=identity.name, password=secrets.token_urlsafe(32), ca_file=ca_file)
        write_private(out.credentials(identity.name), msgspec.json.encode(creds))
        users.append(_user(identity, creds.password))
    # JetStream's files hold tenants' stored responses: beside the secrets here (owner-only),
    # on the NATS container's own volume where the set is mounted read-only.
    store_dir = CONTAINER_JETSTREAM_DIR if mounted_at is not None else folder / "jetstream"
    config = server_config(users, listen, seen, store_dir, _callout(folder) if layout.engines_by_token else "")
    write_private(out.nats_config, config.encode())
    write_keys(out.kv_key)
    write_cache_key(folder)
    return out


def write_cache_key(folder: Path) -> Path:
    """The gateways' cache key (`cache.key`, owner-only): tenants' cache salts come from it."""
    return write_private(folder / "cache.key", secrets.token_urlsafe(32).encode())


def write_api_key(folder: Path) -> Path:
    """The key clients send the gateway as a bearer token (`api-key`, owner-only)."""
    return write_private(folder / "api-key", secrets.token_urlsafe(32).encode())


def _user(identity: Identity, password: str) -> dict:
    p = permissions(identity)
    return {
        "user": identity.name,
        "password": password,
        "permissions": {
            "publish": {"allow": list(p.publish)},
            "subscribe": {"allow": list(p.subscribe)},
            **({"allow_responses": True} if p.allow_responses else {}),
        },
    }


def _callout(folder: Path) -> str:
    """The auth callout's signing key, made (owner-only); its public key, for nats-server."""
    key = KeyPair.new()
    write_private(folder / AUTH_SEED, key.seed.encode())
    return key.public_key


def server_config(users: list[dict], listen: Listen, folder: Path, store_dir: Path, callout_issuer: str = "") -> str:
    """nats-server's configuration (its format accepts JSON): every client must log in;
    JetStream on (the stored Responses' key-value bucket), its files in `store_dir`.
    For a cluster, one file every server reads: the routes to all of them (a server
    skips its own) and their password, its name, ports and folder from its environment.
    With `callout_issuer`, a login not among `users` is asked of the auth callout,
    whose answers that key signs."""
    authorization: dict = {"users": users}
    if callout_issuer:
        authorization["auth_callout"] = {"issuer": callout_issuer, "auth_users": [u["user"] for u in users]}
    config: dict = {
        "listen": f"{listen.host}:{listen.port}",
        "max_control_line": MAX_CONTROL_LINE,
        "authorization": authorization,
        "jetstream": {"store_dir": str(store_dir), "max_memory_store": JETSTREAM_MEMORY_BYTES,
                      "max_file_store": JETSTREAM_FILE_BYTES},
    }
    if listen.tls:
        config["tls"] = {"cert_file": str(folder / "nats-server.crt"), "key_file": str(folder / "nats-server.key"),
                         "timeout": 5}
    if listen.cluster:
        del config["listen"]
        config |= _cluster_config(listen)
        config["jetstream"]["store_dir"] = "$NATS_STORE_DIR"
    text = json.dumps(config, indent=2)
    for variable in SERVER_VARIABLES:  # a bare $NAME is the server's environment; a quoted one, a string
        text = text.replace(f'"${variable}"', f"${variable}")
    return text


def _cluster_config(listen: Listen) -> dict:
    password = secrets.token_urlsafe(32)
    routes = [f"nats://{ROUTE_USER}:{password}@{p.host}:{p.route_port}" for p in listen.cluster]
    return {
        "host": listen.host, "port": "$NATS_PORT", "server_name": "$NATS_SERVER_NAME",
        "cluster": {"name": CLUSTER_NAME, "host": listen.host, "port": "$NATS_ROUTE_PORT", "routes": routes,
                    "authorization": {"user": ROUTE_USER, "password": password, "timeout": 5}},
    }


def _write_tls(folder: Path, names: tuple[str, ...]) -> Path:
    from yuebing.certificates import server_certificate

    ca_pem, cert_pem, key_pem = server_certificate(names)
    write_private(folder / "nats-server.crt", cert_pem)
    write_private(folder / "nats-server.key", key_pem)
    return write_private(folder / "ca.crt", ca_pem)


def kubernetes_secrets(folder: Path, layout: Layout, namespace: str = "yuebing") -> list[dict]:
    """The set as Kubernetes Secrets, one per component (compose/kubernetes/ mounts each
    pod only its own files out of its component's): what `yuebing secrets --kubernetes` writes."""
    def secret(name: str, files: list[str]) -> dict:
        data = {f: base64.b64encode((folder / f).read_bytes()).decode() for f in files}
        return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": data,
                "metadata": {"name": f"yuebing-{name}", "namespace": namespace}}

    def role(kind: str) -> list[str]:
        if layout.engines_by_token:  # nothing per replica: the pods log in with their own tokens
            return ["kv.key"]
        engines = [e.name for e in layout.engines() if e.role == kind]
        return ["kv.key", *(f"{e}.nats.json" for e in engines), *(f"messenger-{e}.nats.json" for e in engines)]

    nats = [NATS_CONFIG, f"{AUTH_USER}.nats.json", AUTH_SEED] if layout.engines_by_token else [NATS_CONFIG]
    return [secret("nats", nats), secret("gateway", ["gateway.nats.json", "api-key", "cache.key"]),
            secret("conductor", ["conductor.nats.json"]), secret("prefill", role("prefill")),
            secret("decode", role("decode"))]
