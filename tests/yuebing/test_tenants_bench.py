import json

import pytest

from shared.tenants import key_sha256, load
from yuebing.bench.tenants import PhaseResult, TenantsSpec, table, tenants_json, write_tenants


def test_the_flood_rate_is_the_factor_times_capacity_and_the_workload_lasts_a_phase():
    spec = TenantsSpec(steady_rps=2.0, capacity_rps=10.0, flood_factor=4.0, seconds=30.0)
    assert spec.flood_rps == 40.0
    assert spec.workload(2.0).requests == 60 and spec.workload(40.0).requests == 1200
    with pytest.raises(ValueError):
        TenantsSpec(flood_factor=0)


def test_the_file_is_one_a_tenants_file_reads_and_is_rewritten_whole(tmp_path):
    keys = {"steady": "k1" * 12, "flood": "k2" * 12}
    assert json.loads(tenants_json(keys, "critical"))["tenants"][1] == {
        "id": "flood", "key_sha256": key_sha256("k2" * 12), "priority": "critical"}
    path = tmp_path / "tenants.json"
    write_tenants(path, keys, "standard")
    write_tenants(path, keys, "critical")
    assert {t.priority for t in load(str(path)).by_id.values()} == {"critical"}
    assert not path.with_suffix(".new").exists()


def test_the_table_puts_steady_beside_its_goodput_alone():
    text = table([PhaseResult("alone", {"steady": 2.0}, {"steady": 0}),
                  PhaseResult("fair", {"steady": 1.9, "flood": 8.0}, {"steady": 1, "flood": 500})])
    alone, fair = text.splitlines()[1:]
    assert "1.00" in alone and "—" in alone
    assert "0.95" in fair and "8.00" in fair and "1, 500" in fair
