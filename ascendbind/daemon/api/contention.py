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
worker released, for as long as its series last (below). A thread first met after a worker's first look is new (born or
renamed since) and counts from its birth; the threads at the first look count
from then. A tid whose counters are lower than at its last read is another
thread, born under a tid the kernel handed out again; one that wrapped the
whole pid space between two reads and outgrew its predecessor would be taken
for it, the limit the reconcile loop's thread cache has too.

Labels stay bounded by the host: ``npu`` is one NPU id and ``role`` one of four,
so each family has at most 4 series per NPU (``pool_foreign_*``: one), however many
workers come and go and whatever NPU sets they ask for. A worker driving one NPU
adds everything to it. A worker driving several runs each role on the union of
its NPUs' role CPUs (applier/bind.py), so which NPU a thread serves is unknown;
what it ran since its last read is added to the NPU whose CPUs of that role hold
the CPU the thread is on at the read (its ``stat``, read only for such a worker),
else the NPU whose pool holds it, else the worker's lowest NPU: over many reads a
thread's time lands where it ran. UVB poll threads run on the UVB pool, which is
no NPU's: they count to the worker's lowest NPU. A series is exported from the
first look of the first worker that feeds it (at 0) and leaves with the last
one: when no held worker drives that NPU any more (with that role), its counters
go, and come back from 0 with the next (a new series to Prometheus, whose
``rate()`` reads the gap as none). A counter never goes back while it is there.

Foreign load. CPU time is ``/proc/stat``'s busy time of the pool's CPUs (user,
nice, system, irq, softirq) less the CPU time of the worker's main, ACL and
release threads, which the binding keeps on those CPUs, since the worker's
first look; per NPU of the worker, its pool's CPUs less its threads' time counted to
that NPU. The counter follows the largest difference seen (tick rounding, or for
a worker of several NPUs a thread's time counted to the other NPU, cannot make it
go back). Interrupts are the counts of numbered IRQs on those
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
    thread_cpu, thread_sched

__all__ = ["Contention", "ROLE_NAMES", "MIN_INTERVAL", "MAIN_SWEEP"]

ROLE_NAMES = ("main", "acl", "release", "uvb")
MIN_INTERVAL = 1.0  # seconds: a look younger than this is reused
# a scrape reads one in MAIN_SWEEP of a worker's main threads (staggered by tid), every ACL,
# release and UVB thread, and every thread it has not read yet; GET /v1/workers reads all
MAIN_SWEEP = 16
_NS = 1e-9

_FAMILIES = (
    ("ascendbind_role_cpu_seconds", "CPU time of the bound workers' threads of one role on one NPU (schedstat)"),
    ("ascendbind_role_run_delay_seconds", "Time the bound workers' threads of one role on one NPU waited on a run "
                                          "queue, runnable but not running (schedstat)"),
    ("ascendbind_role_involuntary_switches", "Involuntary context switches of the bound workers' threads of one "
                                             "role on one NPU (taken off the CPU while still runnable)"),
)
_FOREIGN_CPU = ("ascendbind_pool_foreign_cpu_seconds", "CPU time other tasks took on the main, ACL and release "
                "CPUs of one NPU's bound workers (busy time of those CPUs less the workers' own threads')")
_FOREIGN_IRQS = ("ascendbind_pool_foreign_interrupts", "Device interrupts that fired on the main, ACL and release "
                 "CPUs of one NPU's bound workers other than their NPUs' own SQ/CQ")
_INFO = ("ascendbind_worker_info", "1 per held worker and NPU it drives: its pid, the NPU, that NPU's pool CPUs and "
         "NUMA nodes and, in a pod the kubelet made, the pod's namespace, name and container (empty when not known)")
INFO_LABELS = ("pid", "npu", "pool", "numa", "namespace", "pod_name", "container_name")


def _role_order(role: str) -> tuple[int, str]:
    """The roles first, in ROLE_NAMES order, then the thread classes (config-defined names) by name."""
    return (ROLE_NAMES.index(role), "") if role in ROLE_NAMES else (len(ROLE_NAMES), role)


class _Worker:
    """What the looks remember of one held worker."""

    __slots__ = ("threads", "roles", "fed", "own_ns", "busy0", "irqs0", "foreign_ns", "foreign_irqs", "pod")

    def __init__(self) -> None:
        self.threads: dict[int, tuple] = {}  # tid -> (cpu ns, delay ns, involuntary) at its last read
        # role -> [cpu ns, delay ns, involuntary, threads seen] since bound, [4]: threads at the last look
        self.roles: dict[str, list[int]] = {}
        self.fed: set = set()  # the series keys it feeds: (npu, role) and npu (foreign)
        # per NPU: its threads' time counted there since the first look, the pool's busy ns and
        # IRQ count at the first look, and the foreign figures counted so far
        self.own_ns: dict[int, int] = {}
        self.busy0: dict[int, int] = {}
        self.irqs0: dict[int, int] = {}
        self.foreign_ns: dict[int, int] = {}
        self.foreign_irqs: dict[int, int] = {}
        self.pod: dict[str, str] | None = None


class _View:
    """One held worker as a look needs it, copied under the daemon's lock."""

    __slots__ = ("key", "pid", "npus", "roles", "uvb", "role_cpus", "pools", "numa", "own_irqs")

    def __init__(self, h) -> None:
        b = h.binding
        self.key = (b.pid, b.start_time)
        self.pid = b.pid
        plans = sorted(b.plan.npus, key=lambda p: p.npu)
        self.npus = tuple(p.npu for p in plans)
        self.roles = {tid: seen.role for tid, seen in h.threads.items()}
        self.uvb = tuple(b.plan.uvb_tids)
        # per NPU and role, the CPUs the plan gives it: where a thread of a worker of several
        # NPUs is found says which NPU its time counts to
        self.role_cpus = {p.npu: {"main": frozenset(p.main), "acl": frozenset(p.acl),
                                  "release": frozenset(p.release),
                                  **{name: frozenset(cpus) for name, cpus in p.classes}} for p in plans}
        self.pools = {p.npu: frozenset((*p.main, *p.acl, *p.release)) for p in plans}
        self.numa = {p.npu: sorted(p.numa_nodes) for p in plans}
        own = {w.irq for w in b.irqs}
        for p in (b.plan.irqs or {}).values():
            own.update(i for i in (p.sq, p.cq) if i is not None)
        self.own_irqs = frozenset(own)

    def npu_of(self, role: str, cpu: int | None) -> int:
        """The NPU a thread of ``role`` found on ``cpu`` counts to (module docstring)."""
        if cpu is not None and role != "uvb":
            for n in self.npus:
                if cpu in self.role_cpus[n].get(role, ()):
                    return n
            for n in self.npus:
                if cpu in self.pools[n]:
                    return n
        return self.npus[0]


class Contention:
    """The contention series of one daemon (a collector on its registry) and the figures
    ``/v1/workers`` shows. ``daemon``: anything with a ``reader`` of the held table and ``config.proc_root``."""

    def __init__(self, daemon, *, log_dir: str = LOG_DIR, min_interval: float = MIN_INTERVAL) -> None:
        self.daemon = daemon
        self.log_dir = log_dir
        self.min_interval = min_interval
        self._lock = threading.Lock()
        self._workers: dict[tuple[int, int], _Worker] = {}
        self._views: list[_View] = []
        # (npu, role) -> [cpu ns, delay ns, involuntary]; npu -> [foreign cpu ns, interrupts]
        self._totals: dict[tuple[int, str], list[int]] = {}
        self._foreign: dict[int, list[int]] = {}
        self._feeders: dict = {}  # a series key -> the held workers feeding it
        self._at = float("-inf")
        self._looks = 0

    # ------------------------------------------------------------ series

    def _feed(self, key, worker: tuple[int, int], w: _Worker, table: dict, width: int) -> None:
        """``worker`` feeds series ``key`` of ``table`` from now on (made at 0 if new)."""
        table.setdefault(key, [0] * width)
        self._feeders.setdefault(key, set()).add(worker)
        w.fed.add(key)

    def _forget(self, worker: tuple[int, int]) -> None:
        """A worker released: its counts stay in its series while another worker feeds them;
        a series it fed last leaves with it."""
        w = self._workers.pop(worker)
        for key in w.fed:
            feeders = self._feeders.get(key)
            if feeders is None:
                continue
            feeders.discard(worker)
            if not feeders:
                del self._feeders[key]
                (self._totals if isinstance(key, tuple) else self._foreign).pop(key, None)

    # ------------------------------------------------------------ looking

    def refresh(self, *, force: bool = False) -> None:
        """Read every held worker's threads and pools once (unless a look is younger than
        ``min_interval``); ``force``: a look now, of every thread. Never call it holding
        the daemon's lock."""
        if not force and time.monotonic() - self._at < self.min_interval:
            return
        # copied under the daemon's lock and let go: worker_json runs under it and takes ours
        views = self.daemon.reader.read(lambda held: [_View(h) for h in held.values() if h.binding.plan.npus])
        with self._lock:
            proc_root = self.daemon.config.proc_root
            live = {v.key for v in views}
            for key in [k for k in self._workers if k not in live]:
                self._forget(key)
            pools = {p: p for v in views for p in v.pools.values()}  # each distinct pool once
            every = frozenset().union(*pools)
            busy = cpu_busy_ns(every, proc_root) if every else {}
            irqs = interrupt_counts(pools, proc_root) if every else {}
            for v in views:
                w = self._workers.get(v.key)
                first = w is None
                if first:
                    w = self._workers[v.key] = _Worker()
                    w.pod = pod_names(v.pid, proc_root, self.log_dir)
                self._look(v, w, first, proc_root, force)
                for n in v.npus:
                    self._pool(v, w, n, busy, irqs)
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
            seen = self._threads(v, w, fd, roles, baseline=first, full=full or first)
        finally:
            os.close(fd)
        for tid in v.uvb:
            ufd = open_task_dir(tid, proc_root)
            if ufd is not None:
                try:
                    seen += self._threads(v, w, ufd, {tid: "uvb"}, baseline=first, full=True)
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

    def _threads(self, v: _View, w: _Worker, fd: int, roles: dict[int, str], *, baseline: bool,
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
        several = len(v.npus) > 1
        for tid in todo:
            role = roles[tid]
            counts = w.roles.get(role)
            if counts is None:  # the role's series are exported from its first thread, at 0
                counts = w.roles[role] = [0, 0, 0, 0, 0]
                for n in v.npus:
                    self._feed((n, role), v.key, w, self._totals, 3)
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
            npu = v.npu_of(role, thread_cpu(fd, tid)) if several and role != "uvb" else v.npus[0]
            total = self._totals[(npu, role)]
            for i in range(3):
                total[i] += now[i] - last[i]
                counts[i] += now[i] - last[i]
            if role != "uvb":
                w.own_ns[npu] = w.own_ns.get(npu, 0) + now[0] - last[0]
        return seen

    def _pool(self, v: _View, w: _Worker, npu: int, busy: dict[int, int] | None,
              irqs: dict[frozenset, dict[int, int]] | None) -> None:
        if npu not in w.fed:
            self._feed(npu, v.key, w, self._foreign, 2)
        foreign = self._foreign[npu]
        pool = v.pools[npu]
        if busy and all(c in busy for c in pool):
            now = sum(busy[c] for c in pool)
            base = w.busy0.setdefault(npu, now)
            seen = now - base - w.own_ns.get(npu, 0)
            if seen > w.foreign_ns.get(npu, 0):
                foreign[0] += seen - w.foreign_ns.get(npu, 0)
                w.foreign_ns[npu] = seen
        if irqs is not None and pool in irqs:
            now = sum(n for irq, n in irqs[pool].items() if irq not in v.own_irqs)
            base = w.irqs0.setdefault(npu, now)
            seen = now - base
            if seen > w.foreign_irqs.get(npu, 0):
                foreign[1] += seen - w.foreign_irqs.get(npu, 0)
                w.foreign_irqs[npu] = seen

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
                          for role, c in sorted(w.roles.items(), key=lambda kv: _role_order(kv[0]))},
                "foreign": {"cpu_seconds": round(sum(w.foreign_ns.values()) * _NS, 6),
                            "interrupts": sum(w.foreign_irqs.values())},
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
        # a look reused from before a release must not show its worker
        held = {(h.binding.pid, h.binding.start_time) for h in self.daemon.reader.records().values()}
        with self._lock:
            for key in [k for k in self._workers if k not in held]:
                self._forget(key)  # its series leave now, not at the next look
            fams = self._families()
            for (npu, role), values in sorted(self._totals.items()):
                fams[0].add_metric([str(npu), role], values[0] * _NS)
                fams[1].add_metric([str(npu), role], values[1] * _NS)
                fams[2].add_metric([str(npu), role], values[2])
            cpu = CounterMetricFamily(*_FOREIGN_CPU, labels=["npu"])
            irq = CounterMetricFamily(*_FOREIGN_IRQS, labels=["npu"])
            for npu, (ns, n) in sorted(self._foreign.items()):
                cpu.add_metric([str(npu)], ns * _NS)
                irq.add_metric([str(npu)], n)
            info = GaugeMetricFamily(*_INFO, labels=list(INFO_LABELS))
            for v in self._views:
                if v.key not in held:
                    continue
                w = self._workers.get(v.key)
                pod = (w.pod if w is not None else None) or {}
                names = [pod.get("namespace", ""), pod.get("pod_name", ""), pod.get("container_name", "")]
                for n in v.npus:  # one per NPU: ``npu`` is one NPU id, to join the per-NPU series on
                    info.add_metric([str(v.pid), str(n), format_cpulist(v.pools[n]), ",".join(map(str, v.numa[n])),
                                     *names], 1)
        yield from fams
        yield cpu
        yield irq
        yield info
