"""Every planner error and warning path: a code from the fixed set and a sentence with numbers."""

import pytest

from ascendbind.values.config import Config
from ascendbind.errors import PlanImpossible
from ascendbind.values.model import DeviceType
from ascendbind.planner import ERROR_CODES, WARNING_CODES, make_plan
from ascendbind.planner.codes import issue
from tests.planner_hosts import a2_host, a3_host, a950_host, host, worker

DEFAULT = Config()


def r(lo, hi):
    return tuple(range(lo, hi + 1))


def only_error(plan, npu):
    assert plan.npu(npu) is None, "an NPU with an error must be absent from npus"
    errs = [e for e in plan.errors if e.npu == npu]
    assert len(errs) == 1, plan.errors
    assert errs[0].code in ERROR_CODES
    return errs[0]


def test_codes_are_a_closed_set():
    with pytest.raises(ValueError):
        issue(0, "something_new", "x")
    assert not set(ERROR_CODES) & set(WARNING_CODES)


def test_slice_too_small_names_the_cpus_needed():
    e = only_error(make_plan(a3_host(), worker(range(64)), [5], DEFAULT), 5)
    assert e.code == "slice_too_small"
    assert "need 80 CPUs for 16 NPUs, cpuset has 64" in e.reason


def test_slice_too_small_without_irq_binding_needs_3_per_npu():
    plan = make_plan(a3_host(), worker(range(47)), [0], Config(irq_binding=False))
    assert "need 48 CPUs for 16 NPUs, cpuset has 47" in only_error(plan, 0).reason
    assert make_plan(a3_host(), worker(range(48)), [0], Config(irq_binding=False)).npu(0).pool == (0, 1, 2)


def test_slice_too_small_under_share_needs_one_per_npu():
    e = only_error(make_plan(a3_host(), worker(range(15)), [0], Config(small_pool="share")), 0)
    assert "need 16 CPUs for 16 NPUs, cpuset has 15" in e.reason
    p = make_plan(a3_host(), worker(range(16)), [3], Config(small_pool="share")).npu(3)
    assert p.pool == p.irq == p.main == p.acl == p.release == (3,)


def test_npu_out_of_range_in_global_slice():
    e = only_error(make_plan(a3_host(), worker(range(640)), [16, 5], DEFAULT), 16)
    assert e.code == "npu_out_of_range"
    assert "16 NPUs" in e.reason and "0-15" in e.reason


def test_unknown_npu_in_topo_affinity():
    plan = make_plan(a2_host(), worker(range(192)), [9, 0], DEFAULT)
    e = only_error(plan, 9)
    assert e.code == "unknown_npu" and "0-7" in e.reason
    assert plan.npu(0) is not None


def test_negative_npu_is_unknown():
    assert only_error(make_plan(a3_host(), worker(range(640)), [-1], DEFAULT), -1).code == "unknown_npu"


def test_global_slice_id_inside_the_range_but_not_a_logic_id():
    h = host(100, 2, device_type=DeviceType.A3, chips=[(0, 0, 0), (0, 1, 2)])
    plan = make_plan(h, worker(range(100)), [1, 0], DEFAULT)
    assert only_error(plan, 1).code == "unknown_npu"
    assert plan.npu(0).pool == r(0, 49)


def test_affinity_outside_cpuset():
    e = only_error(make_plan(a2_host(), worker(range(48)), [0], DEFAULT), 0)
    assert e.code == "affinity_outside_cpuset"
    assert "144-167" in e.reason and "0-47" in e.reason


def test_no_affinity_for_one_npu_while_others_have_it():
    aff = {0: frozenset(r(144, 167))}
    plan = make_plan(a2_host(affinity=aff), worker(range(192)), [0, 3], DEFAULT)
    e = only_error(plan, 3)
    assert e.code == "no_affinity" and "NPU 3" in e.reason
    assert plan.npu(0).pool == r(144, 191)


def test_pool_too_small_in_topo_affinity():
    # NPU0 and NPU2 share 144-147 (next node not allowed): 2 CPUs each
    plan = make_plan(a2_host(), worker(r(144, 147)), [0], DEFAULT)
    e = only_error(plan, 0)
    assert e.code == "pool_too_small"
    assert "144-145" in e.reason and "2 CPUs" in e.reason and "minimum of 5" in e.reason


def test_pool_too_small_can_share_instead():
    p = make_plan(a2_host(), worker(r(144, 147)), [0], Config(small_pool="share")).npu(0)
    assert (p.pool, p.irq, p.main, p.acl, p.release) == ((144, 145), (144,), (144,), (145,), (145,))


def test_950_affinity_spanning_two_nodes():
    aff = {0: frozenset(r(32, 95))}
    e = only_error(make_plan(a950_host(affinity=aff), worker(range(256)), [0], DEFAULT), 0)
    assert e.code == "spans_numa_nodes" and "32-95" in e.reason and "0-1" in e.reason


@pytest.mark.parametrize("tpc,said", [(4, "4 threads per core"), (None, "does not report")])
def test_950_bad_threads_per_core(tpc, said):
    e = only_error(make_plan(a950_host(threads_per_core=tpc), worker(range(256)), [0], DEFAULT), 0)
    assert e.code == "bad_threads_per_core" and said in e.reason


def test_950_too_few_clusters():
    # node 0 allowed = 0-24: one full 16-CPU cluster; NPU1 is the second NPU there
    plan = make_plan(a950_host(), worker(r(0, 24)), [0, 1], DEFAULT)
    e = only_error(plan, 1)
    assert e.code == "too_few_clusters"
    assert "25 allowed CPUs" in e.reason and "1 full 16-CPU cluster" in e.reason and "2nd" in e.reason
    assert plan.npu(0).pool == r(0, 15)


def test_950_without_any_affinity_is_an_error_not_a_fallback():
    plan = make_plan(a950_host(affinity={}), worker(range(256)), [0], DEFAULT)
    assert only_error(plan, 0).code == "no_affinity"
    assert plan.fallback is None


def test_950_outside_cpuset():
    e = only_error(make_plan(a950_host(), worker(r(64, 127)), [0], DEFAULT), 0)
    assert e.code == "affinity_outside_cpuset"


def test_pools_overlap_warning_names_both_npus():
    # NPU0 on node 6 extends to 144-191; NPU1's affinity 160-175 spans nodes 6-7 (no extension)
    aff = {0: frozenset(r(144, 167)), 1: frozenset(r(160, 175))}
    plan = make_plan(a2_host(affinity=aff), worker(range(192)), [0], DEFAULT)
    assert plan.npu(0).pool == r(144, 191)
    (w,) = plan.warnings
    assert w.code == "pools_overlap" and w.npu == 0
    assert "NPU 0" in w.reason and "NPU 1" in w.reason and "160-175" in w.reason
    assert not plan.errors


def test_errors_are_json_ready():
    j = make_plan(a3_host(), worker(range(64)), [5], DEFAULT).to_json()
    assert j["npus"] == {}
    assert j["errors"][0]["npu"] == 5 and j["errors"][0]["code"] == "slice_too_small"


def test_the_target_rule_rejects_unknown_requested_ids():
    from ascendbind.planner import resolve_targets
    from ascendbind.values.targeting import TargetRequest

    with pytest.raises(PlanImpossible) as exc:
        resolve_targets(a3_host(), worker(range(640)), TargetRequest(npus=(16,)))
    assert exc.value.code == "unknown_npu" and "0-15" in str(exc.value)
