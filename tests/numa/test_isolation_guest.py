"""Isolation on a real two-node kernel under a noisy neighbour (the isolation guest: the
2node guest's layout, booted for these tests alone).

The fixture npu-smi describes two NPUs, one a node: NPU 0's pool is CPUs 0-3, NPU 1's
4-7. ``stress-ng --cpu 8`` keeps every CPU busy. A worker bound on NPU 0 protects
NPU 0's main, ACL and release CPUs; what this checks is what the kernel itself
shows: every IRQ mask in /proc/irq, the per-CPU counts of /proc/interrupts while
the guest's own devices are kept busy, the daemon's threads' masks in
/proc/<pid>/task/*/status. Release, stop and ``kill -9`` plus a restart each put
every mask back byte for byte. At ``host`` the neighbour's threads, those of a
neighbour started after the bind too, and the soft-lockup watchdog's checks leave
those CPUs and come back on release.

Under emulation a Python step on a saturated vCPU takes minutes, so the neighbour
runs only while something is measured under it: it is started before the daemon
and the worker and kept stopped (SIGSTOP to its process group) while they start,
bind, release and stop; it runs through each 30 s interrupt window, and at
``host`` while its threads are checked off the worker's CPUs. A stopped task is
moved like a running one: its mask is what is checked.

Some minutes of emulation: the suite boots it in the background with the other guests
(tests/test_numa_guest.py); ``make test-isolation-guest`` runs it alone.

At ``host`` this test process names itself ``guest_test`` and is exempt
(``isolation_exempt``): the level would move it too, and what it starts would
inherit the narrowed mask instead of being moved.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time

import pytest

from ascendbind.values.cpulist import parse_cpulist
from tests.daemon_harness import DaemonProc, base_env, free_port, wait_for
from tests.numa.conftest import recorded_npu_smi
from tests.threadname import name_self
from tests.test_isolation_daemon import assert_off_the_protected_cpus, changed, host_masks, put_back, thread_cpus
from tests.workers import start_worker

SLOW = 600.0  # seconds: Python in the guest runs tens of times slower than on a host
WINDOW = 30.0  # seconds the interrupt counts are compared over, the guest's devices kept busy
STARTED_ON = frozenset(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def npu_smi(tmp_path_factory):
    return recorded_npu_smi(str(tmp_path_factory.mktemp("npu-smi")), 2, "0-3;4-7")


@pytest.fixture
def masks():
    saved = host_masks()
    try:
        yield saved
    finally:
        put_back(saved)


@pytest.fixture
def neighbour():
    """``stress-ng --cpu 8`` in a session of its own, its workers started, then stopped until
    a window runs it (``running``)."""
    proc = stress_ng(8)
    try:
        started(proc, 8)
        os.killpg(proc.pid, signal.SIGSTOP)
        yield proc
    finally:
        stopped(proc)


@pytest.fixture
def exempt():
    with open("/proc/self/comm", "rb") as fh:
        own = fh.read().strip()
    name_self(b"guest_test")
    try:
        yield "guest_test"
    finally:
        name_self(own)


def stress_ng(cpus: int) -> subprocess.Popen:
    # stress-ng keeps its files in its working directory: the guest's /tmp, not the read-only checkout
    return subprocess.Popen(["stress-ng", "--cpu", str(cpus), "--timeout", "1800s", "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, cwd="/tmp")


def started(proc: subprocess.Popen, workers: int) -> None:
    assert wait_for(lambda: proc.poll() is not None or len(_children(proc.pid)) >= workers, SLOW)
    assert proc.poll() is None, f"stress-ng exited {proc.returncode}: {proc.stderr.read()[-2000:]!r}"


@contextlib.contextmanager
def running(proc: subprocess.Popen):
    """``proc``'s process group let run for a while, then stopped again."""
    os.killpg(proc.pid, signal.SIGCONT)
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGSTOP)


def stopped(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(60)


def task_cpus(root: subprocess.Popen) -> dict[int, frozenset[int]]:
    """Every thread of ``root`` and of its children: its allowed CPUs."""
    out = {}
    for pid in (root.pid, *_children(root.pid)):
        with contextlib.suppress(OSError):
            out.update(thread_cpus(pid))
    return out


def last_cpus(root: subprocess.Popen) -> dict[int, int]:
    """Every thread of ``root`` and of its children: the CPU it last ran on (stat's field 39)."""
    out = {}
    for pid in (root.pid, *_children(root.pid)):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                    out[int(tid)] = int(fh.read().rpartition(")")[2].split()[36])
    return out


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as fh:
            out += [int(c) for c in fh.read().split()]
    return out


@contextlib.contextmanager
def daemon(directory: str, npu_smi: str, **env: str):
    full = base_env(os.path.join(directory, "s.sock"), os.path.join(directory, "state"), free_port(),
                    ASCENDBIND_NPU_SMI=npu_smi, ASCENDBIND_IRQBALANCE="warn", ASCENDBIND_MEMORY_CHECK_SECONDS="0",
                    ASCENDBIND_COMMAND_TIMEOUT_SECONDS="120", **env)
    os.makedirs(directory, exist_ok=True)
    d = DaemonProc(directory, full)
    try:
        yield start(d)
    finally:
        d.stop(timeout=SLOW)


def start(d: DaemonProc) -> DaemonProc:
    d.start(wait=False)
    d.wait_ready(SLOW)
    d.wait_discovered(SLOW)
    return d


def bind(d: DaemonProc, pid: int) -> dict:
    status, body = d.curl("POST", "/v1/bind", {"pid": pid, "npu": 0})
    assert status == 200, body
    return d.client.workers()["isolation"]


# ------------------------------------------------------------ /proc/interrupts


def irq_counts() -> dict[str, list[int]]:
    """Each numbered IRQ's count per CPU (the columns of /proc/interrupts, CPU 0 first)."""
    with open("/proc/interrupts") as fh:
        header = fh.readline().split()
        out = {}
        for line in fh:
            name, _, rest = line.partition(":")
            if name.strip().isdigit():
                out[name.strip()] = [int(w) for w in rest.split()[:len(header)]]
    return out


def busy_devices(directory: str, files: int) -> None:
    """Work for the guest's own devices: files written and read back through the root file
    system (virtio 9p), each fsync'd, so their interrupts fire while the counts are read."""
    for i in range(files):
        path = os.path.join(directory, f"busy-{i}")
        with open(path, "wb") as fh:
            fh.write(os.urandom(4096))
            fh.flush()
            os.fsync(fh.fileno())
        with open(path, "rb") as fh:
            fh.read()
        os.unlink(path)


def busy_for(directory: str, seconds: float) -> int:
    """busy_devices, a file at a time, until ``seconds`` have passed (at least five files):
    the window the interrupt counts are compared over. How many files it took."""
    deadline, files = time.monotonic() + seconds, 0
    while files < 5 or time.monotonic() < deadline:
        busy_devices(directory, 1)
        files += 1
    return files


def fired(before: dict[str, list[int]], after: dict[str, list[int]], irqs: set[str], cpus) -> int:
    return sum(after[i][c] - before[i][c] for i in irqs if i in before and i in after for c in cpus
               if c < len(after[i]))


# ------------------------------------------------------------ the tests


def test_irqs_under_a_neighbour_no_other_irq_and_no_daemon_thread_on_the_workers_cpus_and_each_restore(
        masks, neighbour, npu_smi, tmp_path):
    # the guest's root is the host's, read-only: busy_devices writes to a 9p directory
    # of the host that the guest may write, its results directory
    work = tempfile.mkdtemp(prefix="busy-", dir=os.environ.get("NUMA_GUEST_OUT") or str(tmp_path))
    with daemon(str(tmp_path / "d"), npu_smi, ASCENDBIND_ISOLATION="irqs") as d, start_worker() as w:
        iso = bind(d, w.pid)
        protected = parse_cpulist(iso["protected"])
        housekeeping = parse_cpulist(iso["housekeeping"])
        assert protected and protected <= frozenset(range(4)) and not protected & housekeeping, iso
        assert_off_the_protected_cpus(iso)
        assert set(thread_cpus(d.pid).values()) == {housekeeping}
        moved = {k[4:] for k in changed(masks) if k.startswith("irq:")}
        assert moved, "no IRQ of the guest was moved"
        # x86 moves an IRQ when it next fires: one round first, so the counts read the new masks
        with running(neighbour):
            busy_devices(work, 5)
            before = irq_counts()
            busy_for(work, WINDOW)
            after = irq_counts()
        # the guest's devices interrupted, and never on the worker's CPUs
        elsewhere = fired(before, after, moved, sorted(set(range(len(after[next(iter(after))]))) - protected))
        assert elsewhere > 0, "busy_devices made no interrupt of a moved IRQ: the check would prove nothing"
        assert fired(before, after, moved, sorted(protected)) == 0
        # release puts every mask back, byte for byte, and the daemon's threads where they were
        assert d.curl("POST", "/v1/release", {"pid": w.pid})[0] == 200
        assert changed(masks) == {}
        assert set(thread_cpus(d.pid).values()) == {STARTED_ON}
        # stop puts back
        bind(d, w.pid)
        assert changed(masks)
        d.stop(timeout=SLOW)
        assert changed(masks) == {}
        # kill -9: the masks stay as the killed daemon left them; the next one, finding its
        # worker gone, puts them back
        start(d)
        bind(d, w.pid)
        narrowed = host_masks()
        d.stop(signal.SIGKILL, timeout=SLOW)
        assert host_masks() == narrowed
    # the worker has exited: a daemon started now on the same state puts every mask back
    again = start(DaemonProc(d.dir, d.env))
    try:
        assert wait_for(lambda: changed(masks) == {}, SLOW), changed(masks)
    finally:
        again.stop(timeout=SLOW)
    os.rmdir(work)


def test_host_under_a_neighbour_moves_its_threads_and_a_late_ones_off_the_workers_cpus_and_release_puts_back(
        masks, neighbour, npu_smi, exempt, tmp_path):
    work = tempfile.mkdtemp(prefix="busy-", dir=os.environ.get("NUMA_GUEST_OUT") or str(tmp_path))
    everywhere = set(task_cpus(neighbour).values())
    with daemon(str(tmp_path / "d"), npu_smi, ASCENDBIND_ISOLATION="host", ASCENDBIND_ISOLATION_EXEMPT=exempt) as d, \
            start_worker() as w:
        iso = bind(d, w.pid)
        protected = parse_cpulist(iso["protected"])
        assert iso["level"] == "host" and protected <= frozenset(range(4)), iso
        assert_off_the_protected_cpus(iso)
        assert set(thread_cpus(d.pid).values()) == {parse_cpulist(iso["housekeeping"])}
        # the soft-lockup watchdog's stopper task leaves them too
        assert parse_cpulist(changed(masks)["watchdog"][1]) == STARTED_ON - protected, changed(masks)
        # the neighbour's threads, and those of one started after the bind, leave the worker's CPUs
        assert wait_for(lambda: not any(c & protected for c in task_cpus(neighbour).values()), SLOW), \
            task_cpus(neighbour)
        late = stress_ng(2)
        try:
            started(late, 2)
            assert wait_for(lambda: not any(c & protected for c in task_cpus(late).values()), SLOW), task_cpus(late)
        finally:
            stopped(late)
        with running(neighbour):
            busy_devices(work, 5)
            before = irq_counts()
            busy_for(work, WINDOW)
            after = irq_counts()
            # where each of the neighbour's threads ran last, after 30 s of running: never there
            ran_on = last_cpus(neighbour)
        moved = {k[4:] for k in changed(masks) if k.startswith("irq:")}
        assert fired(before, after, moved, sorted(protected)) == 0
        assert ran_on and not set(ran_on.values()) & protected, ran_on
        assert d.curl("POST", "/v1/release", {"pid": w.pid})[0] == 200
        assert wait_for(lambda: set(task_cpus(neighbour).values()) == everywhere, SLOW), task_cpus(neighbour)
        assert changed(masks) == {}
    os.rmdir(work)
