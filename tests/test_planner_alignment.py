"""Alignment policies: the worked examples of docs/alignment.md, reasons, guard, precedence, JSON."""

import pytest

from ascendbind.values.config import Config
from ascendbind.settings import load_config
from ascendbind.errors import Conflict, UsageError
from ascendbind.values.model import Plan
from ascendbind.planner import make_plan
from ascendbind.planner.align.alignment import ALIGNMENT_FAILURE_REASONS, resolve_policy
from tests.planner_hosts import a2_host, a3_host, a950_host, worker


def r(lo, hi):
    return tuple(range(lo, hi + 1))


def a2(policy="none", allowed=range(192), mems=range(8), **cfg):
    return make_plan(a2_host(), worker(allowed, mems=mems), [3], Config(topology_policy=policy, **cfg))


def alignment(plan):
    return plan.to_json()["alignment"]


# ---------------------------------------------------------------- worked examples


def test_a2_npu3_default_plan_is_not_aligned_and_says_why():
    plan = a2()
    assert plan.npu(3).pool == r(120, 143)  # the seed pool is untouched
    al = alignment(plan)
    assert al["policy"] == "none" and al["aligned"] is False
    assert al["numa_nodes"] == [4]
    assert al["reason"].startswith("device wants NUMA 4; cpu pool 120-143 is on NUMA 5")
    assert al["failure"] == "pool_off_mask"
    assert {"npu": 3, "numa_nodes": [4], "preferred": True, "score": 0} in al["providers"]["device"]


@pytest.mark.parametrize("policy", ["single-numa-node", "restricted", "best-effort"])
def test_a2_npu3_aligning_policies_split_node_4_with_npu1(policy):
    p = a2(policy).npu(3)
    assert (p.pool, p.irq, p.main, p.acl, p.release) == (r(108, 119), (108, 109), r(110, 117), (118,), (119,))
    assert p.numa_nodes == (4,)
    al = alignment(a2(policy))
    assert al["aligned"] is True and al["reason"] is None and al["numa_nodes"] == [4]
    assert al["npus"]["3"]["rebuilt"] is True


def test_a2_numa_extension_none_gives_the_same_pool_aligned():
    plan = a2(numa_extension="none")
    assert plan.npu(3).pool == r(108, 119)
    al = alignment(plan)
    assert al["aligned"] is True and al["npus"]["3"]["rebuilt"] is False


def test_a2_aligned_pools_of_neighbours_stay_disjoint():
    cfg = Config(topology_policy="single-numa-node")
    pools = {}
    for npu in range(8):  # one worker per NPU, all with the whole host as cpuset
        pools[npu] = set(make_plan(a2_host(), worker(range(192), mems=range(8)), [npu], cfg).npu(npu).pool)
    assert pools[1] == set(r(96, 107)) and pools[0] == set(r(144, 155))
    assert sum(map(len, pools.values())) == len(set().union(*pools.values())) == 96


def test_a3_cpuset_3_200_npu5_single_numa_node_trims_to_node_0():
    plan = make_plan(a3_host(), worker(r(3, 200), mems=range(8)), [5], Config(topology_policy="single-numa-node"))
    p = plan.npu(5)
    assert (p.pool, p.irq, p.main, p.acl, p.release) == (r(68, 79), (68, 69), r(70, 77), (78,), (79,))
    assert alignment(plan)["aligned"] is True and alignment(plan)["numa_nodes"] == [0]
    # the default keeps the seed pool 68-80, across nodes 0 and 1
    seed = make_plan(a3_host(), worker(r(3, 200), mems=range(8)), [5], Config())
    assert seed.npu(5).pool == r(68, 80) and alignment(seed)["aligned"] is False


def test_a3_cpuset_4_131_npu9_is_rejected_naming_the_cpu_provider():
    plan = make_plan(a3_host(), worker(r(4, 131), mems=range(8)), [9], Config(topology_policy="single-numa-node"))
    assert plan.npu(9) is None
    (e,) = plan.errors
    assert e.code == "topology_rejected"
    assert "cpu: slice 76-83 has 4 CPUs on NUMA 0 and 4 on NUMA 1, a pool needs 5" in e.reason
    al = alignment(plan)
    assert al["aligned"] is False and al["failure"] == "cpu_no_fit"
    assert al["npus"]["9"]["admitted"] is False


def test_a3_rejected_under_restricted_but_admitted_unaligned_under_best_effort():
    w = worker(r(4, 131), mems=range(8))
    assert make_plan(a3_host(), w, [9], Config(topology_policy="restricted")).errors[0].code == "topology_rejected"
    plan = make_plan(a3_host(), w, [9], Config(topology_policy="best-effort"))
    assert plan.npu(9).pool == r(76, 83) and not plan.errors
    al = alignment(plan)
    assert al["aligned"] is False and "best-effort keeps the seed pool" in al["reason"]
    # kubelet's best non-preferred width: the cpu provider needs both nodes
    assert al["numa_nodes"] == [0, 1]


def test_a3_full_host_is_aligned_by_default():
    plan = make_plan(a3_host(), worker(range(640), mems=range(8)), [5], Config())
    al = alignment(plan)
    assert al["aligned"] is True and al["numa_nodes"] == [2]
    assert [h["numa_nodes"] for h in al["providers"]["device"]] == [None]  # A3: no device opinion


def test_950_clusters_are_aligned_and_unchanged():
    for policy in ("none", "single-numa-node"):
        plan = make_plan(a950_host(), worker(range(256), mems=range(4)), [3], Config(topology_policy=policy))
        assert plan.npu(3).pool == r(80, 95)
        assert alignment(plan)["aligned"] is True and alignment(plan)["numa_nodes"] == [1]


# ---------------------------------------------------------------- why, not just no


def test_memory_mismatch_names_mems_allowed():
    plan = a2("restricted", mems=[0, 1])
    (e,) = plan.errors
    assert "memory: Mems_allowed is NUMA 0-1, but device and cpu agree on NUMA 4" in e.reason
    assert alignment(plan)["failure"] == "memory_mismatch"


def test_device_cpu_mismatch_names_the_device_node_and_the_cpu_shortfall():
    plan = a2("restricted", allowed=r(96, 99) + r(120, 191))
    (e,) = plan.errors
    assert e.reason.endswith(
        "device wants NUMA 4; cpu: NUMA 4's 4 allowed CPUs are shared by NPUs 1, 3 and give NPU 3 2, a pool needs 5")
    assert alignment(plan)["failure"] == "device_cpu_mismatch"


def test_unknown_mems_allowed_is_no_opinion():
    plan = a2("restricted", mems=[])
    assert plan.npu(3).pool == r(108, 119)
    assert alignment(plan)["providers"]["memory"] == [{"npu": 3, "numa_nodes": None, "preferred": True, "score": 0}]


def test_max_numa_nodes_guard():
    plan = a2("restricted", max_numa_nodes=4)
    (e,) = plan.errors
    assert e.code == "too_many_numa_nodes" and "8 NUMA nodes" in e.reason and "max_numa_nodes = 4" in e.reason
    plan = a2("none", max_numa_nodes=4)
    assert plan.npu(3).pool == r(120, 143) and not plan.errors
    al = alignment(plan)
    assert al["aligned"] is False and al["failure"] == "too_many_numa_nodes"
    assert "not evaluated" in al["reason"]


def test_failure_reasons_come_from_the_fixed_set():
    plans = [a2(), a2("restricted", mems=[0, 1]), a2("restricted", allowed=r(96, 99) + r(120, 191)),
             a2("none", max_numa_nodes=4),
             make_plan(a3_host(), worker(r(4, 131), mems=range(8)), [9], Config(topology_policy="restricted"))]
    seen = {alignment(p)["failure"] for p in plans}
    assert seen <= set(ALIGNMENT_FAILURE_REASONS)
    assert seen == {"pool_off_mask", "memory_mismatch", "device_cpu_mismatch", "too_many_numa_nodes", "cpu_no_fit"}
    assert len(set(ALIGNMENT_FAILURE_REASONS)) == len(ALIGNMENT_FAILURE_REASONS)


def test_prefer_closest_numa_only_changes_ties():
    # both are equally aligned on the A2: the option must not move an aligned pool
    assert a2("single-numa-node", prefer_closest_numa=True).npu(3).pool == r(108, 119)


# ---------------------------------------------------------------- JSON


def test_alignment_block_shape_and_round_trip():
    plan = a2()
    j = plan.to_json()
    assert {"policy", "aligned", "numa_nodes", "providers", "reason"} <= set(j["alignment"])
    assert set(j["alignment"]["providers"]) == {"device", "cpu", "memory"}
    again = Plan.from_json(j)
    assert again.to_json() == j


def test_multi_npu_reason_names_each_npu():
    plan = make_plan(a2_host(), worker(range(192), mems=range(8)), [1, 3], Config())
    al = alignment(plan)
    # NPU1's seed pool 96-119 is on its own node; NPU3's is not
    assert al["npus"]["1"]["aligned"] is True and al["npus"]["3"]["aligned"] is False
    assert al["reason"].startswith("NPU 3: device wants NUMA 4")
    assert al["aligned"] is False


def test_defaults_keep_reproducing_the_seed():
    seed_a3 = make_plan(a3_host(), worker(range(640), mems=range(8)), range(16), Config())
    assert [p.pool for p in seed_a3.npus] == [r(40 * i, 40 * i + 39) for i in range(16)]
    for npu, pool in ((0, r(144, 167)), (2, r(168, 191))):
        plan = make_plan(a2_host(), worker(r(144, 191), mems=range(8)), [npu], Config())
        assert plan.npu(npu).pool == pool


# ---------------------------------------------------------------- precedence


def test_resolve_policy_precedence():
    assert resolve_policy(None, Config()) == "none"
    assert resolve_policy(None, Config(topology_policy="restricted")) == "restricted"
    # the default config names no policy: the request wins
    assert resolve_policy("single-numa-node", Config()) == "single-numa-node"
    node = load_config(None, env={}, overrides={"topology_policy": "restricted"})
    assert resolve_policy("restricted", node) == "restricted"
    with pytest.raises(Conflict) as exc:
        resolve_policy("single-numa-node", node)
    assert exc.value.code == "policy_mismatch" and exc.value.exit_status == 9
    assert "single-numa-node" in str(exc.value) and "restricted" in str(exc.value)
    with pytest.raises(UsageError):
        resolve_policy("strict", Config())


def test_make_plan_applies_the_request_policy():
    plan = make_plan(a2_host(), worker(range(192), mems=range(8)), [3], Config(), request_policy="single-numa-node")
    assert plan.npu(3).pool == r(108, 119) and alignment(plan)["policy"] == "single-numa-node"
    node = load_config(None, env={}, overrides={"topology_policy": "best-effort"})
    with pytest.raises(Conflict):
        make_plan(a2_host(), worker(range(192)), [3], node, request_policy="restricted")
