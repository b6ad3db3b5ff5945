"""The port book (yuebing/ports.py): no draw hands out a port another draw holds."""

from __future__ import annotations

import os
import socket

from yuebing import process
from yuebing.ports import Lease, PortBook, live, pick


def test_lapsed_bookings_and_those_of_dead_drawers_are_dropped():
    leases = {1: Lease(10, 50.0), 2: Lease(11, 200.0), 3: Lease(12, 200.0)}
    assert set(live(leases, 100.0, lambda pid: pid != 12)) == {2}


def test_pick_skips_a_base_whose_run_is_booked_or_taken():
    assert pick([100, 200, 300], 2, booked={201}, taken=lambda p: p == 101) == 300
    assert pick([100], 1, booked={100}, taken=lambda p: False) is None


def test_the_same_candidate_is_never_handed_out_twice(tmp_path):
    book = PortBook(tmp_path / "ports.json")
    free = lambda p: False  # noqa: E731 - nothing binds in this test
    assert book.book(1, [40_000, 40_001], free) == 40_000
    assert book.book(1, [40_000, 40_001], free) == 40_001  # 40_000 is booked, though still unbound
    assert book.book(1, [40_000, 40_001], free) is None


def test_a_torn_book_starts_afresh(tmp_path):
    path = tmp_path / "ports.json"
    path.write_text("{not json")
    assert PortBook(path).book(1, [40_000], lambda p: False) == 40_000


def test_many_draws_in_a_row_are_all_different_and_free():
    drawn = [process.free_port() for _ in range(50)]
    assert len(set(drawn)) == len(drawn)
    with socket.socket() as s:  # and each one can be bound
        s.bind(("127.0.0.1", drawn[-1]))


def test_a_link_in_place_of_the_book_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("{}")
    link = tmp_path / "ports.json"
    os.symlink(target, link)
    try:
        PortBook(link).book(1, [40_000], lambda p: False)
    except OSError:
        pass
    else:
        raise AssertionError("the book followed a link")
