"""Which GPUs each engine gets, against faked device lists (no GPU needed)."""

from __future__ import annotations

import pytest

from shared.config import ClusterConfig
from yuebing.gpus import assign, usable
from yuebing.launcher import UpOptions

EIGHT = [str(i) for i in range(8)]


def test_four_prefills_and_four_decodes_on_eight_gpus_each_get_their_own():
    needs = UpOptions(config=ClusterConfig(), prefill=4, decode=4).gpu_needs()
    plan = assign(needs, usable("auto", EIGHT))
    assert plan == {**{f"prefill-{i}": str(i) for i in range(4)}, **{f"decode-{i}": str(4 + i) for i in range(4)}}


def test_tensor_parallel_sizes_and_cpp_stages_take_several_gpus_each():
    config = ClusterConfig(prefill_tensor_parallel_size=2, decode_tensor_parallel_size=2)
    needs = UpOptions(config=config, prefill=1, cpp_groups=1, cpp_stages=2, decode=2).gpu_needs()
    assert needs == [("prefill-0", 2), ("prefill-1", 4), ("decode-0", 2), ("decode-1", 2)]
    with pytest.raises(ValueError, match="need 10 GPUs .* but 8 are available"):
        assign(needs, EIGHT)
    assert assign(needs[:3], EIGHT) == {"prefill-0": "0,1", "prefill-1": "2,3,4,5", "decode-0": "6,7"}


def test_asking_for_more_gpus_than_listed_is_refused_with_what_was_asked():
    needs = UpOptions(config=ClusterConfig(), prefill=4, decode=4).gpu_needs()
    with pytest.raises(ValueError, match=r"need 8 GPUs \(prefill-0 1, .*decode-3 1\), but 2 are available \(0, 1\)"):
        assign(needs, ["0", "1"])


def test_a_machine_without_gpus_runs_cpu_engines_unless_gpus_are_named():
    assert usable("auto", []) == [] and assign([("decode-0", 1)], []) == {}
    with pytest.raises(ValueError, match="which nvidia-smi does not list; it lists: none"):
        usable("0,1", [])


@pytest.mark.parametrize("spec", ["0,0", "x", "", "1,-2"])
def test_bad_gpu_lists_are_refused(spec):
    with pytest.raises(ValueError, match="--gpus must be"):
        usable(spec, EIGHT)


def test_named_gpus_are_used_in_the_order_given():
    assert assign([("prefill-0", 1), ("decode-0", 1)], usable("6,2", EIGHT)) == {"prefill-0": "6", "decode-0": "2"}
    assert usable("none", EIGHT) == []


def test_colocated_engines_are_decode_instances_with_decode_shards():
    config = ClusterConfig(mode="colocated", decode_tensor_parallel_size=2)
    assert UpOptions(config=config, prefill=1, decode=1).gpu_needs() == [("decode-0", 2), ("decode-1", 2)]
