"""``isolation = host`` on the 2node guest's own kernel: the real unbound-workqueue and
soft-lockup watchdog masks, and process events.

The guest is disposable, so here the daemon acts on the host-wide settings it may
only ever touch in a guest: ``/sys/devices/virtual/workqueue/cpumask`` (the mask the
kernel's unbound work shares), ``/proc/sys/kernel/watchdog_cpumask`` (the CPUs the
soft-lockup detector's stopper task visits), and, running as root in the initial namespaces, it
learns of new processes from the kernel's process connector (events mode, where
the pid-namespace tests on the host run the sweep). Two fixture NPUs, one per node
(``0-3;4-7``); a worker bound on NPU 1 protects its main, ACL and release CPUs.

This test process names itself ``guest_test`` and is exempt (``isolation_exempt``):
otherwise the level would move it too, and every ``sleep`` it starts would inherit
the narrowed mask with no event needed. Exempt, its children are forked with the
whole mask and the exempt name, and become moveable only at their ``exec``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time

import pytest

from tests.daemon_harness import running_daemon, wait_for
from tests.numa.conftest import recorded_npu_smi
from tests.threadname import name_self
from tests.workers import cpus_allowed_of, start_worker

SLOW = 600.0  # seconds: Python in the guest runs tens of times slower than on a host
WQ = "/sys/devices/virtual/workqueue/cpumask"
WATCHDOG = "/proc/sys/kernel/watchdog_cpumask"
ALL = frozenset(range(8))


def wq() -> str:
    with open(WQ) as fh:
        return fh.read().strip()


def allowed(pid: int) -> frozenset[int] | None:
    return cpus_allowed_of(pid, pid)


@pytest.fixture
def daemon(tmp_path_factory):
    with open("/proc/self/comm", "rb") as fh:
        own = fh.read().strip()
    name_self(b"guest_test")
    env = {"ASCENDBIND_ISOLATION_EXEMPT": "guest_test","ASCENDBIND_NPU_SMI": recorded_npu_smi(str(tmp_path_factory.mktemp("npu-smi")), 2, "0-3;4-7"),
           "ASCENDBIND_ISOLATION": "host", "ASCENDBIND_IRQBALANCE": "warn", "ASCENDBIND_COMMAND_TIMEOUT_SECONDS": "60"}
    try:
        with running_daemon(str(tmp_path_factory.mktemp("daemon")), ready_timeout=SLOW, **env) as d:
            d.wait_discovered(SLOW)
            yield d
    finally:
        name_self(own)


def watchdog() -> str:
    with open(WATCHDOG) as fh:
        return fh.read()


def test_host_moves_tasks_started_before_and_after_and_the_workqueue_mask_and_puts_them_back(daemon):
    before_wq, before_watchdog = wq(), watchdog()
    sleepers: list[subprocess.Popen] = []

    def sleeper() -> int:
        sleepers.append(subprocess.Popen(["sleep", "600"]))
        return sleepers[-1].pid

    try:
        early = sleeper()
        assert allowed(early) == ALL
        with start_worker() as w:
            daemon.client.bind(pid=w.pid, npu=1)
            iso = daemon.client.workers()["isolation"]
            protected = frozenset(int(c) for c in _cpus(iso["protected"]))
            assert iso["level"] == "host" and protected, iso
            assert allowed(early) == ALL - protected
            assert not int(wq(), 16) & sum(1 << c for c in protected), wq()
            assert frozenset(int(c) for c in _cpus(watchdog().strip())) == ALL - protected, watchdog()
            # this process, exempt, keeps its mask; what it starts after the bind is found by a
            # process event (its exec) and moved, within a deadline poll
            assert allowed(w.pid) != ALL and cpus_allowed_of(os.getpid(), os.getpid()) == ALL
            assert wait_for(lambda: daemon.client.workers()["isolation"]["tasks"]["events"]["mode"] == "events",
                            SLOW), daemon.client.workers()["isolation"]["tasks"]
            took = []
            for _ in range(20):
                t0 = time.monotonic()
                pid = sleeper()
                assert wait_for(lambda: allowed(pid) == ALL - protected, 10, 0.001), allowed(pid)
                took.append(1000 * (time.monotonic() - t0))
            print(f"start to move, events mode, 20 starts: p50 {statistics.median(took):.1f} ms, "
                  f"max {max(took):.1f} ms")
            daemon.client.release(pid=w.pid)
        assert all(allowed(p.pid) == ALL for p in sleepers)
        assert wq() == before_wq, "the workqueue mask must come back byte for byte"
        assert watchdog() == before_watchdog, "the watchdog's CPUs must come back byte for byte"
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def _cpus(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out
