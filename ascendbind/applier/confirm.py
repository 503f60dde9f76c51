"""After the affinity writes: did each one reach the worker? The ones that did not are undone.

``sched_setaffinity`` takes a thread id, and a thread id (the pid too: it is
the main thread's) passes to another process once its thread is reaped, so a
write made a moment after the worker was observed may land on a stranger: the
newcomer that took the worker's pid, with its threads on the worker's thread
ids, or a process forked onto the id of one thread that exited. The affinity
step therefore holds the worker by its pin (discovery/read/pin.py), reads each
thread's mask right before writing it, and once the writes are done asks:

* which tids written are still tasks of the worker? Its task directory, listed
  through the directory the request opened (a worker that exited but is not
  reaped yet still lists its own), or by path and then the pidfd (none, once
  it says exited: the number may name another process by then);
* has the worker exited (its pidfd polls readable)? Then it is not bound,
  whatever was written.

A tid written that is not the worker's now was either the worker's thread when
written (it exited since, and whoever took the number later was born with a mask
of its own) or already the stranger's. The mask tells them apart: a thread that
still holds exactly the mask read back after our write was written by us, and
gets back the mask read just before it; any other mask was not ours to undo.
(A thread born after the write with exactly that mask, forked from a thread we
had bound, gets the mask that thread had before binding: the lesser error, and
one that needs its number recycled within the microseconds between two calls.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..discovery.read.bounded import task_affinity
from ..values.cpulist import format_cpulist
from ..discovery.read.pin import ProcessPin

__all__ = ["StrayWrite", "Confirmation", "confirm_writes", "STRAY_RESULTS"]

# what became of a write that reached another thread than the worker's:
# undone (mask set back), failed (could not be), gone (the thread exited: nothing
# left to undo), unchanged (its mask is no longer the one we wrote: not ours)
STRAY_RESULTS = ("undone", "failed", "gone", "unchanged")
_MAX_REPORTED = 20


@dataclass(frozen=True)
class StrayWrite:
    tid: int
    wrote: frozenset[int]  # the mask the kernel kept after our write
    previous: frozenset[int]  # the mask read right before it
    result: str  # one of STRAY_RESULTS

    def to_json(self) -> dict:
        return {"tid": self.tid, "wrote": format_cpulist(self.wrote), "previous": format_cpulist(self.previous),
                "result": self.result}


@dataclass(frozen=True)
class Confirmation:
    """``exited``: the worker has exited (none of the writes is its any longer);
    ``stray``: the writes whose tid is not the worker's now, each with what became of it."""

    exited: bool
    stray: tuple[StrayWrite, ...] = ()

    def count(self, result: str) -> int:
        return sum(1 for s in self.stray if s.result == result)

    @property
    def landed_elsewhere(self) -> int:
        """Writes found on another process's thread (undone or not)."""
        return self.count("undone") + self.count("failed")

    def to_json(self) -> dict:
        return {"exited": self.exited, **{r: self.count(r) for r in STRAY_RESULTS},
                "writes": [s.to_json() for s in self.stray if s.result in ("undone", "failed")][:_MAX_REPORTED]}


def confirm_writes(pin: ProcessPin, written: Mapping[int, tuple[frozenset[int], frozenset[int]]],
                   listed: frozenset[int] | None = None) -> Confirmation:
    """Check ``written`` (tid -> (mask before, mask kept after our write)) against the
    process ``pin`` holds, and undo each write found on another process's thread.
    ``listed``: the worker's task list as listed through the pin after the last write
    (the affinity step's last pass), else it is listed here."""
    tids, exited = pin.listing(listed)
    stray = [_undo(tid, before, after) for tid, (before, after) in written.items()
             if tids is None or tid not in tids]
    return Confirmation(exited, tuple(stray))


def _undo(tid: int, before: frozenset[int], after: frozenset[int]) -> StrayWrite:
    try:
        now = frozenset(task_affinity(tid))
    except OSError:
        return StrayWrite(tid, after, before, "gone")
    if now != after or now == before:
        return StrayWrite(tid, after, before, "unchanged")
    try:
        os.sched_setaffinity(tid, before)
        back = frozenset(task_affinity(tid))
    except ProcessLookupError:
        return StrayWrite(tid, after, before, "gone")
    except OSError:
        return StrayWrite(tid, after, before, "failed")
    return StrayWrite(tid, after, before, "undone" if back == before else "failed")
