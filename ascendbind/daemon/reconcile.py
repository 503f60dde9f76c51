"""The reconcile loop: keep bound workers bound.

Every ``reconcile_seconds`` (a ``threading.Event.wait``, so an idle daemon
sleeps; ``stop()`` wakes it at once), for each held worker:

1. gone? (absent, zombie, or the pid now names another process) -> drop it;
   its IRQ masks are restored only for NPUs no live worker owns;
2. threads born since the last pass, or renamed into another role (a thread
   is created by a main thread and names itself ``acl_thread`` afterwards), are
   pinned by role: a late ``acl_thread`` ends on the ACL CPU;
3. threads whose mask differs from the one we set were moved by someone else:
   that is *drift*. It is re-asserted and counted with a culprit guess from a
   fixed set: ``env`` (the worker's environ asks an OpenMP/ACL runtime to bind:
   OMP_PROC_BIND, KMP_AFFINITY, CPU_AFFINITY_CONF), ``irqbalance`` (an IRQ
   mask moved while irqbalance runs), ``unknown``. A worker re-asserted
   ``REASSERT_LIMIT`` times within ``window`` seconds keeps moving itself
   back: it is reported ``culprit="self"`` and left alone (vllm-ascend binds its
   own workers unless ``enable_cpu_binding`` is false, see docs/daemon.md);
4. IRQ masks we wrote are checked the same way.
5. every ``memory_check_seconds``, the share of its memory on its pool's NUMA
   nodes is measured, and the memory step run again when it is too low
   (daemon/locality.py; in the background, rate-limited).

Cost per pass: one listdir + one comm read + one sched_getaffinity per thread,
proportional to the number of threads; nothing else is polled.
"""

from __future__ import annotations

import threading
import time

import structlog

from ..applier.affinity import bind_threads, cpus_for_role, role_of, thread_masks
from ..applier.bind import merge_npu_plans
from ..applier.identity import verify_identity
from ..applier.irq import irqbalance_pids, read_irq_mask, set_irq_affinity
from ..cpulist import parse_mask
from ..errors import ProcessGone
from ..model import Step
from .locality import MemoryLocality

__all__ = ["Reconciler", "REASSERT_LIMIT", "AFFINITY_ENV", "env_culprit"]

log = structlog.get_logger("ascendbind.reconcile")

REASSERT_LIMIT = 3
# environment variables that make a runtime inside the worker set its own affinity
AFFINITY_ENV = ("OMP_PROC_BIND", "KMP_AFFINITY", "CPU_AFFINITY_CONF", "GOMP_CPU_AFFINITY")


def env_culprit(pid: int, proc_root: str) -> bool:
    """True when the worker's environ sets one of AFFINITY_ENV (bounded read)."""
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as fh:
            raw = fh.read(1 << 20)
    except OSError:
        return False
    for item in raw.split(b"\0"):
        key, _, value = item.partition(b"=")
        if key.decode("ascii", "replace") in AFFINITY_ENV and value.strip():
            return True
    return False


def _irq_targets(binding) -> dict[int, frozenset[int]]:
    """IRQ -> the CPUs the irq step set it to (only writes that succeeded)."""
    out: dict[int, frozenset[int]] = {}
    for s in binding.steps:
        if s.step is Step.IRQ:
            for entry in s.data.get("npus", ()) or ():
                for w in entry.get("writes", ()) or ():
                    if w.get("status") == "ok":
                        out[int(w["irq"])] = frozenset(w["cpus"])
    return out


class Reconciler:
    def __init__(self, daemon, *, reassert_limit: int = REASSERT_LIMIT, window: float | None = None) -> None:
        self.daemon = daemon
        self.reassert_limit = reassert_limit
        self._window = window
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_pass = time.monotonic()
        # per worker: tid -> comm as last seen (a rename can change the role)
        self._comms: dict[int, dict[int, str]] = {}
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
        t0 = time.monotonic()
        with d.lock:
            pids = sorted(d.held)
        dirty = False
        for pid in pids:
            with d.lock:
                h = d.held.get(pid)
                if h is None:
                    continue
                try:
                    verify_identity(pid, h.binding.start_time, d.config.proc_root)
                except ProcessGone as exc:
                    d.held.pop(pid, None)
                    self._comms.pop(pid, None)
                    d._undo_gone(h, "recycled" if exc.code == "pid_recycled" else "exited")
                    dirty = True
                    continue
                if not h.left_alone:
                    dirty |= self._threads(h)
                if not h.irqs_left_alone:
                    dirty |= self._irqs(h)
        for gone in set(self._comms) - set(pids):
            self._comms.pop(gone, None)
        if dirty:
            d.save()
        self._memory_locality()
        d.metrics.reconcile_runs.inc()
        d.metrics.reconcile_duration.observe(time.monotonic() - t0)

    def _memory_locality(self) -> None:
        """Due locality checks (and at most one memory-step rerun) start in the
        background: numa_maps walks and migratepages take seconds, this pass must not."""
        self.locality.tick()

    def _threads(self, h) -> bool:
        d, b = self.daemon, h.binding
        pid, proc_root = b.pid, d.config.proc_root
        merged = merge_npu_plans(b.plan.npus)
        mode = b.plan.mode
        masks = thread_masks(pid, proc_root=proc_root)
        comms = self._comms.setdefault(pid, {})
        for tid in [t for t in h.known if t not in masks]:
            h.known.pop(tid, None)
            comms.pop(tid, None)

        new: list[int] = []
        drifted: list[int] = []
        for tid, (comm, mask) in masks.items():
            renamed = tid in comms and role_of(comms[tid]) != role_of(comm)
            comms[tid] = comm
            if tid not in h.known or renamed:
                if mask != cpus_for_role(merged, role_of(comm), mode):
                    new.append(tid)
                else:
                    h.known[tid] = mask
            elif mask != h.known[tid]:
                drifted.append(tid)

        if new:
            bind_threads(pid, merged, mode, proc_root=proc_root, only_tids=new)
            h.late_threads += len(new)
            d.metrics.late_threads.inc(len(new))
            log.info("late threads pinned", pid=pid, tids=new[:20], count=len(new))
        if drifted:
            culprit = "env" if env_culprit(pid, proc_root) else "unknown"
            if not self._may_reassert(h, culprit, f"{len(drifted)} thread masks of {pid}"):
                return True
            bind_threads(pid, merged, mode, proc_root=proc_root, only_tids=drifted)
        if new or drifted:
            after = thread_masks(pid, proc_root=proc_root)
            for tid in (*new, *drifted):
                if tid in after:
                    h.known[tid] = after[tid][1]
        return bool(drifted)

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
        culprit = "irqbalance" if irqbalance_pids(proc_root) else "unknown"
        if not self._may_reassert(h, culprit, f"IRQ masks {[irq for irq, _ in moved]}", irq=True):
            return True
        for irq, cpus in moved:
            set_irq_affinity(irq, cpus, proc_root=proc_root)
        return True

    def _may_reassert(self, h, culprit: str, what: str, *, irq: bool = False) -> bool:
        """Count one drift event; False (and the worker left alone) past the per-window limit."""
        d = self.daemon
        now = time.monotonic()
        times = h.irq_reasserts if irq else h.reasserts
        while times and now - times[0] > self.window:
            times.popleft()
        h.drift_events += 1
        if len(times) >= self.reassert_limit:
            if irq:
                # a repeat IRQ mover is irqbalance (or another tuner), not the worker
                h.irqs_left_alone, h.culprit = True, culprit
                d.metrics.drifted(culprit)
                log.warning("IRQ masks keep moving; no longer re-asserting them", pid=h.binding.pid,
                            culprit=culprit, hint="stop irqbalance or set irqbalance = \"stop\"")
                return False
            h.left_alone, h.culprit = True, "self"
            d.metrics.drifted("self")
            log.warning(
                "worker keeps moving its threads back; leaving it alone",
                pid=h.binding.pid, reasserts=len(times), window_seconds=self.window,
                hint="turn off the in-process binder (vllm-ascend: additional_config enable_cpu_binding=false)",
            )
            return False
        times.append(now)
        h.culprit = culprit
        d.metrics.drifted(culprit)
        d.metrics.reasserts.inc()
        log.info("drift re-asserted", pid=h.binding.pid, what=what, culprit=culprit)
        return True
