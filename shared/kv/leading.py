"""The leading run: how many blocks at the start of a prompt's block list are held.

A block's KV is only usable after every block before it, so whoever asks "how much
of this prompt is here?" (the connector, its pool follower, the messenger, the
Conductor's index) wants the length of the leading run, never a count of matches.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from typing import TypeVar

T = TypeVar("T")


def leading_run(items: Iterable[T], held: Callable[[T], object]) -> int:
    """How many leading `items` are `held`: `held` is called on each in order and on
    none after the first that is not (so it may act, e.g. pin, as it counts)."""
    n = 0
    for item in items:
        if not held(item):
            break
        n += 1
    return n


def leading_count(items: Iterable[T], container: Container[T]) -> int:
    """How many leading `items` are in `container`."""
    return leading_run(items, container.__contains__)
