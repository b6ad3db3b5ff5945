"""The cluster's KV-plane key: who may put a block into a node pool, or take one.

Messengers talk to each other over ZeroMQ CURVE (services/messenger/transport.py).
The cluster has one CURVE keypair, shared by its messengers: each one serves with it
and connects with it, and admits only peers that prove they hold its secret (the
CURVE handshake proves it; the ZAP check admits only the cluster's public key). So
holding the secret is membership, and the key file is as sensitive as a password.

The file is JSON, `{"public": "<z85>", "secret": "<z85>"}`, owner-only (0600),
written with O_EXCL|O_NOFOLLOW and read back only when nobody else could have read
or replaced it (shared/private_file.py).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils import z85

from shared.private_file import read_private, write_private

KEY_FILE_ENV = "YUEBING_KV_KEY_FILE"
Z85_KEY_CHARS = 40  # a 32-byte Curve25519 key in Z85


class KeyFile(msgspec.Struct, forbid_unknown_fields=True):
    public: str
    secret: str


@dataclass(frozen=True)
class ClusterKeys:
    """The cluster's CURVE keypair, Z85-encoded, as libzmq takes it."""

    public: bytes
    secret: bytes

    def __post_init__(self) -> None:
        for name, key in (("public", self.public), ("secret", self.secret)):
            if len(key) != Z85_KEY_CHARS:
                raise ValueError(f"the {name} key must be {Z85_KEY_CHARS} Z85 characters, got {len(key)}")
        if zmq.curve_public(self.secret) != self.public:
            raise ValueError("the public key is not the secret key's")

    def __repr__(self) -> str:  # never print the secret into a log
        return f"ClusterKeys(public={self.public.decode()!r})"


def message_key(keys: ClusterKeys) -> bytes:
    """The AES-256 key that seals each KV message in the "aes-gcm" mode: derived from
    the cluster's secret, so holding the secret is membership there too."""
    return hashlib.blake2b(z85.decode(keys.secret), digest_size=32, person=b"yuebing-kv-aead").digest()


def generate_keys() -> ClusterKeys:
    public, secret = zmq.curve_keypair()
    return ClusterKeys(public, secret)


def write_keys(path: str | os.PathLike[str], keys: ClusterKeys | None = None) -> ClusterKeys:
    """A new key file at `path` (fresh keys unless given); fails if anything is there."""
    keys = keys or generate_keys()
    write_private(path, msgspec.json.encode(KeyFile(keys.public.decode(), keys.secret.decode())))
    return keys


def load_keys(path: str | os.PathLike[str]) -> ClusterKeys:
    """The keys of an owner-only key file, or a ValueError that says what is wrong
    (a file others can read, a symlink, another user's, a malformed one)."""
    try:
        data = msgspec.json.decode(read_private(path), type=KeyFile)
        return ClusterKeys(data.public.encode(), data.secret.encode())
    except (OSError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"KV key file {path}: {e}") from e
