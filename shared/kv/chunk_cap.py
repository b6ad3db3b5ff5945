"""The cap on one prompt's chunk per step follows the decode work on an engine, not
the role it launched in.

vLLM reads `long_prefill_token_threshold` at every step, from the scheduler config
it shares with the connector's scheduler half. An engine launched for prefill runs
prompts whole; once it decodes (its role moved, or the Conductor pooled the fleet)
a whole prompt would stall its streams for a step past their TBT SLO. So a decode
request carries the cap its streams can bear (`kv_chunk_cap`), and while any such
request is on the engine, the threshold is the smallest of them (and of the launch
cap); when the last one ends, the launch cap is back.

Pure data: the scheduler half (shared/kv/scheduler.py) calls `add` and `remove` as
requests come and go and writes `threshold()` into vLLM's scheduler config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KV_CHUNK_CAP = "kv_chunk_cap"  # the request's kv_transfer_params key: tokens, > 0


@dataclass
class ChunkCaps:
    launched: int  # the engine's own threshold, as launched (0: none)
    caps: dict[str, int] = field(default_factory=dict)  # requests on the engine that asked for one

    def add(self, request_id: str, params: Mapping[str, Any] | None) -> bool:
        """A new request; True when it asks for a cap (a malformed one asks for none)."""
        cap = (params or {}).get(KV_CHUNK_CAP)
        if not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0:
            return False
        self.caps[request_id] = cap
        return True

    def remove(self, request_id: str) -> bool:
        """A request ended; True when it had asked for a cap."""
        return self.caps.pop(request_id, None) is not None

    def threshold(self) -> int:
        """One prompt's tokens per step at the most now (0: the step's budget)."""
        caps = [c for c in (self.launched, *self.caps.values()) if c > 0]
        return min(caps) if caps else 0
