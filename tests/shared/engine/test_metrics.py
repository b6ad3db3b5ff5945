"""An engine instance's Prometheus page: vLLM's metrics labelled with the instance,
and the instance's own load."""

import time

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared.config import ClusterConfig
from shared.engine.metrics import instance_registry
from shared.instance import Instance


def samples(registry: CollectorRegistry) -> dict[str, tuple[dict, float]]:
    text = generate_latest(registry).decode()
    return {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}


def test_vllms_metrics_carry_the_instance_id_beside_the_instances_own_load():
    engine = CollectorRegistry()  # stands in for the default registry vLLM's stat logger fills
    Counter("vllm:num_preemptions", "Preemptions", ["model_name", "engine"], registry=engine).labels("tiny", "0").inc(2)
    instance = Instance("decode", "decode-0", "node-1", ClusterConfig(calibrate_time_model=False), nc=None)
    instance.load.num_waiting, instance.load.kv_usage, instance.served_total = 3, 0.25, 7
    instance.outbox.chunks, instance.outbox.batches = 40, 5
    got = samples(instance_registry(instance, engine))
    assert got["vllm:num_preemptions_total"] == ({"model_name": "tiny", "engine": "0", "instance_id": "decode-0"}, 2)
    who = {"instance_id": "decode-0", "role": "decode", "node": "node-1"}
    assert got["yuebing_instance_engine_waiting"] == (who, 3)
    assert got["yuebing_instance_kv_cache_usage_ratio"] == (who, 0.25)
    assert got["yuebing_instance_served_total"] == (who, 7)
    assert got["yuebing_instance_token_chunks_total"] == (who, 40) and got["yuebing_instance_token_batches_total"] == (who, 5)
    assert got["yuebing_instance_requests"] == (who, 0) and got["yuebing_instance_slowdown"] == (who, 1.0)
    assert got["yuebing_instance_slowdown_evidence_seconds"] == (who, 0.0)  # not calibrated: no evidence counts


def test_a_calibrated_instance_says_how_much_work_its_slowdown_rests_on():
    instance = Instance("decode", "decode-0", "node-1", ClusterConfig(calibrate_time_model=True), nc=None)
    assert samples(instance_registry(instance, CollectorRegistry()))["yuebing_instance_slowdown_evidence_seconds"][1] == 0
    instance.load.calibration.add(0.4, 0.4, now=time.monotonic())  # on the prediction: a slowdown of exactly 1
    got = samples(instance_registry(instance, CollectorRegistry()))
    assert got["yuebing_instance_slowdown"][1] == 1.0
    assert 0 < got["yuebing_instance_slowdown_evidence_seconds"][1] <= 0.4
