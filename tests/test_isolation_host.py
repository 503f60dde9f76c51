"""``isolation = host`` with a real ``ascendbind serve``, in a pid namespace of its own.

The daemon moves every process it can see, so it only ever runs as a child of
tests/hostlevel_ns.py, init of a fresh pid namespace with ``/proc/irq`` read-only
and the unbound workqueues' ``cpumask`` and ``/proc/sys/kernel/watchdog_cpumask`` covered by plain
files (all host-wide).
Outside the connector's initial namespace the daemon finds new tasks by listing
``/proc`` (the *sweep* mode); events mode runs in the QEMU guest
(tests/numa/test_isolation_host_guest.py).

The fixture npu-smi describes two NPUs near CPU 0 and CPU 1 (the lowest two CPUs the
tests may use; ``NPU1_CPU`` is the second): a worker bound on NPU 1 protects CPU 1, CPU 0
is housekeeping. Every mask is read back from ``/proc/<pid>/task/*/status``
(``Cpus_allowed_list``) inside the namespace.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time

import pytest

from ascendbind.values.cpulist import format_cpulist, parse_cpulist, parse_mask
from ascendbind.daemon.isolate.hosttasks import never_moved
from ascendbind.discovery.gather.hosttasks import ProcessFacts
from tests.daemon_harness import metric_value, wait_for
from tests.deploy_tools import in_ci
from tests.golden import ROOT

HARNESS = os.path.join(ROOT, "tests", "hostlevel_ns.py")
STARTED_ON = frozenset(os.sched_getaffinity(0))
# the harness's NPU 1 is near the second-lowest CPU the tests may use (its NPU_CPUS, which it
# derives the same way from the affinity it inherits from us): CPU 1 on most machines, and never
# "the last CPU" but on a machine of exactly two
NPU1_CPU = sorted(STARTED_ON)[1] if len(STARTED_ON) >= 2 else None


class Namespace:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def __getattr__(self, op: str):
        return lambda **kw: self.call(op, **kw)

    def call(self, op: str, answer_within: float = 60, **kw):
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], answer_within)[0]:
            raise AssertionError(f"no answer to {op} within {answer_within} s")
        out = json.loads(self.proc.stdout.readline())
        if isinstance(out, dict) and "error" in out:
            raise AssertionError(f"{op}: {out['error']}")
        return out

    def iso(self) -> dict:
        return self.status()["isolation"]


@pytest.fixture
def ns():
    unshare = shutil.which("unshare")
    why = "unshare is missing" if unshare is None else "a pid namespace needs root" if os.geteuid() else \
        "needs two CPUs: one to protect, one for the rest" if len(STARTED_ON) < 2 else None
    if why is None:
        p = subprocess.Popen([unshare, "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, HARNESS],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        ready = select.select([p.stdout], [], [], 60)[0] and p.stdout.readline()
        if not ready:
            p.kill()
            why = f"the namespace did not start: {p.communicate(timeout=10)[1][-2000:]}"
    if why is not None:
        if in_ci():
            pytest.fail(why)
        pytest.skip(why)
    n = Namespace(p)
    try:
        yield n
    finally:
        try:
            p.stdin.write('{"op": "exit"}\n')
            p.stdin.flush()
            p.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()
            p.wait(10)


def bind(ns: Namespace, pid: int) -> None:
    out = ns.curl(method="POST", path="/v1/bind", body={"pid": pid, "npu": 1})
    assert out["code"] == 200, out


def release(ns: Namespace, pid: int) -> None:
    out = ns.curl(method="POST", path="/v1/release", body={"pid": pid})
    assert out["code"] == 200, out


def only(masks: dict[str, str]) -> set[str]:
    return set(masks.values())


def moved(ns: Namespace, pid: int, protected: str) -> dict[str, str]:
    """The masks of ``pid`` once none allows a protected CPU. The deadline is 2 s: generous
    beside the 100 ms a new task may stay, and well short of the watcher's full sweep
    (10 s), so only the watcher's own look at new tasks passes it."""
    out = ns.wait_off(pid=pid, cpus=protected, timeout=2)
    assert out["seconds"] is not None, f"pid {pid} still allowed {protected}: {out['masks']}"
    return out["masks"]


# ---------------------------------------------------------------- host


def test_host_moves_other_tasks_started_before_and_after_the_bind_and_release_puts_each_back(ns):
    daemon = ns.daemon(env={"ASCENDBIND_ISOLATION": "host", "ASCENDBIND_ISOLATION_EXEMPT": "keep_*"})["pid"]
    wq_before, watchdog_before = ns.wq()["text"], ns.watchdog()["text"]
    before = ns.spawn(comm="neigh_before", threads=3)["pid"]
    exempt = ns.spawn(comm="keep_tool", threads=1)["pid"]
    worker = ns.spawn(comm="worker", threads=2)["pid"]
    start = {pid: ns.masks(pid=pid) for pid in (1, before, exempt)}
    assert only(start[before]) == {format_cpulist(STARTED_ON)} and len(start[before]) == 4
    bind(ns, worker)
    iso = ns.iso()
    protected, housekeeping = parse_cpulist(iso["protected"]), parse_cpulist(iso["housekeeping"])
    assert iso["level"] == "host" and protected and housekeeping and iso["error"] is None, iso
    rest = format_cpulist(STARTED_ON - protected)
    bound = ns.masks(pid=worker)
    # started before the bind: every thread moved by the bind's own follow
    assert only(ns.masks(pid=before)) == {rest}
    # a child of the bound worker inherits the bind's mask and keeps it; a task started after it
    # is moved within the event window (a deadline poll), and so the child was looked at too
    child = ns.fork(pid=worker)["pid"]
    after = ns.spawn(comm="neigh_after", threads=2)["pid"]
    assert only(moved(ns, after, iso["protected"])) == {rest} and len(ns.masks(pid=after)) == 3
    assert only(ns.masks(pid=child)) <= set(bound.values()) and only(ns.masks(pid=child)) & {iso["protected"]}
    # what a moved task starts later inherits the mask isolation wrote: recorded, and put back too
    ns.thread(pid=before)
    grandchild = ns.fork(pid=before)["pid"]
    assert only(ns.masks(pid=before)) == {rest} and only(ns.masks(pid=grandchild)) == {rest}
    # never moved: the bound worker, pid 1, the exempt name
    assert ns.masks(pid=worker) == bound
    assert ns.masks(pid=1) == start[1] and ns.masks(pid=exempt) == start[exempt]
    # the daemon's threads keep to the housekeeping CPUs
    assert only(ns.masks(pid=daemon)) == {format_cpulist(housekeeping)}
    # the unbound workqueues follow; everything changed is in the state file with its original
    assert parse_mask(ns.wq()["text"]) == parse_mask(wq_before) - protected
    assert parse_cpulist(ns.watchdog()["text"]) == parse_cpulist(watchdog_before) - protected  # the watchdog too
    record = ns.state()["isolation"]["masks"]
    assert record["workqueues"]["original"] == wq_before
    assert record["watchdog"]["original"] == watchdog_before
    tids = {f"task:{tid}:" for tid in start[before]}
    saved = {k: v for k, v in record.items() if any(k.startswith(t) for t in tids)}
    assert len(saved) == 4 and {v["original"] for v in saved.values()} == {format_cpulist(STARTED_ON)}
    tasks = ns.iso()["tasks"]
    assert tasks["events"]["mode"] == "sweep", tasks  # outside the connector's namespace
    assert tasks["never_moved"]["pid 1"] == 1 and tasks["never_moved"]["exempt"] == 1
    assert tasks["never_moved"]["bound"] >= 1 and tasks["never_moved"]["daemon"] >= 1
    assert tasks["moved_as_started"] >= 1  # the late neighbour (its threads and children inherit)
    text = ns.cli(args=["status"])
    assert text["rc"] == 0, text["stderr"]
    assert "isolation: host" in text["stdout"] and "other tasks: new ones found by sweep" in text["stdout"]
    assert f"left to the kernel: unless it isolates CPUs {iso['protected']} from boot" in text["stdout"]
    assert "never moved: pid 1 1, daemon" in text["stdout"] and "exempt 1" in text["stdout"]
    release(ns, worker)
    # every mask back as it was, read back
    assert only(ns.masks(pid=before)) == {format_cpulist(STARTED_ON)} and len(ns.masks(pid=before)) == 5
    assert set(start[before]) < set(ns.masks(pid=before)) and ns.wq()["text"] == wq_before
    assert ns.watchdog()["text"] == watchdog_before
    assert only(ns.masks(pid=grandchild)) == {format_cpulist(STARTED_ON)}
    assert only(ns.masks(pid=after)) == {format_cpulist(STARTED_ON)}
    assert ns.masks(pid=exempt) == start[exempt] and ns.masks(pid=1) == start[1]
    assert "isolation" not in ns.state()


def test_a_task_narrowed_by_its_owner_is_reported_and_never_fought_over(ns):
    ns.daemon(env={"ASCENDBIND_ISOLATION": "host"})
    inside = ns.spawn(comm="pinned_inside", threads=1)["pid"]
    later = ns.spawn(comm="narrows_later", threads=1)["pid"]
    worker = ns.spawn(comm="worker", threads=1)["pid"]
    npu1_cpu = str(NPU1_CPU)  # NPU 1's CPU: protected once the worker is bound on it
    ns.pin(pid=inside, cpus=npu1_cpu)
    bind(ns, worker)
    iso = ns.iso()
    assert iso["protected"] == npu1_cpu, iso
    # pinned inside the protected CPUs by its owner: left there, and said
    assert only(ns.masks(pid=inside)) == {npu1_cpu}
    assert iso["tasks"]["pinned_inside"] == 2 and {p["reason"] for p in iso["tasks"]["pinned"]} == {
        "task_pinned_inside"}
    # moved, then its owner puts it back on the protected CPU: the next full sweep leaves it
    moved(ns, later, npu1_cpu)
    ns.pin(pid=later, cpus=npu1_cpu)
    since = time.time()
    assert wait_for(lambda: (ns.iso()["tasks"]["swept_at"] or 0) > since, 30), "no full sweep within 30 s"
    assert only(ns.masks(pid=later)) == {npu1_cpu}
    iso = ns.iso()
    assert iso["tasks"]["left_to_owner"] == 2
    assert {e["reason"] for e in iso["left_to_owner"]} == {"changed_by_owner"}
    text = ns.metrics()["text"]
    assert metric_value(text, "ascendbind_isolation_tasks", state="left_to_owner") == 2
    assert metric_value(text, "ascendbind_isolation_tasks", state="pinned_inside") == 2
    release(ns, worker)
    assert only(ns.masks(pid=later)) == {npu1_cpu} and only(ns.masks(pid=inside)) == {npu1_cpu}
    assert "changed by its owner meanwhile" in ns.log()["log"]


def test_a_worker_narrowed_before_its_bind_is_planned_and_released_with_its_cpus_from_before(ns):
    # two workers on one NPU: the second starts while the first is bound, so the level moves it
    # off the protected CPU before it asks to be bound itself
    # with no cpuset readable a worker is planned from its threads' masks, which isolation narrowed
    ns.hide_cgroups()
    ns.daemon(env={"ASCENDBIND_ISOLATION": "host"}, config="allow_shared_npu = true\n")
    first = ns.spawn(comm="worker", threads=1)["pid"]
    bind(ns, first)
    protected = ns.iso()["protected"]
    second = ns.spawn(comm="worker", threads=2)["pid"]
    narrowed = only(moved(ns, second, protected))
    assert narrowed == {format_cpulist(STARTED_ON - parse_cpulist(protected))}
    out = ns.curl(method="POST", path="/v1/bind", body={"pid": second, "npu": 1})
    # planned from its CPUs before isolation: the NPU's CPU is among them, so the bind succeeds
    assert out["code"] == 200 and out["body"]["status"] == "bound", out
    assert any("isolation had narrowed" in w for w in out["body"]["warnings"]), out["body"]["warnings"]
    assert set(parse_cpulist(c) for c in ns.masks(pid=second).values()) <= {parse_cpulist(protected)}
    # its threads are the bind's now: isolation keeps no record of them
    tids = {f"task:{tid}:" for tid in ns.masks(pid=second)}
    assert not [k for k in ns.state()["isolation"]["masks"] if any(k.startswith(t) for t in tids)]
    # released while the first stays bound: back to every CPU it had before isolation, and then
    # moved off the protected CPU like any other task
    release(ns, second)
    assert only(moved(ns, second, protected)) == narrowed
    release(ns, first)
    assert only(ns.masks(pid=second)) == {format_cpulist(STARTED_ON)}
    assert only(ns.masks(pid=first)) == {format_cpulist(STARTED_ON)}


def test_sighup_off_stop_and_a_restart_after_kill_9_put_back_every_task_mask(ns):
    ns.daemon(env={}, config='isolation = "host"\n')  # in the file: SIGHUP reloads it
    wq = ns.wq()["text"]
    n = ns.spawn(comm="neighbour", threads=2)["pid"]
    worker = ns.spawn(comm="worker", threads=1)["pid"]
    start = ns.masks(pid=n)
    bind(ns, worker)
    protected = ns.iso()["protected"]
    narrowed = moved(ns, n, protected)
    narrowed_wq = ns.wq()["text"]
    assert narrowed != start and narrowed_wq != wq

    ns.sighup(config='isolation = "off"\n')
    assert wait_for(lambda: ns.masks(pid=n) == start and ns.wq()["text"] == wq, 15), ns.masks(pid=n)
    ns.sighup(config='isolation = "host"\n')
    assert ns.wait_off(pid=n, cpus=protected, timeout=15)["seconds"] is not None

    assert ns.stop()["rc"] == 0
    assert ns.masks(pid=n) == start and ns.wq()["text"] == wq, "stop must put every mask back"
    ns.restart()  # the worker is still bound: the level moves the neighbour again
    assert ns.wait_off(pid=n, cpus=protected, timeout=15)["seconds"] is not None
    # and then the workqueue mask: killed between the truncation and the write of this plain
    # file (sysfs has no such state), the daemon would leave it empty, an owner's value
    assert wait_for(lambda: ns.wq()["text"] == narrowed_wq, 15), ns.wq()

    ns.kill()
    assert ns.masks(pid=n) == narrowed, "a killed daemon leaves its masks"
    ns.end(pid=worker)
    ns.restart()  # nothing bound any more: the next daemon owes every mask
    assert wait_for(lambda: ns.masks(pid=n) == start and ns.wq()["text"] == wq, 15), (
        ns.masks(pid=n), start, ns.wq(), wq, ns.state(), ns.log()["log"][-3000:])
    assert "isolation" not in ns.state()


def test_off_changes_no_other_task_and_no_workqueue_mask(ns):
    ns.daemon(env={})
    wq = ns.wq()["text"]
    n = ns.spawn(comm="neighbour", threads=2)["pid"]
    worker = ns.spawn(comm="worker", threads=1)["pid"]
    start = ns.masks(pid=n)
    bind(ns, worker)
    iso = ns.iso()
    assert iso["level"] == "off" and iso["protected"], iso
    after = ns.spawn(comm="after", threads=1)["pid"]
    after_start = ns.masks(pid=after)
    # the daemon's own threads moved (every level does that): proof it followed the bind
    assert iso["daemon_threads"]["cpus"] == iso["housekeeping"]
    assert ns.masks(pid=n) == start and ns.masks(pid=after) == after_start and ns.wq()["text"] == wq
    assert iso["tasks"] is None and "isolation" not in ns.state()


# ---------------------------------------------------------------- never moved, as a table


_UID = "0b5f6a4e-8d7c-4a1b-9e2f-3c4d5e6f7a8b"
_UID_ = _UID.replace("-", "_")


def _p(pid=500, comm="job", ppid=400, kernel=False, cgroups=("/user.slice/u.scope",), start=7) -> ProcessFacts:
    return ProcessFacts(pid, start, comm, ppid, kernel, tuple(cgroups))


@pytest.mark.parametrize("facts, ancestors, why", [
    (_p(), [400], None),
    (_p(pid=1, comm="systemd", ppid=0), [], "pid 1"),
    (_p(comm="kworker/0:1", kernel=True, cgroups=()), [], "kernel"),
    (_p(pid=900), [400], "daemon"),                       # the daemon itself
    (_p(), [900, 300], "daemon"),                         # a tool it runs
    (_p(pid=800, start=5), [400], "bound"),               # the bound worker
    (_p(pid=800, start=6), [400], None),                  # its pid, reused by another process
    (_p(), [800, 400], "bound"),                          # a child of the bound worker
    (_p(cgroups=(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{_UID_}.slice/"
                 "cri-containerd-abc.scope",)), [400], "kubepods"),  # v2, systemd driver
    (_p(cgroups=("/", f"/kubepods/besteffort/pod{_UID}/c2")), [400], "kubepods"),  # v1 cpuset, cgroupfs
    # a pod-looking tree a user made below a cgroup delegated to it exempts nothing
    (_p(cgroups=(f"/user.slice/user-1234.slice/user@1234.service/app.slice/kubepods/pod{_UID}/c",)), [400], None),
    (_p(cgroups=("/kubepods/burstable",)), [400], None),  # the kubelet's tree, but no pod
    (_p(cgroups=("/system.slice/agent.service",)), [400], "exempt"),
    (_p(cgroups=("/system.slice/agent.service/sub",)), [400], "exempt"),
    (_p(cgroups=("/system.slice/agent.services",)), [400], None),  # a prefix of a name is not its cgroup
    (_p(comm="keep_me"), [400], "exempt"),
])
def test_which_tasks_the_host_level_never_moves(facts, ancestors, why):
    got = never_moved(facts, ancestors, {800: 5}, 900, ("/system.slice/agent.service",), ("keep_*",))
    assert got == why
