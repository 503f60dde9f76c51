"""The placement rules' worked examples (A3 slices, A2 shared affinity), exactly, plus each mode's basics."""

import dataclasses

import pytest

from ascendbind.values.config import Config
from ascendbind.values.model import DeviceType, Mode
from ascendbind.planner import make_plan
from tests.planner_hosts import A2_AFFINITY, a2_host, a3_host, a950_host, host, worker

DEFAULT = Config()


def r(lo, hi):
    return tuple(range(lo, hi + 1))


# ---------------------------------------------------------------- A3, 640 CPUs, 16 NPUs


def test_seed_a3_640_cpus_16_npus_each_worker_gets_its_40_cpu_slice():
    plan = make_plan(a3_host(), worker(range(640)), range(16), DEFAULT)
    assert plan.mode is Mode.GLOBAL_SLICE and plan.fallback is None
    assert not plan.errors and not plan.warnings
    for i in range(16):
        p = plan.npu(i)
        assert p.pool == r(40 * i, 40 * i + 39)
        # c0-c1 IRQ, c2-c37 main, c38 ACL, c39 release
        assert p.irq == r(40 * i, 40 * i + 1)
        assert p.main == r(40 * i + 2, 40 * i + 37)
        assert p.acl == (40 * i + 38,)
        assert p.release == (40 * i + 39,)
        assert p.numa_nodes == (40 * i // 80,)


def test_seed_a3_worker5_row():
    plan = make_plan(a3_host(), worker(range(640)), [5], DEFAULT)
    (p,) = plan.npus
    assert (p.npu, p.pool, p.irq, p.main, p.acl, p.release) == (
        5, r(200, 239), (200, 201), r(202, 237), (238,), (239,))
    assert plan.to_json()["npus"]["5"]["numa_nodes"] == [2]


def test_seed_a3_workers_with_the_same_cpuset_get_disjoint_slices():
    # the key property of global_slice: slicing by global id, not by the visible list
    a = make_plan(a3_host(), worker(range(640), pid=1), [0, 1], DEFAULT)
    b = make_plan(a3_host(), worker(range(640), pid=2), [2, 3], DEFAULT)
    pools = [set(p.pool) for p in a.npus + b.npus]
    assert sum(map(len, pools)) == len(set().union(*pools)) == 160


def test_global_slice_extra_cpus_go_to_the_lowest_ids():
    # 643 CPUs over 16 NPUs: base 40, extra 3 -> NPUs 0-2 get 41
    h = a3_host()
    plan = make_plan(h, worker(range(643)), [0, 2, 3, 15], DEFAULT)
    assert plan.npu(0).pool == r(0, 40)
    assert plan.npu(2).pool == r(82, 122)
    assert plan.npu(3).pool == r(123, 162)
    assert plan.npu(15).pool == r(603, 642)


def test_global_slice_counts_npus_from_topo_rows_then_targets():
    h = host(100, 2, device_type=DeviceType.A3, topo_rows=4)
    assert make_plan(h, worker(range(100)), [1], DEFAULT).npu(1).pool == r(25, 49)
    h = host(100, 2, device_type=DeviceType.A3, topo_rows=0)
    assert make_plan(h, worker(range(100)), [0, 1], DEFAULT).npu(1).pool == r(50, 99)


# ---------------------------------------------------------------- A2 topo_affinity


@pytest.mark.parametrize("npu,pool", [(0, r(144, 167)), (2, r(168, 191))])
def test_seed_a2_hidden_same_affinity_npus_split_the_extended_pool(npu, pool):
    # process A sees only NPU0, process B only NPU2; both have cpuset 144-191
    plan = make_plan(a2_host(), worker(range(144, 192)), [npu], DEFAULT)
    assert plan.mode is Mode.TOPO_AFFINITY
    assert [p.npu for p in plan.npus] == [npu]
    assert plan.npu(npu).pool == pool
    assert not plan.errors and not plan.warnings


def test_a2_full_host_pairs_extend_to_the_next_node_and_split():
    plan = make_plan(a2_host(), worker(range(192)), range(8), DEFAULT)
    # extended pools are 24 + 24 CPUs: NPU0,2 -> 144-191 split 24/24
    expect = {0: r(144, 167), 2: r(168, 191), 1: r(96, 119), 3: r(120, 143),
              4: r(0, 23), 6: r(24, 47), 5: r(48, 71), 7: r(72, 95)}
    assert {p.npu: p.pool for p in plan.npus} == expect
    # the alignment example: NPU3 sits entirely on the neighbour node
    assert plan.npu(3).numa_nodes == (5,)
    assert not plan.warnings


def test_a2_npu3_roles():
    p = make_plan(a2_host(), worker(range(192)), [3], DEFAULT).npu(3)
    assert (p.irq, p.main, p.acl, p.release) == ((120, 121), r(122, 141), (142,), (143,))


def test_extension_wraps_from_the_last_node_to_node_0():
    aff = {0: frozenset(r(168, 191))}
    plan = make_plan(a2_host(affinity=aff), worker(range(192)), [0], DEFAULT)
    assert plan.npu(0).pool == r(0, 23) + r(168, 191)
    assert plan.npu(0).numa_nodes == (0, 7)


def test_affinity_spanning_two_nodes_is_not_extended():
    aff = {0: frozenset(r(24, 71))}
    plan = make_plan(a2_host(affinity=aff), worker(range(192)), [0], DEFAULT)
    assert plan.npu(0).pool == r(24, 71)


def test_extension_takes_only_allowed_cpus_of_the_next_node():
    plan = make_plan(a2_host(), worker(r(96, 130)), [1], DEFAULT)
    # NPU1 and NPU3 share 96-119 + 120-130 (35 CPUs): 17 / 18
    assert plan.npu(1).pool == r(96, 112)
    plan3 = make_plan(a2_host(), worker(r(96, 130)), [3], DEFAULT)
    assert plan3.npu(3).pool == r(113, 130)


def test_numa_extension_none_keeps_the_affinity_node():
    cfg = Config(numa_extension="none")
    plan = make_plan(a2_host(), worker(range(192)), [1, 3], cfg)
    assert plan.npu(1).pool == r(96, 107) and plan.npu(3).pool == r(108, 119)


def test_numa_extension_closest_uses_distances():
    # 4 nodes of 10; node 0 is nearest to node 2 (15), the default next node 1 is far (30)
    h = host(40, 4, device_type=DeviceType.A2, chips=[(0, 0, 0), (1, 0, 1)],
             affinity={0: frozenset(r(0, 9)), 1: frozenset(r(0, 9))})
    dist = {0: (10, 30, 15, 30), 1: (30, 10, 30, 15), 2: (15, 30, 10, 30), 3: (30, 15, 30, 10)}
    h = dataclasses.replace(h, numa_distances=dist)
    plan = make_plan(h, worker(range(40)), [0, 1], Config(numa_extension="closest"))
    assert plan.npu(0).pool == r(0, 9) and plan.npu(1).pool == r(20, 29)
    assert plan.npu(1).numa_nodes == (2,)
    assert not plan.warnings
    seed = make_plan(h, worker(range(40)), [0, 1], DEFAULT)
    assert seed.npu(1).pool == r(10, 19)


def test_numa_extension_closest_ties_go_to_the_lower_node_and_may_overlap():
    # distances(8): nodes 0-3 and 4-7 are near (20) within each half. NPU0,2 (node 6)
    # extend to node 4 while NPU1,3 (node 4) extend to node 5: the extended pools
    # intersect without being identical, and the plan says so.
    plan = make_plan(a2_host(), worker(range(192)), [0, 1], Config(numa_extension="closest"))
    assert plan.npu(0).pool == r(96, 119)
    assert plan.npu(1).pool == r(96, 119)
    (w,) = plan.warnings
    assert w.code == "pools_overlap" and "NPU 0" in w.reason and "NPU 1" in w.reason


def test_numa_extension_closest_without_distances_is_next_with_a_warning():
    h = a2_host(with_distances=False)
    plan = make_plan(h, worker(range(192)), [0], Config(numa_extension="closest"))
    assert plan.npu(0).pool == r(144, 167)
    assert [w.code for w in plan.warnings] == ["extension_fallback"]


def test_a2_without_affinity_falls_back_to_global_slice_and_says_so():
    plan = make_plan(a2_host(affinity={}), worker(range(192)), [3], DEFAULT)
    assert plan.mode is Mode.GLOBAL_SLICE
    assert plan.fallback and "global_slice" in plan.fallback and "affinity" in plan.fallback
    assert plan.npu(3).pool == r(72, 95)  # 192 // 8 = 24 per NPU
    assert plan.to_json()["fallback"] == plan.fallback


def test_unknown_device_type_uses_topo_affinity():
    h = host(48, 2, device_type=DeviceType.UNKNOWN, chips=[(0, 0, 0)], affinity={0: frozenset(r(0, 23))})
    plan = make_plan(h, worker(range(48)), [0], DEFAULT)
    assert plan.mode is Mode.TOPO_AFFINITY and plan.npu(0).pool == r(0, 47)


def test_config_device_type_overrides_the_host():
    plan = make_plan(a2_host(), worker(range(192)), [3], Config(device_type="A3"))
    assert plan.mode is Mode.GLOBAL_SLICE and plan.device_type is DeviceType.A3
    assert plan.npu(3).pool == r(72, 95)


# ---------------------------------------------------------------- Ascend 950


def test_950_clusters_in_logical_id_order_per_node():
    plan = make_plan(a950_host(), worker(range(256), uvb=[901, 902]), [0, 1, 3], DEFAULT)
    assert plan.mode is Mode.ASCEND950_CLUSTER
    # SMT-2: clusters of 16; node 0 = 0-63 -> NPU0 0-15, NPU1 16-31; node 1 -> NPU2 64-79, NPU3 80-95
    assert plan.npu(0).pool == r(0, 15) and plan.npu(1).pool == r(16, 31)
    assert plan.npu(3).pool == r(80, 95)
    for p in plan.npus:
        assert p.main == p.pool and p.irq == p.acl == p.release == ()
    # UVB: node 0 minus CPU 0 minus the clusters handed out on node 0 (NPU0, NPU1)
    assert plan.uvb_cpus == r(32, 63)
    assert plan.uvb_tids == (901, 902)


def test_950_hidden_same_node_npu_keeps_its_cluster():
    # a worker that sees only NPU1 still leaves NPU0's cluster alone
    plan = make_plan(a950_host(), worker(range(256)), [1], DEFAULT)
    assert plan.npu(1).pool == r(16, 31)


def test_950_one_thread_per_core_means_8_cpu_clusters():
    plan = make_plan(a950_host(threads_per_core=1), worker(range(256)), [1], DEFAULT)
    assert plan.npu(1).pool == r(8, 15)


def test_950_uvb_pool_when_clusters_fill_node_0():
    # node 0 allowed = 0-31: both clusters handed out -> fall back to node 0 minus CPU 0
    plan = make_plan(a950_host(), worker(r(0, 31)), [0], DEFAULT)
    assert plan.uvb_cpus == r(1, 31)


def test_950_partial_cluster_is_not_handed_out():
    plan = make_plan(a950_host(), worker(r(0, 20)), [0], DEFAULT)
    assert plan.npu(0).pool == r(0, 15)
    assert plan.uvb_cpus == r(16, 20)


def test_non_950_plans_have_no_uvb():
    plan = make_plan(a2_host(), worker(range(192), uvb=[5]), [0], DEFAULT)
    assert plan.uvb_cpus == () and plan.uvb_tids == ()


def test_plan_json_shape_is_spec_section_4():
    j = make_plan(a3_host(), worker(range(640)), [5], DEFAULT).to_json()
    assert set(j) >= {"mode", "device_type", "fallback", "allowed_cpus", "npus", "uvb", "errors", "warnings"}
    assert j["device_type"] == "A3" and j["mode"] == "global_slice"
    assert set(j["npus"]["5"]) == {"pool", "irq", "main", "acl", "release", "numa_nodes"}
    assert j["uvb"] == {"tids": [], "cpus": []}


def test_a2_affinity_fixture_matches_the_issue():
    assert A2_AFFINITY[3] == frozenset(r(96, 119)) and A2_AFFINITY[6] == frozenset(r(0, 23))
