"""plan --explain text, config lint, and the alignment examples on the fixture hosts."""

import os

import pytest

from ascendbind.values.config import Config
from ascendbind.settings import load_config
from ascendbind.discovery import SnapshotHost, discover_host, discover_worker
from ascendbind.planner import make_plan
from ascendbind.planner.explain import explain_plan
from ascendbind.planner.lint import lint_config
from tests.planner_hosts import a2_host, a3_host, a950_host, host, worker
from ascendbind.values.model import DeviceType

HOSTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "hosts")


def r(lo, hi):
    return tuple(range(lo, hi + 1))


# ---------------------------------------------------------------- explain


def test_explain_shows_hints_merge_and_decision():
    h, w, cfg = a2_host(), worker(range(192), mems=range(8)), Config()
    plan = make_plan(h, w, [3], cfg)
    text = explain_plan(h, w, plan, cfg)
    assert "topology_policy none (from default)" in text
    assert "device  NUMA 4" in text and "topo affinity on NUMA 4" in text
    assert "cpu     NUMA 4" in text and "12 of 24 allowed CPUs, split 2 ways" in text
    assert "memory  NUMA 0-7   not preferred" in text
    assert "merge    NUMA 4, preferred, score 50  (device NUMA 4 AND cpu NUMA 4 AND memory NUMA 4)" in text
    assert "decision admitted; seed pool 120-143 on NUMA 5; not aligned" in text
    assert "device wants NUMA 4; cpu pool 120-143 is on NUMA 5" in text and "[pool_off_mask]" in text
    assert "config lint: nothing to report" in text


def test_explain_a_rejection_and_the_lint():
    h, w = a3_host(), worker(r(4, 131), mems=range(8))
    cfg = load_config(None, env={}, overrides={"topology_policy": "single-numa-node", "prefer_closest_numa": True})
    plan = make_plan(h, w, [9], cfg)
    text = explain_plan(h, w, plan, cfg)
    assert "(from node config)" in text
    assert "device  any" in text and "HCCS" in text
    assert "merge    no combination of one hint per provider shares a NUMA node" in text
    assert "decision rejected by single-numa-node" in text
    assert "cpu: slice 76-83 has 4 CPUs on NUMA 0 and 4 on NUMA 1, a pool needs 5" in text
    assert "prefer_closest_numa = true has no effect under topology_policy = single-numa-node" in text


def test_explain_a_rebuilt_pool_and_a_request_policy():
    h, w = a2_host(), worker(range(192), mems=range(8))
    plan = make_plan(h, w, [3], Config(), request_policy="best-effort")
    text = explain_plan(h, w, plan, Config())
    assert "topology_policy best-effort (from request)" in text
    assert "pool built inside NUMA 4: 108-119 (seed pool 120-143); aligned" in text


def test_explain_lists_npus_that_failed_before_alignment():
    h, w = a3_host(), worker(range(64))
    plan = make_plan(h, w, [5], Config())
    assert "NPU 5: not planned before alignment [slice_too_small]" in explain_plan(h, w, plan, Config())


# ---------------------------------------------------------------- lint


def lint(h=None, **cfg):
    return lint_config(load_config(None, env={}, overrides=cfg), h or a2_host())


def test_lint_is_quiet_for_defaults():
    assert lint() == [] and lint(a3_host()) == [] and lint(a950_host()) == []


def test_lint_extension_under_single_numa_node():
    (w,) = lint(topology_policy="single-numa-node")
    assert w.startswith("numa_extension = next does nothing under topology_policy = single-numa-node")
    assert lint(topology_policy="single-numa-node", numa_extension="none") == []


def test_lint_share_under_restricted():
    out = lint(topology_policy="restricted", numa_extension="none", small_pool="share")
    assert out == [w for w in out if w.startswith("small_pool = share under topology_policy = restricted")] and out


def test_lint_full_pcpus_on_one_thread_per_core():
    (w,) = lint(cpu_bind_policy="full-pcpus")
    assert "no-op" in w and "1 thread per core" in w
    assert lint(a950_host(), cpu_bind_policy="full-pcpus") == []  # SMT-2 host


def test_lint_other_tensions():
    assert any("prefer_closest_numa" in w for w in lint(topology_policy="single-numa-node", numa_extension="none",
                                                          prefer_closest_numa="true"))
    assert any("max_numa_nodes = 4" in w for w in lint(topology_policy="best-effort", max_numa_nodes=4))
    assert any("global_slice never extends" in w for w in lint(a3_host(), numa_extension="closest"))
    assert any("distances" in w for w in lint(a2_host(with_distances=False), numa_extension="closest"))
    one = host(48, 1, device_type=DeviceType.A2, chips=[(0, 0, 0)], affinity={0: frozenset(range(48))})
    assert any("one NUMA node" in w for w in lint(one, topology_policy="restricted", numa_extension="none"))
    assert any("Ascend 950" in w for w in lint(a950_host(), irq_binding="false"))


# ---------------------------------------------------------------- fixture hosts


def fixture_plan(name, npu, pid=None, **cfg):
    path = os.path.join(HOSTS, name)
    if not os.path.isdir(path):
        pytest.skip(f"fixture host {name} not present")
    config = load_config(None, env={}, overrides=cfg)
    source = SnapshotHost(path)
    h = discover_host(source, config)
    w = discover_worker(source, pid, config)
    return make_plan(h, w, [npu], config)


def test_fixture_a2_npu3_default_single_numa_and_no_extension():
    plan = fixture_plan("a2-8x910b3", 3)
    al = plan.to_json()["alignment"]
    assert plan.npu(3).pool == r(120, 143)
    assert al["aligned"] is False and al["reason"].startswith("device wants NUMA 4; cpu pool 120-143 is on NUMA 5")
    for cfg in ({"topology_policy": "single-numa-node"}, {"numa_extension": "none"}):
        p = fixture_plan("a2-8x910b3", 3, **cfg)
        n = p.npu(3)
        assert (n.pool, n.irq, n.main, n.acl, n.release) == (r(108, 119), (108, 109), r(110, 117), (118,), (119,))
        assert p.to_json()["alignment"]["aligned"] is True


def test_fixture_a3_cpusets():
    p = fixture_plan("a3-16die", 5, pid=1001, topology_policy="single-numa-node")
    assert p.npu(5).pool == r(68, 79) and p.to_json()["alignment"]["aligned"] is True
    p = fixture_plan("a3-16die", 9, pid=1002, topology_policy="single-numa-node")
    assert p.npu(9) is None
    assert "cpu: slice 76-83 has 4 CPUs on NUMA 0 and 4 on NUMA 1, a pool needs 5" in p.errors[0].reason


def test_fixture_310p_full_pcpus_keeps_cores_whole():
    plans = [fixture_plan("310p-4card", npu, cpu_bind_policy="full-pcpus") for npu in range(8)]
    src = SnapshotHost(os.path.join(HOSTS, "310p-4card"))
    core = {c.cpu: c.core for c in discover_host(src, Config()).cpus}
    owner = {}
    for npu, plan in enumerate(plans):
        for c in plan.npu(npu).pool:
            assert owner.setdefault(core[c], npu) == npu
    assert len(owner) == 32  # every core of the host used exactly once
