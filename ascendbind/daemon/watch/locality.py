"""Memory locality: how much of a bound worker's private memory is on its pool's
NUMA nodes, and the memory step run again when too little is.

Binding moves the threads; the memory step moves the private pages the worker
had then (applier/memory.py); later allocations follow first touch on the new
CPUs. What still drifts away: memory a worker allocated before it was bound and
touched again from elsewhere, allocations that fell back to a remote node when
the local one was full. So every ``memory_check_seconds`` the reconcile pass has
each bound worker's ``/proc/<pid>/numa_maps`` read (through the daemon's
HostSource) and the share of its *private* resident memory, in bytes, on the
NUMA nodes of its pool(s) computed: ``memory_local_ratio`` in ``status``,
``ascendbind_memory_local_ratio{npu}`` in the metrics. Shared memory (page
cache, ``/dev/shm`` and other shared mappings) is reported beside it in
``status`` (``memory_kib_by_node``), never counted in the ratio: it is never
moved, so it could only make a rerun look due that would change nothing. A
worker with no private memory resident has no ratio (no sample): 1.0 would claim
a locality nobody measured, 0 would trigger a pointless move.

When the ratio is below ``memory_local_threshold`` the memory step runs again,
rate-limited (lifecycle.memory_rerun_due): never while a move of the worker is
queued or running, at least ``memory_rerun_seconds`` after the last move began
(the bind's own counts), that interval doubled for every rerun in a row that was
futile (lifecycle.rerun_was_futile: pages pinned for DMA by the NPU driver cannot
move, and walking 100 GiB again every few minutes to find that out buys
nothing), up to ``RERUN_BACKOFF_CAP`` times.

Cost: the kernel walks the page tables of every mapping to print numa_maps, so
it never runs on the reconcile thread (whose progress feeds the systemd
watchdog): ``tick`` starts one background round at a time over the workers
whose check is due, and a round asks for at most one rerun, for the worst
worker. The rerun itself is a job for the daemon's mover (memmove.py): the round
does not wait for it. Nothing is read or moved under the daemon's lock.

The series is labelled by NPU only (bounded by the host, no pid): a worker
driving several NPUs gives each of them its ratio; two workers sharing an NPU
(``allow_shared_npu``) give it the lower of theirs, the one an alert should see.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from ...applier.memory import memory_target
from ...discovery.parse.numa_maps import local_ratio
from ...discovery.gather.worker import NUMA_MAPS_LIMIT, read_numa_residency
from ...errors import AscendbindError, DiscoveryError, ParseError, ProcessGone
from ...values.model import Binding, StepResult
from .lifecycle import Limits, Observation, RerunMemory, decide, memory_rerun_due, rerun_was_futile
from ..runtime.threadname import name_os_thread

__all__ = ["MemoryLocality", "ratios_by_npu", "pool_nodes"]

log = structlog.get_logger("ascendbind.locality")


def pool_nodes(binding: Binding) -> frozenset[int]:
    """The NUMA nodes of every pool the worker is bound to: where its threads run."""
    return frozenset(n for p in binding.plan.npus for n in p.numa_nodes)


def ratios_by_npu(helds: Iterable[Any]) -> dict[int, float]:
    """NPU -> the lowest measured ratio among the workers bound to it."""
    out: dict[int, float] = {}
    for h in helds:
        ratio = h.memory_local_ratio
        if ratio is None:
            continue
        for npu in h.binding.npus:
            out[npu] = min(ratio, out.get(npu, ratio))
    return out


def _check_due(h, now: float, interval: float) -> bool:
    """Whether held worker ``h`` is due a locality check at ``now``."""
    return h.memory_checked_at is None or now - h.memory_checked_at >= interval


class MemoryLocality:
    """The check and the rerun for one daemon (``daemon.reader``, ``daemon.looking_at``,
    ``daemon.hosts.source``, ``daemon.metrics``, ``daemon.config``)."""

    def __init__(self, daemon, *, numa_maps_limit: int = NUMA_MAPS_LIMIT) -> None:
        self.daemon = daemon
        self.numa_maps_limit = numa_maps_limit
        # one long-lived thread runs the rounds: it sleeps on the condition (no timeout)
        # between them, costs no thread start a minute, and shows up under its own name
        # in ``top -H`` and in the idle benchmark's per-thread split
        self._cond = threading.Condition()
        self._queued: list | None = None
        self._running = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def busy(self) -> bool:
        with self._cond:
            return self._queued is not None or self._running

    def tick(self, now: float | None = None, held: Mapping[int, Any] | None = None) -> bool:
        """From the reconcile pass: start a background round over the workers whose
        check is due, unless one still runs. True when a round was started. ``held``:
        the pass's copy of the held table, to tell without the lock that none is due
        (the usual answer: a worker is due once every few minutes)."""
        interval = self.daemon.config.memory_check_seconds
        if interval <= 0:
            self._forget()
            return False
        now = time.monotonic() if now is None else now
        if held is not None and not any(_check_due(h, now, interval) for h in held.values()):
            return False
        if self.busy():
            return False
        due = self.due(now)
        if not due:
            return False
        with self._cond:
            if self._closed:
                return False
            self._queued = due
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="memory-locality", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def close(self) -> None:
        """End the round thread (a round already running completes first)."""
        with self._cond:
            self._closed = True
            self._queued = None
            self._cond.notify_all()

    def _serve(self) -> None:
        name_os_thread()
        while True:
            with self._cond:
                while self._queued is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                due, self._queued = self._queued, None
                self._running = True
            try:
                self.run_round(due)
            except Exception:  # a bug here must not take the daemon down; the next tick tries again
                log.exception("memory locality round crashed")
            finally:
                with self._cond:
                    self._running = False

    def due(self, now: float) -> list:
        interval = self.daemon.config.memory_check_seconds
        return [h for _, h in sorted(self.daemon.reader.records().items()) if _check_due(h, now, interval)]

    def run_round(self, due: list, now: float | None = None):
        """Measure each of ``due``, then ask the mover for a rerun of the worst one that
        is due one. Returns that move job, or None when none was asked for."""
        measured = []
        for h in due:
            ratio = self.measure(h, time.monotonic() if now is None else now)
            if ratio is not None:
                measured.append((ratio, h.binding.pid, h))
        for _ratio, _pid, h in sorted(measured, key=lambda m: m[:2]):
            job = self.rerun_if_due(h, time.monotonic() if now is None else now)
            if job is not None:
                return job
        return None

    def measure(self, h, now: float) -> float | None:
        """Read the worker's numa_maps; record (and export) its ratio. None when
        there is none: unreadable, malformed, no private memory resident, or no
        longer held."""
        d, b = self.daemon, h.binding
        ratio: float | None = None
        residency = None
        try:
            residency = read_numa_residency(d.hosts.source, b.pid, start_time=b.start_time,
                                            limit=self.numa_maps_limit)
            if h.pin is not None and h.pin.exited():  # a newcomer's map, whatever its start time says
                raise ProcessGone(f"process {b.pid} has exited")
        except ProcessGone:
            result = "unreadable"  # the reconcile pass drops the worker
        except ParseError as exc:
            result = "malformed"
            log.warning("numa_maps does not parse; locality unknown", pid=b.pid, error=str(exc))
        except DiscoveryError as exc:
            result = "too_large" if exc.code == "too_large" else "unreadable"
            log.info("numa_maps not read; locality unknown", pid=b.pid, error=str(exc))
        else:
            ratio = local_ratio(residency.private_kib, pool_nodes(b))
            result = "measured" if ratio is not None else "no_pages"
        d.metrics.memory_check(result)
        with d.looking_at(h) as current:
            if not current:
                return None
            obs = Observation(memory_measured=True, memory_ratio=ratio, memory_residency=residency)
            actions = decide(h.record(), obs, now, self._limits())
            d.act(h, [a for a in actions if not isinstance(a, RerunMemory)])  # reruns: one per round, worst first
        return ratio

    def _limits(self) -> Limits:
        cfg = self.daemon.config
        return Limits(memory_local_threshold=cfg.memory_local_threshold,
                      memory_rerun_seconds=cfg.memory_rerun_seconds)

    def rerun_if_due(self, h, now: float):
        """Ask the mover to move ``h``'s pages again when ``memory_rerun_due`` says so;
        the move job, or None."""
        d, b = self.daemon, h.binding
        limits = self._limits()

        def due(record) -> bool:
            return memory_rerun_due(record.memory_ratio, limits.memory_local_threshold, record.memory_last_run,
                                    now, limits.memory_rerun_seconds, record.memory_futile,
                                    moving=record.memory_moving)

        try:
            target = memory_target(b.plan, d.hosts.get())
        except AscendbindError as exc:
            log.info("memory step not run again", pid=b.pid, error=str(exc))
            return None
        if isinstance(target, StepResult):
            return None  # one node, or no NUMA facts: nowhere to move to
        return d.rerun_memory(h, target, now, due)

    def futile(self, ratio_before: float | None, ratio_after: float | None) -> bool:
        return rerun_was_futile(ratio_before, ratio_after, self._limits())

    def _forget(self) -> None:
        """The check is switched off (memory_check_seconds = 0): no stale ratios."""
        self.daemon.forget_locality()
