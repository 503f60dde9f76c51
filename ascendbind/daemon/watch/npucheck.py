"""A bind that names its NPU, checked against npu-smi's process table after the answer.

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

* ``confirmed``: the table lists the worker on the NPU it is bound to;
* ``unlisted``: the table does not list the worker (it has not opened its NPU
  yet, as a worker started by ``ascendbind run`` has not): nothing contradicts
  the request, nothing is done;
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
its pending check.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import structlog

from ...errors import AscendbindError, Conflict
from ...values.model import HostFacts, WorkerFacts
from ...planner import resolve_targets
from ...values.targeting import TargetRequest
from ..runtime.threadname import name_os_thread

__all__ = ["NpuChecker", "check_named_npu"]

log = structlog.get_logger("ascendbind.npucheck")

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
    """One thread checking named binds of ``daemon`` (the Daemon) after their answers."""

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self._cond = threading.Condition()
        self._due: dict[int, tuple] = {}  # pid -> (start_time, npus, request, host, worker)
        self._closed = False
        self._busy = False
        self._thread: threading.Thread | None = None

    def submit(self, pid: int, start_time: int, npus: Sequence[int], request: TargetRequest,
               host: HostFacts, worker: WorkerFacts) -> None:
        with self._cond:
            if self._closed:
                return
            self._due[pid] = (start_time, tuple(npus), request, host, worker)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="npu-check", daemon=True)
                self._thread.start()
            self._cond.notify()

    def idle(self) -> bool:
        """Nothing queued or being checked (tests wait for this)."""
        with self._cond:
            return not self._due and not self._busy

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._due.clear()
            self._cond.notify_all()

    def _serve(self) -> None:
        name_os_thread()
        while True:
            with self._cond:
                while not self._due and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                pid = next(iter(self._due))
                item = self._due.pop(pid)
                self._busy = True
            try:
                self._check(pid, *item)
            except Exception:  # noqa: BLE001 - a bug here costs one check, never the thread
                log.exception("npu check crashed", pid=pid)
            finally:
                with self._cond:
                    self._busy = False

    def _check(self, pid: int, start_time: int, npus: tuple[int, ...], request: TargetRequest,
               host: HostFacts, worker: WorkerFacts) -> None:
        d = self.daemon
        try:
            rows = d.hosts.processes()  # outside the lock: npu-smi may be slow
        except AscendbindError as exc:
            verdict, why = "unverified", f"npu-smi's process table is unavailable: {exc}"
        else:
            verdict, why = check_named_npu(host, worker, request, npus, rows)
        d.npu_checked(pid, start_time, npus, verdict, why)
