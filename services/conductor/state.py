"""The Conductor's bookkeeping: what it assigned where, and when that should end.

Plain data with an explicit clock (`now`), so that the live Conductor (wall clock,
events from instances) and the simulator (simulated clock) keep it the same way.
It turns into the loads the policies read.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from services.conductor.cpp import PipelineGroup
from services.conductor.index import PrefixIndex
from services.conductor.policy import (
    Decision,
    DecodeItem,
    DecodeLoad,
    Params,
    PrefillLoad,
    Request,
    decode_context,
    prefill_s,
)
from services.conductor.ranking import Ranking
from shared.calibration import Calibration
from shared.predictor import Predictor

WINDOW_S = 180.0  # Preble's load window: three minutes
DECODE_TIME_WEIGHT = 0.05  # learned t_d: the weight of each completed decode (about the last 20)


@dataclass
class Assigned:
    blocks: int
    prefill_s: float
    cached_tokens: int
    prompt_len: int
    at: float
    ttft_s: float = 0.0  # its queue, transfer and prefill, as the profile alone predicts them


@dataclass
class PrefillBook:
    # A CPP group's stages; None: one instance. Its queue is kept whole (busy until
    # the last stage ends), though the next prompt's first chunks could start sooner.
    group: PipelineGroup | None = None
    busy_until: float = 0.0
    outstanding: dict[str, Assigned] = field(default_factory=dict)  # in the order assigned
    active_blocks: int = 0  # sum over outstanding
    outstanding_s: float = 0.0  # their predicted prefill seconds
    # What was assigned over the last WINDOW_S, and its running sums.
    window: deque[Assigned] = field(default_factory=deque)
    window_prefill_s: float = 0.0
    window_cached: int = 0
    window_prompt: int = 0
    # Its first tokens' observed times against ttft_s (queue included: a slow
    # instance's queue drains slowly too).
    calibration: Calibration = field(default_factory=Calibration)

    def add(self, request_id: str, a: Assigned) -> None:
        self.outstanding[request_id] = a
        self.active_blocks += a.blocks
        self.outstanding_s += a.prefill_s
        self.window.append(a)
        self.window_prefill_s += a.prefill_s
        self.window_cached += a.cached_tokens
        self.window_prompt += a.prompt_len

    def done(self, request_id: str) -> Assigned | None:
        a = self.outstanding.pop(request_id, None)
        if a is not None:
            self.active_blocks -= a.blocks
            self.outstanding_s = self.outstanding_s - a.prefill_s if self.outstanding else 0.0  # no drift
        return a

    def queue_s(self, now: float) -> float:
        """Predicted work ahead of a prompt arriving now: until `busy_until`, and never
        less than what the prompts behind the oldest outstanding one are predicted to
        take. `busy_until` passes at the wall clock's pace; an engine slower than its
        time model (another host, neighbours on its cores) is still working through
        those prompts after it. Without this floor the books drained while the engine
        did not: measured live, a queue of ten long prompts (3 s) booked as nearly
        empty, and admission took short prompts that then waited seconds."""
        if not self.outstanding:
            return max(0.0, self.busy_until - now)
        head = next(iter(self.outstanding.values()))
        return max(0.0, self.busy_until - now, self.outstanding_s - head.prefill_s)

    def trim(self, now: float) -> None:
        while self.window and self.window[0].at < now - WINDOW_S:
            a = self.window.popleft()
            self.window_prefill_s -= a.prefill_s
            self.window_cached -= a.cached_tokens
            self.window_prompt -= a.prompt_len


@dataclass
class ClusterState:
    predictor: Predictor
    params: Params
    index: PrefixIndex
    prefill: dict[str, PrefillBook] = field(default_factory=dict)
    decode: dict[str, dict[str, DecodeItem]] = field(default_factory=dict)
    decode_capacity: int = 1 << 30  # requests one decode instance can hold at once
    # Where each request is, so events that name only the request find their books.
    placed: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Local prefills (services/conductor/modes.py): per decode instance, the uncached
    # prompt tokens of each request it prefills itself, until its first token.
    local: dict[str, dict[str, int]] = field(default_factory=dict)
    decode_time_s: float = field(init=False)  # t_d as used now: configured, or learned (Params.learn_decode_time)
    # Prefill predictions times each instance's observed over predicted TTFT, the
    # quantile `calibration_z` of it, of work like the prediction (shared/calibration.py);
    # None: the profile alone.
    # The live Conductor's choice (ClusterConfig.calibrate_time_model, slo_attainment).
    calibration_z: float | None = None
    # Kept current by every booking, so that a decision reads the least loaded few
    # (`shortlist`) without looking at every instance: prefill instances by when
    # their queue empties, decode instances by their booked batch's step time.
    queues: Ranking = field(default_factory=Ranking)
    batches: Ranking = field(default_factory=Ranking)
    booked: dict[str, tuple[int, int]] = field(default_factory=dict)  # decode instance → (requests, context tokens)
    groups: set[str] = field(default_factory=set)  # the prefill instances that are CPP groups

    def __post_init__(self) -> None:
        self.decode_time_s = self.params.decode_time_s

    # --- membership ---------------------------------------------------------
    def add_instance(self, role: str, instance_id: str, group: PipelineGroup | None = None) -> None:
        if role == "prefill" and instance_id not in self.prefill:
            self.prefill[instance_id] = PrefillBook(group)
            self.queues.set(instance_id, 0.0)
            if group is not None:
                self.groups.add(instance_id)
        elif role == "decode" and instance_id not in self.decode:  # a prefill instance may hold decodes already
            self.decode[instance_id] = {}
            self._rebook(instance_id, 0, 0)

    def remove_instance(self, instance_id: str) -> None:
        """A departed instance leaves every book; so do requests placed on it that no
        live instance's book holds any more (nothing would ever finish them here)."""
        self.prefill.pop(instance_id, None)
        self.decode.pop(instance_id, None)
        self.local.pop(instance_id, None)
        self.queues.remove(instance_id)
        self.groups.discard(instance_id)
        self.batches.remove(instance_id)
        self.booked.pop(instance_id, None)
        self.index.remove_instance(instance_id)
        self.placed = {rid: (p, d) for rid, (p, d) in self.placed.items()
                       if p in self.prefill or d in self.decode}

    def prefill_pace(self, now: float, ids: Iterable[str]) -> float:
        """The prefill instances' first tokens, observed over predicted: the mean of
        their median paces (1.0 with none, or with the time model left uncalibrated)."""
        paces = [self.prefill[iid].calibration.pace(now) for iid in ids if iid in self.prefill]
        return sum(paces) / len(paces) if paces and self.calibration_z is not None else 1.0

    # --- views for the policies ---------------------------------------------
    def prefill_loads(self, hashes: Sequence[str], now: float, pool_prefix: Mapping[str, int] | None = None,
                      shortlist: int = 0, skip: Callable[[str], bool] | None = None) -> list[PrefillLoad]:
        """The prefill instances `skip` does not reject, in id order: every one, or
        (`shortlist` k > 0) the k holding the longest prefix of `hashes`, the k whose
        queues empty first and every CPP group. `pool_prefix`: per instance, the
        prefix its node's pool holds (live cluster); an instance's prefix is the
        longer of that and its own engine's cache."""
        runs = self.index.runs(hashes)  # the instances holding its first block, by run length
        prefixes: dict[str, int] = {}
        for n, ids in runs:  # dict.fromkeys: a run every instance shares costs no Python loop
            prefixes.update(dict.fromkeys(ids, n))
        if pool_prefix:
            for iid, n in pool_prefix.items():
                if n > prefixes.get(iid, 0):
                    prefixes[iid] = n
            runs = _by_length(prefixes)
        if 0 < 2 * shortlist < len(self.prefill):  # else it would hold about every instance anyway
            ids = self._prefill_shortlist(runs, shortlist, skip)
        else:
            ids = sorted(iid for iid in self.prefill if skip is None or not skip(iid))
        return [self._prefill_load(iid, prefixes.get(iid, 0), now) for iid in ids]

    def _prefill_shortlist(self, runs: Sequence[tuple[int, set[str]]], k: int,
                           skip: Callable[[str], bool] | None) -> list[str]:
        def dropped(iid: str) -> bool:
            return iid not in self.prefill or (skip is not None and skip(iid))

        # Every CPP group (a few at most) competes with the single instances the policy picks.
        groups = {iid for iid in self.groups if not dropped(iid)}
        singles = self.queues.first(k, lambda iid: iid in groups or dropped(iid))
        return sorted({*self._longest(runs, k, dropped), *singles, *groups})

    def _longest(self, runs: Sequence[tuple[int, set[str]]], k: int, dropped: Callable[[str], bool]) -> list[str]:
        """The k holding the longest prefixes, the emptiest queues first among equals.
        A run many instances share (a system prompt on every instance) is read in
        queue order, not sorted whole."""
        chosen: list[str] = []
        for _, ids in reversed(runs):
            room = k - len(chosen)
            if room <= 0:
                break
            if len(ids) > 4 * room:
                chosen += self.queues.first(room, lambda iid: iid not in ids or dropped(iid))
            else:
                chosen += heapq.nsmallest(room, (iid for iid in ids if not dropped(iid)),
                                          key=lambda iid: (self.queues.key(iid), iid))
        return chosen

    def _prefill_load(self, iid: str, prefix_blocks: int, now: float) -> PrefillLoad:
        book = self.prefill[iid]
        book.trim(now)
        return PrefillLoad(
            instance_id=iid,
            queue_s=book.queue_s(now),
            active_blocks=book.active_blocks,
            prefix_blocks=prefix_blocks,
            hit_ratio=book.window_cached / book.window_prompt if book.window_prompt else 0.0,
            window_load_s=book.window_prefill_s,
            free_blocks=self.index.capacity_blocks - self.index.used_blocks(iid),
            slowdown=1.0 if self.calibration_z is None else book.calibration.pace(now, self.calibration_z),
            paces=() if self.calibration_z is None else book.calibration.tails(now, self.calibration_z),
            group=book.group,
        )

    def decode_loads(self, now: float, shortlist: int = 0, skip: Callable[[str], bool] | None = None) -> list[DecodeLoad]:
        """The decode instances `skip` does not reject, in id order: every one, or
        (`shortlist` k > 0, fewer than half of them) the k whose booked batches step
        fastest."""
        if 0 < 2 * shortlist < len(self.decode):  # else it would hold about every instance anyway
            ids = sorted(self.batches.first(shortlist, skip))
        else:
            ids = sorted(iid for iid in self.decode if skip is None or not skip(iid))
        return [self.decode_load(iid, now) for iid in ids]

    def decode_load(self, instance_id: str, now: float) -> DecodeLoad:
        """One instance's decodes (none booked: an empty batch), whatever its role: a
        prefill instance decodes too while no decode instance is live."""
        t_d = self.decode_time_s
        items = tuple(i if i.start > now or i.end > now else _due(i, now, t_d)  # _due's test, inlined: the hot path
                      for i in self.decode.get(instance_id, {}).values())
        return DecodeLoad(instance_id, items, self.decode_capacity)

    def local_queued(self, decode_id: str) -> int:
        """Prompt tokens a decode instance has yet to prefill itself."""
        return sum(self.local.get(decode_id, {}).values())

    def decode_prefix(self, hashes: Sequence[str], decode_id: str) -> int:
        """Leading blocks of `hashes` the decode engine's own prefix cache holds."""
        return self.index.prefix_blocks(hashes, [decode_id])[decode_id]

    # --- events -------------------------------------------------------------
    def assign(self, req: Request, hashes: Sequence[str], decision: Decision, now: float) -> None:
        choice = decision.prefill
        bs = self.params.block_size
        cached = min(choice.cached_blocks * bs, req.prompt_len - 1)
        book = self.prefill[choice.instance_id]
        work_s = prefill_s(self.predictor, book.group, req.prompt_len - cached, cached)
        start = now + book.queue_s(now)
        self._busy(choice.instance_id, start + work_s + self.predictor.transfer_s(choice.pull_blocks * bs))
        book.add(req.request_id, Assigned(req.prompt_blocks, work_s, cached, req.prompt_len, now,
                                          ttft_s=book.busy_until - now))
        # The prefill engine keeps these blocks in its prefix cache afterwards.
        self.index.insert(choice.instance_id, hashes)
        start = now + decision.prefill.ttft_s
        item = DecodeItem(start, start + self.decode_time_s, decode_context(req.prompt_len, req.max_tokens))
        self._book(decision.decode_id, req.request_id, item)
        self.placed[req.request_id] = (choice.instance_id, decision.decode_id)

    def assign_decode(self, req: Request, decode_id: str, now: float) -> None:
        """A request placed on a decode instance alone (a retry after its prefill):
        it decodes from now for t_d."""
        item = DecodeItem(now, now + self.decode_time_s, decode_context(req.prompt_len, req.max_tokens))
        self._book(decode_id, req.request_id, item)
        self.placed[req.request_id] = ("", decode_id)

    def assign_local(self, req: Request, hashes: Sequence[str], decode_id: str, uncached_tokens: int, ttft_s: float,
                     now: float) -> None:
        """A request its decode instance prefills itself: in the batch from now (its
        prefill is steps of that batch), decoding for t_d after its predicted TTFT."""
        item = DecodeItem(now, now + ttft_s + self.decode_time_s, decode_context(req.prompt_len, req.max_tokens))
        self._book(decode_id, req.request_id, item)
        self.local.setdefault(decode_id, {})[req.request_id] = uncached_tokens
        self.placed[req.request_id] = ("", decode_id)
        self.index.insert(decode_id, hashes)  # its engine keeps the blocks it computes

    def prefill_done(self, request_id: str, now: float) -> None:
        self._off_local(request_id)
        prefill_id, _ = self.placed.get(request_id, ("", ""))
        book = self.prefill.get(prefill_id)
        a = self._off_prefill(request_id, now)
        if a is not None and book is not None:
            book.calibration.add(now - a.at, a.ttft_s, now)
        _, decode_id = self.placed.get(request_id, ("", ""))
        items = self.decode.get(decode_id)
        if items is not None and request_id in items:
            # Decoding starts now; it should last t_d from here.
            old = items[request_id]
            items[request_id] = DecodeItem(now, now + self.decode_time_s, old.ctx_tokens)

    def finished(self, request_id: str, now: float, completed: bool = False) -> None:
        """Decode done (`completed`), refused, cancelled or failed: the request leaves
        every book; a completed decode teaches t_d how long decodes take."""
        self._off_prefill(request_id, now)  # if its prefill_done never came
        self._off_local(request_id)
        _, decode_id = self.placed.pop(request_id, ("", ""))
        item = self._unbook(decode_id, request_id)
        if completed and item is not None and self.params.learn_decode_time and item.start <= now:
            # item.start: when its prefill_done said decoding began. Still in the future:
            # that never came, and the span says nothing (it would teach a negative t_d).
            self.decode_time_s += DECODE_TIME_WEIGHT * (now - item.start - self.decode_time_s)

    def _off_local(self, request_id: str) -> None:
        _, decode_id = self.placed.get(request_id, ("", ""))
        self.local.get(decode_id, {}).pop(request_id, None)

    def _off_prefill(self, request_id: str, now: float) -> Assigned | None:
        prefill_id, _ = self.placed.get(request_id, ("", ""))
        book = self.prefill.get(prefill_id)
        a = book.done(request_id) if book is not None else None
        if a is not None and not book.outstanding:
            self._busy(prefill_id, min(book.busy_until, now))  # idle now, whatever we predicted
        return a

    def _busy(self, prefill_id: str, until: float) -> None:
        self.prefill[prefill_id].busy_until = until
        self.queues.set(prefill_id, until)

    def _book(self, decode_id: str, request_id: str, item: DecodeItem) -> None:
        items = self.decode.setdefault(decode_id, {})
        old = items.get(request_id)
        items[request_id] = item
        n, tokens = self.booked.get(decode_id, (0, 0))
        if old is None:
            self._rebook(decode_id, n + 1, tokens + item.ctx_tokens)
        elif old.ctx_tokens != item.ctx_tokens:
            self._rebook(decode_id, n, tokens + item.ctx_tokens - old.ctx_tokens)

    def _unbook(self, decode_id: str, request_id: str) -> DecodeItem | None:
        item = self.decode.get(decode_id, {}).pop(request_id, None)
        if item is not None:
            n, tokens = self.booked.get(decode_id, (1, item.ctx_tokens))
            self._rebook(decode_id, n - 1, tokens - item.ctx_tokens)
        return item

    def _rebook(self, decode_id: str, requests: int, tokens: int) -> None:
        self.booked[decode_id] = (requests, tokens)
        self.batches.set(decode_id, self.predictor.decode_step_s(requests, tokens))


def _by_length(prefixes: Mapping[str, int]) -> list[tuple[int, set[str]]]:
    """Instances grouped by the length of the prefix they hold, shortest first."""
    runs: dict[int, set[str]] = {}
    for iid, n in prefixes.items():
        if n > 0:
            runs.setdefault(n, set()).add(iid)
    return sorted(runs.items())


def _due(item: DecodeItem, now: float, t_d: float) -> DecodeItem:
    """A request still decoding past its predicted end (no "finished" yet) is a long
    one, and it still holds its decode slot: predict it another t_d from now.
    Taking it as ending now would show its decode instance emptier in the future than
    it will be, and send it requests it must refuse after their prefill (docs/simulator.md,
    "Simulator": wasted prefills 3,916 → 2,317 on the conversation trace)."""
    if item.start > now or item.end > now:
        return item
    return DecodeItem(item.start, now + t_d, item.ctx_tokens)
