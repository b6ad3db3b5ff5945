from services.conductor.fairness import LOADED, Load, judge, rate, share_of
from shared.tenants import Tenant

STEADY, FLOOD = Tenant("steady"), Tenant("flood")
WEIGHTS = {"steady": 1.0, "flood": 1.0}
PAST = LOADED + 0.1


def loads(**tenants: tuple[int, int]) -> dict[str, Load]:
    """Each tenant's (requests in flight, tokens admitted of late: a rate)."""
    return {t: Load(*x) for t, x in tenants.items()}


def test_below_the_loaded_mark_everybody_is_admitted():
    assert judge(Tenant("x", priority="sheddable"), LOADED, loads(flood=(9, 99)), WEIGHTS) is None
    assert judge(FLOOD, 0.1, loads(flood=(99, 9900), steady=(1, 100)), WEIGHTS) is None


def test_past_it_sheddable_goes_first_and_critical_never():
    assert judge(Tenant("s", priority="sheddable"), PAST, {}, WEIGHTS).cause == "shed_class"
    assert judge(Tenant("c", priority="critical"), 0.99, loads(c=(50, 5000), other=(1, 10)), WEIGHTS) is None


def test_a_flooding_tenant_is_held_to_its_share_of_late_and_the_steady_one_is_not():
    now = loads(flood=(3, 90_000), steady=(1, 10_000))
    refused = judge(FLOOD, PAST, now, WEIGHTS)
    assert refused.cause == "fair_share" and "is taking 1.8x its fair share of the tokens admitted of late" in refused.reason
    assert judge(STEADY, PAST, now, WEIGHTS) is None


def test_what_a_tenant_holds_in_flight_does_not_let_a_flood_in():
    # The steady tenant's request just came: by tokens in flight the flood would be
    # under its share now, and its request would land beside the steady one's stream.
    assert judge(FLOOD, PAST, loads(flood=(1, 12_000), steady=(2, 10_000)), WEIGHTS).cause == "fair_share"


def test_every_active_tenant_may_have_one_request_in_flight():
    # A flood's first request after its last one ended, and a steady tenant's whose
    # chance bunching put it over its share of late: one at a time is never refused.
    assert judge(FLOOD, PAST, loads(flood=(0, 90_000), steady=(1, 10_000)), WEIGHTS) is None
    assert judge(STEADY, PAST, loads(flood=(1, 9_000), steady=(0, 11_000)), WEIGHTS) is None
    assert judge(STEADY, PAST, loads(flood=(1, 9_000), steady=(1, 11_000)), WEIGHTS).cause == "fair_share"


def test_a_tenant_new_to_the_window_is_judged_by_its_rate_so_far():
    # 3,000 tokens in its first half second is 3,000 tokens/s (a second at least),
    # against the steady tenant's 10,000 over the whole window: over its share.
    assert rate(3_000, first_at=9.5, now=10.0) == 3_000.0
    assert rate(10_000, first_at=-5.0, now=10.0) == 1_000.0  # the window's 10 s, not the 15 since
    assert judge(FLOOD, PAST, loads(flood=(2, rate(3_000, 9.5, 10.0)), steady=(1, 1_000)), WEIGHTS).cause == "fair_share"
    assert judge(FLOOD, PAST, loads(flood=(2, rate(800, 9.5, 10.0)), steady=(1, 1_000)), WEIGHTS) is None


def test_weights_scale_the_share():
    heavy, weights = Tenant("heavy", weight=3.0), {"heavy": 3.0, "light": 1.0}
    assert share_of(heavy, {"heavy": 15, "light": 5}, weights) == 1.0
    assert judge(heavy, PAST, loads(heavy=(2, 12), light=(1, 8)), weights) is None
    assert judge(heavy, PAST, loads(heavy=(2, 16), light=(1, 4)), weights).cause == "fair_share"


def test_a_tenant_alone_is_never_refused_for_its_share():
    assert judge(STEADY, PAST, {}, WEIGHTS) is None
    assert judge(STEADY, PAST, loads(steady=(7, 7000)), WEIGHTS) is None  # alone: all the room is its own


def test_an_idle_tenant_still_active_keeps_its_room():
    # Between two of its requests it holds nothing; the flood may not take the gap.
    assert judge(FLOOD, PAST, loads(flood=(1, 9_000), steady=(0, 3_000)), WEIGHTS).cause == "fair_share"
    assert share_of(FLOOD, {"flood": 0, "steady": 0}, WEIGHTS) == 0.0  # nobody holds any: nobody is over
