"""A bind that names its NPU, or that nothing proves, checked against npu-smi's process
table after the answer.

A request that names its NPU is bound without running npu-smi (a process-table
run costs tens to hundreds of milliseconds, and seconds on a busy driver): the
worker's container device set and its ``ASCEND_*`` variables still check the
name, but on a bare host they say nothing, and a worker npu-smi lists on NPU 1
could be bound to NPU 0's CPUs. So once such a bind is answered, one thread
reads the table (the same shared, cached run a bind without an NPU uses) and
runs the same target rule (planner/npus/targets.py) with it. The verdict is
recorded on the held worker (``npu_check`` in ``/v1/workers``), counted in
``ascendbind_npu_checks_total{verdict}`` and logged when it is not
``confirmed``:

* ``confirmed``: the table lists the worker on the NPU it is bound to; an
  unproven binding (proof.py) becomes proven by it: isolation starts for it, and
  it holds its NPU from then on;
* ``unlisted``: the table does not list the worker (it has not opened its NPU
  yet, as a worker started by ``ascendbind run`` has not): nothing contradicts
  the request, nothing is done; an unproven binding stays unproven;
* ``unverified``: the table could not be read, or the rule refused for another
  reason than a mismatch; nothing is done;
* ``contradicted``: the rule with the table answers ``npu_mismatch``, exactly
  as the bind would have been answered had it read the table. The binding is
  undone as a release undoes it (threads back to their original CPUs, IRQ
  masks restored when nobody else holds the NPU), counted as
  ``ascendbind_workers_dropped_total{reason="npu_mismatch"}``, and the worker
  runs unbound: the daemon binds the NPU the caller names or nothing, never
  another one it guessed. Its next bind, naming the listed NPU or none, binds it.

The verdict goes to the ``Daemon`` (``npu_checked``), which applies it only to
the binding it was made for (same pid, start time and NPUs): a worker
released, re-bound or gone meanwhile is left as it is.
Pending checks are at most one per held worker; a worker bound again replaces
its pending check. A binding still unproven after its check is checked again,
1 s later, then 2, 4, … up to once a minute, for as long as it is held: a
worker ``ascendbind run`` started binds itself before its exec, so the table
lists it only seconds later. The checks due together share one table run.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

import structlog

from ...errors import AscendbindError, Conflict
from ...values.model import HostFacts, WorkerFacts
from ...planner import resolve_targets
from ...values.targeting import TargetRequest
from ..runtime.threadname import name_os_thread

__all__ = ["NpuChecker", "check_named_npu", "listed_verdict", "RECHECK_FIRST", "RECHECK_MAX"]

log = structlog.get_logger("ascendbind.npucheck")

# an unproven binding's table is asked again this long after the last check, doubling each time up
# to RECHECK_MAX: a worker started by ``ascendbind run`` opens its NPU within seconds of its exec
RECHECK_FIRST = 1.0
RECHECK_MAX = 60.0

def check_named_npu(host: HostFacts, worker: WorkerFacts, request: TargetRequest, bound: Sequence[int],
                    rows) -> tuple[str, str]:
    """(verdict, sentence) for a worker bound to ``bound`` on ``request``, given npu-smi's
    process table ``rows``. Pure: the bind's own facts with the table put back."""
    ev = worker.npu_evidence
    if ev is not None and "process_table" in ev.unavailable:
        unavailable = {k: v for k, v in ev.unavailable.items() if k != "process_table"}
        worker = dataclasses.replace(worker, npu_evidence=dataclasses.replace(ev, unavailable=unavailable))
    listed = sorted({r.npu for r in rows if r.pid == worker.pid})
    try:
        decision = resolve_targets(dataclasses.replace(host, processes=tuple(rows)), worker, request)
    except Conflict as exc:
        if exc.code == "npu_mismatch":
            return "contradicted", str(exc)
        return "unverified", str(exc)
    except AscendbindError as exc:
        return "unverified", str(exc)
    if not listed:
        return "unlisted", "npu-smi's process table does not list the worker (yet)"
    if set(decision.npus) != set(bound):
        return "unverified", f"the rule with the table picks NPU(s) {list(decision.npus)}, bound to {list(bound)}"
    return "confirmed", f"npu-smi lists the worker on NPU(s) {listed}"


class NpuChecker:
    """One thread checking named and unproven binds of ``daemon`` (the Daemon) after their
    answers, and the unproven ones again until npu-smi lists them (``RECHECK_FIRST`` seconds
    later, doubling up to ``RECHECK_MAX``). One process-table run serves every check due
    at once, so a thousand unproven bindings cost one npu-smi run a round, not a thousand."""

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self._cond = threading.Condition()
        self._due: dict[int, tuple] = {}  # pid -> (due at, tries, (start_time, npus, request, host, worker))
        self._closed = False
        self._busy = False
        self._thread: threading.Thread | None = None

    def submit(self, pid: int, start_time: int, npus: Sequence[int], request: TargetRequest,
               host: HostFacts | None, worker: WorkerFacts | None, *, delay: float = 0.0, tries: int = 0) -> None:
        """Check ``pid``'s binding in ``delay`` seconds (a bind again replaces what is queued).
        ``host`` and ``worker`` None: only the table's listing decides (a binding restored
        from the state file has no facts kept)."""
        with self._cond:
            if self._closed:
                return
            self._due[pid] = (time.monotonic() + delay, tries, (start_time, tuple(npus), request, host, worker))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="npu-check", daemon=True)
                self._thread.start()
            self._cond.notify()

    def idle(self) -> bool:
        """Nothing due now nor being checked (tests wait for this; a re-check queued for later
        does not count)."""
        with self._cond:
            now = time.monotonic()
            return not self._busy and not any(at <= now for at, _, _ in self._due.values())

    def pending(self, pid: int) -> bool:
        """Whether a check of ``pid`` is queued (now or later)."""
        with self._cond:
            return pid in self._due

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._due.clear()
            self._cond.notify_all()

    def _take_due(self) -> dict[int, tuple] | None:
        """Wait for checks that are due and take them all; None once closed."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                due = {pid: item for pid, item in self._due.items() if item[0] <= now}
                if due:
                    for pid in due:
                        del self._due[pid]
                    self._busy = True
                    return due
                nearest = min((at for at, _, _ in self._due.values()), default=None)
                self._cond.wait(None if nearest is None else max(0.0, nearest - now))
            return None

    def _serve(self) -> None:
        name_os_thread()
        while True:
            due = self._take_due()
            if due is None:
                return
            try:
                self._round(due)
            except Exception:  # noqa: BLE001 - a bug here costs one round, never the thread
                log.exception("npu check crashed", pids=sorted(due))
            finally:
                with self._cond:
                    self._busy = False

    def _round(self, due: dict[int, tuple]) -> None:
        d = self.daemon
        try:
            rows, failure = d.hosts.processes(), None  # outside the lock: npu-smi may be slow
        except AscendbindError as exc:
            rows, failure = (), f"npu-smi's process table is unavailable: {exc}"
        for pid, (_at, tries, (start_time, npus, request, host, worker)) in sorted(due.items()):
            if failure is not None:
                verdict, why = "unverified", failure
            elif host is None or worker is None:
                verdict, why = listed_verdict(pid, npus, rows)
            else:
                verdict, why = check_named_npu(host, worker, request, npus, rows)
            # still unproven: ask the table again, less often each time (unless a bind again
            # meanwhile queued a check of its own)
            if d.npu_checked(pid, start_time, npus, verdict, why) and not self.pending(pid):
                self.submit(pid, start_time, npus, request, host, worker, tries=tries + 1,
                            delay=min(RECHECK_MAX, RECHECK_FIRST * 2 ** min(tries, 16)))


def listed_verdict(pid: int, npus: Sequence[int], rows) -> tuple[str, str]:
    """(verdict, sentence) from the table's listing alone, for a binding without its facts."""
    listed = sorted({r.npu for r in rows if r.pid == pid})
    if not listed:
        return "unlisted", "npu-smi's process table does not list the worker (yet)"
    if set(npus) <= set(listed):
        return "confirmed", f"npu-smi lists the worker on NPU(s) {listed}"
    return "unverified", f"npu-smi lists the worker on NPU(s) {listed}, bound to {list(npus)}"
