"""Books kept in step among several Conductors.

A request's updates (prefill done, finished) go only to the Conductor that placed it
(Placement.conductor), so each Conductor reads its own share's updates, as a lone
one reads them all. What the others need, its own placements and its requests'
updates, it sends them as one BookDigest per sync interval. A Conductor so reads one
digest per interval from each peer, instead of a booking and two update messages per
request the peers place: what each reads grows with its own share of the requests,
not with the number of Conductors (in Python a message's wake and parse cost about
as much as a decision's scoring).

The digest leaves with the first decision or update handled once an interval has
passed since the last one: the loop is awake then anyway. A timer sends it only when
the loop goes quiet, two intervals after the last send, and beats; a busy
Conductor's timer never fires, so the digests cost the sender no wakes of their own.

Each item of a digest carries its age, and a peer dates it back by as much: the
books time prefills by their prefill_done (the calibration), and a delay of one
interval would look like a prefill that much slower.

Peers are blind to a placement for one interval, two when the sender goes quiet.
Two Conductors may so admit onto the last headroom of one decode instance; its own
check on arrival is the arbiter (services/conductor/bookings.py).

A digest goes out at least every heartbeat interval, empty if need be. A peer whose
digests stop for the liveness timeout is lost, and its placements leave the others'
books: which of its requests ended while nobody read its updates cannot be known,
and books that never empty would refuse capacity until the requests' deadlines.
Its requests still running are then not counted, as with a lone Conductor
restarted; each decode instance's own check stays the arbiter. A Conductor back
within the timeout (the launcher or Kubernetes restarted it) is a new incarnation
(BookDigest.incarnation): its earlier placements leave the books the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from shared.liveness import shift_seen
from shared.messages import Admission, BookDigest, Booking, RequestUpdate


@dataclass
class Digest:
    """What a Conductor's books took in since its last digest, each with when."""

    conductor: str  # whose
    incarnation: str
    bookings: list[tuple[Booking, float]] = field(default_factory=list)
    updates: list[tuple[RequestUpdate, float]] = field(default_factory=list)
    admissions: list[tuple[Admission, float]] = field(default_factory=list)
    sent_at: float = float("-inf")

    def booked(self, b: Booking, now: float) -> None:
        self.bookings.append((b, now))

    def updated(self, u: RequestUpdate, now: float) -> None:
        self.updates.append((u, now))

    def admitted(self, a: Admission, now: float) -> None:
        self.admissions.append((a, now))

    @property
    def pending(self) -> bool:
        return bool(self.bookings or self.updates or self.admissions)

    def due(self, now: float, wait_s: float, beat_s: float) -> bool:
        """Something to send `wait_s` after the last send, or a beat owed: nothing
        went out for `beat_s`."""
        return (self.pending and now - self.sent_at >= wait_s) or now - self.sent_at >= beat_s

    def timer_at(self, sync_s: float, beat_s: float) -> float:
        """When the timer should send it, if no handler has by then: two intervals
        after the last send while it holds anything, a beat after it otherwise."""
        return self.sent_at + (2 * sync_s if self.pending else beat_s)

    def take(self, now: float) -> BookDigest:
        """All of it, as one message, each item aged by how long it waited here."""
        out = BookDigest(conductor=self.conductor, incarnation=self.incarnation,
                         bookings=[_aged(b, now - at) for b, at in self.bookings],
                         updates=[_aged(u, now - at) for u, at in self.updates],
                         admissions=[_aged(a, now - at) for a, at in self.admissions])
        self.bookings, self.updates, self.admissions, self.sent_at = [], [], [], now
        return out

    def put_back(self, out: BookDigest, now: float) -> None:
        """A digest that could not be sent: its items go out with the next one, first."""
        self.bookings[:0] = [(b, now - b.age_s) for b in out.bookings]
        self.updates[:0] = [(u, now - u.age_s) for u in out.updates]
        self.admissions[:0] = [(a, now - a.age_s) for a in out.admissions]


Aged = TypeVar("Aged", Booking, RequestUpdate, Admission)


def _aged(item: Aged, age_s: float) -> Aged:
    item.age_s = max(0.0, age_s)
    return item


@dataclass
class Peers:
    """The other Conductors, known by their digests: which ones went silent, and
    which came back as a new process."""

    timeout_s: float
    seen_at: dict[str, float] = field(default_factory=dict)
    incarnations: dict[str, str] = field(default_factory=dict)
    lost_total: int = 0

    def heard(self, name: str, incarnation: str, now: float) -> bool:
        """A digest from `name`; True when it is a new incarnation of one known: the
        old process's placements are to be forgotten."""
        self.seen_at[name] = now
        old = self.incarnations.get(name)
        self.incarnations[name] = incarnation
        if old is not None and old != incarnation:
            self.lost_total += 1
            return True
        return False

    def lost(self, now: float) -> list[str]:
        """Peers silent past the timeout: forgotten here, known again by their next digest."""
        gone = sorted(n for n, seen in self.seen_at.items() if now - seen > self.timeout_s)
        for name in gone:
            del self.seen_at[name]
            self.incarnations.pop(name, None)
        self.lost_total += len(gone)
        return gone

    def unheard(self, deaf_s: float, now: float) -> None:
        """This Conductor could not listen for `deaf_s` (its loop stalled): that is no
        peer's silence (shared/liveness.py Deafness)."""
        shift_seen(self.seen_at, deaf_s, now)
