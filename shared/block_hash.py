"""The chained prefix hash that names a KV block everywhere in the cluster.

h_0 = ROOT, or sha256(ROOT || salt)[:16] with a salt (the model's identity);
h_i = sha256(h_{i-1} || tokens of block i)[:16], over full blocks only. Two prompts
share block i's hash exactly when they share every token up to the end of block i,
which is what lets the gateway, the Conductor, the connector and the simulator talk
about "the same cached prefix" without exchanging tokens.

Why sha256 and not a faster non-cryptographic hash (we used xxh3-128): a block hash
names KV that another request will *reuse*, so a collision hands one user's prompt
another prompt's attention state. With xxh3 a client can craft colliding prompts
(vLLM moved its prefix cache to sha256 after CVE-2025-25183 for this reason). Kept at
16 bytes so messages, pool and SSD headers keep their layout: matching another user's
prompt then takes ~2^128 work, a pair of prompts both crafted by one client ~2^64.
The price, measured by `yuebing bench hash` (docs/security.md, "Block hashes"): 1.4x xxh3's
time at 128-token blocks, +0.26 ms for a 32k-token prompt, a few percent of the
gateway's other work on that prompt at most.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence

# The seed of the chain; the salt (the model's identity) is folded in so that two
# models, or two versions of one model's weights, sharing one pool never collide.
ROOT = b"\x00" * 16
DIGEST_BYTES = 16

Digest = Callable[[bytes], bytes]


def sha256_16(data: bytes) -> bytes:
    """sha256 truncated to 16 bytes: the digest every block hash uses."""
    return hashlib.sha256(data).digest()[:DIGEST_BYTES]


def chain(tokens: Sequence[int], block_size: int, salt: bytes, digest: Digest) -> list[bytes]:
    """The chain over `tokens`' full blocks with any 16-byte `digest` (the benchmark
    compares digests through this, so it times the code the cluster runs)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = digest(ROOT + salt) if salt else ROOT
    out: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        # int64 so that any vocabulary fits and the bytes are the same on every host.
        payload = array("q", tokens[start : start + block_size])
        if sys.byteorder == "big":  # pragma: no cover - the hash is little-endian everywhere
            payload.byteswap()
        prev = digest(prev + payload.tobytes())
        out.append(prev)
    return out


def tail_hash(tokens: Sequence[int], block_size: int, salt: bytes, full: Sequence[bytes]) -> bytes | None:
    """The hash of `tokens`' last partial block (None: they end on a block boundary),
    chained to its full blocks' `full`. It names the KV of exactly these tokens, so
    decode loads a prompt's tail rather than computing it; tagged, so that it never
    names a full block (its input is never a whole number of 8-byte tokens long).
    """
    start = len(full) * block_size
    if start >= len(tokens):
        return None
    prev = full[-1] if full else (sha256_16(ROOT + salt) if salt else ROOT)
    payload = array("q", tokens[start:])
    if sys.byteorder == "big":  # pragma: no cover - the hash is little-endian everywhere
        payload.byteswap()
    return sha256_16(_TAIL_TAG + prev + payload.tobytes())


_TAIL_TAG = b"tail"


def block_hashes(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """Hashes of every full block of `tokens`, as 16-byte digests."""
    return chain(tokens, block_size, salt, sha256_16)


def request_salt(model_salt: bytes, cache_salt: str = "") -> bytes:
    """A request's chain salt: the model's identity, and its cache's salt where it has
    one (a tenant's cache group: shared/tenants.py). The gateway, a continuation and
    the connector hashing a request alike all take it from here."""
    return model_salt + b"\0" + cache_salt.encode() if cache_salt else model_salt


def hex_hashes(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> list[str]:
    """Same as block_hashes, as hex strings (the form carried in JSON messages)."""
    return [h.hex() for h in block_hashes(tokens, block_size, salt)]
