import pytest

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
