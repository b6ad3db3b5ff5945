"""`yuebing bench long-context`'s pure parts: its settings, the clusters it asks
for, and the result and table it makes of two runs and plain vLLM's outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from yuebing.bench.long_context import LongContextBench, Run, cluster_flags, result, table

SPEC = LongContextBench(model=Path("/m/tiny"), repeats=3)


def run(name: str, ttft: list[float], outputs: list[list[int]]) -> Run:
    return Run(name, ttft, outputs, [name] * len(ttft), [3968] * len(ttft))


def test_the_json_has_what_the_issue_names_and_judges_every_output():
    same = [[1, 2], [3, 4], [5, 6]]
    out = result(SPEC, run("single", [1.0, 0.7, 0.8], same), run("cpp-2", [0.5, 0.6, 0.4], same), same)
    assert {"prompt_tokens", "stages", "ttft_single_s", "ttft_cpp_s", "outputs_match"} <= set(out)
    assert (out["ttft_single_s"], out["ttft_cpp_s"], out["outputs_match"]) == (0.8, 0.5, True)
    assert out["ratio"] == pytest.approx(0.625)
    differs = result(SPEC, run("single", [1.0] * 3, same), run("cpp-2", [0.5] * 3, [[1, 2], [3, 9], [5, 6]]), same)
    assert differs["outputs_match"] is False
    assert "equal plain vLLM's: NO" in table(differs) and "| 0.50 |" in table(differs)


def test_both_clusters_cut_prompts_alike_and_only_the_second_is_a_group():
    single, cpp = cluster_flags(SPEC, cpp=False), cluster_flags(SPEC, cpp=True)
    for flags in (single, cpp):
        assert flags[flags.index("--step-tokens") + 1] == "512"
    assert "--cpp-groups" not in single and cpp[cpp.index("--prefill") + 1] == "0"
    assert cpp[cpp.index("--cpp-stages") + 1] == "2"


@pytest.mark.parametrize(("fields", "error"), [
    ({"prompt_tokens": 4090}, "exceed the context limit"),
    ({"stages": 1}, "--stages must be at least 2"),
])
def test_settings_that_cannot_run_are_refused(fields, error):
    with pytest.raises(ValueError, match=error):
        LongContextBench(model=Path("/m/tiny"), **fields)
