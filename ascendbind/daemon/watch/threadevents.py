"""Where the reconcile loop learns of thread changes: the kernel's process events, or nothing.

In *events* mode a pass reads, before it looks at anybody, the process events
queued since the last pass (discovery/read/proc_connector.py; the socket keeps
only the bound workers' events, the rest of the host's churn is dropped in the
kernel), and folds them into the threads each worker's look must read again
(discovery/parse/proc_events.py). The look then needs no listing and no name sweep:
one mask read per thread, and a name read only for a thread born or renamed.

In *listing* mode (``events`` returns None) the looks count, list and sweep
names as observe.py describes. The loop runs in listing mode when
``thread_events`` is off, when the connector cannot be had (the reason is
exported: ``ascendbind_reconcile_mode{mode,reason}``, and logged once), and for
``RETRY_PASSES`` passes after events were lost ``LOSS_LIMIT`` passes in a row.

What keeps events mode exact:

* Events can be lost (ENOBUFS: the queue outgrew its buffer) or unknown (the
  loop just entered events mode: renames a name sweep had not reached yet).
  The pass then re-reads everything once (``EventLook.reread_all``): every
  worker's task list and every thread's name.
* A worker bound since the last pass had no events kept for it until the
  filter named it; its first look lists and reads the names the bind read
  (the reconcile loop tracks which workers it has looked at).
* A worker that calls ``exec`` loses its other threads and its name without
  a rename event: its threads are read afresh (``ThreadChanges.resync``).

Each worker's events are counted against a budget (eventbudget.py,
``thread_event_budget`` events a second). A worker over it leaves the kernel
filter, so its events are dropped before they are queued (with its backlog
still queued, the socket is replaced rather than drained), and its looks list
its task directory (``EventLook.listing``) until a probe, a small socket
filtered to it alone, finds it calm; its threads are read whole on the look
after it went over and on the look after it is let back (``EventLook.reread``).
Events lost in the read that put a worker over budget, or in the next one, are
its doing: the pass re-reads everything, but it counts for nothing towards the
fallback of the whole loop to listing.

After an overflow the kernel drops every event for the socket, reporting it
once, until a read empties the queue: the full read that makes good a loss
waits for that read.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import structlog

from ...discovery.read.proc_connector import ProcEventSocket
from ...discovery.parse.proc_events import ThreadChanges, parse_events, thread_changes
from ...errors import DiscoveryError
from .eventbudget import PROBE_SECONDS, EventBudget

__all__ = ["ThreadEvents", "EventLook", "LOSS_LIMIT", "RETRY_PASSES", "DEFAULT_BUDGET"]

log = structlog.get_logger("ascendbind.reconcile")

LOSS_LIMIT = 3  # passes in a row that lost events before the loop falls back to listing
RETRY_PASSES = 60  # passes in listing mode after that, before events are tried again
_RETRIED = ("overflow", "error")  # reasons that may pass; the others hold until the config changes
DEFAULT_BUDGET = 2000  # events a second per worker (the config's thread_event_budget)
PROBE_BYTES = 64 << 10  # a probe's queue: a flood overflows it within milliseconds, a calm worker never


def _open_probe() -> ProcEventSocket:
    return ProcEventSocket.open(buffer_bytes=PROBE_BYTES)


@dataclass(frozen=True)
class EventLook:
    """What one pass learnt from the events: the changes, or that everything is to be read
    afresh; the workers over their event budget (``listing``: their looks list), and those
    whose threads are to be read whole once (``reread``: gone over, or let back, just now)."""

    changes: ThreadChanges
    reread_all: bool = False
    listing: frozenset[int] = frozenset()
    reread: frozenset[int] = frozenset()


class ThreadEvents:
    """The process-events source of one reconcile loop, and its mode."""

    def __init__(self, metrics, *, opener=ProcEventSocket.open, clock=time.monotonic, prober=_open_probe) -> None:
        self.metrics = metrics
        self.opener = opener
        self.clock = clock
        self.prober = prober
        self.budget = EventBudget(DEFAULT_BUDGET)
        self._probes: dict[int, list] = {}  # tgid -> [its probe socket, opened at, events so far]
        self._over_lately = False  # the last read put a worker over budget: a loss now is its doing
        self._unsure = False  # events may have been lost since the last full read (see _after_loss)
        self.mode = "listing"
        self.reason = ""
        self._src: ProcEventSocket | None = None
        self._tgids: frozenset[int] | None = None
        self._retry_at: float = 0
        self._losses = 0

    def events(self, pass_no: int, bound: Collection[int], enabled: bool,
               budget: int = DEFAULT_BUDGET) -> EventLook | None:
        """This pass's events for the ``bound`` workers; None: look by listing this pass.
        ``budget``: events a second each worker may send before it is followed by listing."""
        if not enabled:
            self.close()
            self._retry_at = 0
            self._listing("off")
            return None
        now = self.clock()
        self.budget.rate = float(budget)
        self.budget.keep(bound)
        if self._src is None:
            if pass_no < self._retry_at or not self._open(pass_no, bound):
                return None
            self.mode, self.reason, self._unsure = "events", "", False  # this look reads everything
            self.metrics.set_reconcile_mode("events")
            log.info("reconcile learns of thread changes from process events", kernel_filter=self._src.filtered)
            return EventLook(ThreadChanges(), reread_all=True, listing=self._over(bound))
        back = self._probe(now, bound)
        self._filter(bound)
        try:
            datagrams, lost = self._src.read()
        except OSError as exc:
            self._give_up(pass_no, "error", f"reading process events failed: {exc}")
            return EventLook(ThreadChanges(), reread_all=True)
        listing = self.budget.listing()
        changes = thread_changes((ev for d in datagrams for ev in parse_events(d)),
                                 frozenset(t for t in bound if t not in listing))
        over = self._charge(changes, bound, now, lost)
        changes = changes.without(over)
        if changes.events:
            self.metrics.thread_events.inc(changes.events)
        if over and not self._src.drained and not self._open(pass_no, bound):
            return EventLook(changes, reread_all=True)  # no socket to be had: listing from the next pass
        look = EventLook(changes, listing=self._over(bound), reread=(back | over) & frozenset(bound))
        blamed, self._over_lately = bool(over) or self._over_lately, bool(over)
        return self._after_loss(pass_no, look, lost, blamed)

    def _probe(self, now: float, bound: Collection[int]) -> frozenset[int]:
        """Open a probe for each worker whose cooldown passed, settle the probes open
        (eventbudget.py); the workers let back. A probe is a socket of its own, filtered
        to its worker, so a flood it meets never crowds the other workers' queue."""
        for tgid in [t for t in self._probes if t not in bound]:
            self._probes.pop(tgid)[0].close()
        back = set()
        for tgid in self.budget.due(now) - self._probes.keys():
            try:
                src = self.prober()
            except DiscoveryError:
                src = None
            if src is None or not src.set_filter([tgid]):
                if src is not None:
                    src.close()
                self.budget.settle(tgid, 0, False, PROBE_SECONDS, now)  # no probe: let back on trust
                back.add(tgid)
                continue
            self._probes[tgid] = [src, now, 0]
        for tgid, probe in list(self._probes.items()):
            try:
                datagrams, lost = probe[0].read()
            except OSError:
                datagrams, lost = [], True
            probe[2] += len(datagrams)
            verdict = self.budget.settle(tgid, probe[2], lost, now - probe[1], now)
            if verdict is not None:
                self._probes.pop(tgid)[0].close()
                if verdict:
                    back.add(tgid)
                else:  # still flooding: over again, for a longer cooldown
                    self.metrics.thread_event_overflows.inc()
        return frozenset(back)

    def _open(self, pass_no: int, bound: Collection[int]) -> bool:
        """Subscribe on a new socket, in place of any open one, filtered to the workers followed.
        A socket replaced after a worker went over budget takes that worker's backlog with it:
        draining it would cost a read per event, and until it is drained the kernel drops
        every other worker's events too. What the old queue held is unknown: a full read."""
        self._close_src()
        try:
            self._src = self.opener()
        except DiscoveryError as exc:
            self._retry_at = pass_no + RETRY_PASSES if exc.code in _RETRIED else float("inf")
            self._listing(exc.code, str(exc))
            return False
        self._tgids, self._losses, self._unsure = None, 0, True
        self._filter(bound)
        return True

    def _after_loss(self, pass_no: int, look: EventLook, lost: bool, blamed: bool) -> EventLook:
        """Count a loss (``blamed``: a worker over budget caused it, no step towards listing
        for all), and make the look read everything afresh once the queue has been emptied
        since: until then the kernel may still be dropping events without a word."""
        if lost:
            self.metrics.thread_event_losses.inc()
            self._unsure = True
            if blamed:
                log.warning("process events were lost to a worker over its budget; every bound thread is read afresh")
            else:
                self._losses += 1
                log.warning("process events were lost; every bound thread is read afresh",
                            passes_in_a_row=self._losses)
                if self._losses >= LOSS_LIMIT:
                    self._give_up(pass_no, "overflow", f"process events lost {self._losses} passes in a row")
                    return dataclasses.replace(look, reread_all=True)
        else:
            self._losses = 0
        if self._unsure and self._src is not None and self._src.drained:
            self._unsure = False
            return dataclasses.replace(look, reread_all=True)
        return look

    def _charge(self, changes: ThreadChanges, bound: Collection[int], now: float, lost: bool) -> frozenset[int]:
        """Charge the workers' budgets; those it puts over leave the kernel filter at once."""
        over = self.budget.charge(changes.counts, now, lost=lost)
        if over:
            self._filter(bound)
            self.metrics.thread_event_overflows.inc(len(over))
            first = sorted(over)[:20]
            log.warning("workers sent more thread events than their budget; their threads are found by listing",
                        pids=first, events={p: changes.counts[p] for p in first},
                        budget_per_second=self.budget.rate,
                        retry_in_seconds={p: self.budget.describe(p, now)["retry_in_seconds"] for p in first})
        return over

    def _over(self, bound: Collection[int]) -> frozenset[int]:
        """The bound workers over budget now (exported as a gauge)."""
        listing = self.budget.listing() & frozenset(bound)
        self.metrics.thread_event_listing.set(len(listing))
        return listing

    def _filter(self, bound: Collection[int]) -> bool:
        tgids = frozenset(bound) - self.budget.listing()
        if self._src is not None and tgids != self._tgids:
            self._src.set_filter(tgids)
            self._tgids = tgids
        return self._src is not None and self._src.filtered

    def _give_up(self, pass_no: int, reason: str, why: str) -> None:
        self.close()
        self._retry_at = pass_no + RETRY_PASSES
        self._listing(reason, why)

    def _listing(self, reason: str, why: str = "") -> None:
        if (self.mode, self.reason) == ("listing", reason):
            return
        self.mode, self.reason = "listing", reason
        self.metrics.set_reconcile_mode("listing", reason)
        if reason != "off":
            log.warning("reconcile learns of thread changes by listing", reason=reason, why=why)

    def fileno(self) -> int | None:
        """The events socket while in events mode (readable: events are queued), else None."""
        return self._src.fileno() if self._src is not None else None

    def wake_fd(self) -> int | None:
        """The events socket when the kernel keeps only the bound workers' events on it, so
        that it turns readable only on their news: the loop may sleep on it. None otherwise
        (listing mode, or a kernel without the filter: the host's whole churn arrives)."""
        src = self._src
        return src.fileno() if src is not None and src.filtered else None

    def describe(self) -> dict[str, str | None]:
        """The mode for /healthz: ``events``, or ``listing`` with the reason (``off`` when configured so)."""
        return {"mode": self.mode, "reason": self.reason or None}

    def worker(self, pid: int) -> dict[str, Any]:
        """How the loop learns of one worker's threads, for ``/v1/workers``: ``events``, or
        ``listing`` with the loop's reason or ``over_budget``; how often it went over its
        budget, and the seconds until it is let back."""
        out = self.budget.describe(pid, self.clock())
        over = out.pop("over_budget")
        if self.mode != "events":
            return {"mode": "listing", "reason": self.reason or None, **out}
        return {"mode": "listing" if over else "events", "reason": "over_budget" if over else None, **out}

    def close(self) -> None:
        for probe in self._probes.values():
            probe[0].close()
        self._probes.clear()
        self._close_src()

    def _close_src(self) -> None:
        if self._src is not None:
            self._src.close()
            self._src = None
