"""The reconcile loop: keep bound workers bound.

Every ``reconcile_seconds`` (a ``threading.Event.wait``, so an idle daemon
sleeps; ``stop()`` wakes it at once), for each held worker:

1. gone? (absent, zombie, or the pid now names another process) -> drop it;
   its IRQ masks are restored only for NPUs no live worker owns;
2. one look at its threads (observe.py): threads born since the last look, or
   renamed into another role, are pinned by role (a late ``acl_thread`` ends on
   the ACL CPU);
3. threads whose mask differs from the one we set were moved by someone else:
   that is *drift*. It is re-asserted and counted with a culprit from a fixed
   set, decided on evidence (blame.py): ``self`` (the worker's own binder:
   torch_npu's CPU_AFFINITY_CONF, vllm-ascend's enable_cpu_binding), ``env``
   (OpenMP binding variables), ``external`` (anything else: taskset, another
   tuner). Whatever the culprit, a worker re-asserted ``REASSERT_LIMIT`` times
   within ``window`` seconds is left alone, and its status says why;
4. IRQ masks we wrote are checked the same way (``irqbalance`` / ``external``).
5. every ``memory_check_seconds``, the share of its memory on its pool's NUMA
   nodes is measured, and the memory step run again when it is too low
   (daemon/locality.py; in the background, rate-limited).

Cost per pass: one task listing per worker and one sched_getaffinity per thread;
``comm`` only for the few threads whose name can have changed (observe.py).
The pass's CPU time is measured on its own thread (``time.thread_time``), so
the metric stays honest when the host is busy and the pass is preempted.
"""

from __future__ import annotations

import os
import threading
import time

import structlog

from ..applier.affinity import bind_threads
from ..applier.bind import merge_npu_plans
from ..applier.identity import verify_identity
from ..applier.irq import irqbalance_pids, read_irq_mask, set_irq_affinity
from ..cpulist import parse_mask
from ..errors import ProcessGone
from .blame import Blame, blame_irqs, blame_threads, left_alone_sentence
from .evidence import read_evidence
from .held import SeenThread, accepted
from .observe import observe_threads, role_cpus
from .locality import MemoryLocality

__all__ = ["Reconciler", "REASSERT_LIMIT"]

log = structlog.get_logger("ascendbind.reconcile")

REASSERT_LIMIT = 3


def _irq_targets(binding) -> dict[int, frozenset[int]]:
    """IRQ -> the CPUs the irq step set it to (only writes that succeeded)."""
    return {w.irq: w.cpus for w in binding.irqs if w.pinned}


class Reconciler:
    def __init__(self, daemon, *, reassert_limit: int = REASSERT_LIMIT, window: float | None = None) -> None:
        self.daemon = daemon
        self.reassert_limit = reassert_limit
        self._window = window
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_pass = time.monotonic()
        self.passes = 0  # staggers the comm sweep (observe.comm_due)
        self.locality = MemoryLocality(daemon)

    @property
    def interval(self) -> float:
        return max(0.2, float(self.daemon.config.reconcile_seconds))

    @property
    def window(self) -> float:
        return self._window if self._window is not None else max(60.0, 10 * self.interval)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="reconcile", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and \
            time.monotonic() - self.last_pass < 3 * self.interval + 30

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.pass_once()
            except Exception:  # a bug in one pass must not end reconciling for good
                log.exception("reconcile pass crashed")
            self.last_pass = time.monotonic()

    # ------------------------------------------------------------ one pass

    def pass_once(self) -> None:
        d = self.daemon
        t0, c0 = time.monotonic(), time.thread_time()
        self.passes += 1
        with d.lock:
            pids = sorted(d.held)
        dirty = False
        for pid in pids:
            with d.lock:
                h = d.held.get(pid)
                if h is not None:
                    dirty |= self._reconcile_worker(h)
        if dirty:
            d.save()
        self._memory_locality()
        d.metrics.reconcile_runs.inc()
        d.metrics.reconcile_duration.observe(time.monotonic() - t0)
        d.metrics.reconcile_cpu.observe(time.thread_time() - c0)

    def _reconcile_worker(self, h) -> bool:
        """One held worker (under the daemon lock); True when the state file must be written."""
        if self._drop_if_gone(h):
            return True
        dirty = False
        if not h.left_alone:
            dirty |= self._threads(h)
        if not h.irqs_left_alone:
            dirty |= self._irqs(h)
        return dirty

    def _drop_if_gone(self, h) -> bool:
        d, pid = self.daemon, h.binding.pid
        try:
            verify_identity(pid, h.binding.start_time, d.config.proc_root)
        except ProcessGone as exc:
            d.held.pop(pid, None)
            d._undo_gone(h, "recycled" if exc.code == "pid_recycled" else "exited")
            return True
        return False

    def _memory_locality(self) -> None:
        """Due locality checks (and at most one memory-step rerun) start in the
        background: numa_maps walks and migratepages take seconds, this pass must not."""
        self.locality.tick()

    # ------------------------------------------------------------ threads

    def _threads(self, h) -> bool:
        b = h.binding
        cpus = role_cpus(b.plan)
        seen = observe_threads(b.pid, h.threads, cpus, self.passes, proc_root=self.daemon.config.proc_root)
        if seen is None:
            return False  # the task list vanished: the next pass drops the worker
        to_pin, drifted = seen
        if to_pin:
            self._pin_late(h, to_pin, cpus)
        return self._drifted(h, drifted, cpus) if drifted else False

    def _pin_late(self, h, to_pin: list[tuple[int, str]], cpus) -> None:
        d, b = self.daemon, h.binding
        tids = [tid for tid, _ in to_pin]
        bind_threads(b.pid, merge_npu_plans(b.plan.npus), b.plan.mode, proc_root=d.config.proc_root, only_tids=tids)
        self._remember(h, to_pin, cpus)
        h.late_threads += len(tids)
        d.metrics.late_threads.inc(len(tids))
        log.info("late threads pinned", pid=b.pid, tids=tids[:20], count=len(tids))

    def _drifted(self, h, drifted: list[int], cpus) -> bool:
        d, b = self.daemon, h.binding
        blame = blame_threads(read_evidence(b.pid, d.config.proc_root))
        h.culprit, h.blame = blame.culprit, blame.why
        if not self._may_reassert(h, blame, f"{len(drifted)} thread masks of {b.pid}"):
            return True
        bind_threads(b.pid, merge_npu_plans(b.plan.npus), b.plan.mode, proc_root=d.config.proc_root,
                     only_tids=drifted)
        self._remember(h, [(tid, h.threads[tid].role) for tid in drifted if tid in h.threads], cpus)
        return True

    def _remember(self, h, tids: list[tuple[int, str]], cpus) -> None:
        """Record the masks the kernel kept after we set them (read back: a cpuset may narrow them)."""
        for tid, role in tids:
            try:
                mask = accepted(os.sched_getaffinity(tid), cpus[role])
            except OSError:
                h.threads.pop(tid, None)  # exited meanwhile
                continue
            # the role we pinned for: if the thread renamed itself meanwhile, its next
            # (young) look sees a role that differs and moves it again
            prev = h.threads.get(tid)
            if prev is not None:
                prev.mask, prev.role = mask, role
            else:
                h.threads[tid] = SeenThread(mask, role)

    # ------------------------------------------------------------ IRQs

    def _irqs(self, h) -> bool:
        proc_root = self.daemon.config.proc_root
        moved = []
        for irq, cpus in _irq_targets(h.binding).items():
            text = read_irq_mask(irq, proc_root=proc_root)
            try:
                if text is not None and parse_mask(text) != cpus:
                    moved.append((irq, cpus))
            except ValueError:
                continue
        if not moved:
            return False
        blame = blame_irqs(bool(irqbalance_pids(proc_root)))
        h.irq_culprit = blame.culprit
        if not self._may_reassert(h, blame, f"IRQ masks {[irq for irq, _ in moved]}", irq=True):
            return True
        for irq, cpus in moved:
            set_irq_affinity(irq, cpus, proc_root=proc_root)
        return True

    # ------------------------------------------------------------ the limit

    def _may_reassert(self, h, blame: Blame, what: str, *, irq: bool = False) -> bool:
        """Count one drift event; False (and the threads or IRQs left alone) past the per-window limit."""
        d = self.daemon
        now = time.monotonic()
        times = h.irq_reasserts if irq else h.reasserts
        while times and now - times[0] > self.window:
            times.popleft()
        h.drift_events += 1
        d.metrics.drifted(blame.culprit)
        if len(times) >= self.reassert_limit:
            why = left_alone_sentence("IRQ masks" if irq else "thread masks", blame, len(times), self.window)
            if irq:
                h.irqs_left_alone, h.irqs_left_alone_why = True, why
            else:
                h.left_alone, h.left_alone_why = True, why
            log.warning("masks keep moving; no longer re-asserting them", pid=h.binding.pid, what=what,
                        culprit=blame.culprit, reasserts=len(times), window_seconds=self.window, why=why)
            return False
        times.append(now)
        d.metrics.reasserts.inc()
        log.info("drift re-asserted", pid=h.binding.pid, what=what, culprit=blame.culprit)
        return True
