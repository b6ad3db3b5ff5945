"""`yuebing bench transfer` with real messenger processes, on small sizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_transfer_bench_moves_every_block_and_writes_json(tmp_path):
    out = tmp_path / "xfer.json"
    run = subprocess.run(
        [sys.executable, "-m", "yuebing", "bench", "transfer", "--sizes-kib", "64", "1024", "--total-mib", "16",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["transport"] == "zmq-tcp-loopback"
    assert [r["block_bytes"] for r in result["results"]] == [64 * 1024, 1024 * 1024]
    for r in result["results"]:
        assert r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["zmq_gbps"] > 0
    assert "| 1 MiB |" in run.stdout
