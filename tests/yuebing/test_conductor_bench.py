from yuebing.bench.conductor import ConductorBench, run, table


def test_conductor_bench_reports_every_size():
    result = run(ConductorBench(sizes=(4, 16), indexed_blocks=20_000, decisions=300), show_progress=False)
    assert [r["instances"] for r in result["results"]] == [4, 16]
    for r in result["results"]:
        assert r["indexed_blocks"] > 15_000 and r["accepted"] > 0
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["decisions_per_s"] > 0
        assert r["gc_tracked"] > 0 and r["gc_full_ms"] > 0
    assert len(table(result).splitlines()) == 2 + 2
    # Each size again with every instance scored, on the same requests: the baseline.
    assert all(r["baseline"]["decisions"] == 300 and r["speedup"] > 0 for r in result["results"])


def test_without_a_shortlist_there_is_no_baseline_to_repeat():
    result = run(ConductorBench(sizes=(4,), indexed_blocks=5_000, decisions=50, shortlist=0), show_progress=False)
    assert "baseline" not in result["results"][0] and "every instance scored" in table(result)
