"""The `yuebing` command's parser: built from the command modules, `yuebing up`'s
flags generated from ClusterConfig and UpOptions, the documented surface (docs/command.md) intact."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from shared.config import ClusterConfig
from yuebing import cli
from yuebing.commands import up as up_command

# `yuebing up`'s flags that docs/command.md documents, with a value each.
README_UP = ["--prefill", "2", "--decode", "1", "--nodes", "3", "--port", "8123", "--api-key-file", "key",
             "--policy", "kvcentric", "--admission", "predictive", "--slo-ttft-ms", "500", "--slo-tbt-ms", "50",
             "--profile", "p.json", "--pool-mib", "64", "--eviction", "lfu", "--ssd-dir", "ssd", "--ssd-mib", "128",
             "--kv-wait", "0.5", "--no-kv-streaming", "--no-engine-prefix-cache", "--run-dir", "run",
             "--max-model-len", "2048", "--request-timeout", "60", "--ready-file", "ready.json"]


@pytest.fixture
def model_dir(tmp_path):
    """The files `yuebing up` looks for before it starts (yuebing/preflight.py)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    return tmp_path / "m"


@pytest.fixture
def started(monkeypatch):
    """What `yuebing up` would have started the cluster with."""
    seen = []
    monkeypatch.setattr(up_command, "up", lambda options: seen.append(options) or 0)
    return seen


def test_every_command_module_follows_the_protocol():
    for module in cli.COMMANDS:
        assert module.__doc__ and callable(module.add_parser) and callable(module.run), module.__name__
        assert getattr(module, "GROUP", None) in (None, *cli.GROUPS), module.__name__


def test_every_cluster_setting_is_a_flag_of_up_with_its_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["up", "--help"])
    help_text = capsys.readouterr().out
    for name in ClusterConfig.__struct_fields__:
        if name in up_command.NOT_FLAGS:
            continue
        alias = up_command.CONFIG_ALIASES.get(name)
        flag = alias.flag if alias and alias.flag else name.replace("_", "-")
        assert f"--{flag}" in help_text, name
    assert "(default: 512)" in help_text and "(default: round_robin)" in help_text


def test_readme_flags_reach_the_config_and_the_layout(model_dir, started, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["up", "--model", str(model_dir), *README_UP]) == 0
    (options,) = started
    assert (options.prefill, options.decode, options.nodes, options.port, options.api_key_file) == (2, 1, 3, 8123, tmp_path / "key")
    assert options.run_dir == Path("run") and options.ready_file == Path("ready.json")
    c = options.config
    assert (c.policy, c.admission, c.slo_ttft_ms, c.slo_tbt_ms) == ("kvcentric", "predictive", 500.0, 50.0)
    assert c.profile == str(tmp_path / "p.json") and c.ssd_dir == str(tmp_path / "ssd") and c.model == str(model_dir)
    assert (c.pool_bytes, c.ssd_bytes, c.eviction, c.kv_wait_s) == (64 << 20, 128 << 20, "lfu", 0.5)
    assert not c.kv_stream_layers and not c.engine_prefix_caching
    assert (c.max_model_len, c.request_timeout_s) == (2048, 60.0)


def test_up_defaults_are_the_configs(model_dir, started, monkeypatch):
    monkeypatch.delenv("YUEBING_API_KEY_FILE", raising=False)
    assert cli.main(["up", "--model", str(model_dir)]) == 0
    (options,) = started
    assert options.config == msgspec.structs.replace(ClusterConfig(), model=str(model_dir))
    assert (options.prefill, options.decode, options.nodes, options.api_key_file, options.run_dir) == (1, 1, 1, None, None)


def test_up_refuses_a_missing_model_and_a_bad_setting(model_dir, started, tmp_path, capsys):
    assert cli.main(["up", "--model", str(tmp_path / "none")]) == 2
    assert "(no config.json)" in capsys.readouterr().err
    assert cli.main(["up", "--model", str(model_dir), "--block-size", "10"]) == 2
    assert "block_size must be a positive multiple of 16" in capsys.readouterr().err and not started


def test_model_init_takes_the_spec_from_its_flags(tmp_path):
    out = tmp_path / "m"
    argv = ["model", "init", "--out", str(out), "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
            "--intermediate", "48", "--max-position", "64", "--seed", "3"]
    assert cli.main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (1, 32, 48)
    assert cli.main([*argv, "--if-missing"]) == 0


def test_bench_conductor_writes_its_json(tmp_path, capsys):
    out = tmp_path / "c.json"
    argv = ["bench", "conductor", "--sizes", "2", "--blocks", "2000", "--decisions", "50", "--json", str(out)]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    assert [r["instances"] for r in result["results"]] == [2] and "decisions/s" in capsys.readouterr().out
