"""`yuebing bench transfer` with real messenger processes, on small sizes: every
transport in one run, beside the bare Transfer Engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from yuebing.bench.transfer import engine_unavailable

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
    assert result["transport"] == "tcp-loopback"
    assert [r["block_bytes"] for r in result["results"]] == [64 * 1024, 1024 * 1024]
    engine = not engine_unavailable()  # where it cannot load, its columns read 0 and the run says why
    for r in result["results"]:
        assert r["zmq"] > 0 and r["zmq_plaintext"] > 0 and r["memcpy_gbps"] > 0 and r["bare_zmq_gbps"] > 0
        assert (r["mooncake"] > 0, r["mooncake_gbps"] > 0) == (engine, engine)
        assert r["gbps"] == max(r["zmq"], r["mooncake"])
        assert r["ratio_to_mooncake"] == (r["gbps"] / r["mooncake_gbps"] if engine else 0.0)
    assert "| 1 MiB |" in run.stdout and "bare Mooncake TE" in run.stdout
