"""The suite's report (tests/suite_report.py): modules by wall time, each cluster with
the modules that used it, the time spent starting them."""

from tests.suite_report import SuiteReport


def test_the_report_lists_modules_slowest_first_and_each_cluster_with_its_users():
    report = SuiteReport()
    report.modules.update({"tests/a.py": 2.0, "tests/e2e/test_b.py": 90.0})
    shared, other = object(), object()
    report.started("cluster", "disaggregated: 1 prefill, 1 decode, 2 nodes", 2, 61.5, shared)
    report.started("vllm serve", "plain vLLM's OpenAI server", 1, 20.0, "http://x/v1")
    report.used("tests/e2e/test_b.py", [("mode", shared), other])
    report.used("tests/e2e/test_c.py", [shared])
    lines = report.lines()
    assert lines[0] == "wall time per module (1.5 min in all):"
    assert lines[1].endswith("tests/e2e/test_b.py") and lines[2].endswith("tests/a.py")
    assert lines[3] == "clusters started: 2, 82 s starting them, 3 engines in all:"
    assert lines[4] == ("    61.5 s  2 engines  cluster: disaggregated: 1 prefill, 1 decode, 2 nodes  "
                        "used by test_b.py, test_c.py")
    assert lines[5].endswith("vllm serve: plain vLLM's OpenAI server  used by -")
