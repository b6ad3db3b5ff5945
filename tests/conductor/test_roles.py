"""Roles as the live Conductor uses them: a moved instance drains its old role's
work and then serves its new one; the planner's turn moves instances on the books'
demand; a restarted instance is back in its launch role."""

from __future__ import annotations

import msgspec

from services.conductor.app import Conductor
from shared.messages import RequestUpdate
from tests.conductor.test_app import ask, conductor, hb

ROSTER = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))


def cluster(**kw) -> Conductor:
    return conductor(ROSTER, **{"policy": "round_robin", **kw})


def test_a_moving_instance_drains_then_serves_its_new_role():
    c = cluster()
    first = c.schedule(ask("r1", ["a"]), now=0.0)
    busy = first.placement.decode_id
    c.roles.draining[busy] = "prefill"  # as the planner's move does
    second = c.schedule(ask("r2", ["b"]), now=0.1)
    assert second.placement.decode_id not in ("", busy) and second.placement.prefill_id == "p0"
    c.plan(now=0.2)
    assert busy in c.roles.draining  # r1 still decodes there: nothing is migrated
    c.on_update(RequestUpdate(request_id="r1", kind="finished", completed=True), now=0.3)
    c.settle_roles()  # between the planner's turns: the service checks every DRAIN_POLL_S
    assert c.roles.assigned == {busy: "prefill"} and not c.roles.draining
    prefills = {c.schedule(ask(f"r{i}", [f"x{i}"]), now=0.5).placement.prefill_id for i in range(3, 7)}
    assert prefills == {"p0", busy}  # round robin over both prefill instances now
    assert c.stats(now=0.5).roles == {busy: "prefill"}


def test_a_restarted_instance_comes_back_in_its_launch_role():
    c = cluster()
    c.roles.assigned["d1"] = "prefill"
    c.on_heartbeat(msgspec.structs.replace(hb("d1", "decode"), pid=2), now=100.0)  # silent, then back
    assert "d1" not in c.roles.assigned


def test_the_planner_moves_a_decode_to_prefill_under_long_prompts():
    # Disaggregated: adaptive mode would pool these light decodes' engines instead.
    c = cluster(planner=True, slo_tbt_ms=1000.0, mode="disaggregated")
    for i in range(400):  # long prompts, few tokens out, 5 a second: prefill-bound, one decode enough
        t = i * 0.2
        for iid, role in ROSTER:
            c.on_heartbeat(hb(iid, role), now=t)
        reply = c.schedule(msgspec.structs.replace(ask(f"r{i}", [f"h{i}-{j}" for j in range(30)]), max_tokens=2), now=t)
        if reply.accepted:
            c.on_update(RequestUpdate(request_id=f"r{i}", kind="finished", completed=True), now=t + 0.05)
        if i % 100 == 99:
            c.plan(now=t)
    stats = c.stats(now=80.0)
    assert stats.role_changes >= 1 and set(stats.draining.values()) | set(stats.roles.values()) == {"prefill"}
