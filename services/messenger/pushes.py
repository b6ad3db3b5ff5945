"""The trace span of each request's push of KV to another node: from its first
reservation (the Reserve that carries the request's trace context) to its release,
when prefill is done with it and every layer has been handed to the transport.

Bounded: a push whose release never comes (its engine died) ends after `MAX_OPEN_S`,
and at most `MAX_OPEN` are open (the oldest ends first)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from shared import tracing
from shared.kv.wire import Reserve

MAX_OPEN = 4096
MAX_OPEN_S = 120.0


@dataclass
class Pushes:
    node: str
    open: OrderedDict[str, tuple[Any, float]] = field(default_factory=OrderedDict)  # owner → (span, opened at)

    def reserved(self, r: Reserve, now: float) -> None:
        if not r.trace or not r.dest or r.dest == self.node or r.owner in self.open:
            return
        span = tracing.started("messenger.push", r.owner, r.trace, node=self.node, to_node=r.dest)
        if span is None:
            return
        self.open[r.owner] = (span, now)
        while len(self.open) > MAX_OPEN:
            self._end(next(iter(self.open)), "dropped: too many open")

    def released(self, owner: str) -> None:
        if owner in self.open:
            self._end(owner, "")

    def expire(self, now: float) -> None:
        for owner, (_, opened) in list(self.open.items()):
            if now - opened > MAX_OPEN_S:
                self._end(owner, "never released")

    def _end(self, owner: str, why: str) -> None:
        span, _ = self.open.pop(owner)
        if why:
            span.set_attribute("yuebing.ended", why)
        span.end()
