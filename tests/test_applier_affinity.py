"""Per-thread binding on a real worker process, read back from /proc/<pid>/task/*/status."""

from __future__ import annotations

import os
import time

import pytest

from ascendbind.applier.affinity import (
    bind_threads,
    cpus_for_role,
    role_of,
    set_all_threads,
)
from ascendbind.discovery.gather.process import thread_masks
from ascendbind.values.model import Mode, NpuPlan
from ascendbind.values.reasons import Outcome, Reason
from tests.workers import cpus_allowed_of, small_pool_plan, start_worker

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="roles need 2 CPUs to be told apart")


def expected_cpus(plan: NpuPlan, comm: str) -> frozenset[int]:
    return cpus_for_role(plan, role_of(comm), Mode.TOPO_AFFINITY)


def test_role_of_follows_the_seed_names():
    assert role_of("acl_thread") == "acl"
    assert role_of("acl_thread_3") == "acl"
    assert role_of("release_thread") == "release"
    assert role_of("release_thread1") == "release"
    assert role_of("python3") == "main"
    assert role_of("my_acl_thread") == "main"  # prefix, not substring


def test_cpus_for_role_seed_split_and_950():
    plan = NpuPlan(0, tuple(range(40)), (0, 1), tuple(range(2, 38)), (38,), (39,), (0,))
    assert cpus_for_role(plan, "main", Mode.GLOBAL_SLICE) == frozenset(range(2, 38))
    assert cpus_for_role(plan, "acl", "global_slice") == {38}
    assert cpus_for_role(plan, "release", Mode.TOPO_AFFINITY) == {39}
    # Ascend 950: every thread to the whole cluster
    cluster = NpuPlan(0, tuple(range(16)), (), tuple(range(16)), (), (), (0,))
    for role in ("main", "acl", "release"):
        assert cpus_for_role(cluster, role, Mode.ASCEND950_CLUSTER) == frozenset(range(16))
    # a role the plan leaves empty falls back to main, never to an empty mask
    assert cpus_for_role(cluster, "acl", Mode.TOPO_AFFINITY) == frozenset(range(16))
    with pytest.raises(ValueError):
        cpus_for_role(plan, "irq", Mode.TOPO_AFFINITY)


def test_bind_real_worker_every_role_read_back():
    plan = small_pool_plan(CPUS)
    with start_worker(plain=4, acl=2, release=2) as w:
        res = bind_threads(w.pid, plan, Mode.TOPO_AFFINITY)
        assert res.outcome is Outcome.APPLIED, res.detail
        threads = w.threads()
        assert res.data["bound"] == len(threads)
        assert res.data["counts"] == {"main": len(threads) - 4, "acl": 2, "release": 2}
        for tid, comm in threads.items():
            assert cpus_allowed_of(w.pid, tid) == expected_cpus(plan, comm), (tid, comm)


@needs_two
def test_two_cpu_share_main_on_first_acl_release_on_last():
    plan = small_pool_plan(CPUS[:2])
    with start_worker(plain=2, acl=1, release=1) as w:
        assert bind_threads(w.pid, plan, "topo_affinity").outcome is Outcome.APPLIED
        for tid, comm in w.threads().items():
            want = {CPUS[1]} if comm.startswith(("acl_thread", "release_thread")) else {CPUS[0]}
            assert cpus_allowed_of(w.pid, tid) == want, comm


def test_950_binds_every_thread_to_the_cluster():
    pool = tuple(CPUS[-1:])
    plan = NpuPlan(0, pool, (), pool, (), (), (0,))
    with start_worker(plain=2, acl=1, release=1) as w:
        res = bind_threads(w.pid, plan, Mode.ASCEND950_CLUSTER)
        assert res.outcome is Outcome.APPLIED
        assert {cpus_allowed_of(w.pid, t) for t in w.threads()} == {frozenset(pool)}


def test_late_threads_are_caught_by_only_tids_and_by_a_rebind():
    plan = small_pool_plan(CPUS)
    with start_worker(plain=1, acl=0, release=0) as w:
        set_all_threads(w.pid, frozenset(CPUS))
        bind_threads(w.pid, plan, Mode.TOPO_AFFINITY)
        # spawned by the worker's (bound) main thread, a late thread inherits main's
        # CPUs: right for a plain thread, wrong for an acl_thread until rebound
        late = w.spawn("acl_thread_late")
        assert cpus_allowed_of(w.pid, late) == frozenset(plan.main)
        res = bind_threads(w.pid, plan, Mode.TOPO_AFFINITY, only_tids=[late])
        assert res.outcome is Outcome.APPLIED and res.data["bound"] == 1
        assert cpus_allowed_of(w.pid, late) == frozenset(plan.acl)
        masks = thread_masks(w.pid)
        assert masks[late] == ("acl_thread_late", frozenset(plan.acl))
        assert set(masks) == set(w.threads())


def test_threads_appearing_while_binding_are_bound():
    plan = small_pool_plan(CPUS)
    with start_worker(plain=2, acl=1, release=1) as w:
        w.churn(True)
        try:
            for _ in range(5):
                res = bind_threads(w.pid, plan, Mode.TOPO_AFFINITY)
                assert res.outcome is Outcome.APPLIED, res.detail
                assert res.data["passes"] >= 2
        finally:
            w.churn(False)
        for tid, comm in w.threads().items():
            assert cpus_allowed_of(w.pid, tid) == expected_cpus(plan, comm)


def test_a_thread_exiting_during_binding_is_not_an_error():
    plan = small_pool_plan(CPUS)
    with start_worker(plain=1, acl=1, release=0) as w:
        gone = w.spawn("worker_gone")
        w.stop(gone)
        # deterministic: the tid we were told about no longer exists
        res = bind_threads(w.pid, plan, Mode.TOPO_AFFINITY, only_tids=[gone])
        assert res.outcome is Outcome.APPLIED
        assert res.data["vanished"] == 1 and res.data["bound"] == 0
        # racy for real: short-lived threads come and go under the loop; bind until
        # one vanished under it (a deadline, not a count: a loaded machine is slow)
        w.churn(True)
        try:
            seen_vanish = False
            deadline = time.monotonic() + 60
            binds = 0
            while not seen_vanish and time.monotonic() < deadline:
                res = bind_threads(w.pid, plan, Mode.TOPO_AFFINITY)
                binds += 1
                assert res.outcome is Outcome.APPLIED, res.detail
                seen_vanish = res.data["vanished"] > 0
        finally:
            w.churn(False)
        assert seen_vanish, f"no thread exited during {binds} binds of a churning worker"


def test_dead_pid_is_pid_gone():
    with start_worker(plain=0, acl=0, release=0) as w:
        pid = w.pid
    res = bind_threads(pid, small_pool_plan(CPUS), Mode.TOPO_AFFINITY)
    assert res.outcome is Outcome.FAILED and res.reason is Reason.PID_GONE
    assert thread_masks(pid) == {}


def test_set_all_threads_restores_the_allowed_cpus():
    plan = small_pool_plan(CPUS)
    with start_worker() as w:
        bind_threads(w.pid, plan, Mode.TOPO_AFFINITY)
        res = set_all_threads(w.pid, frozenset(CPUS))
        assert res.outcome is Outcome.APPLIED
        assert set(w.cpus_allowed().values()) == {frozenset(CPUS)}
