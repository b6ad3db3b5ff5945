"""The suite's shared cluster layouts: each is started once, used by every e2e module
that fits it, and stopped after its last user (tests/conftest.py puts each layout's
users together; tests/e2e/conftest.py starts and stops them). A new e2e test joins
one of these rather than starting a cluster of its own (docs/development.md).

Keys are the session fixtures that start them, in the order the suite runs them;
values are their `yuebing up` flags beyond tests/e2e/conftest.py's `launch()` ones."""

from __future__ import annotations

import json
from pathlib import Path

from shared.private_file import write_private
from shared.tenants import key_sha256

TOOL_CALL_PARSER = "hermes"  # the tiny model's chat template speaks Hermes' tool-call format
# The real model `make test` fetches (`yuebing model fetch`), beside the tiny one.
REAL_MODEL = "smollm2-135m-instruct"

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
        # A stopped decode hands its streams on at once: the test of it (tests/e2e/test_migration.py)
        # sees the hand-off whatever this host's pace (letting them finish is Instance.drain's tests').
        "--drain-timeout-s", "0",
    ),
    # Two gateways and two Conductors sharing the schedule requests over a NATS cluster
    # of three (the gateways' own tests too); KV between the nodes over ZeroMQ; tenants (a file: tests/e2e/conftest.py
    # `tenants_file`), the anonymous one every test sending no key is.
    "two_conductors_process": (
        "--nodes", "2", "--kv-transport", "zmq", "--fault-injection", "--conductors", "2", "--mode", "disaggregated",
        "--gateways", "2", "--nats-servers", "3",
    ),
    # The real model (REAL_MODEL), in the dtype vLLM picks for it, as `make run` serves
    # it: its tokenizer, chat template and text against `vllm serve` on the same folder.
    "real_model_process": ("--nodes", "2", "--dtype", "auto", "--tool-call-parser", TOOL_CALL_PARSER),
}  # fmt: skip


# The shared cluster's tenants (tests/e2e/test_tenants.py): requests sending no key are
# `public`'s (every other test's), each other tenant has a key; gamma and delta share a
# cache group. Keys for tests only.
TENANT_KEYS = {"acme": "key-acme-0123456789", "beta": "key-beta-0123456789", "gamma": "key-gamma-0123456789",
               "delta": "key-delta-0123456789", "ops": "key-ops-0123456789", "capped": "key-capped-0123456789",
               "tokcap": "key-tokcap-0123456789", "streamcap": "key-streamcap-0123456789"}
TENANT_GROUPS = {"gamma": "team", "delta": "team"}
TENANT_LIMITS = {"capped": {"requests_per_minute": 6}, "tokcap": {"tokens_per_minute": 2000},
                 "streamcap": {"max_streams": 1}}


def write_tenants(folder: Path, keys: dict[str, list[str]] | None = None) -> Path:
    """The shared cluster's tenants file in `folder` (owner-only); `keys`: each
    tenant's keys instead of its one (a rotation)."""
    keys = keys or {t: [k] for t, k in TENANT_KEYS.items()}
    tenants = [{"id": "public", "anonymous": True}]
    for tenant, its_keys in keys.items():
        entry = {"id": tenant, "key_sha256": [key_sha256(k) for k in its_keys], "metrics": tenant == "ops",
                 **TENANT_LIMITS.get(tenant, {})}
        tenants.append(entry | ({"cache_group": TENANT_GROUPS[tenant]} if tenant in TENANT_GROUPS else {}))
    new, path = folder / "tenants.json.new", folder / "tenants.json"
    new.unlink(missing_ok=True)
    write_private(new, json.dumps({"tenants": tenants}).encode())
    return new.replace(path)  # at once, as an operator's editor or a Secret's update would
