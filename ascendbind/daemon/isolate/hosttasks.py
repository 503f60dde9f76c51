"""The ``host`` level's other tasks: which are never moved and why, and where each
thread of the others goes.

``HostTasks.wanted`` sweeps the processes (all of them, or those an event or a
listing just named) and answers, for each thread isolation may change, its
mask now and the mask it wants (``task_target``: its mask less the protected
CPUs); the keeper weighs each with rules/verdicts.py like any other mask, under
the key ``task:<tid>:<start time>``.

Never moved, and counted by why:

* ``pid 1``: the init process (systemd). Its affinity is inherited by every
  service it starts later, so changing it would be a host-wide change that
  outlives the daemon; the daemon never acts on pid 1. What it starts is moved
  like any other task, within the event window.
* ``kernel``: every kernel thread (``PF_KTHREAD``). Per-CPU ones refuse any
  change, the rest are the kernel's; unbound kernel work follows the unbound
  workqueues' mask instead.
* ``daemon``: the daemon and the tools it runs (selfmask.py keeps them on
  the housekeeping CPUs).
* ``bound``: a bound worker and every process below it. Its threads are the
  bind's; a child inherits the mask of the thread that forked it (a data
  loader, a compile worker): it is part of the workload the pool was planned
  for, so it keeps that mask.
* ``kubepods``: a process in a pod's cgroup of the tree the kubelet made
  (``kubepods`` at the top of a hierarchy, v1 or v2: discovery/parse/kubelet.py
  ``kubelet_place``; a ``kubepods`` a user makes below a cgroup delegated to it
  exempts nothing). kubelet's CPU manager
  writes those cpusets and rewrites them on its own reconcile, which resets
  the affinity of the tasks inside: moving them would be a fight lost every
  few seconds. Pods keep off the pools through kubelet itself.
* ``exempt``: ``isolation_exempt``: a cgroup path (that cgroup and those
  below it) or a shell-style pattern of the process's name.

A thread whose own mask lies wholly inside the protected CPUs was put there by
its owner; it is left there and reported (``task_pinned_inside``). A thread
whose mask changed after isolation set it is left to its owner by the keeper
(``changed_by_owner``) and never touched again while it lives (``hands_off``):
whoever set it again wants it so, and a second write would be a fight.

The record grows with the tasks moved; past ``MAX_TASKS`` no further task is
moved (``too_many_tasks``, counted) so the state file stays bounded.
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Iterable, Mapping

import structlog

from ...applier.taskmask import task_cpus
from ...values.config import Config, exempt_entries
from ...values.cpulist import format_cpulist
from ...discovery.parse.kubelet import kubelet_place
from ...discovery.gather.hosttasks import ProcessFacts, list_pids, process_facts, thread_starts
from ...planner.isolate.isolation import IsolationPlan, task_target
from ...values.reasons import Reason
from .rules.keys import MaskKey
from .wanted import Wanted
from .rules.records import SavedMask, TaskSaved
from .rules.verdicts import Holds, holds

__all__ = ["HostTasks", "never_moved", "before_isolation", "task_keys_of", "MAX_TASKS", "NEVER"]

log = structlog.get_logger("ascendbind.isolation")

MAX_TASKS = 16384  # threads with a saved mask: some 1.3 MiB of state file, 35 ms to encode
MAX_DEPTH = 64  # parents walked up to find a bound worker or the daemon
NEVER = ("pid 1", "kernel", "daemon", "bound", "kubepods", "exempt")


def never_moved(p: ProcessFacts, ancestors: Iterable[int], bound: Mapping[int, int | None], own: int,
                cgroups: tuple[str, ...], comms: tuple[str, ...]) -> str | None:
    """Why process ``p`` is never moved (one of ``NEVER``), or None. ``ancestors``: the
    pids above it; ``bound``: the bound workers' pid -> start time; ``own``: the daemon's pid;
    ``cgroups``, ``comms``: the exempt cgroup paths and name patterns."""
    if p.pid == 1:
        return "pid 1"
    if p.kernel:
        return "kernel"
    line = (p.pid, *ancestors)
    if own in line:
        return "daemon"
    if (p.pid in bound and bound[p.pid] in (None, p.start_time)) or any(a in bound for a in line[1:]):
        return "bound"
    if any(kubelet_place(path).pod_uid is not None for path in p.cgroups):
        return "kubepods"
    if any(path == c or path.startswith(c + "/") for path in p.cgroups for c in cgroups):
        return "exempt"
    if any(fnmatch.fnmatchcase(p.comm, pattern) for pattern in comms):
        return "exempt"
    return None


def _by_tid(saved: Mapping[MaskKey, SavedMask]) -> dict[int, list[SavedMask]]:
    """The task records by thread id, whatever their start time."""
    out: dict[int, list[SavedMask]] = {}
    for key, mask in saved.items():
        if key.kind == "task":
            out.setdefault(key.tid, []).append(mask)
    return out


def before_isolation(saved: Mapping[MaskKey, SavedMask], tids: Iterable[int]) -> frozenset[int]:
    """The CPUs the threads ``tids`` were allowed before isolation narrowed them: the union
    of the originals recorded for those that still hold a mask isolation wrote (a record
    whose mask the thread no longer holds is its owner's since, or an older thread's)."""
    by_tid = _by_tid(saved)
    out: set[int] = set()
    for tid in tids:
        for mask in by_tid.get(tid, ()):
            now = task_cpus(tid)
            if holds(mask, now) is Holds.OURS:
                out |= mask.original_cpus() or now
    return frozenset(out)


def task_keys_of(saved: Mapping[MaskKey, SavedMask], tids: Iterable[int]) -> list[MaskKey]:
    """The task records of the threads ``tids`` (whatever their start time)."""
    wanted = set(tids)
    return [k for k in saved if k.kind == "task" and k.tid in wanted]


_HEIRS = (None, "exempt", "kubepods")  # whose threads may hold a mask inherited from a moved task


class _Inheritance:
    """Whether a thread with no record of its own holds a mask isolation wrote on a
    thread of its own process or of its parent: a thread inherits the mask of the
    thread that creates it, and a process that of the thread that forks it. Such a
    thread is recorded with that thread's original, so putting the host back gives
    it the mask it would have had (its own later choice is its owner's, as for any
    task). A record's thread id may since name another task: only a record this
    thread's mask is still ours by (verdicts.py ``holds``) counts."""

    def __init__(self, saved: Mapping[MaskKey, SavedMask], proc: str) -> None:
        self.proc = proc
        self.by_tid: dict[int, SavedMask] = {tid: masks[-1] for tid, masks in _by_tid(saved).items()}
        self.parents: dict[int, list[int]] = {}

    def __call__(self, p: ProcessFacts, threads: Mapping[int, int], now: frozenset[int]) -> SavedMask | None:
        if not self.by_tid:
            return None
        for tid in threads:
            found = self._match(tid, now)
            if found is not None:
                return found
        if p.ppid not in self.parents:
            self.parents[p.ppid] = list(thread_starts(p.ppid, self.proc)) if p.ppid > 1 else []
        for tid in self.parents[p.ppid]:
            found = self._match(tid, now)
            if found is not None:
                return found
        return None

    def add(self, tid: int, mask: SavedMask) -> None:
        self.by_tid[tid] = mask

    def _match(self, tid: int, now: frozenset[int]) -> SavedMask | None:
        mask = self.by_tid.get(tid)
        if mask is not None and holds(mask, now) is Holds.OURS:
            return TaskSaved(mask.original, (format_cpulist(now),))
        return None


class _Sweep:
    """One pass over some processes: what ``HostTasks.wanted`` answers, gathered as it goes."""

    def __init__(self, tasks: HostTasks, iso: IsolationPlan, config: Config, bound: Mapping[int, int | None],
                 saved: Mapping[MaskKey, SavedMask], skip: Iterable[str]) -> None:
        self.tasks, self.iso, self.proc, self.bound, self.saved = tasks, iso, config.proc_root, bound, saved
        self.cgroups, self.comms = exempt_entries(config.isolation_exempt)
        self.own, self.skip = os.getpid(), set(skip)
        self.room = MAX_TASKS - sum(1 for k in saved if k.kind == "task")
        self.facts: dict[int, ProcessFacts | None] = {}
        self.parents: dict[int, int] = {}
        self.inherit = _Inheritance(saved, self.proc)
        self.out: Wanted = {}
        self.swept: set[MaskKey] = set()
        self.never: dict[str, int] = {}
        self.heirs: dict[MaskKey, SavedMask] = {}
        self.over = 0

    def ancestors(self, p: ProcessFacts) -> list[int]:
        out, pid = [], p.ppid
        while pid > 1 and len(out) < MAX_DEPTH and pid not in out:
            out.append(pid)
            if pid not in self.parents:
                known = self.facts.get(pid)
                up = known if known is not None else process_facts(pid, self.proc, cgroups=False)
                self.parents[pid] = up.ppid if up is not None else 0
            pid = self.parents[pid]
        return out

    def process(self, pid: int) -> None:
        p = self.facts[pid] = process_facts(pid, self.proc)
        if p is None:
            return
        line = self.ancestors(p) if p.pid != 1 and not p.kernel else ()
        why = never_moved(p, line, self.bound, self.own, self.cgroups, self.comms)
        if why is not None:
            self.never[why] = self.never.get(why, 0) + 1
        threads = thread_starts(pid, self.proc) if why in _HEIRS else {}
        for tid, start in threads.items():
            self.thread(p, why, threads, tid, MaskKey.of("task", tid, start))

    def thread(self, p: ProcessFacts, why: str | None, threads: Mapping[int, int], tid: int, key: MaskKey) -> None:
        self.swept.add(key)
        if key in self.tasks.hands_off or key in self.skip:
            return
        now = task_cpus(tid)
        if now is None:
            return
        mine = self.saved.get(key)
        if mine is None and (mine := self.inherit(p, threads, now)) is not None:
            self.heirs[key] = mine
            self.inherit.add(tid, mine)
        if why is not None:
            return
        base = (mine.original_cpus() or now) if mine is not None else now
        target = task_target(base, self.iso.protected_cpus)
        if target is None:
            self.tasks.pinned_inside(key, p, tid, now, self.iso)
            return
        if mine is None and target != now:
            if self.room <= 0:
                self.over += 1
                return
            self.room -= 1
        self.out[key] = (format_cpulist(now), target)


class HostTasks:
    """What the host level knows of the other tasks between sweeps."""

    def __init__(self) -> None:
        self.hands_off: set[MaskKey] = set()  # task keys left to their owner: never written again
        self.pinned: dict[MaskKey, dict] = {}  # task key -> the report of a task pinned inside
        self.never: dict[str, int] = {}  # why -> processes, from the latest full sweep
        self.over_limit = 0  # threads not moved in the latest sweep: the record is full
        self.moved = 0  # threads the watcher moved (tasks started after the level's follow)
        self.listed: frozenset[int] = frozenset()  # the pids the latest full sweep saw
        self.swept_at: float | None = None
        self.sweep_seconds = 0.0  # what the latest full sweep took (under the daemon's lock)
        self.mode: dict[str, str | None] = {"mode": "off", "reason": None}  # set by the watcher

    def wanted(self, iso: IsolationPlan, config: Config, bound: Mapping[int, int | None],
               saved: Mapping[MaskKey, SavedMask], skip: Iterable[str],
               pids: Iterable[int] | None = None) -> tuple[Wanted, set[MaskKey], dict[MaskKey, SavedMask]]:
        """(key -> (mask text now, wanted CPUs), the task keys swept, the records of tasks
        that inherited a mask isolation wrote) for the processes ``pids`` (None: every
        process; then the memory of gone tasks is pruned too)."""
        full = pids is None
        t0 = time.monotonic()
        listing = list_pids(config.proc_root) if full else sorted(set(pids))
        sweep = _Sweep(self, iso, config, bound, saved, skip)
        for pid in listing:
            sweep.process(pid)
        if full:
            self.sweep_seconds = time.monotonic() - t0
            self.never, self.listed = sweep.never, frozenset(listing)
            self.hands_off &= sweep.swept
            self.pinned = {k: v for k, v in self.pinned.items() if k in sweep.swept}
            self.over_limit = sweep.over
        else:
            self.over_limit += sweep.over
        if sweep.over:
            log.warning("isolation moves no more tasks: the record is full", limit=MAX_TASKS, not_moved=sweep.over)
        return sweep.out, sweep.swept, sweep.heirs

    def heirs(self, config: Config, saved: Mapping[MaskKey, SavedMask]) -> dict[MaskKey, SavedMask]:
        """The records of every task that inherited a mask isolation wrote and has none of
        its own yet: taken before the level puts the host back, so those go back too."""
        if not any(k.kind == "task" for k in saved):
            return {}
        proc = config.proc_root
        inherit = _Inheritance(saved, proc)
        out: dict[MaskKey, SavedMask] = {}
        found = None
        processes = [p for pid in list_pids(proc) if (p := process_facts(pid, proc, cgroups=False)) is not None
                     and not p.kernel and p.pid != 1]
        # a grandchild inherits from a child whose record is only found in this sweep: again
        # until a pass finds nothing (an heir of a record lost in a crash is found this way too)
        for _ in range(MAX_DEPTH):
            if found is not None and not found:
                break
            found = {}
            for p in processes:
                threads = thread_starts(p.pid, proc)
                for tid, start in threads.items():
                    key = MaskKey.of("task", tid, start)
                    if key in saved or key in out or key in self.hands_off:
                        continue
                    now = task_cpus(tid)
                    if now is not None and (mine := inherit(p, threads, now)) is not None:
                        found[key] = mine
                        inherit.add(tid, mine)
            out.update(found)
        return out

    def pinned_inside(self, key: MaskKey, p: ProcessFacts, tid: int, now: frozenset[int], iso: IsolationPlan) -> None:
        if key in self.pinned:
            return
        detail = (f"task {tid} of {p.comm} (pid {p.pid}) is allowed only CPUs {format_cpulist(now)}, all of them "
                  f"protected ({format_cpulist(iso.protected_cpus)}): its owner put it there, so it is left there")
        self.pinned[key] = {"what": key, "reason": Reason.TASK_PINNED_INSIDE.value, "detail": detail}
        log.warning("a task pinned inside the protected CPUs is left there", task=tid, pid=p.pid, comm=p.comm,
                    cpus=format_cpulist(now))

    def left_to_owner(self, key: MaskKey) -> None:
        """The keeper found ``key`` changed by its owner: it is never written again while it lives."""
        if key.kind == "task":
            self.hands_off.add(key)

    def to_json(self) -> dict:
        pinned = list(self.pinned.values())
        return {
            "events": self.mode,
            "never_moved": {k: self.never.get(k, 0) for k in NEVER},
            "left_to_owner": len(self.hands_off),
            "pinned_inside": len(pinned),
            "pinned": pinned[:32],
            "too_many_tasks": self.over_limit,
            "moved_as_started": self.moved,
            "swept_at": self.swept_at,
            "sweep_seconds": round(self.sweep_seconds, 4),
        }

