import pytest

from services.conductor.fairness import LOADED, fair_share, judge
from shared.tenants import Tenant

STEADY, FLOOD = Tenant("steady"), Tenant("flood")
WEIGHTS = {"steady": 1.0, "flood": 1.0}


def test_below_the_loaded_mark_everybody_is_admitted():
    assert judge(Tenant("x", priority="sheddable"), LOADED, {"flood": 99}, WEIGHTS) is None
    assert judge(FLOOD, 0.1, {"flood": 99}, WEIGHTS) is None


def test_past_it_sheddable_goes_first_and_critical_never():
    assert judge(Tenant("s", priority="sheddable"), LOADED + 0.1, {}, WEIGHTS).cause == "shed_class"
    assert judge(Tenant("c", priority="critical"), 0.99, {"c": 50}, WEIGHTS) is None


def test_a_flooding_tenant_is_held_to_its_share_and_the_steady_one_is_not():
    in_flight = {"flood": 18, "steady": 2}
    refused = judge(FLOOD, LOADED + 0.1, in_flight, WEIGHTS)
    assert refused.cause == "fair_share" and "10.0 of 20" in refused.reason
    assert judge(STEADY, LOADED + 0.1, in_flight, WEIGHTS) is None


def test_weights_scale_the_share():
    heavy = Tenant("heavy", weight=3.0)
    assert fair_share(heavy, {"heavy": 10, "light": 10}, {"heavy": 3.0, "light": 1.0}) == pytest.approx(15.0)
    assert judge(heavy, LOADED + 0.1, {"heavy": 12, "light": 8}, {"heavy": 3.0, "light": 1.0}) is None


def test_a_tenant_alone_is_never_refused_for_its_share():
    assert fair_share(STEADY, {}, WEIGHTS) == 1.0
    assert judge(STEADY, LOADED + 0.2, {"steady": 0}, WEIGHTS) is None
    assert judge(STEADY, LOADED + 0.2, {"steady": 7}, WEIGHTS) is None  # alone: all the room is its own
    assert judge(STEADY, LOADED + 0.2, {"steady": 7, "flood": 0}, WEIGHTS) is None
