"""Plain `vllm serve` for the comparing benchmarks: the cluster engines' settings."""

from __future__ import annotations

from pathlib import Path

from yuebing.bench import vllm_serve


def test_plain_vllm_runs_with_the_cluster_engines_settings():
    argv = vllm_serve.argv(Path("/m/tiny"), 8123, max_model_len=1024, dtype="float32")
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert pairs["--served-model-name"] == "tiny" and pairs["--max-model-len"] == "1024"
    assert (pairs["--block-size"], pairs["--max-num-batched-tokens"], pairs["--dtype"]) == ("128", "2048", "float32")
