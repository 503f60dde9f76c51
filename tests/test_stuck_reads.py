"""A real daemon and workers whose files are hostile to read: a ``/dev`` that is a FUSE
mount nobody serves, and an environment rewritten into one multi-MB value.

The daemon runs in a private mount namespace whose /proc/devices lists the NPU
driver's major (tests/containers.py), so it reads each contained worker's /dev
through /proc/<pid>/root; npu-smi is the fixture one replaying 8 NPUs. The FUSE
worker (tests/hostile_workers.py) is pid 1 of its own mount and pid namespace: the
mount goes with it, and once it exits the kernel aborts the connection, which ends
the daemon's read that was left behind.

The daemon's API serves uid 0 on two threads of its own, so a test keeps at most one
bind that waits out the deadline in flight at a time.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ascendbind.values.cpulist import format_cpulist
from ascendbind.discovery.read.deadline import READ_DEADLINE
from ascendbind.discovery.parse.procfs import ENVIRON_LIMIT

from .containers import FakeNpuHost, contained_worker, daemon_with_driver_major, npu_major
from .daemon_harness import DaemonProc, base_env, free_port, metric_value, wait_for
from .hostile_workers import rewritten_environ_worker, unserved_fuse_dev

MAJOR = npu_major()
# 8 NPUs: NPU 3 near CPU 0 (the lowest CPU the tests may use: a pool of its own), the others near
# every CPU of this machine
NPUS = {"ASCENDBIND_FAKE_NPUS": "8",
        "ASCENDBIND_FAKE_NPU_AFFINITY": ";".join(str(min(os.sched_getaffinity(0))) if n == 3
                                                 else format_cpulist(os.sched_getaffinity(0)) for n in range(8))}


def start_daemon(directory: Path) -> DaemonProc:
    host = FakeNpuHost(str(directory / "host"), **NPUS)
    env = base_env(str(directory / "s.sock"), str(directory / "state"), free_port(), ASCENDBIND_FIXTURE_HOST=host.dir)
    daemon = DaemonProc(str(directory), env, daemon_with_driver_major(str(directory), MAJOR)).start()
    daemon.wait_discovered()
    return daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("stuck"))
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def fresh(request):
    yield
    if "daemon" in request.fixturenames:
        d = request.getfixturevalue("daemon")
        assert d.alive(), d.log()[-3000:]
        d.client.release(all=True)


def reads(d: DaemonProc, name: str) -> dict[str, float | None]:
    """``ascendbind_worker_reads_<name>`` by file, from one scrape."""
    text = d.metrics_text()
    return {f: metric_value(text, f"ascendbind_worker_reads_{name}", file=f) for f in ("environ", "cmdline", "dev")}


def timed(call):
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def thread_names(pid: int) -> list[str]:
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as fh:
            names.append(fh.read().strip())
    return names


def no_fuse_mount_on_the_host() -> bool:
    with open("/proc/self/mountinfo") as fh:
        return " unserved " not in fh.read()


def test_a_worker_whose_dev_nobody_serves_gets_503_within_the_deadline_and_nobody_else_waits(daemon):
    with unserved_fuse_dev(major=MAJOR, env={"ASCEND_VISIBLE_DEVICES": "5"}) as stuck, \
            contained_worker([("davinci3", 3)], env={"ASCEND_VISIBLE_DEVICES": "3"}, major=MAJOR) as other:
        assert no_fuse_mount_on_the_host()
        answer = {}
        bind = threading.Thread(target=lambda: answer.update(
            zip(("reply", "seconds"), timed(lambda: daemon.curl("POST", "/v1/bind", {"pid": stuck.pid}))))
        )
        bind.start()
        # while that bind waits on its read, the daemon answers everyone else at once
        health = []
        while bind.is_alive():
            health.append(timed(daemon.client.health)[1])
        bind.join()
        (status, body), seconds = answer["reply"], answer["seconds"]
        assert status == 503 and body["error"] == "read_timeout", body
        assert f"/proc/{stuck.pid}/root/dev" in body["detail"] and "did not answer" in body["detail"]
        assert READ_DEADLINE <= seconds < READ_DEADLINE + 3, seconds
        assert len(health) >= 3 and max(health) < 1.0, health

        # the read is still stuck; the same worker is refused at once, another is bound
        (status, body), seconds = timed(lambda: daemon.curl("POST", "/v1/bind", {"pid": stuck.pid}))
        assert status == 503 and body["error"] == "read_timeout" and "has not returned" in body["detail"], body
        assert seconds < 1.0
        (status, body), seconds = timed(lambda: daemon.curl("POST", "/v1/bind", {"pid": other.pid}))
        assert status == 200 and body["npus"] == [3], body
        assert seconds < 5.0
        assert reads(daemon, "abandoned_total") == {"environ": 0, "cmdline": 0, "dev": 1}
        assert reads(daemon, "stuck") == {"environ": 0, "cmdline": 0, "dev": 1}
        # the second bind stopped at its first read of the worker: its environment
        assert reads(daemon, "refused_total") == {"environ": 1, "cmdline": 0, "dev": 0}
        assert "worker-read" in thread_names(daemon.pid)  # the stuck reader, as ps -L shows it
        daemon_pid = daemon.pid
    # the worker exited: its FUSE connection is aborted, and the read that was left behind returns
    assert wait_for(lambda: reads(daemon, "stuck")["dev"] == 0, 15), daemon.log()[-2000:]
    assert no_fuse_mount_on_the_host() and daemon.pid == daemon_pid


def test_the_daemon_stops_on_sigterm_while_a_read_of_a_worker_is_stuck(tmp_path):
    d = start_daemon(tmp_path)
    try:
        with unserved_fuse_dev(major=MAJOR) as stuck:
            status, body = d.curl("POST", "/v1/bind", {"pid": stuck.pid})
            assert status == 503 and body["error"] == "read_timeout", body
            assert reads(d, "stuck")["dev"] == 1
            started = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            assert d.proc.wait(timeout=20) == 0, d.log()[-2000:]
            assert time.monotonic() - started < 10
            assert "ascendbind stopped" in d.log()
    finally:
        d.stop()


def test_a_worker_that_rewrote_its_environ_into_one_multi_mb_value_costs_the_daemon_little(daemon):
    with rewritten_environ_worker(6 << 20) as (w, size):
        assert size > 5 << 20
        (status, body), seconds = timed(lambda: daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 3}))
        assert status == 200 and body["npus"] == [3], body
        # before: no answer within 40 s, and the daemon's memory grew by hundreds of MB
        assert seconds < 5.0
        assert any(f"longer than the {ENVIRON_LIMIT}-byte cap" in warning for warning in body["warnings"])
        with open(f"/proc/{daemon.pid}/status") as fh:
            peak_kib = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
        assert peak_kib < 200 * 1024, peak_kib
        assert os.path.exists(f"/proc/{w.pid}")
