"""Counting the leading run."""

from shared.kv.leading import leading_count, leading_run


def test_the_run_stops_at_the_first_block_not_held():
    assert leading_count(["a", "b", "c", "d"], {"a", "b", "d"}) == 2
    assert leading_count(["x", "a"], {"a"}) == 0
    assert leading_count([], {"a"}) == 0


def test_the_predicate_sees_each_block_in_order_and_none_past_the_first_miss():
    seen: list[int] = []
    assert leading_run([1, 2, 3, 4], lambda i: seen.append(i) or i < 3) == 2
    assert seen == [1, 2, 3]
