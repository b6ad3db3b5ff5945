"""`yuebing bench transfer` with real messenger processes, on small sizes: every
transport in one run, beside the bare Transfer Engine; and its verdict over runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from yuebing.bench.transfer import TransferResult, cpu_seconds, cpu_table, engine_unavailable, to_json, verdict


@pytest.mark.e2e
def test_transfer_bench_moves_every_block_and_writes_json(tmp_path):
    out = tmp_path / "xfer.json"
    run = subprocess.run(
        [sys.executable, "-m", "yuebing", "bench", "transfer", "--sizes-kib", "64", "1024", "--total-mib", "16",
         "--tries", "2", "--json", str(out)],
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
        assert r["tcp"] > 0 and r["gbps"] == max(r["zmq"], r["tcp"], r["mooncake"]) and r["tries"] == 2
        assert r["ratio_to_mooncake"] == (r["gbps"] / r["mooncake_gbps"] if engine else 0.0)
        # Each side's CPU per GB, per transport as deployed: a messenger moving bytes spends CPU on them.
        assert set(r["cpu_s_per_gb"]) == ({"zmq", "tcp", "mooncake"} if engine else {"zmq", "tcp"})
        assert all(len(sides) == 2 and all(s >= 0 for s in sides) for sides in r["cpu_s_per_gb"].values())
        assert r["cpu_s_per_gb"]["tcp"][1] > 0  # the receiver decrypts every byte
        assert set(r["loop_s_per_gb"]) == set(r["cpu_s_per_gb"])
        assert all(0 <= loop <= every + 1e-9 for t in r["cpu_s_per_gb"]
                   for loop, every in zip(r["loop_s_per_gb"][t], r["cpu_s_per_gb"][t]))
    assert "| 1 MiB |" in run.stdout and "bare Mooncake TE" in run.stdout
    assert "tcp: sender, receiver CPU-s/GB" in run.stdout


def result(block_bytes: int, ratio: float) -> TransferResult:
    return TransferResult(block_bytes, 4, ratio, 1.0, ratio, ratio, ratio, 0.5, 1.0, 0.5, 10.0, 1.0, 0.5)


def test_the_verdict_takes_the_lowest_ratio_of_every_run_per_block_size():
    runs = [[result(65536, 1.2), result(1 << 20, 1.1)], [result(65536, 0.9), result(1 << 20, 1.3)]]
    text = verdict(runs)
    assert "64 KiB: 1.20, 0.90 (lowest 0.90; >= 1.0 in every run: no)" in text
    assert "1 MiB: 1.10, 1.30 (lowest 1.10; >= 1.0 in every run: yes)" in text
    data = to_json(runs)
    assert [r["ratio_to_mooncake"] for r in data["results"]] == [0.9, 1.3] and len(data["runs"]) == 2
    assert "runs" not in to_json(runs[:1])


def test_cpu_seconds_of_this_process_grow_as_it_works_and_the_table_shows_each_side():
    import os

    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert cpu_seconds(os.getpid()) > before
    assert 0 < cpu_seconds(os.getpid(), loop_only=True) <= cpu_seconds(os.getpid())
    r = TransferResult(65536, 4, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 10.0, 1.0, 0.5,
                       cpu_s_per_gb={"tcp": [0.25, 0.5]}, loop_s_per_gb={"tcp": [0.125, 0.25]})
    assert "| 64 KiB | 0.250 (0.125), 0.500 (0.250) |" in cpu_table([r])
