"""Whether bound workers get their CPUs: per role and per pool, read at scrape time.

Per held worker and role (``main``, ``acl``, ``release``; ``uvb`` for the Ascend
950 UVB poll threads where the plan has them), the threads' CPU time, run-queue
delay (time runnable but waiting for a CPU) and involuntary context switches,
from each thread's ``schedstat`` and ``status``. Per pool (the worker's main,
ACL and release CPUs), the CPU time other tasks took there and the device
interrupts that fired there other than the worker's NPUs' own.

Why at scrape time, not in the reconcile pass: the pass is the daemon's hot
loop (every few seconds, nearly always quiet on an idle host) and costs one
``sched_getaffinity`` per thread, about 1.4 us; reading a thread's
``schedstat`` and ``status`` costs some 30 us (the kernel formats ``status``
whole), twenty times that. A scrape comes every 15–60 s, a look younger than
``MIN_INTERVAL`` is reused, and a scrape reads every ACL, release and UVB thread
but only one in ``MAIN_SWEEP`` (16) of the main threads (staggered by tid, each in
turn; a thread not read yet is read at once): a main thread's counts reach the
series at most ``MAIN_SWEEP`` looks late, never lost while it lives.
``GET /v1/workers`` reads every thread.

Counters that never go backwards. A look adds, per thread, what its counters
grew since the thread's last read to the role the thread has now (a thread
renamed into the ACL role counts there from then on). A thread that exits keeps
what it had at its last read (what it ran after that is not seen); so does a
worker released. A thread first met after a worker's first look is new (born or
renamed since) and counts from its birth; the threads at the first look count
from then. A tid whose counters are lower than at its last read is another
thread, born under a tid the kernel handed out again; one that wrapped the
whole pid space between two reads and outgrew its predecessor would be taken
for it, the limit the reconcile loop's thread cache has too.

Labels stay bounded: ``npu`` is the worker's NPUs in one value (``"3"``, or
``"0,1"`` for a worker that drives two: its main threads run on both NPUs'
main CPUs, so no share of them belongs to one NPU), ``role`` one of four. A
label set outlives its worker (a counter must not vanish), so the series count
is the number of NPU sets ever bound, in practice the NPUs.

Foreign load. CPU time is ``/proc/stat``'s busy time of the pool's CPUs (user,
nice, system, irq, softirq) less the CPU time of the worker's main, ACL and
release threads, which the binding keeps on those CPUs, since the worker's
first look; the counter follows the largest difference seen (tick rounding
cannot make it go back). Interrupts are the counts of numbered IRQs on those
CPUs, less the NPU's own SQ and CQ; the timer tick and other architecture
rows fire everywhere and are left out.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ...values.cpulist import format_cpulist
from ...discovery.gather.cpuusage import LOG_DIR, cpu_busy_ns, interrupt_counts, open_task_dir, pod_names, task_tids, \
    thread_sched

__all__ = ["Contention", "ROLE_NAMES", "MIN_INTERVAL", "MAIN_SWEEP"]

ROLE_NAMES = ("main", "acl", "release", "uvb")
MIN_INTERVAL = 1.0  # seconds: a look younger than this is reused
# a scrape reads one in MAIN_SWEEP of a worker's main threads (staggered by tid), every ACL,
# release and UVB thread, and every thread it has not read yet; GET /v1/workers reads all
MAIN_SWEEP = 16
_NS = 1e-9

_FAMILIES = (
    ("ascendbind_role_cpu_seconds", "CPU time of a bound worker's threads of one role (schedstat), by NPU set"),
    ("ascendbind_role_run_delay_seconds", "Time a bound worker's threads of one role waited on a run queue, "
                                          "runnable but not running (schedstat), by NPU set"),
    ("ascendbind_role_involuntary_switches", "Involuntary context switches of a bound worker's threads of one "
                                             "role (taken off the CPU while still runnable), by NPU set"),
)
_FOREIGN_CPU = ("ascendbind_pool_foreign_cpu_seconds", "CPU time other tasks took on a bound worker's main, ACL "
                "and release CPUs (busy time of those CPUs less the worker's own threads'), by NPU set")
_FOREIGN_IRQS = ("ascendbind_pool_foreign_interrupts", "Device interrupts that fired on a bound worker's main, "
                 "ACL and release CPUs other than its NPUs' own SQ/CQ, by NPU set")
_INFO = ("ascendbind_worker_info", "1 per held worker: its pid, NPUs, pool CPUs, NUMA nodes and, in a pod, the "
         "pod's namespace, name and container (empty when not known)")
INFO_LABELS = ("pid", "npu", "pool", "numa", "namespace", "pod_name", "container_name")


class _Worker:
    """What the looks remember of one held worker."""

    __slots__ = ("threads", "roles", "own_ns", "busy0", "irqs0", "foreign_ns", "foreign_irqs", "pod")

    def __init__(self) -> None:
        self.threads: dict[int, tuple] = {}  # tid -> (start time, cpu ns, delay ns, involuntary)
        # role -> [cpu ns, delay ns, involuntary, threads seen] since bound, [3]: threads at the last look
        self.roles: dict[str, list[int]] = {}
        self.own_ns = 0  # main/acl/release CPU time since the first look
        self.busy0: int | None = None  # the pool's busy ns at the first look
        self.irqs0: int | None = None
        self.foreign_ns = 0
        self.foreign_irqs = 0
        self.pod: dict[str, str] | None = None


class _View:
    """One held worker as a look needs it, copied under the daemon's lock."""

    __slots__ = ("key", "pid", "npu", "roles", "uvb", "pool", "numa", "own_irqs")

    def __init__(self, h) -> None:
        b = h.binding
        self.key = (b.pid, b.start_time)
        self.pid = b.pid
        self.npu = ",".join(str(n) for n in sorted(b.npus))
        self.roles = {tid: seen.role for tid, seen in h.threads.items()}
        self.uvb = tuple(b.plan.uvb_tids)
        self.pool = frozenset(c for p in b.plan.npus for c in (*p.main, *p.acl, *p.release))
        self.numa = sorted({n for p in b.plan.npus for n in p.numa_nodes})
        own = {w.irq for w in b.irqs}
        for p in (b.plan.irqs or {}).values():
            own.update(i for i in (p.sq, p.cq) if i is not None)
        self.own_irqs = frozenset(own)


class Contention:
    """The contention series of one daemon (a collector on its registry) and the figures
    ``/v1/workers`` shows. ``daemon``: anything with ``held``, ``lock`` and ``config.proc_root``."""

    def __init__(self, daemon, *, log_dir: str = LOG_DIR, min_interval: float = MIN_INTERVAL) -> None:
        self.daemon = daemon
        self.log_dir = log_dir
        self.min_interval = min_interval
        self._lock = threading.Lock()
        self._workers: dict[tuple[int, int], _Worker] = {}
        self._views: list[_View] = []
        self._totals: dict[tuple[str, str], list[int]] = {}  # (npu, role) -> [cpu ns, delay ns, involuntary]
        self._foreign: dict[str, list[int]] = {}  # npu -> [cpu ns, interrupts]
        self._at = float("-inf")
        self._looks = 0

    # ------------------------------------------------------------ looking

    def refresh(self, *, force: bool = False) -> None:
        """Read every held worker's threads and pools once (unless a look is younger than
        ``min_interval``); ``force``: a look now, of every thread. Never call it holding
        the daemon's lock."""
        if not force and time.monotonic() - self._at < self.min_interval:
            return
        with self.daemon.lock:  # taken first and let go: worker_json runs under it and takes ours
            views = [_View(h) for h in self.daemon.held.values()]
        with self._lock:
            proc_root = self.daemon.config.proc_root
            for key in [k for k in self._workers if k not in {v.key for v in views}]:
                del self._workers[key]  # released: its counts stay in the totals
            pools = frozenset().union(*(v.pool for v in views)) if views else frozenset()
            busy = cpu_busy_ns(pools, proc_root) if pools else {}
            irqs = interrupt_counts(pools, proc_root) if pools else {}
            for v in views:
                w = self._workers.get(v.key)
                first = w is None
                if first:
                    w = self._workers[v.key] = _Worker()
                    w.pod = pod_names(v.pid, proc_root, self.log_dir)
                self._look(v, w, first, proc_root, force)
                self._pool(v, w, busy, irqs)
            self._views = views
            self._looks += 1
            self._at = time.monotonic()

    def _look(self, v: _View, w: _Worker, first: bool, proc_root: str, full: bool) -> None:
        fd = open_task_dir(v.pid, proc_root)
        if fd is None:
            return
        try:
            roles = v.roles
            if first:  # the cache may lag a pass behind: threads it has not met yet count as main
                roles = {tid: roles.get(tid, "main") for tid in task_tids(fd)}
            seen = self._threads(w, fd, roles, v.npu, baseline=first, full=full or first)
        finally:
            os.close(fd)
        for tid in v.uvb:
            ufd = open_task_dir(tid, proc_root)
            if ufd is not None:
                try:
                    seen += self._threads(w, ufd, {tid: "uvb"}, v.npu, baseline=first, full=True)
                finally:
                    os.close(ufd)
        live = set(seen)
        for tid in [t for t in w.threads if t not in live]:
            del w.threads[tid]  # exited, or gone from the loop's record: its counts stay
        for counts in w.roles.values():
            counts[4] = 0
        for tid in live:
            role = "uvb" if tid in v.uvb else roles.get(tid, "main")
            if role in w.roles:
                w.roles[role][4] += 1

    def _threads(self, w: _Worker, fd: int, roles: dict[int, str], npu: str, *, baseline: bool,
                 full: bool) -> list[int]:
        known = w.threads
        if full:
            todo = list(roles)
        else:  # this look's share: the role threads, one in MAIN_SWEEP main threads, and the new
            turn = self._looks % MAIN_SWEEP
            todo = [tid for tid, role in roles.items() if role != "main" or tid % MAIN_SWEEP == turn
                    or tid not in known]
        reading = set(todo)
        seen = [tid for tid in roles if tid in known and tid not in reading]  # not its turn: added at its next read
        for tid in todo:
            role = roles[tid]
            total = self._totals.setdefault((npu, role), [0, 0, 0])  # exported from the first look, at 0
            counts = w.roles.setdefault(role, [0, 0, 0, 0, 0])
            s = thread_sched(fd, tid)
            if s is None:
                if tid in known:
                    del known[tid]  # exited (or not this worker's any more): its counts stay
                continue
            seen.append(tid)
            last = known.get(tid)
            now = known[tid] = (s.cpu_ns, s.delay_ns, s.nonvoluntary)
            # a tid whose counters went back is another thread (the kernel handed the tid out
            # again): it counts from its birth
            new = last is None or now[0] < last[0] or now[1] < last[1] or now[2] < last[2]
            if new:
                counts[3] += 1
            if baseline:
                continue
            if new:
                last = (0, 0, 0)  # a thread born (or renamed in) since the first look
            for i in range(3):
                total[i] += now[i] - last[i]
                counts[i] += now[i] - last[i]
            if role != "uvb":
                w.own_ns += now[0] - last[0]
        return seen

    def _pool(self, v: _View, w: _Worker, busy: dict[int, int] | None, irqs: dict[int, int] | None) -> None:
        foreign = self._foreign.setdefault(v.npu, [0, 0])
        if busy and all(c in busy for c in v.pool):
            now = sum(busy[c] for c in v.pool)
            if w.busy0 is None:
                w.busy0 = now
            seen = now - w.busy0 - w.own_ns
            if seen > w.foreign_ns:
                foreign[0] += seen - w.foreign_ns
                w.foreign_ns = seen
        if irqs is not None:
            now = sum(n for irq, n in irqs.items() if irq not in v.own_irqs)
            if w.irqs0 is None:
                w.irqs0 = now
            seen = now - w.irqs0
            if seen > w.foreign_irqs:
                foreign[1] += seen - w.foreign_irqs
                w.foreign_irqs = seen

    # ------------------------------------------------------------ answers

    def worker_json(self, pid: int, start_time: int) -> dict | None:
        """One worker's figures since it was bound, from the last look (None: not looked at yet)."""
        with self._lock:
            w = self._workers.get((pid, start_time))
            if w is None:
                return None
            return {
                "roles": {role: {"cpu_seconds": round(c[0] * _NS, 6), "run_delay_seconds": round(c[1] * _NS, 6),
                                 "involuntary_switches": c[2], "threads_seen": c[3], "threads": c[4]}
                          for role, c in sorted(w.roles.items(), key=lambda kv: ROLE_NAMES.index(kv[0]))},
                "foreign": {"cpu_seconds": round(w.foreign_ns * _NS, 6), "interrupts": w.foreign_irqs},
                "pod": w.pod,
            }

    def describe(self) -> Iterable:
        yield from self._families()
        yield CounterMetricFamily(*_FOREIGN_CPU, labels=["npu"])
        yield CounterMetricFamily(*_FOREIGN_IRQS, labels=["npu"])
        yield GaugeMetricFamily(*_INFO, labels=list(INFO_LABELS))

    def _families(self):
        return [CounterMetricFamily(name, text, labels=["npu", "role"]) for name, text in _FAMILIES]

    def collect(self) -> Iterable:
        self.refresh()
        with self.daemon.lock:  # a look reused from before a release must not show its worker
            held = {(h.binding.pid, h.binding.start_time) for h in self.daemon.held.values()}
        with self._lock:
            fams = self._families()
            for (npu, role), values in sorted(self._totals.items()):
                fams[0].add_metric([npu, role], values[0] * _NS)
                fams[1].add_metric([npu, role], values[1] * _NS)
                fams[2].add_metric([npu, role], values[2])
            cpu = CounterMetricFamily(*_FOREIGN_CPU, labels=["npu"])
            irq = CounterMetricFamily(*_FOREIGN_IRQS, labels=["npu"])
            for npu, (ns, n) in sorted(self._foreign.items()):
                cpu.add_metric([npu], ns * _NS)
                irq.add_metric([npu], n)
            info = GaugeMetricFamily(*_INFO, labels=list(INFO_LABELS))
            for v in self._views:
                if v.key not in held:
                    continue
                w = self._workers.get(v.key)
                pod = (w.pod if w is not None else None) or {}
                info.add_metric([str(v.pid), v.npu, format_cpulist(v.pool), ",".join(map(str, v.numa)),
                                 pod.get("namespace", ""), pod.get("pod_name", ""), pod.get("container_name", "")], 1)
        yield from fams
        yield cpu
        yield irq
        yield info
