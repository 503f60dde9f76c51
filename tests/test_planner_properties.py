"""Hypothesis properties of the planner over generated hosts ."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascendbind.values.config import Config
from ascendbind.values.model import DeviceType
from ascendbind.planner import make_plan
from tests.planner_hosts import host, worker

SETTINGS = settings(max_examples=int(__import__("os").environ.get("PLANNER_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cpusets(draw, n_cpus):
    kind = draw(st.sampled_from(["all", "range", "subset"]))
    if kind == "all":
        return frozenset(range(n_cpus))
    if kind == "range":
        lo = draw(st.integers(0, n_cpus - 1))
        hi = draw(st.integers(lo, n_cpus - 1))
        return frozenset(range(lo, hi + 1))
    return frozenset(draw(st.sets(st.integers(0, n_cpus - 1), min_size=1)))


@st.composite
def topo_cases(draw, device_type=DeviceType.A2, node_aligned=False):
    n_nodes = draw(st.integers(1, 8))
    per = draw(st.integers(4, 32))
    n_cpus = n_nodes * per
    n_npus = draw(st.integers(1, 12))
    aff = {}
    for npu in range(n_npus):
        node = draw(st.integers(0, n_nodes - 1))
        kind = "node" if node_aligned else draw(st.sampled_from(["node", "node", "part", "span"]))
        if kind == "node":
            aff[npu] = frozenset(range(node * per, (node + 1) * per))
        elif kind == "part":
            lo = draw(st.integers(node * per, (node + 1) * per - 1))
            hi = draw(st.integers(lo, (node + 1) * per - 1))
            aff[npu] = frozenset(range(lo, hi + 1))
        else:
            lo = draw(st.integers(0, n_cpus - 1))
            hi = draw(st.integers(lo, n_cpus - 1))
            aff[npu] = frozenset(range(lo, hi + 1))
    h = host(n_cpus, n_nodes, device_type=device_type, chips=[(i, 0, i) for i in range(n_npus)], affinity=aff)
    allowed = draw(cpusets(n_cpus))
    ids = list(range(n_npus))
    t1 = draw(st.lists(st.sampled_from(ids), min_size=1, max_size=n_npus, unique=True))
    t2 = draw(st.lists(st.sampled_from(ids), min_size=1, max_size=n_npus, unique=True))
    cfg = Config(small_pool=draw(st.sampled_from(["fail", "share"])), irq_binding=draw(st.booleans()))
    return h, allowed, t1, t2, cfg, per, n_nodes


def extended_pool(h, allowed, npu, per, n_nodes):
    """Oracle for the extended pool (next-node extension), written from the rule, not the code."""
    base = h.topo_affinity[npu] & allowed
    nodes = {c // per for c in base}
    if len(nodes) == 1 and n_nodes > 1:
        nxt = (nodes.pop() + 1) % n_nodes
        base |= {c for c in allowed if c // per == nxt}
    return base


def pools(plan):
    return {p.npu: set(p.pool) for p in plan.npus}


@SETTINGS
@given(topo_cases())
def test_pools_lie_inside_the_allowed_cpus(case):
    h, allowed, t1, _, cfg, _, _ = case
    plan = make_plan(h, worker(allowed), t1, cfg)
    for p in plan.npus:
        assert set(p.pool) <= allowed
        assert p.numa_nodes == tuple(sorted({c // (len(h.cpus) // len(h.numa_nodes)) for c in p.pool}))
    assert {p.npu for p in plan.npus} | {e.npu for e in plan.errors} == set(t1)


@SETTINGS
@given(topo_cases())
def test_topo_affinity_pools_disjoint_unless_extended_pools_intersect_and_differ(case):
    h, allowed, t1, t2, cfg, per, n_nodes = case
    a = make_plan(h, worker(allowed, pid=1), t1, cfg)
    b = make_plan(h, worker(allowed, pid=2), t2, cfg)
    pa, pb = pools(a), pools(b)
    # a worker's pool for an NPU does not depend on which other NPUs it targets
    for npu in pa.keys() & pb.keys():
        assert pa[npu] == pb[npu]
    merged = {**pa, **pb}
    for x in merged:
        for y in merged:
            if x >= y:
                continue
            ex, ey = extended_pool(h, allowed, x, per, n_nodes), extended_pool(h, allowed, y, per, n_nodes)
            if ex == ey or not (ex & ey):
                assert not (merged[x] & merged[y]), (x, y)
    # inside one plan, an overlap always comes with a warning naming both NPUs
    for plan, p in ((a, pa), (b, pb)):
        for x in p:
            for y in p:
                if x < y and p[x] & p[y]:
                    assert any(w.code == "pools_overlap" and f"NPU {x}'" in w.reason and f"NPU {y}'" in w.reason
                               for w in plan.warnings), (x, y, plan.warnings)


@SETTINGS
@given(topo_cases(node_aligned=True))
def test_node_aligned_affinities_without_extension_never_overlap(case):
    # (with the default next-node extension, NPUs on adjacent nodes do overlap: the
    # A2 boards avoid it by putting NPUs on every other node)
    h, allowed, t1, _, cfg, _, _ = case
    plan = make_plan(h, worker(allowed), t1, cfg.replace(numa_extension="none"))
    assert not plan.warnings
    seen = set()
    for p in plan.npus:
        assert not seen & set(p.pool)
        seen |= set(p.pool)


@SETTINGS
@given(topo_cases(device_type=DeviceType.A3))
def test_global_slice_pools_disjoint_across_workers_with_the_same_cpuset(case):
    h, allowed, t1, t2, cfg, _, _ = case
    a = make_plan(h, worker(allowed, pid=1), t1, cfg)
    b = make_plan(h, worker(allowed, pid=2), t2, cfg)
    pa, pb = pools(a), pools(b)
    for npu in pa.keys() & pb.keys():
        assert pa[npu] == pb[npu]
    merged = {**pa, **pb}
    for x in merged:
        assert merged[x] <= allowed
        for y in merged:
            if x < y:
                assert not merged[x] & merged[y]
    # each slice is consecutive in the sorted cpuset
    order = sorted(allowed)
    for cpus in merged.values():
        idx = [order.index(c) for c in sorted(cpus)]
        assert idx == list(range(idx[0], idx[0] + len(idx)))


@SETTINGS
@given(topo_cases())
def test_default_roles_partition_the_pool(case):
    h, allowed, t1, _, _, _, _ = case
    for cfg in (Config(), Config(irq_binding=False)):
        plan = make_plan(h, worker(allowed), t1, cfg)
        for p in plan.npus:
            parts = [p.irq, p.main, p.acl, p.release]
            assert sorted(c for part in parts for c in part) == list(p.pool)
            assert len(p.acl) == len(p.release) == 1 and p.main
            assert len(p.irq) == (2 if cfg.irq_binding else 0)


@SETTINGS
@given(topo_cases(), st.sampled_from([DeviceType.A2, DeviceType.A3, DeviceType.A950]))
def test_same_input_same_plan(case, dt):
    h, allowed, t1, _, cfg, _, _ = case
    import dataclasses

    h = dataclasses.replace(h, device_type=dt, threads_per_core=1)
    one = make_plan(h, worker(allowed), t1, cfg)
    two = make_plan(h, worker(frozenset(sorted(allowed, reverse=True))), list(reversed(t1)) + t1, cfg)
    assert one == two
    assert one.to_json() == two.to_json()


@SETTINGS
@given(topo_cases(device_type=DeviceType.A950, node_aligned=True), st.sampled_from([1, 2]))
def test_950_clusters_are_full_disjoint_and_on_one_node(case, tpc):
    import dataclasses

    h, allowed, t1, t2, cfg, per, _ = case
    h = dataclasses.replace(h, threads_per_core=tpc)
    a = make_plan(h, worker(allowed, pid=1), t1, cfg)
    b = make_plan(h, worker(allowed, pid=2), t2, cfg)
    merged = {**pools(a), **pools(b)}
    for x, cpus in merged.items():
        assert len(cpus) == 8 * tpc
        assert len({c // per for c in cpus}) == 1
        assert cpus <= allowed
        for y, other in merged.items():
            if x < y:
                assert not cpus & other
    node0 = {c for c in allowed if c < per} - {0}
    uvb = set(a.uvb_cpus)
    assert uvb <= node0
    # clusters are kept out of the UVB pool unless they fill node 0 (then: node 0 minus CPU 0)
    if uvb != node0:
        assert not uvb & set().union(*pools(a).values())


@SETTINGS
@given(topo_cases(), st.sampled_from(["single-numa-node", "restricted", "best-effort"]),
       st.sampled_from([DeviceType.A2, DeviceType.A3]))
def test_aligned_pools_are_disjoint_across_workers_and_on_their_merged_node(case, policy, dt):
    import dataclasses

    h, allowed, _, _, cfg, per, n_nodes = case
    h = dataclasses.replace(h, device_type=dt)
    cfg = cfg.replace(topology_policy=policy)
    aligned = {}
    for npu in range(len(h.chips)):  # one single-NPU worker per NPU, all with the same cpuset
        plan = make_plan(h, worker(allowed, mems=range(n_nodes)), [npu], cfg)
        al = plan.to_json()["alignment"]
        p = plan.npu(npu)
        if policy != "best-effort":
            # admitted means aligned; refused means absent with a topology_rejected error
            assert (p is not None) == al["aligned"] or any(e.code != "topology_rejected" for e in plan.errors)
        if p is not None and al["aligned"]:
            assert p.numa_nodes == tuple(al["numa_nodes"]) and len(p.numa_nodes) == 1
            aligned[npu] = set(p.pool)
    for x in aligned:
        for y in aligned:
            if x < y:
                assert not aligned[x] & aligned[y], (x, y)
