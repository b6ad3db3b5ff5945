"""Tenants on a live cluster (two gateways, two Conductors, KV across two nodes; the
tenants file of tests/layouts.py): no tenant reads another's cache, by
`cached_tokens` or by timing; one cache group is shared; a client's own
`cache_salt` splits its tenant's cache; keys rotate in the live file."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest
from scipy.stats import mannwhitneyu

from tests.e2e.ops import eventually, scrape
from tests.layouts import TENANT_KEYS, write_tenants

pytestmark = pytest.mark.e2e

MODEL = "yuebing-tiny"
PROMPT_TOKENS = 900  # 7 full blocks of 128
FULL_BLOCKS = PROMPT_TOKENS // 128 * 128
TIMED = 20  # prompts of each kind the timing test compares


@pytest.fixture
def cluster(two_conductors):
    return two_conductors


def prompt(rnd: random.Random) -> list[int]:
    return [rnd.randrange(32, 127) for _ in range(PROMPT_TOKENS)]


def ask(cluster, tenant: str | None, tokens: list[int], salt: str | None = None, key: str | None = None,
        gateway: int = 0, max_tokens: int = 1) -> httpx.Response:
    key = key or (TENANT_KEYS[tenant] if tenant else None)
    body = {"model": MODEL, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            **({"cache_salt": salt} if salt is not None else {})}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{cluster.urls[gateway]}/v1/completions", json=body, headers=headers, timeout=60)


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def prefill_hits(cluster) -> float:
    """Prompt tokens the prefill engines found cached, in vLLM's own prefix cache or
    through the connector from the pools (vLLM's counters, on their pages)."""
    names = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")
    return sum(v for name, url in cluster.metrics.items() if name.startswith("prefill-")
               for key, v in scrape(url).items() if key.startswith(names))


def test_another_tenant_computes_what_one_cached_and_its_responses_never_name_it(cluster):
    rnd = random.Random(11)
    p = prompt(rnd)
    assert cached(ask(cluster, "acme", p)) == 0
    before = prefill_hits(cluster)
    assert cached(ask(cluster, "acme", p, gateway=1)) == FULL_BLOCKS  # its repeat, on the other gateway too
    repeat = eventually(lambda: prefill_hits(cluster), lambda n: n >= before + FULL_BLOCKS, "acme's repeat counted")
    seen = ask(cluster, "beta", p)
    assert cached(seen) == 0
    assert "acme" not in seen.text and not any("acme" in v for v in seen.headers.values())
    assert cached(ask(cluster, None, p)) == 0  # nor the anonymous tenant
    # B's own repeat is B's cache: each tenant is served from its own blocks. What
    # the engines then found cached is that repeat's alone: B's first ask, and the
    # anonymous one, loaded nothing, from an engine's cache or a pool.
    assert cached(ask(cluster, "beta", p)) == FULL_BLOCKS
    after = eventually(lambda: prefill_hits(cluster), lambda n: n >= repeat + FULL_BLOCKS, "beta's repeat counted")
    assert after - repeat == FULL_BLOCKS
    own = seen.headers["x-yuebing-request-id"]
    lines = [line for line in cluster.log("gateway").splitlines() if own in line]
    assert lines and all('"tenant":"beta"' in line and "acme" not in line for line in lines), lines[:3]


def test_one_cache_group_is_shared_and_a_clients_salt_splits_its_tenants(cluster):
    rnd = random.Random(12)
    shared, split = prompt(rnd), prompt(rnd)
    assert cached(ask(cluster, "gamma", shared)) == 0
    assert cached(ask(cluster, "delta", shared)) == FULL_BLOCKS  # gamma and delta: one group
    assert cached(ask(cluster, "acme", split, salt="x")) == 0
    assert cached(ask(cluster, "acme", split, salt="y")) == 0
    assert cached(ask(cluster, "acme", split)) == 0
    assert cached(ask(cluster, "acme", split, salt="x")) == FULL_BLOCKS
    assert cached(ask(cluster, "beta", split, salt="x")) == 0  # the same salt never joins another's cache


def test_a_tenant_cannot_tell_by_timing_which_prompts_another_sent(cluster):
    rnd = random.Random(13)
    theirs, fresh, repeats = [], [], []
    for _ in range(TIMED):  # interleaved: a slow minute of the host falls on every kind alike
        p, f = prompt(rnd), prompt(rnd)
        ask(cluster, "acme", p)
        repeats.append(ask(cluster, "acme", p).elapsed.total_seconds())
        theirs.append(ask(cluster, "beta", p).elapsed.total_seconds())
        fresh.append(ask(cluster, "beta", f).elapsed.total_seconds())
    same = mannwhitneyu(theirs, fresh, alternative="two-sided").pvalue
    faster = mannwhitneyu(repeats, fresh, alternative="less").pvalue
    print(f"\nTTFT medians, ms: beta on acme's prompts {sorted(theirs)[TIMED // 2] * 1e3:.1f}, beta fresh "
          f"{sorted(fresh)[TIMED // 2] * 1e3:.1f}, acme's repeats {sorted(repeats)[TIMED // 2] * 1e3:.1f}; "
          f"p(same) {same:.3f}, p(repeats faster) {faster:.2g}")
    assert same > 0.01, "beta's TTFT tells acme's prompts from fresh ones"
    assert faster < 0.01, "acme's repeats were not served from its cache"


def test_a_bad_key_is_a_401_and_metrics_are_an_operators(cluster):
    r = ask(cluster, None, [1, 2, 3], key="not-a-key")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    acme = {"Authorization": f"Bearer {TENANT_KEYS['acme']}"}
    assert httpx.get(f"{cluster.url}/metrics", headers=acme, timeout=10).status_code == 401
    assert httpx.get(f"{cluster.url}/metrics", timeout=10).status_code == 401
    ops = {"Authorization": f"Bearer {TENANT_KEYS['ops']}"}
    assert httpx.get(f"{cluster.url}/metrics", headers=ops, timeout=10).status_code == 200
    bad = ask(cluster, "acme", [1, 2, 3], salt="a/b")
    assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]


@pytest.mark.destructive
def test_a_key_rotates_in_the_live_file_with_no_stream_cut(cluster, tenants_file):
    old, new = TENANT_KEYS["acme"], "key-acme-rotated-9876543210"
    keys = {t: [k] for t, k in TENANT_KEYS.items()}
    stream: dict[str, object] = {}

    def long_stream() -> None:  # under the old key, read slowly: open across the rotation
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 800, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{cluster.api}/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {old}"}) as r:
            stream["status"] = r.status_code
            events = [line for line in r.iter_lines() if line and not time.sleep(0.01)]
        stream["ended"], stream["last"] = time.monotonic(), json.loads(events[-2].removeprefix("data: "))

    try:
        reader = threading.Thread(target=long_stream)
        reader.start()
        write_tenants(tenants_file.parent, {**keys, "acme": [old, new]})
        for gateway in (0, 1):  # each gateway reads the file again on its own
            eventually(lambda g=gateway: ask(cluster, None, [5, 6], key=new, gateway=g).status_code, lambda s: s == 200,
                       f"the new key on gateway {gateway}", 10)
        write_tenants(tenants_file.parent, {**keys, "acme": [new]})
        for gateway in (0, 1):
            eventually(lambda g=gateway: ask(cluster, None, [5, 6], key=old, gateway=g).status_code, lambda s: s == 401,
                       f"the old key refused on gateway {gateway}", 10)
        refused_at = time.monotonic()
        bad = tenants_file.parent / "tenants.json.new"
        bad.write_text("{not json")
        bad.chmod(0o600)
        bad.replace(tenants_file)  # a bad edit: the last good file stays in force
        eventually(lambda: "tenants file refused" in cluster.log("gateway"), bool, "the bad file's log line", 10)
        assert ask(cluster, None, [5, 6], key=new).status_code == 200
        reader.join(timeout=120)
        assert stream["status"] == 200 and stream["last"]["choices"][0]["finish_reason"] == "length", stream
        assert stream["ended"] > refused_at, "the stream ended before its key was refused: rotate sooner"
    finally:
        write_tenants(tenants_file.parent)


def test_a_tenant_past_its_requests_per_minute_gets_openais_429_across_gateways_and_conductors(cluster):
    # Sequential, alternating gateways (so both Conductors take some), 0.15 s apart:
    # each admission reaches the other Conductor's count within two sync intervals
    # (50 ms each), the stated bound; closer together, a peer may admit one more.
    statuses, refused, remaining = [], None, []
    for i in range(9):
        time.sleep(0.15)
        r = ask(cluster, "capped", [7, 8, 9, i], gateway=i % 2)
        statuses.append(r.status_code)
        refused = refused or (r if r.status_code == 429 else None)
        remaining += [r.headers["x-ratelimit-remaining-requests"]] if r.status_code == 200 else []
    assert statuses.count(200) == 6 and set(statuses) == {200, 429}, statuses
    assert remaining == ["5", "4", "3", "2", "1", "0"]  # on every answer, as OpenAI's
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests") and "quota" in error["message"]
    h = refused.headers
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("6", "0")
    assert 1 <= int(h["retry-after"]) <= 60 and h["x-ratelimit-reset-requests"].endswith("s")
    assert ask(cluster, "beta", [7, 8, 9]).status_code == 200  # the others are served meanwhile
    # An operator reads which tenant was refused, and why, on the gateways' pages.
    ops = {"Authorization": f"Bearer {TENANT_KEYS['ops']}"}
    line = 'yuebing_gateway_tenant_refusals_total{reason="quota_requests",tenant="capped"}'
    pages = [httpx.get(f"{url}/metrics", headers=ops, timeout=10).text for url in cluster.urls]
    counted = sum(float(row.split()[-1]) for page in pages for row in page.splitlines() if row.startswith(line))
    assert counted == 3, counted
    assert any('yuebing_gateway_tenant_requests_total{status="200",tenant="beta"}' in page for page in pages)


def test_tokens_per_minute_reserve_prompt_and_max_tokens(cluster):
    p = prompt(random.Random(14))  # 900 tokens, and 16 out: 916 reserved a request
    codes = [ask(cluster, "tokcap", p, max_tokens=16, gateway=i % 2).status_code for i in range(3)]
    assert codes == [200, 200, 429], codes
    r = ask(cluster, "tokcap", p, max_tokens=16)
    assert r.json()["error"]["type"] == "tokens" and r.headers["x-ratelimit-limit-tokens"] == "2000"


def test_a_tenant_at_its_streams_quota_waits_for_one_to_end(cluster):
    started, done = threading.Event(), threading.Event()

    def long_stream() -> None:  # ~800 tokens: seconds of generation, its slot held meanwhile
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 800, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {TENANT_KEYS['streamcap']}"}
        with httpx.stream("POST", f"{cluster.api}/completions", json=body, headers=headers, timeout=120) as r:
            for _ in r.iter_lines():
                started.set()
        done.set()

    reader = threading.Thread(target=long_stream)
    reader.start()
    try:
        assert started.wait(30), "the first stream never started"
        for gateway in (0, 1):  # whichever Conductor takes the ask: each counts the other's admission
            r = eventually(lambda g=gateway: ask(cluster, "streamcap", [1, 2], gateway=g), lambda r: r.status_code == 429,
                           f"a second stream refused through gateway {gateway}", 10)
            assert "streams" in r.json()["error"]["message"] and r.json()["error"]["type"] == "streams"
        assert not done.is_set(), "the first stream ended before both refusals: make it longer"
    finally:
        reader.join(timeout=120)
    eventually(lambda: ask(cluster, "streamcap", [1, 2]).status_code, lambda s: s == 200, "served once it ended", 10)


def test_the_messages_api_knows_each_tenant_by_its_x_api_key_and_keeps_their_caches_apart(cluster):
    """Anthropic's SDK sends the key as x-api-key: the same tenants, the same cache groups."""
    from anthropic import Anthropic, AuthenticationError

    def client(key: str, gateway: int = 0) -> Anthropic:
        return Anthropic(base_url=cluster.urls[gateway], api_key=key, timeout=60, max_retries=0)

    text = "".join(chr(random.Random(12).randrange(97, 123)) for _ in range(600))  # a few full blocks
    ask_ = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}], "extra_body": {"temperature": 0}}
    first = client(TENANT_KEYS["acme"]).messages.create(**ask_).usage
    again = client(TENANT_KEYS["acme"], gateway=1).messages.create(**ask_).usage
    other = client(TENANT_KEYS["beta"]).messages.create(**ask_).usage
    prompt = first.input_tokens + first.cache_read_input_tokens
    assert prompt >= 256 and first.cache_read_input_tokens == 0
    assert again.cache_read_input_tokens == prompt // 128 * 128 and again.input_tokens == prompt % 128
    assert other.cache_read_input_tokens == 0 and other.input_tokens == prompt
    with pytest.raises(AuthenticationError) as e:
        client("not-a-key").messages.create(**ask_)
    assert e.value.body["error"]["type"] == "authentication_error"


def test_a_stored_response_is_its_tenants_continued_on_another_gateway_from_the_cache(cluster):
    """Stored in JetStream, which both gateways read: turn 2 on the other gateway finds
    turn 1 by its id, and its prompt's full blocks in the cache; another tenant finds neither."""
    from openai import NotFoundError, OpenAI

    def client(tenant: str, gateway: int) -> OpenAI:
        return OpenAI(base_url=f"{cluster.urls[gateway]}/v1", api_key=TENANT_KEYS[tenant], timeout=60, max_retries=0)

    text = "".join(chr(random.Random(13).randrange(97, 123)) for _ in range(600))
    first = client("acme", 0).responses.create(model=MODEL, input=text, max_output_tokens=4, temperature=0)
    second = client("acme", 1).responses.create(model=MODEL, input="and then?", previous_response_id=first.id,
                                                max_output_tokens=4, temperature=0)
    turn1 = first.usage.input_tokens
    assert second.usage.input_tokens > turn1 and second.usage.input_tokens_details.cached_tokens >= turn1 // 128 * 128
    assert client("acme", 1).responses.retrieve(first.id).output_text == first.output_text
    for gateway in (0, 1):
        with pytest.raises(NotFoundError):
            client("beta", gateway).responses.retrieve(first.id)
        with pytest.raises(NotFoundError):
            client("beta", gateway).responses.create(model=MODEL, input="x", previous_response_id=first.id)
