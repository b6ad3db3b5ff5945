"""The connector's scheduler half through vLLM's hooks, with the messenger and the
followed pool played by stubs (the decisions themselves are test_plan.py's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from shared.block_hash import block_hashes, request_salt
from shared.kv.options import Options
from shared.kv.plan import Load, Save
from shared.kv.scheduler import ConnectorScheduler
from shared.kv.wire import NO_ROOM, Bye, Pin, Release, Renew, Reply, Reserve

OPTS = Options(kv_dir="/nowhere", node="n", block_size=4, salt=b"s", model="m")
PROMPT = list(range(13))  # three full blocks and a token
HASHES = block_hashes(PROMPT, 4, b"s")


@dataclass
class Messenger:
    pinned: int = 3  # how many leading blocks a pin finds
    reserved: list[int] = field(default_factory=list)  # slots a reservation answers with
    calls: list[object] = field(default_factory=list)
    notes: list[object] = field(default_factory=list)
    lease_s: float = 0.0  # what its replies say pins last (0: not said)

    def call(self, message: object) -> Reply:
        self.calls.append(message)
        if isinstance(message, Pin):
            return Reply(pool_id="p", slots=list(range(20, 20 + min(self.pinned, len(message.hashes)))),
                         lease_s=self.lease_s)
        return Reply(pool_id="p", slots=self.reserved, lease_s=self.lease_s)

    def note(self, message: object) -> bool:
        self.notes.append(message)
        return True


@dataclass
class Pool:
    ready: set[bytes] = field(default_factory=lambda: set(HASHES))
    alive: bool = True

    def has_failed(self, block_hash: bytes) -> bool:
        return False

    def close(self) -> None:
        pass


def scheduler(messenger: Messenger) -> ConnectorScheduler:
    s = ConnectorScheduler(OPTS, client=messenger, follower=Pool())  # type: ignore[arg-type]
    s.engine = "e"
    s.kv_cache_manager = SimpleNamespace(get_block_ids=lambda _rid: ([100, 101, 102, 103],))
    return s


def request(**params: object) -> SimpleNamespace:
    return SimpleNamespace(request_id="r", kv_transfer_params=params, prompt_token_ids=PROMPT, num_tokens=len(PROMPT),
                           cache_salt=None)


def step(computed: int, scheduled: int) -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="r", num_computed_tokens=computed)],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                           num_scheduled_tokens={"r": scheduled})


def allocated(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def test_matching_asks_nobody_and_the_allocated_claim_is_pinned():
    messenger = Messenger()
    s = scheduler(messenger)
    s.on_new_request(request(kv_blocks=3))
    for _ in range(3):  # vLLM may ask again, or drop the answer when it has no room
        assert s.get_num_new_matched_tokens(request(), 0) == (12, False)
    assert messenger.calls == []
    s.update_state_after_alloc(request(), allocated([7, 8, 9, 10]), num_external_tokens=12)
    assert messenger.calls == [Pin(owner="r", hashes=HASHES, engine="e")]
    meta = s.build_connector_meta(step(12, 1))
    assert (meta.pool_id, meta.loads, meta.failed) == ("p", [Load("r", [7, 8, 9], [20, 21, 22])], [])


def test_a_block_evicted_between_match_and_pin_is_loaded_as_failed():
    s = scheduler(Messenger(pinned=1))
    s.on_new_request(request(kv_blocks=3))
    s.get_num_new_matched_tokens(request(), 0)
    s.update_state_after_alloc(request(), allocated([7, 8, 9, 10]), num_external_tokens=12)
    meta = s.build_connector_meta(step(12, 1))
    assert (meta.loads, meta.failed) == ([Load("r", [7], [20])], [8, 9])


def test_prefill_saves_what_each_step_completes_and_reports_the_run_sent():
    messenger = Messenger(reserved=[5, NO_ROOM])
    s = scheduler(messenger)
    s.on_new_request(request(kv_dest="d"))
    s.get_num_new_matched_tokens(request(), 0)
    s.update_state_after_alloc(request(), allocated([100, 101, 102, 103]), num_external_tokens=0)
    assert messenger.calls == []  # nothing claimed, nothing pinned
    meta = s.build_connector_meta(step(0, 8))
    assert messenger.calls == [Reserve(owner="r", hashes=HASHES[:2], dest="d", engine="e")]
    assert meta.saves == [Save(100, 5, HASHES[0])]
    assert s.request_finished(request(), []) == (False, {"kv_blocks": 1})
    assert messenger.notes == [Renew(engine="e", owners=["r"]), Release(owner="r")]


def test_the_first_reservation_carries_the_requests_trace_context_and_nothing_else():
    messenger = Messenger(reserved=[5, 6])
    s = scheduler(messenger)
    trace = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "baggage": "x" * 9}
    s.on_new_request(request(kv_dest="d", kv_trace=trace))
    s.get_num_new_matched_tokens(request(), 0)
    s.update_state_after_alloc(request(), allocated([100, 101, 102, 103]), num_external_tokens=0)
    s.build_connector_meta(step(0, 8))
    assert [c.trace for c in messenger.calls] == [{"traceparent": trace["traceparent"]}]  # W3C headers only


def test_running_requests_renew_their_pins_each_step_at_most_every_quarter_lease(monkeypatch):
    messenger = Messenger(lease_s=2.0)  # renewals every 0.5 s at most
    s = scheduler(messenger)
    clock = [100.0]
    monkeypatch.setattr("shared.kv.scheduler.time.monotonic", lambda: clock[0])
    s.build_connector_meta(step(0, 1))
    assert messenger.notes == []  # nothing tracked: nothing to renew
    s.on_new_request(request(kv_blocks=3))
    s.get_num_new_matched_tokens(request(), 0)
    s.update_state_after_alloc(request(), allocated([7, 8, 9, 10]), num_external_tokens=12)
    assert s.renew_s == 0.5  # learnt from the pin's reply
    for _ in range(4):  # steps at 100.0, .2, .4, .6: renewals at the first and the last
        s.build_connector_meta(step(12, 1))
        clock[0] += 0.2
    assert messenger.notes == [Renew(engine="e", owners=["r"])] * 2  # at 100.0 and at 100.6
    s.request_finished(request(), [])
    clock[0] += 1.0
    s.build_connector_meta(step(12, 1))  # gone from the books: no longer renewed
    assert messenger.notes[-1] == Release(owner="r")


def test_an_engine_that_stops_says_bye_so_its_pins_go_at_once():
    messenger = Messenger()
    s = scheduler(messenger)
    s.client.close = lambda: None  # the stub has no sockets
    s.shutdown()
    assert messenger.notes == [Bye(engine="e")]


def test_a_decode_request_caps_the_engines_prompt_chunks_while_it_runs():
    # vLLM reads long_prefill_token_threshold from this config at every step.
    config = SimpleNamespace(long_prefill_token_threshold=0)  # launched for prefill
    s = ConnectorScheduler(OPTS, client=Messenger(), follower=Pool(), scheduler_config=config)  # type: ignore[arg-type]
    s.on_new_request(request(kv_blocks=3, kv_chunk_cap=256))
    assert config.long_prefill_token_threshold == 256
    s.on_new_request(SimpleNamespace(request_id="p", kv_transfer_params={"kv_dest": "n"}, prompt_token_ids=PROMPT,
                                     num_tokens=len(PROMPT), cache_salt=None))
    s.request_finished(SimpleNamespace(request_id="p"), [])  # a prefill's end changes nothing
    assert config.long_prefill_token_threshold == 256
    s.request_finished(request(), [])
    assert config.long_prefill_token_threshold == 0


def test_a_request_carrying_no_hashes_is_hashed_under_its_own_cache_salt():
    # As the gateway hashes it (a tenant's group): a prompt of one group never names
    # another's blocks, whoever computes its hashes.
    s = scheduler(Messenger())
    plain, salted = request(kv_blocks=3), request(kv_blocks=3)
    salted.request_id, salted.cache_salt = "t", "group-salt"
    s.on_new_request(plain)
    s.on_new_request(salted)
    assert s.tracked["r"].hashes[:3] == block_hashes(PROMPT, 4, b"s")  # and the tail's, the one token
    salted_hashes = block_hashes(PROMPT, 4, request_salt(b"s", "group-salt"))
    assert s.tracked["t"].hashes[:3] == salted_hashes and s.tracked["t"].hashes != s.tracked["r"].hashes
