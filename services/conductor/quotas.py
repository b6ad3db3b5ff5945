"""Each tenant's quotas (shared/tenants.py): requests and tokens per minute, streams
at once. Pure: the Conductor feeds it its own admissions and its peers' (their
bookings, a sync interval late) and the requests' ends, and asks it before placing.

Counted over a sliding minute: a request counts from its admission, with its
prompt plus max_tokens reserved (what it may take at most), until a minute later; a
stream, from its admission to its end. Where several Conductors share the requests,
each counts its peers' admissions from their digests (services/conductor/sync.py):
one interval late, so the Conductors together may admit up to (Conductors - 1) x a
sync interval's worth of a tenant's arrivals past its limit (docs/tenants.md).

The same books keep fairness's figures (services/conductor/fairness.py): each tenant's
requests in flight and the tokens admitted over its shorter window.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from services.conductor import fairness
from services.conductor.fairness import Load
from shared.tenants import Tenant

WINDOW_S = 60.0
Limit = Literal["requests", "tokens", "streams"]


@dataclass(frozen=True)
class Refusal:
    """Why a tenant's request is over its quota, and when asking again may pass."""

    limit: Limit
    bound: int  # the tenant's limit
    remaining: int  # of it, now
    reset_s: float  # until the oldest counted admission leaves the minute (streams: a guess)

    @property
    def reason(self) -> str:
        per = "" if self.limit == "streams" else " per minute"
        return f"{self.limit} quota of {self.bound}{per} reached"


@dataclass
class Window:
    """Admissions (when, which, tokens) over the last `span_s`, oldest first, and
    their tokens' sum: kept as they come and go, never summed again per decision."""

    span_s: float
    entries: deque[tuple[float, str, int]] = field(default_factory=deque)
    tokens: int = 0

    def add(self, at: float, request_id: str, tokens: int) -> None:
        self.entries.append((at, request_id, tokens))
        if len(self.entries) > 1 and self.entries[-2][0] > at:  # a peer's, older than ours: keep it ordered
            self.entries = deque(sorted(self.entries))
        self.tokens += tokens

    def settle(self, request_id: str, tokens: int) -> None:
        """Its reservation replaced by what it took (the newest first: ends come soon)."""
        for i in range(len(self.entries) - 1, -1, -1):
            at, rid, counted = self.entries[i]
            if rid == request_id:
                self.entries[i] = (at, rid, tokens)
                self.tokens += tokens - counted
                return

    def expire(self, now: float) -> None:
        while self.entries and self.entries[0][0] <= now - self.span_s:
            self.tokens -= self.entries.popleft()[2]


@dataclass
class Usage:
    """One tenant's admissions, over the quotas' minute and over fairness's shorter
    window, and its open streams."""

    minute: Window = field(default_factory=lambda: Window(WINDOW_S))
    recent: Window = field(default_factory=lambda: Window(fairness.WINDOW_S))
    streams: dict[str, float] = field(default_factory=dict)  # open ones: until their deadline

    def open(self, request_id: str, until: float) -> None:
        self.streams[request_id] = until  # admitted again (its peer's booking of it, or a retry): one stream

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def settle(self, request_id: str, tokens: int) -> None:
        self.minute.settle(request_id, tokens)
        self.recent.settle(request_id, tokens)

    def expire(self, now: float) -> None:
        self.minute.expire(now)
        self.recent.expire(now)


@dataclass
class Quotas:
    usage: dict[str, Usage] = field(default_factory=dict)
    tenant_of: dict[str, str] = field(default_factory=dict)  # open stream → its tenant
    # Every stream's deadline, soonest first (ended ones are dropped when theirs comes):
    # an end nobody heard of (its Conductor lost, its update with it) must not hold
    # a tenant's stream for ever, and finding the overdue ones costs no walk of them all.
    deadlines: list[tuple[float, str]] = field(default_factory=list)

    def check(self, tenant: Tenant, tokens: int, now: float) -> Refusal | None:
        """None where `tenant` may have a request of `tokens` (prompt + max_tokens) now."""
        u = self._usage(tenant.id, now)
        if tenant.requests_per_minute and len(u.minute.entries) >= tenant.requests_per_minute:
            return Refusal("requests", tenant.requests_per_minute, 0, self._reset(u, now))
        if tenant.tokens_per_minute and u.minute.tokens + tokens > tenant.tokens_per_minute:
            left = max(0, tenant.tokens_per_minute - u.minute.tokens)
            return Refusal("tokens", tenant.tokens_per_minute, left, self._tokens_reset(u, tenant, tokens, now))
        if tenant.max_streams and len(u.streams) >= tenant.max_streams:
            return Refusal("streams", tenant.max_streams, 0, 1.0)
        return None

    def admitted(self, tenant_id: str, request_id: str, tokens: int, at: float, until: float) -> None:
        """A request admitted at `at` (a peer's: as long ago as its digest says), its
        stream open at the latest `until` (its deadline)."""
        u = self.usage.setdefault(tenant_id, Usage())
        u.minute.add(at, request_id, tokens)
        u.recent.add(at, request_id, tokens)
        u.open(request_id, until)
        self.tenant_of[request_id] = tenant_id
        heapq.heappush(self.deadlines, (until, request_id))

    def finished(self, request_id: str, tokens: int = -1) -> None:
        """Its stream is over (its admission still counts for the minute), and, where
        `tokens` is known, its reservation settles on what it took."""
        tenant_id = self.tenant_of.pop(request_id, None)
        if tenant_id is None:
            return
        u = self.usage[tenant_id]
        u.close(request_id)
        if tokens >= 0:
            u.settle(request_id, tokens)

    def remaining(self, tenant: Tenant, now: float) -> dict[str, int]:
        """What is left of each limit the tenant has (for the response's headers)."""
        u = self._usage(tenant.id, now)
        left = {"requests": tenant.requests_per_minute - len(u.minute.entries),
                "tokens": tenant.tokens_per_minute - u.minute.tokens}
        return {k: max(0, v) for k, v in left.items() if getattr(tenant, f"{k}_per_minute")}

    def loads(self, now: float) -> dict[str, Load]:
        """Each tenant's requests in flight (its open streams) and tokens admitted within
        fairness's window, for those with either: the fairness policy's figures."""
        out = {}
        for tenant_id in self.usage:
            u = self._usage(tenant_id, now)
            if u.recent.entries or u.streams:
                first = u.recent.entries[0][0] if u.recent.entries else now
                out[tenant_id] = Load(len(u.streams), fairness.rate(u.recent.tokens, first, now))
        return out

    def reset(self, tenant_id: str, now: float) -> float:
        """Until the minute's oldest admission leaves it (0: none counted)."""
        return self._reset(self._usage(tenant_id, now), now)

    def _usage(self, tenant_id: str, now: float) -> Usage:
        self._overdue(now)
        u = self.usage.setdefault(tenant_id, Usage())
        u.expire(now)
        return u

    def _overdue(self, now: float) -> None:
        """Close the streams whose deadline has passed with no end heard."""
        while self.deadlines and self.deadlines[0][0] <= now:
            until, request_id = heapq.heappop(self.deadlines)
            tenant_id = self.tenant_of.get(request_id)
            if tenant_id is None:
                continue  # ended, its end heard
            u = self.usage[tenant_id]
            if u.streams.get(request_id) == until:  # not admitted again since, with a later one
                u.close(request_id)
                del self.tenant_of[request_id]

    @staticmethod
    def _reset(u: Usage, now: float) -> float:
        return max(0.0, u.minute.entries[0][0] + WINDOW_S - now) if u.minute.entries else 0.0

    @staticmethod
    def _tokens_reset(u: Usage, tenant: Tenant, tokens: int, now: float) -> float:
        """Until enough of the minute's tokens have left it for `tokens` to fit (a
        request larger than the whole quota never fits: a minute, the window)."""
        if tokens > tenant.tokens_per_minute:
            return WINDOW_S
        need = u.minute.tokens + tokens - tenant.tokens_per_minute
        for at, _, counted in u.minute.entries:
            need -= counted
            if need <= 0:
                return max(0.0, at + WINDOW_S - now)
        return 0.0

