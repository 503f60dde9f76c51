"""The daemon's own threads: on the housekeeping CPUs while any worker is bound.

At every isolation level the daemon keeps itself off the bound workers' main,
ACL and release CPUs: its API threads, reconcile loop, memory mover, and every
tool it runs (npu-smi, lscpu, ps), since a child starts with the mask of the
thread that forked it. With no worker bound they go back to the CPUs the
process started on (systemd's ``CPUAffinity=``, a cpuset, or every CPU).

``sched_setaffinity`` changes one thread only, and a thread inherits its mask
from the thread that creates it. So every thread the daemon has is set, then
the task list is read again: a thread created meanwhile by a thread not yet
set would have the old mask. The round repeats until a listing shows no new
thread (a thread created after that comes from a thread already set). Only
the CPUs the process started on are used: a housekeeping set outside them
(a cpuset that excludes them) leaves the threads where they are, and says so.
"""

from __future__ import annotations

from ...discovery.read.bounded import task_affinity
from ...applier.taskmask import set_task_cpus, task_cpus
from ...values.cpulist import format_cpulist
from ...discovery.gather.hostwork import own_threads

__all__ = ["DaemonThreads", "MAX_ROUNDS"]

MAX_ROUNDS = 8  # listings until no new thread shows up; threads are not created in a loop here


class DaemonThreads:
    """The daemon process's threads and where they started."""

    def __init__(self) -> None:
        self.started_on = frozenset(task_affinity(0))
        self.cpus: frozenset[int] = self.started_on  # where they are kept now
        self.note = "where they started: nothing is bound"

    def keep_on(self, cpus: frozenset[int] | None, why: str) -> bool:
        """Set every thread to ``cpus`` (None: where they started); True when every
        thread took it. ``why`` is the status note when they are confined."""
        target = self.started_on if cpus is None else frozenset(cpus) & self.started_on
        if cpus is not None and not target:
            self.note = (f"where they started ({format_cpulist(self.started_on)}): the housekeeping CPUs "
                         f"{format_cpulist(cpus)} are outside them")
            target = self.started_on
        else:
            self.note = why if cpus is not None else "where they started: nothing is bound"
        if target == self.cpus and self._all_on(target):
            return True
        done: set[int] = set()
        ok = True
        for _ in range(MAX_ROUNDS):
            tids = own_threads()
            if tids is None:
                ok = False
                break
            fresh = [t for t in tids if t not in done]
            if not fresh:
                break
            for tid in fresh:
                w = set_task_cpus(f"thread {tid}", tid, target)
                ok = ok and w.status in ("ok", "gone")
                done.add(tid)
        self.cpus = target
        return ok

    def _all_on(self, target: frozenset[int]) -> bool:
        tids = own_threads()
        return tids is not None and all(task_cpus(t) in (target, None) for t in tids)

    def to_json(self) -> dict:
        return {"cpus": format_cpulist(self.cpus), "started_on": format_cpulist(self.started_on), "note": self.note}
