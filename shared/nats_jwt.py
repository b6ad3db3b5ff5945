"""NATS's own keys and JWTs, as far as an auth callout needs them.

An nkey is an Ed25519 key written in base32 with a one-byte prefix naming what it is
(an account's public key starts with A, a user's with U, a seed with S) and a CRC-16
at the end. A NATS JWT is a JWT whose header says `ed25519-nkey`, signed by the nkey
its `iss` names. The auth callout (services/nats_auth/) answers nats-server with
two: an authorization response carrying a user JWT, both signed by the account key
nats-server's `auth_callout.issuer` names.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

PREFIX_SEED = 18 << 3  # S
PREFIX_ACCOUNT = 0  # A
PREFIX_USER = 20 << 3  # U
HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}


def crc16(data: bytes) -> int:
    """CRC-16/XMODEM, which nkeys end with."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def _encode(raw: bytes) -> str:
    return base64.b32encode(raw + crc16(raw).to_bytes(2, "little")).decode().rstrip("=")


def _decode(text: str) -> bytes:
    raw = base64.b32decode(text + "=" * (-len(text) % 8))
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if crc16(body) != crc:
        raise ValueError("not an nkey: its checksum does not match")
    return body


@dataclass(frozen=True)
class KeyPair:
    """An nkey's seed: it signs, and names its public key."""

    seed: str  # S..., secret

    @classmethod
    def new(cls, prefix: int = PREFIX_ACCOUNT) -> KeyPair:
        first, second = PREFIX_SEED | (prefix >> 5), (prefix & 31) << 3
        return cls(_encode(bytes([first, second]) + secrets.token_bytes(32)))

    def _parts(self) -> tuple[int, bytes]:
        raw = _decode(self.seed)
        if raw[0] & 0xF8 != PREFIX_SEED or len(raw) != 34:
            raise ValueError("not an nkey seed")
        return ((raw[0] & 7) << 5) | (raw[1] >> 3), raw[2:]

    @property
    def public_key(self) -> str:
        prefix, seed = self._parts()
        public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return _encode(bytes([prefix]) + public)

    def sign(self, data: bytes) -> bytes:
        return Ed25519PrivateKey.from_private_bytes(self._parts()[1]).sign(data)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode(claims: dict[str, Any], signer: KeyPair) -> str:
    """A NATS JWT of `claims`, issued (`iss`) and signed by `signer`; its id (`jti`) is
    the hash of the rest, as NATS's own libraries make it."""
    body = {**claims, "iss": signer.public_key}
    body.pop("jti", None)
    digest = hashlib.sha512(json.dumps(body, sort_keys=True).encode()).digest()[:32]
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    head = _b64(json.dumps(HEADER).encode()) + "." + _b64(json.dumps(body).encode())
    return head + "." + _b64(signer.sign(head.encode()))


def decode(token: str) -> dict[str, Any]:
    """A NATS JWT's claims, its signature checked against the nkey its `iss` names."""
    try:
        head, body, signature = token.split(".")
        claims = json.loads(_unb64(body))
        issuer = _decode(claims["iss"])
        Ed25519PublicKey.from_public_bytes(issuer[1:]).verify(_unb64(signature), f"{head}.{body}".encode())
    except Exception as e:  # a malformed token is as bad as a forged one
        raise ValueError(f"not a valid NATS JWT: {e or type(e).__name__}") from e
    return claims
