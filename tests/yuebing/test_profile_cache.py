"""Which profile a model's cluster predicts by: the shipped one for the weights it was
measured on, else one measured here once per model, dtype and machine."""

import sys
import time

import pytest

from shared.config import DEFAULT_PROFILE, ClusterConfig
from yuebing import launcher, profile_cache
from yuebing.model import ModelSpec, default_model_dir, write_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("YUEBING_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def measured(monkeypatch) -> list:
    """profile_cache.measure as a double that writes the shipped rows (no engine)."""
    calls = []

    def measure(model_dir, dtype, out, cancelled=None):
        calls.append((model_dir.name, dtype))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(DEFAULT_PROFILE.read_text())

    monkeypatch.setattr(profile_cache, "measure", measure)
    return calls


def test_the_tiny_model_is_described_by_the_shipped_profile(cache, measured):
    if not (default_model_dir() / "config.json").is_file():
        pytest.skip("no tiny model written (make model)")
    assert profile_cache.ensure(default_model_dir(), "float32", print) == DEFAULT_PROFILE
    assert measured == []


def test_another_model_is_measured_once_per_dtype_and_kept(tmp_path, cache, measured):
    model = tmp_path / "other"
    write_model(ModelSpec(layers=1, hidden=64, heads=2, kv_heads=1, intermediate=64), model)
    said = []
    first = profile_cache.ensure(model, "auto", said.append)
    assert first.is_file() and first.is_relative_to(cache) and "once" in said[0]
    assert profile_cache.ensure(model, "auto", said.append) == first
    assert profile_cache.ensure(model, "float32", said.append) != first
    assert measured == [("other", "auto"), ("other", "float32")]


def test_the_cache_key_changes_with_the_weights_and_the_machine():
    a = profile_cache.cached("a" * 64, "auto", "cpu x2")
    assert a != profile_cache.cached("b" * 64, "auto", "cpu x2") != profile_cache.cached("a" * 64, "auto", "cpu x4")
    assert "x2" not in a.name  # the machine's description goes in as a digest


def test_the_machine_names_its_processor_cores_and_engine():
    where = profile_cache.machine()
    assert "gpus:" in where and "vllm" in where and f"x{__import__('os').cpu_count()}" in where


def test_a_failing_profile_pass_says_why_and_leaves_no_profile(tmp_path, cache, monkeypatch):
    # The pass writes half a profile, then dies.
    script = "import sys; open(sys.argv[-1], 'w').write('{'); sys.exit('ValueError: no such architecture')"
    monkeypatch.setattr(profile_cache, "profile_argv", lambda model, dtype, out: [sys.executable, "-c", script, str(out)])
    out = profile_cache.cached("c" * 64, "auto", "here")
    with pytest.raises(RuntimeError, match="(?s)failed .*no such architecture"):
        profile_cache.measure(tmp_path, "auto", out)
    assert [p.name for p in out.parent.iterdir()] == [out.with_suffix(".log").name]


def test_a_stop_asked_for_during_the_pass_ends_it_and_its_processes(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(profile_cache, "profile_argv",
                        lambda model, dtype, out: [sys.executable, "-c", "import time; time.sleep(60)"])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="stopped"):
        profile_cache.measure(tmp_path, "auto", profile_cache.cached("d" * 64, "auto", "here"), lambda: True)
    assert time.monotonic() - started < 10


def test_the_launcher_gives_the_config_its_models_profile_unless_it_names_one(tmp_path, cache, measured):
    model = tmp_path / "other"
    write_model(ModelSpec(layers=1, hidden=64, heads=2, kv_heads=1, intermediate=64), model)
    profiled = launcher.with_profile(ClusterConfig(model=str(model)))
    assert profiled.profile.startswith(str(cache)) and len(profiled.model_fingerprint) == 64
    assert launcher.with_profile(ClusterConfig(model=str(model), profile="/p.json")).profile == "/p.json"
    assert launcher.with_profile(ClusterConfig(model=str(model), fake_engine_step_ms=5)).profile == ""
    assert len(measured) == 1
