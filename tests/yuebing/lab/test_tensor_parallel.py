"""yuebing/lab/tensor_parallel.py: instances of several GPUs in the time model."""

from __future__ import annotations

import pytest

from shared.predictor import Predictor
from yuebing import cli
from yuebing.lab.tensor_parallel import GPUS, LINKS, InstanceShape, Link, kv_capacity_requests, refuse_unfit, tensor_parallel
from yuebing.shapes import SHAPES

ONE_GPU = Predictor(prefill_coef=(20.0, 0.1, 1e-5, 3e-6), decode_coef=(50.0, 0.04, 1e-4))
MODEL = SHAPES["llama2-70b"]
NO_LINK = InstanceShape(gpus=8, link=Link("free", 1e30, 0.0, "a link that costs nothing"))


def test_one_gpu_is_the_profile_itself():
    assert tensor_parallel(ONE_GPU, MODEL, InstanceShape(gpus=1)) is ONE_GPU


def test_compute_divides_by_the_gpus_times_their_efficiency():
    free = tensor_parallel(ONE_GPU, MODEL, NO_LINK)
    assert free.prefill_s(4096, 1024) == pytest.approx(ONE_GPU.prefill_s(4096, 1024) / 8)
    assert free.decode_step_s(32, 32 * 8192) == pytest.approx(ONE_GPU.decode_step_s(32, 32 * 8192) / 8)
    half = tensor_parallel(ONE_GPU, MODEL, InstanceShape(gpus=8, efficiency=0.5, link=NO_LINK.link))
    assert half.prefill_s(4096) == pytest.approx(ONE_GPU.prefill_s(4096) / 4)


def test_every_layer_adds_two_all_reduces_of_its_tokens():
    instance = InstanceShape(gpus=8, link=LINKS["a800-nvlink"])
    tp = tensor_parallel(ONE_GPU, MODEL, instance)
    free = tensor_parallel(ONE_GPU, MODEL, NO_LINK)
    calls = 2 * MODEL.layers
    for tokens in (1, 512, 4096):
        added = tp.prefill_s(tokens) - free.prefill_s(tokens)
        assert added == pytest.approx(calls * instance.all_reduce_s(tokens, MODEL))
    batch = 32
    added = tp.decode_step_s(batch, batch * 4096) - free.decode_step_s(batch, batch * 4096)
    assert added == pytest.approx(calls * instance.all_reduce_s(batch, MODEL))
    # a ring moves 2(N-1)/N of the data: 7/4 of a 8192 × 2-byte vector per token over the bus
    one = instance.all_reduce_s(1, MODEL) - instance.link.latency_s
    assert one == pytest.approx(2 * 7 / 8 * 8192 * 2 / instance.link.bus_bytes_per_s)


def test_an_instance_that_cannot_hold_its_model_is_refused():
    with pytest.raises(ValueError, match=r"llama2-70b needs 138\.0 GB .* 1 × 80 GiB GPUs offers 77\.3 GB"):
        refuse_unfit(MODEL, "llama2-70b", InstanceShape(gpus=1), context_tokens=0)
    refuse_unfit(MODEL, "llama2-70b", InstanceShape(gpus=2), context_tokens=4096)
    with pytest.raises(ValueError, match="KV of one 65536-token request"):
        refuse_unfit(MODEL, "llama2-70b", InstanceShape(gpus=2), context_tokens=65536)
    refuse_unfit(MODEL, "llama2-70b", InstanceShape(gpus=8), context_tokens=131072)


def test_yuebing_sim_refuses_70b_on_one_gpu_and_runs_it_on_eight(capsys):
    synthetic = ["sim", "--synthetic", "20", "--profile-model", "llama2-70b"]
    assert cli.main(synthetic) == 2
    assert "--gpus-per-instance" in capsys.readouterr().err
    assert cli.main([*synthetic, "--gpus-per-instance", "8"]) == 0


def test_a_bad_instance_is_refused():
    with pytest.raises(ValueError, match="gpus ≥ 1"):
        InstanceShape(gpus=0)
    with pytest.raises(ValueError, match="efficiency"):
        InstanceShape(gpus=2, efficiency=1.5)


def test_another_gpu_scales_prefill_by_compute_and_decode_by_bandwidth():
    a800 = tensor_parallel(ONE_GPU, MODEL, InstanceShape(gpus=1, gpu=GPUS["a800"]))
    h100, slower = GPUS["h100"], GPUS["a800"]
    assert a800.prefill_s(4096) == pytest.approx(ONE_GPU.prefill_s(4096) * h100.bf16_flops / slower.bf16_flops)
    assert a800.decode_step_s(8, 8 * 4096) == pytest.approx(
        ONE_GPU.decode_step_s(8, 8 * 4096) * h100.memory_bytes_per_s / slower.memory_bytes_per_s)


def test_kv_capacity_is_the_memory_left_by_the_weights():
    instance = InstanceShape(gpus=8)
    room = 8 * instance.gpu_memory_bytes * 0.9 - MODEL.weight_bytes
    assert kv_capacity_requests(MODEL, instance, 131072) == int(room // (131072 * MODEL.kv_bytes_per_token)) == 11
    assert kv_capacity_requests(MODEL, InstanceShape(gpus=2), 10**7) == 1  # never none: refuse_unfit says why
