"""Tasks started after the bind: moved at ``host`` within the event window.

A task inherits its mask from the thread that forks it, so what the keeper
moved stays moved, and so do its new threads. What is not covered is a process
forked by one the level never moves: a service pid 1 starts, a shell in an
exempt cgroup, a container runtime. The watcher finds those:

* *events* (the kernel's process connector, discovery/read/proc_connector.py): a
  socket whose kernel-side filter keeps only forks that start a process and
  execs (``process_start_filter``: new threads, renames and exits are dropped
  before they are queued). The thread sleeps in ``select`` and adopts each
  batch as it arrives: a fork is queued before the child first runs, so the
  child is moved within a scheduling round trip of its start. An exec is
  weighed again: a service manager moves its child into the unit's cgroup
  between fork and exec, so an exempt cgroup or name shows only then (what was
  moved at the fork is then put back).
* *sweep* (no connector: a kernel without it, a daemon outside the initial
  pid or user namespace): ``/proc`` is listed every ``SWEEP_SECONDS`` and the
  pids not in the previous listing are adopted. Listing costs about a
  millisecond per thousand processes; the stat and mask of a process are read
  only when it is new.

Either way, a full follow runs every ``FULL_SWEEP_SECONDS`` (``sweep_due``, then
the daemon's commit): a
thread created while its process was being moved, events lost (ENOBUFS), a pid
reused between two listings, an exec the sweep cannot see. It reads every
process under the daemon's lock (some 0.2-0.4 ms a process), so on a host
where it takes longer than 1 % of that period the period grows to a hundred
times the sweep: the lock stays free 99 % of the time. The watcher wakes
when the level starts or stops moving tasks (``Isolation.woken``) and idles
otherwise; every move goes through ``Isolation.adopt`` (the ``adopt`` the daemon
hands the watcher takes its lock and gives the bound workers, the config and
the state file's writer), recorded in the state file before it is written.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Collection

import structlog

from ...discovery.gather.hosttasks import list_pids
from ...discovery.read.proc_connector import ProcEventSocket
from ...discovery.parse.proc_events import parse_events, process_start_filter, started_processes
from ...errors import DiscoveryError
from ...values.config import Config
from .keeper import Isolation

__all__ = ["TaskWatch", "SWEEP_SECONDS", "FULL_SWEEP_SECONDS"]

log = structlog.get_logger("ascendbind.isolation")

SWEEP_SECONDS = 0.05  # the listing period without events: half the 100 ms a new task may stay
FULL_SWEEP_SECONDS = 10.0
RETRY_SECONDS = 60.0  # before events are tried again after a transient failure
_RETRIED = ("error",)


def _open_events() -> ProcEventSocket:
    return ProcEventSocket.open(program=process_start_filter())


class TaskWatch:
    """The thread that moves tasks started after the bind (see the module docstring)."""

    def __init__(self, isolation: Isolation, *, config: Callable[[], Config],
                 adopt: Callable[[Collection[int]], object], commit: Callable[[], object],
                 opener: Callable[[], ProcEventSocket] = _open_events) -> None:
        """``config``: the daemon's config now; ``adopt``: ``Isolation.adopt`` of those pids under
        the daemon's lock; ``commit``: the daemon's commit (a full follow after ``sweep_due``)."""
        self.isolation = isolation
        self.config, self.adopt, self.commit = config, adopt, commit
        self.opener = opener
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._src: ProcEventSocket | None = None
        self._retry_at = 0.0
        self._failed: str | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="isolation-tasks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.isolation.woken.set()
        if self._thread is not None:
            self._thread.join(5)
        self._close()

    def _run(self) -> None:
        iso = self.isolation
        probed = False
        while not self._stop.is_set():
            if not iso.moving_tasks:
                self._close()
                if not probed and self.config().isolation == "host":
                    # learn before the first bind whether events can be had: a kernel that ignores
                    # the subscription costs the wait for its answer, which must not delay the
                    # first move after a bind
                    probed = True
                    if self._events() is not None:
                        self._close()
                iso.tasks.mode = {"mode": "off", "reason": None}
                iso.woken.wait(1.0)
                iso.woken.clear()
                continue
            try:
                self._watch(iso)
            except Exception:  # a bug here must not end the watching for good
                log.exception("the host level's task watcher failed; it starts again in a second")
                self._close()
                self._stop.wait(1.0)

    def _events(self) -> ProcEventSocket | None:
        if self._src is None and time.monotonic() >= self._retry_at:
            try:
                self._src = self.opener()
                self._failed = None
            except DiscoveryError as exc:
                self._retry_at = time.monotonic() + RETRY_SECONDS if exc.code in _RETRIED else float("inf")
                if self._failed != exc.code:
                    log.warning("the host level finds new tasks by listing /proc", reason=exc.code, why=str(exc),
                                every_seconds=SWEEP_SECONDS)
                self._failed = exc.code
        return self._src

    def _watch(self, iso: Isolation) -> None:
        """One stretch of watching, until the level stops moving tasks or the watcher stops."""
        src = self._events()
        iso.tasks.mode = {"mode": "events", "reason": None} if src else {"mode": "sweep", "reason": self._failed}
        # what started between the keeper's full sweep and now (events only flow from here on)
        known = set(list_pids(self.config().proc_root))
        self._adopt(known - iso.tasks.listed)
        next_full = time.monotonic() + FULL_SWEEP_SECONDS
        while iso.moving_tasks and not self._stop.is_set():
            iso.woken.clear()
            if src is not None:
                lost = self._read(src, min(0.5, max(0.0, next_full - time.monotonic())))
                if lost is None:  # the socket failed: sweep from now on
                    return
                if lost:
                    next_full = 0.0
            else:
                self._stop.wait(SWEEP_SECONDS)
                listing = set(list_pids(self.config().proc_root))
                self._adopt(listing - known)
                known = listing
            if time.monotonic() >= next_full:
                iso.sweep_due()
                self.commit()
                next_full = time.monotonic() + max(FULL_SWEEP_SECONDS, 100 * iso.tasks.sweep_seconds)

    def _read(self, src: ProcEventSocket, timeout: float) -> bool | None:
        """Adopt what the queued events name; whether events were lost (None: the socket failed)."""
        try:
            if not select.select([src], [], [], timeout)[0]:
                return False
            datagrams, lost = src.read()
        except OSError as exc:
            log.warning("reading process events failed; the host level lists /proc from now on", error=str(exc))
            self._close()
            self._retry_at = time.monotonic() + RETRY_SECONDS
            self._failed = "error"
            return None
        pids, _malformed = started_processes(ev for d in datagrams for ev in parse_events(d))
        self._adopt(pids)
        return lost

    def _adopt(self, pids: Collection[int]) -> None:
        if pids:
            self.adopt(pids)

    def _close(self) -> None:
        if self._src is not None:
            self._src.close()
            self._src = None
