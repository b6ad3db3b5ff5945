from services.conductor.fairness import LOADED, Load, judge, share_of
from shared.tenants import Tenant

STEADY, FLOOD = Tenant("steady"), Tenant("flood")
WEIGHTS = {"steady": 1.0, "flood": 1.0}
PAST = LOADED + 0.1


def loads(**tenants: tuple[int, int]) -> dict[str, Load]:
    """Each tenant's (tokens in flight, tokens admitted of late)."""
    return {t: Load(*x) for t, x in tenants.items()}


def test_below_the_loaded_mark_everybody_is_admitted():
    assert judge(Tenant("x", priority="sheddable"), LOADED, loads(flood=(99, 99)), WEIGHTS) is None
    assert judge(FLOOD, 0.1, loads(flood=(9900, 9900), steady=(100, 100)), WEIGHTS) is None


def test_past_it_sheddable_goes_first_and_critical_never():
    assert judge(Tenant("s", priority="sheddable"), PAST, {}, WEIGHTS).cause == "shed_class"
    assert judge(Tenant("c", priority="critical"), 0.99, loads(c=(5000, 5000), other=(10, 10)), WEIGHTS) is None


def test_a_flooding_tenant_is_held_to_its_share_and_the_steady_one_is_not():
    now = loads(flood=(18_000, 90_000), steady=(2_000, 10_000))
    refused = judge(FLOOD, PAST, now, WEIGHTS)
    assert refused.cause == "fair_share" and "(1.8x of it in the tokens in flight, 1.8x in those" in refused.reason
    assert judge(STEADY, PAST, now, WEIGHTS) is None


def test_a_tenant_over_its_share_in_flight_but_not_of_late_is_admitted():
    # Two of a steady tenant's requests overlap while the flood, held to its share,
    # has one: a few requests in flight are too few to judge it by.
    assert judge(STEADY, PAST, loads(flood=(1_000, 30_000), steady=(3_000, 10_000)), WEIGHTS) is None


def test_a_tenant_new_to_the_window_is_held_once_it_took_its_share_of_it():
    # Below its share of late (it just came), it is admitted past its share in flight,
    # until what it took of late passes its share: at most the others' short window.
    assert judge(FLOOD, PAST, loads(flood=(4_000, 4_000), steady=(2_000, 10_000)), WEIGHTS) is None
    assert judge(FLOOD, PAST, loads(flood=(4_000, 12_000), steady=(2_000, 10_000)), WEIGHTS).cause == "fair_share"


def test_weights_scale_the_share():
    heavy, weights = Tenant("heavy", weight=3.0), {"heavy": 3.0, "light": 1.0}
    assert share_of(heavy, {"heavy": 15, "light": 5}, weights) == 1.0
    assert judge(heavy, PAST, loads(heavy=(12, 12), light=(8, 8)), weights) is None
    assert judge(heavy, PAST, loads(heavy=(16, 16), light=(4, 4)), weights).cause == "fair_share"


def test_a_tenant_alone_is_never_refused_for_its_share():
    assert judge(STEADY, PAST, {}, WEIGHTS) is None
    assert judge(STEADY, PAST, loads(steady=(7000, 7000)), WEIGHTS) is None  # alone: all the room is its own


def test_an_idle_tenant_still_active_keeps_its_room():
    # Between two of its requests it holds nothing; the flood may not take the gap.
    assert judge(FLOOD, PAST, loads(flood=(500, 9_000), steady=(0, 3_000)), WEIGHTS).cause == "fair_share"
    assert share_of(FLOOD, {"flood": 0, "steady": 0}, WEIGHTS) == 0.0  # nobody holds any: nobody is over
