"""apply_plan / release_binding on a real worker, and process identity."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ascendbind.applier import apply_plan, release_binding
from ascendbind.discovery.gather.identity import proc_state, start_time, verify_identity
from ascendbind.values.config import Config
from ascendbind.errors import PlanImpossible, ProcessGone
from ascendbind.values.frozen import frozen_map
from ascendbind.values.model import (
    DeviceType,
    HostFacts,
    Mode,
    NpuPlan,
    Plan,
    WorkerFacts,
)
from ascendbind.values.reasons import Outcome, Reason, Step
from tests.planner_hosts import one_npu_host
from tests.workers import cpus_allowed_of, small_pool_plan, start_worker

CPUS = sorted(os.sched_getaffinity(0))
CONFIG = Config(small_pool="share")


def host_facts(pci: dict[int, str] | None = None) -> HostFacts:
    return one_npu_host({0: frozenset(CPUS)}, affinity={0: frozenset(CPUS)}, pci=pci)


def plan_for(npu_plan: NpuPlan, mode: Mode = Mode.TOPO_AFFINITY, **kw) -> Plan:
    dev = DeviceType.A950 if mode is Mode.ASCEND950_CLUSTER else DeviceType.A2
    return Plan(mode, dev, None, tuple(CPUS), (npu_plan,), **kw)


def worker_facts(pid: int, start: int | None) -> WorkerFacts:
    return WorkerFacts(pid, start, frozenset(CPUS), "status", frozenset({0}), frozen_map())


def by_step(steps):
    return {s.step: s for s in steps}


# ---------------------------------------------------------------- identity


def test_start_time_matches_proc_stat_and_survives_odd_comm():
    with start_worker(plain=0, acl=0, release=0, names=("a) b (c",)) as w:
        assert start_time(w.pid) == w.start_time
        assert verify_identity(w.pid, w.start_time) == w.start_time
        assert proc_state(w.pid) in ("S", "R")


def test_dead_pid_is_gone():
    with start_worker(plain=0, acl=0, release=0) as w:
        pid, st = w.pid, w.start_time
    assert start_time(pid) is None
    with pytest.raises(ProcessGone) as exc:
        verify_identity(pid, st)
    assert exc.value.code == "pid_gone"
    with pytest.raises(ProcessGone):
        apply_plan(plan_for(small_pool_plan(CPUS)), worker_facts(pid, st), host_facts(), CONFIG)


def test_zombie_counts_as_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # not reaped yet: a zombie once it has exited
        for _ in range(500):
            if proc_state(child.pid) == "Z":
                break
            time.sleep(0.01)
        assert proc_state(child.pid) == "Z"
        with pytest.raises(ProcessGone) as exc:
            verify_identity(child.pid, None)
        assert exc.value.code == "pid_gone"
    finally:
        child.wait()


def test_recycled_pid_is_never_bound():
    plan = small_pool_plan(CPUS)
    with start_worker() as w:
        before = w.cpus_allowed()
        with pytest.raises(ProcessGone) as exc:
            apply_plan(plan_for(plan), worker_facts(w.pid, w.start_time + 1), host_facts(), CONFIG)
        assert exc.value.code == "pid_recycled"
        assert w.cpus_allowed() == before


def test_plan_without_npus_is_refused():
    with start_worker() as w:
        empty = Plan(Mode.TOPO_AFFINITY, DeviceType.A2, None, tuple(CPUS), ())
        with pytest.raises(PlanImpossible):
            apply_plan(empty, worker_facts(w.pid, w.start_time), host_facts(), CONFIG)


# ---------------------------------------------------------------- apply / release


def test_apply_binds_every_role_and_reports_every_step():
    plan = small_pool_plan(CPUS)
    with start_worker(plain=3, acl=1, release=1) as w:
        binding = apply_plan(plan_for(plan), worker_facts(w.pid, w.start_time), host_facts(), CONFIG)
        steps = by_step(binding.steps)
        assert [s.step for s in binding.steps] == [Step.AFFINITY, Step.IRQ, Step.MEMORY, Step.UVB]
        assert steps[Step.AFFINITY].outcome is Outcome.APPLIED
        # no PCI address known (no NPU here): skipped with a reason, not failed
        assert steps[Step.IRQ].outcome is Outcome.SKIPPED
        assert steps[Step.IRQ].reason is Reason.NO_PCI_ADDRESS
        assert steps[Step.MEMORY].outcome is Outcome.SKIPPED
        assert steps[Step.MEMORY].reason is Reason.SINGLE_NUMA_NODE
        assert steps[Step.UVB].reason is Reason.NOT_APPLICABLE
        assert not binding.failed
        assert binding.original_cpus == frozenset(CPUS)
        assert binding.start_time == w.start_time and binding.npus == (0,)
        for tid, comm in w.threads().items():
            role = "acl" if comm.startswith("acl_thread") else "release" if comm.startswith("release_thread") else "main"
            assert cpus_allowed_of(w.pid, tid) == frozenset(getattr(plan, role)), comm

        released = by_step(release_binding(binding, CONFIG))
        assert released[Step.AFFINITY].outcome is Outcome.APPLIED
        assert released[Step.IRQ].reason is Reason.NOTHING_TO_RESTORE
        assert set(w.cpus_allowed().values()) == {frozenset(CPUS)}


def test_pci_address_without_msi_irqs_skips_irq_only():
    with start_worker() as w:
        binding = apply_plan(
            plan_for(small_pool_plan(CPUS)),
            worker_facts(w.pid, w.start_time),
            host_facts({0: "0000:fe:1f.7"}),
            CONFIG,
        )
        steps = by_step(binding.steps)
        assert steps[Step.IRQ].reason is Reason.NO_MSI_IRQS
        assert steps[Step.AFFINITY].outcome is Outcome.APPLIED


def test_release_of_an_exited_worker_touches_nothing():
    with start_worker() as w:
        binding = apply_plan(plan_for(small_pool_plan(CPUS)), worker_facts(w.pid, w.start_time), host_facts(), CONFIG)
    released = by_step(release_binding(binding, CONFIG))
    assert released[Step.AFFINITY].outcome is Outcome.SKIPPED
    assert released[Step.AFFINITY].reason is Reason.PID_GONE


def test_950_binds_the_cluster_and_the_uvb_threads():
    pool = tuple(CPUS)
    uvb_cpu = CPUS[-1]
    npu_plan = NpuPlan(0, pool, (), pool, (), (), (0,))
    # the UVB poll thread lives in another (driver) process; comm is cut at 15 bytes
    with start_worker(plain=0, acl=0, release=0, names=("uvb_poll_window_thread",)) as driver, start_worker() as w:
        uvb_tid = next(t for t, c in driver.threads().items() if c.startswith("uvb_poll_window"))
        plan = plan_for(npu_plan, Mode.ASCEND950_CLUSTER, uvb_cpus=(uvb_cpu,), uvb_tids=(uvb_tid,))
        binding = apply_plan(plan, worker_facts(w.pid, w.start_time), host_facts(), CONFIG)
        steps = by_step(binding.steps)
        assert steps[Step.AFFINITY].outcome is Outcome.APPLIED
        assert steps[Step.IRQ].reason is Reason.NOT_APPLICABLE
        assert steps[Step.UVB].outcome is Outcome.APPLIED
        assert cpus_allowed_of(driver.pid, uvb_tid) == {uvb_cpu}
        assert set(w.cpus_allowed().values()) == {frozenset(pool)}
        released = by_step(release_binding(binding, CONFIG, restore_uvb=True))
        assert released[Step.UVB].outcome is Outcome.APPLIED
        assert cpus_allowed_of(driver.pid, uvb_tid) == frozenset(CPUS)


def test_950_without_uvb_threads_skips_with_reason():
    pool = tuple(CPUS)
    plan = plan_for(NpuPlan(0, pool, (), pool, (), (), (0,)), Mode.ASCEND950_CLUSTER, uvb_cpus=pool)
    with start_worker() as w:
        steps = by_step(apply_plan(plan, worker_facts(w.pid, w.start_time), host_facts(), CONFIG).steps)
        assert steps[Step.UVB].outcome is Outcome.SKIPPED and steps[Step.UVB].reason is Reason.NO_UVB_THREADS


def test_multi_npu_worker_gets_the_union_of_roles():
    if len(CPUS) < 2:
        pytest.skip("needs 2 CPUs")
    a, b = CPUS[0], CPUS[1]
    npus = (NpuPlan(0, (a,), (a,), (a,), (a,), (a,), (0,)), NpuPlan(1, (b,), (b,), (b,), (b,), (b,), (0,)))
    plan = Plan(Mode.TOPO_AFFINITY, DeviceType.A2, None, tuple(CPUS), npus)
    with start_worker() as w:
        binding = apply_plan(plan, worker_facts(w.pid, w.start_time), host_facts(), CONFIG)
        assert binding.npus == (0, 1)
        assert set(w.cpus_allowed().values()) == {frozenset({a, b})}
