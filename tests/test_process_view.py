"""One observation of a process (discovery's ProcessView), on real workers, and what a bind reads.

The read counts come from the interpreter's own audit events (``open``,
``os.listdir``): every file the code under test really opens and every
directory it really lists, with nothing replaced.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from ascendbind.applier.affinity import bind_tasks, cpus_for_role, role_of
from ascendbind.daemon.api.auth import Peer
from ascendbind.daemon.heart.daemon import Daemon
from ascendbind.discovery import LiveHost, SnapshotHost
from ascendbind.discovery.gather.process import ProcessView, observe_process
from ascendbind.discovery.parse.procfs import cpuset_cgroup, parse_cgroup
from ascendbind.discovery.gather.snapshot import RecordingHost
from ascendbind.errors import NotPermitted, ProcessGone
from ascendbind.values.model import Mode
from ascendbind.values.reasons import Outcome
from tests.audit import Reads
from tests.builders import FIXTURE_NPU_SMI, daemon_config
from tests.workers import cpus_allowed_of, small_pool_plan, start_worker

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_BIN = ROOT / "fixtures" / "bin"
CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="roles need 2 CPUs to be told apart")


def _daemon(tmp_path) -> Daemon:
    return Daemon(daemon_config(tmp_path, small_pool="share", npu_smi=FIXTURE_NPU_SMI))


# ---------------------------------------------------------------- the live view


def test_a_live_view_is_the_worker_as_the_kernel_describes_it(monkeypatch):
    monkeypatch.setenv("VIEW_TEST_MARK", "seen")
    with start_worker(plain=2, acl=1, release=1) as w:
        view = observe_process(LiveHost(), w.pid, masks=True)
        threads = w.threads()
        allowed = w.cpus_allowed()
        with open(f"/proc/{w.pid}/cgroup") as fh:
            where = cpuset_cgroup(parse_cgroup(fh.read()))
    assert isinstance(view, ProcessView) and view.key == str(w.pid)
    ident = view.identity
    assert (ident.pid, ident.start_time, ident.tgid, ident.ppid) == (w.pid, w.start_time, w.pid, os.getpid())
    assert not ident.is_kthread and ident.state not in ("Z", "X")
    assert ident.uids[:3] == (os.getuid(),) * 3
    assert view.status.tgid == w.pid
    assert view.status.cpus_allowed == frozenset(os.sched_getaffinity(0))
    assert view.status.mems_allowed  # every process may use some node
    assert view.environ["VIEW_TEST_MARK"] == "seen"
    assert {t.tid: t.comm for t in view.tasks} == threads
    assert [t.tid for t in view.tasks] == sorted(threads)
    assert {t.tid: t.mask for t in view.tasks} == allowed
    assert (view.cpuset.version, view.cpuset.path) == where if where else view.cpuset is None


def test_a_gone_pid_has_no_view():
    with start_worker(plain=1, acl=0, release=0) as w:
        pid = w.pid
    with pytest.raises(ProcessGone) as exc:
        observe_process(LiveHost(), pid)
    assert exc.value.code == "pid_gone"


def test_one_observation_lists_the_tasks_once_and_reads_each_comm_once():
    with start_worker(plain=2, acl=1, release=1) as w:
        tids = set(w.threads())
        with Reads() as r:
            view = observe_process(LiveHost(), w.pid)
    assert {t.tid for t in view.tasks} == tids
    assert r.task_listings(w.pid) == 1
    assert r.comm_reads(tids) == {t: 1 for t in tids}
    assert r.opened("stat") == 1 and r.opened("status") == 1 and r.opened("environ") == 1


def test_a_refused_caller_has_nothing_more_read(tmp_path):
    """Authorization runs on the identity alone: no thread, no environment of a process
    the caller may not touch is read."""
    d = _daemon(tmp_path)
    stranger = Peer(pid=os.getpid(), uid=65534, gid=65534)
    with start_worker(plain=2, acl=1, release=1) as w:
        tids = set(w.threads())
        with Reads() as r, pytest.raises(NotPermitted):
            d.bind_request(stranger, {"pid": w.pid, "npu": 0})
        assert d.held == {} and set(w.cpus_allowed().values()) == {frozenset(CPUS)}
    assert r.task_listings(w.pid) == 0 and r.opened("environ") == 0
    assert r.comm_reads(tids) == {t: 0 for t in tids}


# ---------------------------------------------------------------- replayed from a snapshot


def test_a_recorded_view_replays_from_the_snapshot(tmp_path):
    with start_worker(plain=2, acl=1, release=1) as w:
        live = observe_process(RecordingHost(LiveHost(), str(tmp_path / "snap")), w.pid)
    replayed = observe_process(SnapshotHost(str(tmp_path / "snap")), w.pid)
    assert live.environ is not None and replayed.environ is None  # environ is never written down
    # the state letter is a moment (R or S as the worker ran); the recording kept stat's last read
    same_moment = dataclasses.replace(replayed.identity, state=live.identity.state)
    assert dataclasses.replace(replayed, environ=live.environ, identity=same_moment) == live
    assert replayed.identity.start_time == w.start_time and len(replayed.tasks) == 6


def test_a_fixture_snapshot_view_without_stat_has_no_identity_but_its_facts():
    snap = SnapshotHost(str(ROOT / "fixtures" / "hosts" / "a2-8x910b3"))
    view = observe_process(snap, 4343)
    assert view.identity is None and view.start_time is None and view.pid == 4343
    comms = {int(p.parent.name): p.read_text().strip()
             for p in (ROOT / "fixtures" / "hosts" / "a2-8x910b3" / "proc" / "4343" / "task").glob("*/comm")}
    assert {t.tid: t.comm for t in view.tasks} == comms
    assert view.status.cpus_allowed is not None


# ---------------------------------------------------------------- binding from the view


@needs_two
def test_threads_born_after_the_observation_are_still_bound():
    plan = small_pool_plan(CPUS)
    with start_worker(plain=2, acl=1, release=1) as w:
        view = observe_process(LiveHost(), w.pid)
        late = w.spawn("acl_thread_late")
        assert late not in {t.tid for t in view.tasks}
        with Reads() as r:
            out = bind_tasks(w.pid, plan, Mode.TOPO_AFFINITY, tasks=[(t.tid, t.comm) for t in view.tasks])
        acl = cpus_for_role(plan, "acl", Mode.TOPO_AFFINITY)
        assert cpus_allowed_of(w.pid, late) == acl
        assert out.result.outcome is Outcome.APPLIED and out.result.data["stable"]
        assert out.threads[late] == ("acl_thread_late", acl)
        # the observed threads were bound as named there; only the late one was read
        assert r.comm_reads({t.tid for t in view.tasks} | {late}) == {
            **{t.tid: 0 for t in view.tasks}, late: 1}
        for tid, (comm, mask) in out.threads.items():
            assert mask == cpus_for_role(plan, role_of(comm), Mode.TOPO_AFFINITY) == cpus_allowed_of(w.pid, tid)


@needs_two
def test_a_daemon_bind_lists_the_tasks_at_most_twice_and_reads_each_comm_once(tmp_path):
    d = _daemon(tmp_path)
    root = Peer(pid=os.getpid(), uid=0, gid=0)
    with start_worker(plain=2, acl=1, release=1) as w:
        tids = set(w.threads())
        assert len(tids) == 6
        try:
            with Reads() as r:
                result = d.bind_request(root, {"pid": w.pid, "npu": 0})
            assert result["status"] == "bound"
            assert r.task_listings(w.pid) <= 2, r.events
            assert r.comm_reads(tids) == {t: 1 for t in tids}
            # the held record starts from the masks the bind read back, for every thread
            held = d.held[w.pid].threads
            allowed = w.cpus_allowed()
            assert set(held) == tids
            assert {tid: s.mask for tid, s in held.items()} == allowed
        finally:
            d.release_pid(w.pid)
        assert set(w.cpus_allowed().values()) == {frozenset(CPUS)}
