"""`yuebing trace`: a request served by the shared cluster, followed through its logs
from the gateway to the Conductor, prefill and decode, in time order."""

from __future__ import annotations

import pytest

from tests.e2e.ops import eventually
from yuebing.timeline import entries, render

pytestmark = pytest.mark.e2e


def test_a_served_request_has_a_timeline_across_its_processes(cluster, client):
    raw = client.completions.with_raw_response.create(model="yuebing-tiny", prompt="word " * 150, max_tokens=4,
                                                       temperature=0)
    rid = raw.headers["x-yuebing-request-id"]
    placed = raw.parse().model_extra["yuebing"]
    prefill, decode = placed["prefill_instance"], placed["decode_instance"]
    found = eventually(lambda: entries(cluster.run_dir, rid),
                       lambda found: {"gateway", "conductor", prefill, decode} <= {e.process for e in found}
                       and found[-1].event == "request done", "the request's lines in every log")
    events = [(e.process, e.event) for e in found]
    assert events[0] == ("gateway", "request")
    assert events.index((prefill, "prefill start")) < events.index((decode, "decode start"))
    assert f"request {rid}:" in render(found, rid)
