"""The chained prefix hash that names a KV block everywhere in the cluster.

h_i = xxh3_128(h_{i-1} || tokens of block i), over full blocks only. Two prompts
share block i's hash exactly when they share every token up to the end of block i,
which is what lets the gateway, the Conductor, the connector and the simulator talk
about "the same cached prefix" without exchanging tokens.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

# The seed of the chain; a salt (e.g. the model id) can be folded in so that two
# models sharing one pool never collide.
ROOT = b"\x00" * 16


def block_hashes(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """Hashes of every full block of `tokens`, as 16-byte digests."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = xxhash.xxh3_128_digest(ROOT + salt) if salt else ROOT
    out: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        # int64 so that any vocabulary fits and the bytes are the same on every host.
        payload = array("q", tokens[start : start + block_size])
        if sys.byteorder == "big":  # pragma: no cover - the hash is little-endian everywhere
            payload.byteswap()
        prev = xxhash.xxh3_128_digest(prev + payload.tobytes())
        out.append(prev)
    return out


def hex_hashes(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> list[str]:
    """Same as block_hashes, as hex strings (the form carried in JSON messages)."""
    return [h.hex() for h in block_hashes(tokens, block_size, salt)]
