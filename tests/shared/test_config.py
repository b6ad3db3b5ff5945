import msgspec
import pytest

from services.conductor.planner import PlannerParams, planner_timing
from shared.config import ClusterConfig, check_id, load_config, save_config


def test_round_trip(tmp_path):
    c = ClusterConfig(model="/m/tiny", block_size=32)
    save_config(c, tmp_path / "c.json")
    assert load_config(tmp_path / "c.json") == c
    assert c.served_model_name == "tiny"


def test_unknown_and_invalid_fields_are_refused(tmp_path):
    (tmp_path / "a.json").write_text('{"modle": "/m"}')
    with pytest.raises(ValueError, match="modle"):
        load_config(tmp_path / "a.json")
    (tmp_path / "b.json").write_text('{"block_size": 10}')
    with pytest.raises(ValueError, match="block_size"):
        load_config(tmp_path / "b.json")


def test_ids_must_be_subject_safe():
    assert check_id("prefill-0") == "prefill-0"
    with pytest.raises(ValueError):
        check_id("a.b")


def test_a_config_that_leaves_slos_to_the_profile_gets_them_at_start():
    from shared.service import resolved

    config = resolved(ClusterConfig(max_model_len=4096))
    assert config.admission == "predictive" and config.slo_ttft_ms > 0 and config.slo_tbt_ms > 0
    assert resolved(ClusterConfig(slo_ttft_ms=5.0, slo_tbt_ms=7.0)).slo_ttft_ms == 5.0  # what is set stays


def test_gpu_settings_are_checked_with_the_setting_named():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        ClusterConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="must be at least 1"):
        ClusterConfig(prefill_tensor_parallel_size=0, decode_tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"\(2\) and decode_tensor_parallel_size \(1\) must be equal"):
        ClusterConfig(prefill_tensor_parallel_size=2)
    colocated = ClusterConfig(mode="colocated", decode_tensor_parallel_size=2)  # nothing moves between engines
    assert colocated.tensor_parallel_size("decode") == 2 and colocated.tensor_parallel_size("prefill") == 1


def test_a_dtype_vllm_would_refuse_is_refused_at_once_with_its_choices():
    with pytest.raises(ValueError, match="dtype must be one of auto, half, .* got 'float64'"):
        ClusterConfig(dtype="float64")


def test_the_dtypes_allowed_are_vllms_own():
    import typing

    model = pytest.importorskip("vllm.config.model")
    from shared.config import DTYPES

    assert set(DTYPES) == set(typing.get_args(model.ModelDType))


def test_decode_engines_cap_a_prompts_chunk_to_the_tbt_slo_unless_told_otherwise():
    from shared.service import resolved

    config = resolved(ClusterConfig(max_model_len=2048))
    assert config.block_size <= config.decode_chunk_tokens <= config.step_tokens
    assert config.decode_chunk_tokens % config.block_size == 0
    assert config.prompt_chunk_tokens("decode") == config.decode_chunk_tokens
    assert config.prompt_chunk_tokens("prefill") == 0  # a prefill engine serves whole prompts in turn
    colocated = msgspec.structs.replace(config, mode="colocated")
    assert colocated.prompt_chunk_tokens("decode") == 0  # vLLM's own chunking, as plain vLLM
    assert resolved(ClusterConfig(decode_chunk_tokens=256)).decode_chunk_tokens == 256  # what is set stays
    with pytest.raises(ValueError, match="decode_chunk_tokens"):
        ClusterConfig(decode_chunk_tokens=4096, step_tokens=2048)
    with pytest.raises(ValueError, match="decode_chunk_tokens"):
        ClusterConfig(decode_chunk_tokens=2048, max_model_len=1024)  # vLLM refuses a chunk past the context
    loose = resolved(ClusterConfig(max_model_len=1024, slo_tbt_ms=1000.0))  # any chunk keeps a loose SLO
    assert loose.decode_chunk_tokens == 1024


def test_the_planner_runs_only_where_instances_have_roles_it_may_change():
    for mode in ("colocated", "conditional"):
        with pytest.raises(ValueError, match=f"mode {mode} has no roles"):
            ClusterConfig(model="/m/tiny", mode=mode, planner=True)
    for mode in ("adaptive", "disaggregated"):
        assert ClusterConfig(model="/m/tiny", mode=mode, planner=True).planner


def test_the_planners_timing_is_set_and_checked():
    fast = ClusterConfig(model="/m/tiny", planner=True, planner_interval_s=2, planner_window_s=10, planner_dwell_s=0)
    assert PlannerParams(**planner_timing(fast)) == PlannerParams(interval_s=2, window_s=10, dwell_s=0)
    assert PlannerParams(**planner_timing(ClusterConfig(model="/m/tiny"))) == PlannerParams()  # one set of defaults
    for bad in ({"planner_interval_s": 0}, {"planner_window_s": -1}, {"planner_dwell_s": -1}, {"planner_confirm": 0}):
        with pytest.raises(ValueError, match="planner_"):
            ClusterConfig(model="/m/tiny", **bad)
