from services.conductor.ranking import Ranking


def test_first_reads_the_lowest_keys_ties_by_id_and_follows_updates():
    r = Ranking()
    for iid, key in [("c", 3.0), ("a", 1.0), ("b", 1.0), ("d", 0.5)]:
        r.set(iid, key)
    assert r.first(3) == ["d", "a", "b"]
    r.set("d", 9.0)  # moved: its old place is gone
    assert r.first(3) == ["a", "b", "c"] and len(r) == 4
    assert r.first(2, skip=lambda iid: iid == "a") == ["b", "c"]
    r.remove("b")
    r.remove("missing")
    assert list(r) == ["a", "c", "d"] and "b" not in r and r.key("d") == 9.0
    assert r.first(10) == ["a", "c", "d"]
