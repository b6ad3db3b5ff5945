"""No single request stalls the gateway's event loop (issue 16: tokenizing a 15 MiB
prompt on the loop stalled it for a minute, and every stall over 2 s fails every
in-flight request's liveness check).

A ticker on the server's loop measures how late a 5 ms sleep wakes while the
gateway takes many-MiB prompts: a completion and a chat message far past the
context (refused before any tokenizer time), one just under the character bound
(tokenized on a thread, then refused for length), and a list of token ids. The
figures are printed (`pytest -s`); the bound asserted is lag_bound_s() over the idle lag."""

from __future__ import annotations

import asyncio
import os
import time

import orjson
import pytest

from shared.config import ClusterConfig
from tests.gateway.served import MODEL, EndlessPipeline, Served, read_reply, request_bytes

pytestmark = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(), reason="no tiny model (make test writes it)")
# Each case prints its figure (`pytest -s`).
# The lag is judged against the same ticker's lag with no request, measured just
# after for as long: what the machine's other load costs the loop is not the gateway's.
MIB = 1 << 20


class Ticker:
    """Sleeps 5 ms again and again on the loop; the worst lateness is its lag."""

    def __init__(self) -> None:
        self.max_lag_s = 0.0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.005)
            self.max_lag_s = max(self.max_lag_s, time.perf_counter() - start - 0.005)


@pytest.fixture(scope="module")
def served():
    s = Served(ClusterConfig(model=str(MODEL), max_model_len=512), EndlessPipeline())
    yield s
    s.close()


def lag_while(served: Served, path: str, body: dict) -> tuple[int, float, float]:
    """(status, the loop's worst lag, seconds to the answer) while `body` is served."""
    ticker = served.call(_ticker())
    done = asyncio.run_coroutine_threadsafe(ticker.run(), served.loop)
    time.sleep(0.05)  # the ticker is running
    raw = orjson.dumps(body)
    s = served.connect()
    start = time.monotonic()
    s.sendall(request_bytes(path, raw))
    status, _, _ = read_reply(s)
    took = time.monotonic() - start
    s.close()
    served.loop.call_soon_threadsafe(ticker.stop.set)
    done.result(10)
    baseline = idle_lag(served, took)
    print(f"\n{path} {len(raw) / MIB:.1f} MiB: {status} in {took * 1e3:.0f} ms, "
          f"event-loop lag at most {ticker.max_lag_s * 1e3:.1f} ms (idle: {baseline * 1e3:.1f} ms, "
          f"bound {lag_bound_s() * 1e3:.0f} ms over it)")
    return status, ticker.max_lag_s - baseline, took


def idle_lag(served: Served, seconds: float) -> float:
    """The ticker's worst lag over `seconds` with no request in flight."""
    ticker = served.call(_ticker())
    done = asyncio.run_coroutine_threadsafe(ticker.run(), served.loop)
    time.sleep(max(0.2, seconds))
    served.loop.call_soon_threadsafe(ticker.stop.set)
    done.result(10)
    return ticker.max_lag_s


def lag_bound_s() -> float:
    """The issue's 100 ms on an otherwise idle machine (measured: 5-21 ms); under other
    load (an e2e cluster beside the tests) any thread waits for a core, so 0.5 s, still
    far from the 2 s liveness limit and the seconds tokenizing on the loop would take."""
    return 0.1 if os.getloadavg()[0] < (os.cpu_count() or 1) else 0.5


async def _ticker() -> Ticker:
    return Ticker()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "yuebing-tiny", "prompt": "hello world " * (8 * MIB // 12)}),
    ("/v1/chat/completions", {"model": "yuebing-tiny", "messages": [{"role": "user", "content": "hi there " * (8 * MIB // 9)}]}),
    ("/v1/chat/completions", {"model": "yuebing-tiny", "messages": [{"role": "user", "content": "ab " * 1000}] * 2000}),
])  # fmt: skip
def test_a_many_mib_prompt_never_holds_the_loop(served, path, body):
    status, lag, _ = lag_while(served, path, body)
    assert status == 400  # far past the 512-token context
    assert lag < lag_bound_s(), f"the event loop stalled {lag * 1e3:.0f} ms more than when idle"


def test_a_prompt_just_under_the_character_bound_is_tokenized_off_the_loop(served):
    tokenizer = served.gateway.tokenizer
    chars = 512 * tokenizer.max_token_chars * 4 - 1  # not refused untokenized: tokenized, then refused
    assert not tokenizer.too_long("x" * chars, 512)
    status, lag, _ = lag_while(served, "/v1/completions", {"model": "yuebing-tiny", "prompt": "ab " * (chars // 3)})
    assert status == 400
    assert lag < lag_bound_s(), f"the event loop stalled {lag * 1e3:.0f} ms more than when idle"


@pytest.mark.parametrize("mib", [2, 12])
def test_a_long_list_of_token_ids_never_holds_the_loop(served, mib):
    # orjson builds every int holding the GIL (~15 ms a MiB here): a list longer than
    # any valid request's is refused by counting its commas, before it is parsed.
    prompt = list(range(1000, 1000 + mib * MIB // 7))
    status, lag, _ = lag_while(served, "/v1/completions", {"model": "yuebing-tiny", "prompt": prompt})
    assert status == 400
    assert lag < lag_bound_s(), f"the event loop stalled {lag * 1e3:.0f} ms more than when idle"
