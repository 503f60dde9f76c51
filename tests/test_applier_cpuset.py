"""A worker inside a real cpuset cgroup: the kernel narrows or refuses our masks, and we say so.

The cgroup is made on whichever hierarchy this machine has (tests/cpuset_cgroups.py): cgroup
v1's cpuset one, or cgroup v2's unified one with the cpuset controller; the kernel's answers
are the same on both."""

from __future__ import annotations

import contextlib
import os

import pytest

from ascendbind.applier.affinity import bind_threads
from ascendbind.values.model import Mode, NpuPlan
from ascendbind.values.reasons import Outcome, Reason
from tests import cpuset_cgroups
from tests.workers import cpus_allowed_of, start_worker

CPUS = sorted(os.sched_getaffinity(0))

pytestmark = [
    pytest.mark.skipif(len(CPUS) < 2, reason="narrowing needs 2 CPUs"),
    pytest.mark.skipif(cpuset_cgroups.why_not() is not None, reason=str(cpuset_cgroups.why_not())),
    pytest.mark.usefixtures("which_hierarchy"),
]


@contextlib.contextmanager
def worker_in_cpuset(cpus: str):
    """A test worker moved into a fresh cpuset cgroup limited to ``cpus``; the
    worker is reaped and the cgroup removed whatever happens."""
    with cpuset_cgroups.cpuset_tree([], cpus) as path, start_worker(plain=2, acl=1, release=1) as w:
        cpuset_cgroups.move(path, w.pid)
        yield w


def test_mask_outside_the_cpuset_is_refused_with_the_kept_cpus():
    inside = CPUS[-1]
    outside = CPUS[0]
    # main wants a CPU the cpuset lacks; acl/release want the one it has
    plan = NpuPlan(0, (outside, inside), (outside,), (outside,), (inside,), (inside,), (0,))
    with worker_in_cpuset(str(inside)) as w:
        res = bind_threads(w.pid, plan, Mode.TOPO_AFFINITY)
        assert res.outcome is Outcome.FAILED
        assert res.reason is Reason.MASK_REFUSED
        refused = res.data["refused"]
        assert res.data["refused_count"] == len(w.threads()) - 2
        assert all(r["wanted"] == [outside] and r["kept"] == [inside] for r in refused)
        assert f"kernel kept {inside}" in res.detail
        # the threads that could be bound were bound
        assert res.data["counts"] == {"main": 0, "acl": 1, "release": 1}
        for tid, comm in w.threads().items():
            assert cpus_allowed_of(w.pid, tid) == {inside}, comm


def test_mask_partly_outside_the_cpuset_is_narrowed_and_reported():
    inside = CPUS[-1]
    pool = tuple(CPUS)
    plan = NpuPlan(0, pool, pool[:1], pool, pool[-1:], pool[-1:], (0,))
    with worker_in_cpuset(str(inside)) as w:
        res = bind_threads(w.pid, plan, Mode.TOPO_AFFINITY)
        assert res.outcome is Outcome.FAILED and res.reason is Reason.MASK_NARROWED
        narrowed = res.data["narrowed"]
        assert {n["role"] for n in narrowed} == {"main"}
        assert all(n["kept"] == [inside] and n["wanted"] == list(pool) for n in narrowed)
        assert "narrowed" in res.detail
