"""One task's CPU affinity, set and read back: the daemon's own threads, and the
NPU driver's kernel threads under isolation.

``sched_setaffinity(2)`` changes the one thread it names. A thread created
later inherits the mask of the thread that created it, which is why the
daemon sets every thread it has (selfmask.py) and why the tools it starts run
where the thread that started them does. The kernel narrows a mask to the
task's cpuset and refuses one that leaves nothing (EINVAL); it refuses any
change to a kernel thread bound to its CPU (``PF_NO_SETAFFINITY``: EINVAL too).
Both are ``unchangeable``: the same call would fail the same way again.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

from ..discovery.read.bounded import task_affinity
from ..values.cpulist import format_cpulist
from ..values.decisions import MaskWrite

__all__ = ["set_task_cpus", "task_cpus"]


def task_cpus(tid: int) -> frozenset[int] | None:
    """``tid``'s allowed CPUs, or None when it is gone."""
    try:
        return frozenset(task_affinity(tid))
    except OSError:
        return None


def set_task_cpus(key: str, tid: int, cpus: Iterable[int]) -> MaskWrite:
    """Set ``tid``'s affinity to ``cpus`` and read it back; texts are cpu lists."""
    cpus = frozenset(cpus)
    before = task_cpus(tid)
    if before is None:
        return MaskWrite(key, "gone", None, None, f"task {tid} is gone")
    previous = format_cpulist(before)
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError as exc:
        status = {errno.ESRCH: "gone", errno.EINVAL: "unchangeable"}.get(exc.errno, "failed")
        now = task_cpus(tid)
        return MaskWrite(key, status, previous, None if now is None else format_cpulist(now), exc.strerror or str(exc))
    now = task_cpus(tid)
    if now is None:
        return MaskWrite(key, "gone", previous, None, f"task {tid} exited")
    if now != cpus:
        return MaskWrite(key, "failed", previous, format_cpulist(now),
                         f"set {format_cpulist(cpus)}, read back {format_cpulist(now)}")
    return MaskWrite(key, "ok", previous, format_cpulist(now))
