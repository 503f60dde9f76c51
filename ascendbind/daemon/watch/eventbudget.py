"""A budget of process events per bound worker: whose threads are followed by events, whose by listing.

The kernel sends one process event per fork, rename and exit of every bound
worker's threads, and the reconcile loop reads each one (a ``recv`` and a
parse: some microseconds of the daemon's CPU). A worker that starts, renames
and ends threads by the ten thousand a second would have the daemon spend a
large share of a CPU reading them, overflow the socket's queue (losing the
other workers' events with its own), and so make every worker's look slow.
What a worker costs the daemon must not be the worker's choice.

So each worker has a token bucket: ``rate`` events a second, ``BURST_SECONDS``
seconds' worth at once (a worker that starts a few thousand threads in one go
stays within it). A read that takes a worker's bucket below zero puts it *over
budget*: the loop takes its tgid out of the socket's kernel filter, so the
kernel drops its events before they are queued (the flood costs the daemon
nothing more than what was already queued, read once), and its threads are
found by listing its task directory once per pass, as the listing mode does for
every worker. The other workers keep their events, and the host as a whole
never leaves events mode for one worker's sake.

The queue can overflow before a bucket is empty (the kernel drops what does
not fit, so the read sees less than was sent; a queue capped by
``net.core.rmem_max`` holds a few hundred events): a read that reports lost
events puts the worker that sent more than half of what it did read, and at
least ``BLAME_MIN`` events, over budget at once. A worker within its rate fills
no queue; several that fill it together, none with half, or a queue too small
to tell (fewer events than ``BLAME_MIN``), are nobody's fault here: the loop's
own loss rule applies.

After a cooldown (``BASE_COOLDOWN`` seconds, doubled each time the worker goes
over again, up to ``MAX_COOLDOWN``; back to the base once it has kept within
budget for ``MAX_COOLDOWN`` after being let back) the worker is *probed*: the
loop opens a small socket of its own, filtered to that worker alone, and
counts what arrives there for at least ``PROBE_SECONDS`` (``settle``). A
worker still flooding overflows it (or sends more than its rate) and is over
again, for a doubled cooldown; its flood never reaches the shared queue, so
the other workers' events are never crowded out by a probe. A worker that
kept within its rate is let back: its tgid returns to the filter, its threads
are read whole once (nothing of what happened meanwhile was followed), and its
bucket holds one second's worth. A probe costs one subscription and at most one
small queue's reads: under a minute of doubling, then one every
``MAX_COOLDOWN`` seconds.

This module is the bookkeeping alone: counts and a clock in, decisions out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["EventBudget", "BURST_SECONDS", "BASE_COOLDOWN", "MAX_COOLDOWN", "BLAME_MIN", "PROBE_SECONDS"]

BURST_SECONDS = 2.0
BASE_COOLDOWN = 1.0
MAX_COOLDOWN = 64.0
BLAME_MIN = 32
PROBE_SECONDS = 1.0


@dataclass
class _Bucket:
    tokens: float
    at: float  # when ``tokens`` was last refilled
    over_until: float | None = None  # followed by listing until then
    cooldown: float = 0.0  # the last cooldown given
    back_at: float | None = None  # when it was let back, while it keeps within budget
    overflows: int = 0


class EventBudget:
    """Per-tgid token buckets of process events (see the module's text)."""

    def __init__(self, rate: float, *, base: float = BASE_COOLDOWN, cap: float = MAX_COOLDOWN) -> None:
        self.rate = float(rate)
        self.base, self.cap = base, cap
        self._buckets: dict[int, _Bucket] = {}

    @property
    def burst(self) -> float:
        return self.rate * BURST_SECONDS

    def charge(self, counts: Mapping[int, int], now: float, *, lost: bool = False) -> frozenset[int]:
        """Take ``counts`` (tgid -> events read now) from the buckets; the tgids this puts
        over budget. A tgid already over is not charged: its stray events (queued before
        its filter changed) are not followed. ``lost``: the queue overflowed before this
        read, and the tgid that sent most of what was read (``BLAME_MIN`` events or more)
        is over regardless."""
        over = set()
        total = sum(counts.values())
        for tgid, n in counts.items():
            b = self._buckets.get(tgid)
            if b is None:
                b = self._buckets[tgid] = _Bucket(self.burst, now)
            if b.over_until is not None:
                continue
            b.tokens = min(self.burst, b.tokens + (now - b.at) * self.rate) - n
            b.at = now
            if lost and n >= BLAME_MIN and 2 * n > total:
                b.tokens = min(b.tokens, -1.0)
            if b.tokens < 0:
                self._over(b, now)
                over.add(tgid)
        return frozenset(over)

    def _over(self, b: _Bucket, now: float) -> None:
        """Over budget from ``now``: the base cooldown the first time and after a calm spell
        (``cap`` seconds within budget since it was let back), else the last one doubled."""
        calm = not b.cooldown or (b.back_at is not None and now - b.back_at >= self.cap)
        b.cooldown = self.base if calm else min(self.cap, 2 * b.cooldown)
        b.over_until, b.back_at = now + b.cooldown, None
        b.overflows += 1

    def due(self, now: float) -> frozenset[int]:
        """The tgids over budget whose cooldown has passed: to be probed."""
        return frozenset(t for t, b in self._buckets.items() if b.over_until is not None and now >= b.over_until)

    def settle(self, tgid: int, events: int, lost: bool, seconds: float, now: float) -> bool | None:
        """The verdict of a probe of ``tgid`` open for ``seconds`` that received ``events``
        (``lost``: its queue overflowed): False, still flooding (over again, for a doubled
        cooldown); True, let back (followed by events from now, with one second's worth of
        budget); None, too early to tell (under ``PROBE_SECONDS`` and nothing lost)."""
        b = self._buckets.get(tgid)
        if b is None or b.over_until is None:
            return True
        if lost or events > self.rate * max(seconds, PROBE_SECONDS):
            self._over(b, now)
            return False
        if seconds < PROBE_SECONDS:
            return None
        b.over_until, b.back_at = None, now
        b.tokens, b.at = min(self.burst, self.rate), now
        return True

    def listing(self) -> frozenset[int]:
        """The tgids over budget now (their threads are found by listing)."""
        return frozenset(t for t, b in self._buckets.items() if b.over_until is not None)

    def keep(self, tgids: Collection[int]) -> None:
        """Forget every tgid not in ``tgids`` (released or gone workers)."""
        for tgid in [t for t in self._buckets if t not in tgids]:
            del self._buckets[tgid]

    def describe(self, tgid: int, now: float) -> dict[str, Any]:
        """One worker's budget for ``/v1/workers``: whether it is over, how often it went
        over, and the seconds until it is let back (once the loop's next look comes)."""
        b = self._buckets.get(tgid)
        over = b is not None and b.over_until is not None
        return {"over_budget": over, "overflows": b.overflows if b else 0,
                "retry_in_seconds": round(max(0.0, b.over_until - now), 3) if over else None}
