"""What the ``host`` isolation level reads of the host's other tasks: which processes
exist, each one's stat (name, parent, flags, start time) and cgroups, and its
threads with their own start times.

Every reader answers None (or empty) for a task that is gone: processes start
and exit while the host is swept, which is news for the caller, not an error.

Kernel facts these rely on:

* ``/proc`` lists processes (thread-group leaders) only; a thread is reached
  through ``/proc/<pid>/task/<tid>``, and ``/proc/<tid>/stat`` answers for a
  thread too.
* A task's start time (field 22 of its stat, in clock ticks since boot) with
  its id tells a reused id apart: the same id with another start time is
  another task.
* ``PF_KTHREAD`` (field 9) marks a kernel thread, whatever its name.
* ``/proc/<pid>/cgroup`` holds one line per hierarchy: ``0::/path`` for cgroup
  v2, ``<n>:<controllers>:/path`` for each v1 hierarchy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...values.digits import is_ascii_digits
from ...errors import ParseError
from ..read.bounded import read_bounded
from ..parse.procfs import parse_cgroup
from .process import stat_at

__all__ = ["ProcessFacts", "list_pids", "process_facts", "thread_starts"]


@dataclass(frozen=True)
class ProcessFacts:
    pid: int
    start_time: int
    comm: str
    ppid: int
    kernel: bool  # PF_KTHREAD
    cgroups: tuple[str, ...]  # the cgroup path of each hierarchy (empty: unreadable)


def list_pids(proc_root: str = "/proc") -> list[int]:
    """Every process id ``<proc>`` lists now (empty when unreadable)."""
    try:
        names = os.listdir(proc_root)
    except OSError:
        return []
    return [int(n) for n in names if is_ascii_digits(n)]


def process_facts(pid: int, proc_root: str = "/proc", *, cgroups: bool = True) -> ProcessFacts | None:
    """``pid``'s stat and (with ``cgroups``) cgroup paths; None when it is gone."""
    st = stat_at(f"{proc_root}/{pid}/stat")
    if st is None:
        return None
    paths: tuple[str, ...] = ()
    if cgroups and not st.is_kthread:
        text = read_bounded(f"{proc_root}/{pid}/cgroup", 65536, single=True)
        if text is not None:
            try:
                paths = tuple(e.path for e in parse_cgroup(text, f"{proc_root}/{pid}/cgroup"))
            except ParseError:
                paths = ()
    return ProcessFacts(pid, st.start_time, st.comm, st.ppid, st.is_kthread, paths)


def thread_starts(pid: int, proc_root: str = "/proc") -> dict[int, int]:
    """tid -> start time of each thread of process ``pid`` ({} when it is gone)."""
    try:
        names = os.listdir(f"{proc_root}/{pid}/task")
    except OSError:
        return {}
    out = {}
    for name in names:
        if not is_ascii_digits(name):
            continue
        st = stat_at(f"{proc_root}/{pid}/task/{name}/stat")
        if st is not None:
            out[int(name)] = st.start_time
    return out
