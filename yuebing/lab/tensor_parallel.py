"""Instances of several GPUs in the simulator's time model: tensor parallelism over N
GPUs, from a profile measured on one.

Tensor parallelism splits every layer's weights, compute and memory traffic N ways, so
each fitted cost term is divided by N (by N × `efficiency` where kernels on a slice
run below their full-size speed). Each layer then sums its slices twice, after
attention and after the MLP: two all-reduces of (tokens × hidden) bf16 values per
layer. A ring all-reduce over N GPUs moves 2(N−1)/N of the data through each GPU's
link, and pays a latency per call:

    all_reduce_s(tokens) = latency + 2(N−1)/N × tokens × hidden × 2 bytes / bus bandwidth

Both terms are linear in tokens, so the instance's time model keeps the profile's
form: the latency adds to each step's fixed cost, the bandwidth to its per-token
(prefill) or per-sequence (decode) cost.

The links' figures (`LINKS`) are stated with their sources; none was measured here
(no GPU). An instance that cannot hold its model's weights and one full-context
request's KV is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared.predictor import Predictor
from yuebing.shapes import BF16_BYTES, SHAPES, ModelShape

GIB = 1 << 30


@dataclass(frozen=True)
class Link:
    """The GPUs' interconnect, as an all-reduce sees it."""

    name: str
    bus_bytes_per_s: float  # what a large all-reduce sustains per GPU (nccl-tests' "busbw")
    latency_s: float  # one small all-reduce
    source: str


# NVLink, each way per GPU, times the share nccl-tests sustains on large all-reduces.
# NVIDIA's datasheets: A100 SXM NVLink 600 GB/s and A800 SXM 400 GB/s (both directions
# together), H100 SXM 900 GB/s. nccl-tests' all-reduce on 8 A100 SXM GPUs is commonly
# reported at about 230 GB/s busbw of the 300 GB/s each way: 0.77 is the share used
# for every link here. The latency is an assumption of the order nccl-tests prints for
# messages under 1 MB on one NVLink node, not a measurement.
BUS_SHARE = 0.77
LINKS = {
    "a800-nvlink": Link("A800 SXM NVLink (400 GB/s)", BUS_SHARE * 200e9, 15e-6,
                        "NVIDIA A800 datasheet: NVLink 400 GB/s; busbw share 0.77 (nccl-tests, A100)"),
    "h100-nvlink": Link("H100 SXM NVLink (900 GB/s)", BUS_SHARE * 450e9, 15e-6,
                        "NVIDIA H100 datasheet: NVLink 900 GB/s; busbw share 0.77 (nccl-tests, A100)"),
}


@dataclass(frozen=True)
class Gpu:
    """A GPU as the time model scales it: prefill is bound by its compute, decode by its
    memory bandwidth."""

    name: str
    bf16_flops: float  # dense, peak
    memory_bytes_per_s: float
    source: str


# NVIDIA's datasheets, SXM parts with 80 GB. The profile was measured on an H100; a
# time on another GPU is the H100's times the ratio of peaks (prefill: compute; decode:
# memory bandwidth): a first-order model that assumes both reach the same share of
# their peak.
GPUS = {
    "h100": Gpu("H100 SXM 80GB", 989e12, 3.35e12, "NVIDIA H100 datasheet: BF16 989 TFLOPS dense, HBM3 3.35 TB/s"),
    "a800": Gpu("A800 SXM4 80GB", 312e12, 2.039e12,
                "NVIDIA A800 (A100) datasheet: BF16 312 TFLOPS dense, HBM2e 2,039 GB/s"),
}
PROFILE_GPU = GPUS["h100"]  # what yuebing/lab/data/h100-dense-llama.json was measured on


@dataclass(frozen=True)
class InstanceShape:
    """An instance: `gpus` GPUs of `gpu_memory_bytes` each, tensor-parallel over `link`."""

    gpus: int = 1
    efficiency: float = 1.0  # a slice's kernels' speed against the whole layer's, per GPU
    link: Link = LINKS["a800-nvlink"]
    gpu_memory_bytes: int = 80 * GIB  # A800 80GB and H100 80GB alike
    memory_utilization: float = 0.9  # what vLLM takes of each GPU (gpu_memory_utilization)
    gpu: Gpu = PROFILE_GPU  # the instance's GPUs (another than the profile's: its times scaled)

    def __post_init__(self) -> None:
        if self.gpus < 1 or not 0 < self.efficiency <= 1 or not 0 < self.memory_utilization <= 1:
            raise ValueError(f"an instance needs gpus ≥ 1, 0 < efficiency ≤ 1 and 0 < memory share ≤ 1: {self}")

    def all_reduce_s(self, tokens: int, model: ModelShape) -> float:
        """One all-reduce of `tokens` hidden vectors (0 on one GPU: nothing to sum)."""
        if self.gpus == 1:
            return 0.0
        return self.link.latency_s + tokens * self.all_reduce_s_per_token(model)

    def all_reduce_s_per_token(self, model: ModelShape) -> float:
        """What each token's hidden vector adds to an all-reduce: a ring moves 2(N−1)/N of it."""
        ring = 2 * (self.gpus - 1) / self.gpus
        return ring * model.hidden * BF16_BYTES / self.link.bus_bytes_per_s


def kv_room_bytes(model: ModelShape, instance: InstanceShape) -> float:
    """What the instance's memory holds of KV once the weights are loaded."""
    return instance.gpus * instance.gpu_memory_bytes * instance.memory_utilization - model.weight_bytes


def kv_capacity_requests(model: ModelShape, instance: InstanceShape, context_tokens: int) -> int:
    """Requests of `context_tokens` each whose KV fits beside the weights (at least one)."""
    return max(1, int(kv_room_bytes(model, instance) // (context_tokens * model.kv_bytes_per_token)))


def refuse_unfit(model: ModelShape, name: str, instance: InstanceShape, context_tokens: int) -> None:
    """The weights and one request of `context_tokens` must fit the instance's memory."""
    room = instance.gpus * instance.gpu_memory_bytes * instance.memory_utilization
    needed = model.weight_bytes + context_tokens * model.kv_bytes_per_token
    if context_tokens * model.kv_bytes_per_token > kv_room_bytes(model, instance):
        raise ValueError(
            f"{name} needs {needed / 1e9:.1f} GB (weights {model.weight_bytes / 1e9:.1f} GB in bf16, plus the KV of one "
            f"{context_tokens}-token request) but an instance of {instance.gpus} × {instance.gpu_memory_bytes / GIB:.0f} "
            f"GiB GPUs offers {room / 1e9:.1f} GB at {instance.memory_utilization:.0%}: give it more GPUs "
            "(--gpus-per-instance)")


def tensor_parallel(predictor: Predictor, model: ModelShape, instance: InstanceShape) -> Predictor:
    """The profile's one-GPU time model for an instance of `instance.gpus` of `instance.gpu`."""
    predictor = on_gpu(predictor, instance.gpu)
    if instance.gpus == 1:
        return predictor
    speedup = instance.gpus * instance.efficiency
    calls = 2 * model.layers  # all-reduces a forward makes
    fixed_ms = calls * instance.link.latency_s * 1e3
    per_token_ms = calls * instance.all_reduce_s_per_token(model) * 1e3
    a, b, c, d = (x / speedup for x in predictor.prefill_coef)
    da, db, dc = (x / speedup for x in predictor.decode_coef)
    return replace(predictor, prefill_coef=(a + fixed_ms, b + per_token_ms, c, d),
                   decode_coef=(da + fixed_ms, db + per_token_ms, dc))


def on_gpu(predictor: Predictor, gpu: Gpu, measured_on: Gpu = PROFILE_GPU) -> Predictor:
    """The profile's times on `gpu`: prefill's scaled by the ratio of compute peaks,
    decode's by the ratio of memory bandwidths."""
    if gpu == measured_on:
        return predictor
    return predictor.scaled(prefill=measured_on.bf16_flops / gpu.bf16_flops,
                            decode=measured_on.memory_bytes_per_s / gpu.memory_bytes_per_s)


def instance_predictor(predictor: Predictor, model_name: str, instance: InstanceShape, context_tokens: int) -> Predictor:
    """The profile's one-GPU time model of `model_name` for instances of `instance`:
    refused where one cannot hold the model and a request of `context_tokens`."""
    if model_name in SHAPES:
        shape = SHAPES[model_name]
        refuse_unfit(shape, model_name, instance, context_tokens)
        return tensor_parallel(predictor, shape, instance)
    if instance.gpus > 1 or instance.gpu != PROFILE_GPU:
        raise ValueError(f"instances of several GPUs, or of another GPU, need a model of known shape ({', '.join(SHAPES)})")
    return predictor
