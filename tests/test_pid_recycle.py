"""A worker's identity from the request to its last write, with real pid recycling.

The recycling happens only inside a pid namespace of its own (tests/recycle_ns.py
runs as its init, under ``unshare --pid --fork --mount-proc``), where
``/proc/sys/kernel/ns_last_pid`` hands the worker's number to a stranger right
between the bind's checks and its first write (the daemon's ``before_writes``
hook), or right after a bind, in the tick the worker was born in. The rest runs
on this host with processes of its own: the pin an observation takes, what a
restarted daemon compares, and that no descriptor is left behind.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings

import pytest

from ascendbind.applier.affinity import bind_tasks
from ascendbind.daemon.api.auth import Peer
from ascendbind.daemon.heart.daemon import Daemon
from ascendbind.daemon.state.staterecord import binding_from_json, binding_to_json
from ascendbind.daemon.watch.npucheck import NpuChecker
from ascendbind.daemon.watch.reconcile import Reconciler
from ascendbind.discovery import LiveHost, SnapshotHost
from ascendbind.discovery.gather.identity import pin_identity, verify_identity
from ascendbind.discovery.read.pin import ProcessPin, pidfs_unique
from ascendbind.discovery.gather.process import observe_process
from ascendbind.discovery.read.tasks import exited_pidfds, open_pidfd
from ascendbind.errors import ProcessGone
from ascendbind.values.frozen import frozen_map
from ascendbind.values.model import Mode
from ascendbind.values.reasons import Outcome, Reason
from tests.daemon_harness import metric_value, wait_for
from tests import soak
from tests.builders import fixture_daemon
from tests.deploy_tools import in_ci
from tests.golden import HOSTS, ROOT
from tests.test_daemon_parts import BINDING
from tests.workers import small_pool_plan, start_worker

HARNESS = os.path.join(ROOT, "tests", "recycle_ns.py")
ROOT_PEER = Peer(os.getpid(), 0, 0)


def _in_a_pid_namespace(*args: str) -> dict[str, dict]:
    """tests/recycle_ns.py's figures, by kind, from a run as init of a new pid namespace."""
    unshare = shutil.which("unshare")
    why = "unshare is missing" if unshare is None else "a pid namespace needs root" if os.geteuid() else None
    if why is None:
        r = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", sys.executable, HARNESS, *args, "--json"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
        if r.returncode != 0 and r.stderr.startswith("unshare:"):
            why = r.stderr.strip()
    if why is not None:
        if in_ci():
            pytest.fail(why)
        pytest.skip(why)
    assert r.returncode == 0, r.stderr[-3000:]
    return {run["kind"]: run for run in json.loads(r.stdout.strip().splitlines()[-1])}


def _target(fd: str) -> str | None:
    """What this process's descriptor ``fd`` is open on; None for one closed since it was
    listed (the listing's own)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        return None


def _fds(daemon: Daemon | None = None) -> set[str]:
    """This process's descriptors, once every check of named binds in it is idle: that check
    runs npu-smi after a bind's answer, and its pipes are open while it runs (an earlier
    test's daemon, its check still due, counts too); ``daemon`` says whose check must have run."""
    checkers = [o for o in gc.get_objects() if isinstance(o, NpuChecker)]
    assert daemon is None or daemon.npu_check in checkers
    assert wait_for(lambda: all(c.idle() for c in checkers), 30, 0.01)
    return set(os.listdir("/proc/self/fd"))


# ---------------------------------------------------------------- recycled on purpose, in a namespace


@pytest.mark.soak
def test_a_pid_or_tid_recycled_before_the_writes_leaves_no_stranger_pinned_and_no_newcomer_held():
    n = soak.count(50, 1000)
    runs = _in_a_pid_namespace("--trials", str(n), "--kind", "pid", "--kind", "tid")
    pid, tid = runs["pid"], runs["tid"]
    # the worker's pid and its thread ids went to a stranger after the checks: every
    # write reached the stranger's threads, and every one was set back
    assert pid["trials"] == n and pid["pinned"] == 0 and pid["held"] == 0, pid
    assert pid["answers"] == {"Conflict pid_recycled": n}, pid
    assert pid["undone"] >= n, pid  # at least the main thread of each stranger was written, then undone
    # one thread's id went to a stranger: that write is undone, the worker stays bound, partly
    assert tid["trials"] == n and tid["pinned"] == 0, tid
    assert tid["answers"] == {"200 partial affinity=pid_recycled": n}, tid
    assert tid["undone"] == n, tid


@pytest.mark.soak
def test_a_newcomer_started_in_the_workers_clock_tick_never_passes_for_it():
    n = soak.count(6, 100)  # even: the held trials alternate between the loop and a release
    runs = _in_a_pid_namespace("--trials", str(n), "--kind", "tick", "--kind", "held")
    tick, held = runs["tick"], runs["held"]
    # same pid, same start time: refused at the bind, its writes undone
    assert tick["trials"] == n and tick["pinned"] == 0 and tick["held"] == 0, tick
    assert tick["answers"] == {"Conflict pid_recycled": n} and tick["undone"] >= n, tick
    # recycled after the bind: the daemon calls its worker gone, the loop drops it and a
    # release writes nothing to the stranger
    assert held["trials"] == n and held["pinned"] == 0 and held["held"] == 0, held
    assert held["answers"] == {"gone, dropped by the loop": n // 2, "gone, dropped on release": n // 2}, held


def test_the_harness_refuses_to_recycle_this_machines_pids():
    r = subprocess.run([sys.executable, HARNESS, "--trials", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "pid namespace" in r.stderr


# ---------------------------------------------------------------- the pin, on this host


def test_an_observation_pins_the_process_it_read_and_the_pin_outlives_the_number(record_property):
    # two right answers, by kernel: with pidfs (Linux 6.9 on) a pidfd's inode is its process's
    # own and the pin carries it; before, every pidfd shares one anonymous inode and the pin has none
    unique = pidfs_unique()
    record_property("pidfd_inode", "pidfs, unique per process" if unique else "one anonymous inode")
    print(f"\npidfd inode on {os.uname().release}: {'pidfs, unique per process' if unique else 'anonymous, shared'}")
    with start_worker(plain=2, acl=1, release=0) as w:
        view = observe_process(LiveHost(), w.pid, pin=True)
        pin = view.pin
        assert isinstance(pin, ProcessPin) and pin.pid == w.pid and not pin.exited()
        assert pin.tids() == set(w.threads())
        fresh = open_pidfd(w.pid)
        try:
            if unique:
                assert pin.ino == os.fstat(fresh).st_ino
            else:
                assert pin.ino is None  # an inode every pidfd shares proves nothing: none is kept
        finally:
            os.close(fresh)
        kept = pin.keep()
        pin.close()
        assert pin.exited() and pin.keep() is None  # closed: reads as exited, never as another fd
        assert not kept.exited() and verify_identity(w.pid, w.start_time, pin=kept) == w.start_time
        os.kill(w.pid, signal.SIGKILL)  # a zombie until reaped: exited, though its number is still its own
        assert wait_for(kept.exited, 10)
        assert kept.tids() is None
        with pytest.raises(ProcessGone):
            verify_identity(w.pid, w.start_time, pin=kept)
        kept.close()
    # a snapshot, or another proc root, holds no process
    assert observe_process(SnapshotHost(os.path.join(HOSTS, "a2-8x910b3")), 4242, pin=True).pin is None


def test_threads_that_exit_after_their_write_are_no_recycled_writes():
    # short-lived threads come and go while the worker is bound through its pin: a write to a
    # thread that exited since is checked (its tid is no longer the worker's) and let be
    cpus = sorted(os.sched_getaffinity(0))
    with start_worker(plain=2, acl=1, release=1) as w, pin_identity(w.pid, w.start_time) as pin:
        w.churn(True)
        try:
            gone = 0
            for _ in range(500):
                bound = bind_tasks(w.pid, small_pool_plan(cpus), Mode.TOPO_AFFINITY, pin=pin)
                c = bound.confirmed
                assert bound.result.outcome is Outcome.APPLIED, bound.result.detail
                assert not c.exited and c.landed_elsewhere == 0
                assert not {s.tid for s in c.stray} & set(bound.threads)  # not held as the worker's
                gone += c.count("gone")
                if gone >= 3:
                    break
            assert gone >= 3  # the check did meet threads gone after their write
        finally:
            w.churn(False)


def test_a_restarted_daemon_compares_the_pidfd_inode_the_state_file_kept(tmp_path):
    if not pidfs_unique():
        pytest.skip("this kernel gives every pidfd one anonymous inode (pidfs came with Linux 6.9)")
    with start_worker(plain=1, acl=0, release=0) as a, start_worker(plain=1, acl=0, release=0) as b:
        inos = {}
        for w in (a, b):
            with pin_identity(w.pid, w.start_time) as pin:
                inos[w.pid] = pin.ino
        assert inos[a.pid] != inos[b.pid]
        # a's pid and start time with b's inode: what a newcomer forked in a's tick would show
        cpus = frozenset(os.sched_getaffinity(0))
        entry = dataclasses.replace(BINDING, pid=a.pid, start_time=a.start_time, original_cpus=cpus,
                                    saved_irq_masks=frozen_map(), pidfd_ino=inos[b.pid])
        with pytest.raises(ProcessGone) as exc:
            pin_identity(a.pid, a.start_time, inos[b.pid])
        assert exc.value.code == "pid_recycled"
        for kept, ino in ((0, inos[b.pid]), (1, inos[a.pid]), (1, None)):  # None: a record older than the inode
            d = fixture_daemon(tmp_path)
            d.state.save([binding_to_json(dataclasses.replace(entry, pidfd_ino=ino))])
            try:
                assert d.restore()["kept"] == kept
                assert (a.pid in d.held) == bool(kept)
                if kept:
                    assert d.held[a.pid].pin is not None and d.is_alive(d.held[a.pid])
                    # the next file keeps the inode, an older record's included
                    assert d.state.load().workers[0]["pidfd_ino"] == inos[a.pid]
            finally:
                d.close()
        # the inode survives the file; anything but a positive integer makes the entry malformed
        rec = binding_to_json(dataclasses.replace(entry, pidfd_ino=inos[a.pid]))
        assert binding_from_json(json.loads(json.dumps(rec))).pidfd_ino == inos[a.pid]
        assert "pidfd_ino" not in binding_to_json(BINDING)
        for bad in (-1, 0, True, "7", 1.5):
            with pytest.raises(ValueError):
                binding_from_json({**rec, "pidfd_ino": bad})


def test_a_memory_move_asks_the_workers_pidfd_not_its_start_time(tmp_path):
    d = fixture_daemon(tmp_path)
    try:
        with start_worker(plain=1, acl=0, release=0) as w:
            d.bind_request(ROOT_PEER, {"pid": w.pid, "npu": 0})
            h = d.held[w.pid]
            fd = open_pidfd(w.pid)
            os.kill(w.pid, signal.SIGKILL)  # not reaped: its pid and start time still read as before
            assert wait_for(lambda: exited_pidfds([fd]), 10, 0.002)
            os.close(fd)
            job = d.move_memory(h, 0, "rerun")
            assert job is not None and job.finished.wait(30)
            assert job.result.reason is Reason.PID_GONE
            assert job.result.detail == f"process {w.pid} has exited: nothing moved"
    finally:
        d.close()


def test_binds_releases_refusals_drops_and_restarts_leave_no_descriptor_behind(tmp_path):
    kill_in_hook: list[int] = []

    def hook(pid: int) -> None:
        if pid in kill_in_hook:  # the worker exits between the checks and the writes (its pid is not reused)
            fd = open_pidfd(pid)
            os.kill(pid, signal.SIGKILL)
            assert wait_for(lambda: exited_pidfds([fd]), 10, 0.002)  # every thread gone: a zombie, not reaped
            os.close(fd)

    gc.collect()
    before = _fds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = fixture_daemon(tmp_path, daemon_kw={"before_writes": hook})
        loop = Reconciler(d)
        try:
            with start_worker(plain=2) as a, start_worker(plain=1) as b, start_worker(plain=1) as c:
                loop.pass_once()  # the loop's own descriptors (its stop flag, the events socket)
                gc.collect()  # what earlier tests left for the collector is closed before counting
                at_rest = _fds()
                rest_targets = {fd: _target(fd) for fd in at_rest}  # the listing's own fd: None
                d.bind_request(ROOT_PEER, {"pid": a.pid, "npu": 0})
                d.bind_request(ROOT_PEER, {"pid": a.pid, "npu": 0})  # bound again: one pin, not two
                assert len(_fds(d) - at_rest) == 1
                loop.pass_once()  # the loop's own copy of the pidfd, and the worker's cpuset file held open
                # by what each is open on: the number the listing itself had at rest may be taken since
                added = {fd: target for fd in _fds(d) if (target := _target(fd)) not in (None, rest_targets.get(fd))}
                pidfds = [fd for fd, target in added.items() if "pidfd" in target]  # anon_inode:[pidfd] or pidfd:[…]
                assert len(pidfds) == 2, added
                assert all(added[fd].endswith(("cpuset.effective_cpus", "cpuset.cpus.effective"))
                           for fd in set(added) - set(pidfds)), added
                assert len(added) <= 3, added
                d.release_pid(a.pid)
                kill_in_hook.append(b.pid)
                with pytest.raises(ProcessGone) as exc:
                    d.bind_request(ROOT_PEER, {"pid": b.pid, "npu": 0})
                assert exc.value.code == "pid_gone" and b.pid not in d.held
                d.bind_request(ROOT_PEER, {"pid": c.pid, "npu": 0})
                restarted = fixture_daemon(tmp_path)
                assert restarted.restore()["kept"] == 1 and restarted.held[c.pid].pin is not None
                restarted.close()
                os.kill(c.pid, signal.SIGKILL)
                assert wait_for(lambda: d.held[c.pid].pin.exited(), 10)
                loop.pass_once()  # dropped, its pin and the loop's copy closed
                assert d.held == {}
                loop.pass_once()
                assert _fds(d) - at_rest == set()
            text = d.metrics.render().decode()
            assert metric_value(text, "ascendbind_bind_requests_total", outcome="rejected") == 1
        finally:
            loop.close()
            d.close()
        gc.collect()
    assert _fds() - before == set()
    assert not [str(w.message) for w in caught if "ProcessPin" in str(w.message)]
