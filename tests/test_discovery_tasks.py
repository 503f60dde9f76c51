"""discovery/read/tasks.py on real processes: the thread count the reconcile look trusts,
the task list, comm, environment, command line and parent the blame evidence
reads, and the pidfd poll that tells the loop a worker is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from ascendbind.discovery.gather.identity import start_time
from ascendbind.daemon.heart.daemon import Daemon
from ascendbind.daemon.watch.held import Held
from ascendbind.daemon.watch.reconcile import Reconciler
from ascendbind.discovery.read.tasks import (exited_pidfds, list_tids, open_pidfd, parent_pid, read_cmdline,
                                        read_environ, task_comm, thread_count)
from ascendbind.values.frozen import frozen_map
from ascendbind.values.model import Binding, DeviceType, Mode, NpuPlan, Plan
from tests.builders import daemon_config
from tests.daemon_harness import wait_for
from tests.workers import start_worker


def test_the_thread_count_and_the_task_list_agree_with_the_kernel_as_threads_come_and_go():
    with start_worker(plain=3, acl=1, release=0) as w:
        assert thread_count(w.pid) == len(w.threads()) == len(list_tids(w.pid))
        tid = w.spawn("worker_extra")
        assert thread_count(w.pid) == len(w.threads()) and tid in list_tids(w.pid)
        assert task_comm(w.pid, tid) == "worker_extra"
        w.stop(tid)
        assert thread_count(w.pid) == len(w.threads()) and tid not in list_tids(w.pid)
        assert task_comm(w.pid, tid) is None  # gone
        assert task_comm(w.pid, os.getpid()) is None  # a thread, but not this worker's
    assert thread_count(w.pid) is None and list_tids(w.pid) is None  # reaped


def test_environment_command_line_and_parent_of_a_real_child():
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()",
                              "--numa-bind"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={"OMP_PROC_BIND": "true", "PATH": "/usr/bin"})
    try:
        assert child.stdout.readline() == b"ready\n"  # exec'd: environ and cmdline are the new program's
        assert read_environ(child.pid)["OMP_PROC_BIND"] == "true"
        assert read_environ(child.pid, limit=8) == {}  # cut inside the first name: no entry
        assert read_cmdline(child.pid).split(b"\0")[-2] == b"--numa-bind"
        assert parent_pid(child.pid) == os.getpid()
    finally:
        child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()
    assert read_environ(child.pid) == {} and read_cmdline(child.pid) == b"" and parent_pid(child.pid) is None


def test_a_pidfd_polls_exited_once_the_process_is_a_zombie_and_not_before():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    fd = open_pidfd(child.pid)
    try:
        assert fd is not None
        assert exited_pidfds([fd]) == set()
        child.stdin.close()  # it exits; not reaped yet, so it stays a zombie
        assert wait_for(lambda: exited_pidfds([fd]) == {fd}, 10)
    finally:
        if fd is not None:
            os.close(fd)
        child.wait()


def _held_for(pid: int) -> Held:
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    plan = Plan(Mode.TOPO_AFFINITY, DeviceType.A2, None, cpus, (NpuPlan(0, cpus, cpus[:1], cpus, cpus, cpus, (0,)),))
    return Held(Binding(pid, start_time(pid), (0,), plan, frozenset(cpus), frozen_map({}), ()), 0.0)


def test_the_loop_sees_a_worker_die_through_its_pidfd_and_drops_it(tmp_path):
    d = Daemon(daemon_config(tmp_path))
    rec = Reconciler(d)
    try:
        with start_worker(plain=2, acl=0, release=0) as w:
            d.held = {w.pid: _held_for(w.pid)}
            rec.pass_once()  # opens the pidfd, checks the start time once
            assert w.pid in rec._pidfds and w.pid in d.held
            rec.pass_once()  # quiet: the pidfd answers, no start time read
            assert w.pid in d.held
            os.kill(w.pid, signal.SIGKILL)
            assert wait_for(lambda: exited_pidfds([rec._pidfds[w.pid][1]]), 10)
            rec.pass_once()
            assert w.pid not in d.held
            assert 'ascendbind_workers_dropped_total{reason="exited"} 1.0' in d.metrics.render().decode()
        rec.pass_once()
        assert rec._pidfds == {}  # the pidfd of a dropped worker is closed
    finally:
        rec.close()


def test_a_daemon_thread_carries_its_name_in_comm_for_top_and_the_idle_bench():
    import threading

    from ascendbind.daemon.runtime.threadname import name_os_thread

    seen: dict[str, str | None] = {}
    done = threading.Event()

    def run() -> None:
        name_os_thread()
        seen["comm"] = task_comm(os.getpid(), threading.get_native_id())
        name_os_thread("a-much-longer-name-than-fifteen")
        seen["long"] = task_comm(os.getpid(), threading.get_native_id())
        done.set()

    t = threading.Thread(target=run, name="memory-locality")
    t.start()
    assert done.wait(10)
    t.join()
    assert seen == {"comm": "memory-locality", "long": "a-much-longer-n"}  # the kernel keeps 15 bytes
