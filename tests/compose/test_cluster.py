"""The compose cluster, really up: the API with its key, greedy outputs equal to plain
vLLM, KV crossing the kv network between the two messenger containers, the networks
keeping NATS in, a crashed engine container coming back, and `down` leaving nothing.
The tests run in file order: the crash and the teardown come last."""

from __future__ import annotations

import os
import random
import re
import signal
import urllib.error
import urllib.request

import pytest

from tests.e2e.ops import eventually
from yuebing.compose import COMPOSE_DIR, down, gateway_sees, health, run

BLOCK = 128  # compose/cluster.json's block_size
MAX_TOKENS = 12
SERVED = "yuebing-tiny"
# The first test also builds the image and starts the cluster (minutes on a fresh machine).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


def prompt(length: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(32, 127) for _ in range(length)]


def complete(client, ids: list[int]) -> tuple[list[int], dict, int]:
    r = client.completions.create(model=SERVED, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"return_token_ids": True})
    return r.choices[0].model_extra["token_ids"], r.model_extra["yuebing"], r.usage.prompt_tokens_details.cached_tokens


def messenger_metric(cluster, service: str, name: str) -> float:
    """A counter off the messenger's Prometheus page, read inside its container."""
    read = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9600/metrics', timeout=5).read().decode())"
    page = run(["docker", "exec", cluster.container(service), "python", "-c", read]).stdout
    (value,) = re.findall(rf"^yuebing_messenger_{name}(?:_total)?\{{[^}}]*\}} (\S+)$", page, re.MULTILINE)
    return float(value)


def test_health_says_serving_with_each_instance(compose_cluster):
    with urllib.request.urlopen(f"{compose_cluster.options.url}/health", timeout=5) as r:
        body = r.read().decode()
    for instance in ("prefill-0", "decode-0", "messenger-0", "messenger-1"):
        assert instance in body
    assert compose_cluster.inspect("gateway", "{{.State.Health.Status}}") in ("healthy", "starting")


def test_chat_streaming_and_completions_with_the_key(compose_client):
    chat = compose_client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    stream = compose_client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    text = compose_client.completions.create(model=SERVED, prompt="once upon a time", max_tokens=8, temperature=0)
    assert text.choices[0].text and text.usage.completion_tokens == 8


def test_decode_streams_tokens_over_the_gateways_token_channel_across_containers(compose_cluster, compose_client):
    def channelled() -> float:
        request = urllib.request.Request(f"{compose_cluster.options.url}/metrics",
                                         headers={"Authorization": f"Bearer {compose_cluster.key}"})
        with urllib.request.urlopen(request, timeout=5) as r:
            page = r.read().decode()
        found = re.findall(r'^yuebing_gateway_token_batches_total\{way="channel"\} (\S+)$', page, re.MULTILINE)
        return float(found[0]) if found else 0.0

    # A gateway's first request to a decode instance may stream over NATS while its channel opens.
    for attempt in range(5):
        compose_client.completions.create(model=SERVED, prompt=f"a channel, {attempt}", max_tokens=6, temperature=0)
        if channelled() >= 1:
            return
    pytest.fail("no token batch came over the gateway's token channel")


def test_greedy_outputs_equal_plain_vllm_with_kv_from_the_other_node(compose_cluster, compose_client,
                                                                    reference):
    """Prefill runs on node-0 and decode on node-1: decode loads every block (a partial tail too) from
    messenger-0 through messenger-1, over the kv network, and still matches plain vLLM."""
    before = messenger_metric(compose_cluster, "messenger-1", "blocks_received")
    prompts = [prompt(n, seed=n) for n in (60, 300, 2 * BLOCK, 700)]
    results = [complete(compose_client, p) for p in prompts]
    assert [tokens for tokens, _, _ in results] == reference.greedy(prompts, MAX_TOKENS)
    for p, (_, report, _) in zip(prompts, results):
        assert report["decode_kv_loaded_tokens"] == len(p), report
    received = messenger_metric(compose_cluster, "messenger-1", "blocks_received") - before
    assert received == sum(-(-len(p) // BLOCK) for p in prompts)


def test_a_repeated_long_prefix_is_served_from_the_pool(compose_client):
    shared = prompt(5 * BLOCK, seed=7)
    _, _, first = complete(compose_client, shared + prompt(40, seed=8))
    _, report, again = complete(compose_client, shared + prompt(40, seed=9))
    assert first == 0
    assert again >= 5 * BLOCK, report
    assert report["decode_kv_loaded_tokens"] >= 5 * BLOCK, report


def test_a_request_without_the_key_gets_401_in_openai_form(compose_cluster):
    request = urllib.request.Request(f"{compose_cluster.api}/models")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 401
    assert '"error"' in refused.value.read().decode()


def _reach(cluster, network: str, host: str, port: int) -> int:
    """Exit status of a TCP connect from a fresh container on `network`."""
    probe = f"import socket; socket.create_connection(('{host}', {port}), timeout=3)"
    argv = ["docker", "run", "--rm", "--network", f"{cluster.options.project}_{network}", "--entrypoint", "python",
            "yuebing:latest", "-c", probe]
    return run(argv, timeout_s=60, check=False).returncode


def test_nats_is_reachable_only_from_the_control_network(compose_cluster):
    address = compose_cluster.inspect(
        "nats", f'{{{{(index .NetworkSettings.Networks "{compose_cluster.options.project}_control").IPAddress}}}}')
    assert _reach(compose_cluster, "control", address, 4222) == 0  # the probe itself works
    assert _reach(compose_cluster, "edge", address, 4222) != 0
    assert _reach(compose_cluster, "edge", "nats", 4222) != 0


def test_a_killed_decode_container_restarts_and_serving_resumes(compose_cluster, compose_client):
    url = compose_cluster.options.url
    restarts = int(compose_cluster.inspect("decode-0", "{{.RestartCount}}"))
    os.kill(int(compose_cluster.inspect("decode-0", "{{.State.Pid}}")), signal.SIGKILL)  # a crash, not a stop
    eventually(lambda: gateway_sees(url), lambda s: s is not None and "decode-0" not in s, "decode-0 seen dead", 60)
    assert health(url) == 200  # the prefill instance serves alone meanwhile
    eventually(lambda: gateway_sees(url), lambda s: s is not None and "decode-0" in s, "decode-0 back", 300)
    assert int(compose_cluster.inspect("decode-0", "{{.RestartCount}}")) > restarts
    tokens, _, _ = complete(compose_client, prompt(300, seed=11))
    assert len(tokens) == MAX_TOKENS


def test_down_leaves_nothing(compose_cluster):
    down(compose_cluster.options)
    project = f"label=com.docker.compose.project={compose_cluster.options.project}"
    for kind in ("container", "volume", "network"):
        left = run(["docker", kind, "ls", *(["-a"] if kind == "container" else []), "-q", "--filter", project])
        assert not left.stdout.strip(), f"{kind}s left: {left.stdout}"


IMAGE = "yuebing:latest"  # what compose/docker-compose.yml builds; kept when the cluster is taken down


def test_the_ha_layouts_haproxy_configuration_is_valid_for_the_images_haproxy(compose_cluster):
    """The HA layout (docker-compose.ha.yml) runs HAProxy from this image: its own check
    of the configuration (the layout itself is drilled by `yuebing bench ha`). The image
    is the one the compose cluster was built from; the cluster itself may be gone."""
    checked = run(["docker", "run", "--rm", "--network", "none", "-v",
                   f"{COMPOSE_DIR / 'haproxy'}:/etc/yuebing/haproxy:ro", "--entrypoint", "haproxy",
                   IMAGE, "-c", "-f", "/etc/yuebing/haproxy/haproxy.cfg"],
                  check=False)
    assert checked.returncode == 0 and "Configuration file is valid" in checked.stdout + checked.stderr, checked.stderr
