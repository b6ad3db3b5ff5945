"""The suite's shared cluster layouts: each is started once, used by every e2e module
that fits it, and stopped after its last user (tests/conftest.py puts each layout's
users together; tests/e2e/conftest.py starts and stops them). A new e2e test joins
one of these rather than starting a cluster of its own (docs/development.md).

Keys are the session fixtures that start them, in the order the suite runs them;
values are their `yuebing up` flags beyond tests/e2e/conftest.py's `launch()` ones."""

from __future__ import annotations

TOOL_CALL_PARSER = "hermes"  # the tiny model's chat template speaks Hermes' tool-call format

LAYOUTS: dict[str, tuple[str, ...]] = {
    # One prefill on node-0, one decode on node-1: most tests, their KV always crosses nodes.
    "cluster_process": (
        "--policy", "kvcentric", "--admission", "predictive", "--nodes", "2",
        "--fault-injection",  # tests/e2e/test_transfer.py arms the messengers' fault switches
        "--tool-call-parser", TOOL_CALL_PARSER,
    ),
    # A second instance of each role: retry and migration, cache-aware placement, chaos.
    # Deadlines of 30 s, the chaos test's (yuebing/bench/chaos.py, DEADLINE_S).
    "two_of_each_process": (
        "--nodes", "2", "--prefill", "2", "--decode", "2", "--policy", "cache_aware", "--request-timeout", "30",
    ),
    # Two Conductors sharing the schedule requests; KV between the nodes over ZeroMQ.
    "two_conductors_process": (
        "--nodes", "2", "--kv-transport", "zmq", "--fault-injection", "--conductors", "2", "--mode", "disaggregated",
    ),
}  # fmt: skip
