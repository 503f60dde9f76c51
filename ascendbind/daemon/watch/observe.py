"""One look at a bound worker's threads per reconcile pass, as cheap as the kernel allows.

Per thread a look costs one ``sched_getaffinity``: the mask is the only thing
that can drift, and no interface hands out the masks of many threads at once.

The task list is read only when the thread set may have changed. Listing
``/proc/<pid>/task`` makes the kernel build a ``/proc`` entry for every thread
and costs more than the masks themselves (measured: about three quarters of a
look at 16 x 200 threads), while threads come and go rarely once a worker runs.
So a look first reads the thread count (the task directory's link count, which
the kernel keeps in O(1): ``/proc/<pid>/stat`` would walk every thread to sum
their CPU times); when it equals the number of threads cached, it walks the
cache instead (``_look_known``): the masks of all cached threads are fetched
and compared in one C-level sweep (``map``), so a quiet worker costs a syscall
per thread and next to no interpreter time, which matters most when the pass
runs every few seconds on cold caches. That
walk gives up and lists after all when anything is off: a cached thread is gone
(ESRCH), its ``comm`` cannot be read under this pid, or a mask moved (drift is
acted upon only after a listing has confirmed that the thread is this worker's).
A thread that exits while another is born keeps the count; the exited one then
answers ESRCH. Only if the kernel handed its tid to another process between two
passes (a pid-space wrap within one period) could the walk miss the newcomer,
and then for at most one comm sweep: the sweep reads each cached thread's
``comm`` through ``/proc/<pid>/task/<tid>``, which fails for a tid that is not
this worker's.

``comm`` (three more syscalls) is read only when it can have news, decided by
``comm_due``:

* a thread never seen before: its role comes from its name;
* a *young* thread, for its first ``YOUNG_PASSES`` passes: a thread is created
  by another (inheriting its mask) and names itself afterwards, so a listing
  can catch it between ``clone`` and ``prctl(PR_SET_NAME)``; the CANN runtime's
  ``acl_thread`` is born that way. A pass or two later it carries its name;
* every other thread once every ``COMM_SWEEP_PASSES`` passes, staggered by tid
  so each pass reads the same small share (no pass pays for a full sweep): a
  thread renamed long after birth is still moved to its role, at most a sweep
  later. That costs 1/COMM_SWEEP_PASSES of a comm read per thread per pass.

The cache (``Held.threads``: tid -> SeenThread) is updated in place; threads
that need the applier are returned for the daemon to act on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter

from ...discovery.read.bounded import task_affinity
from ...applier.affinity import cpus_for_role, role_of, targets_of
from ...applier.bind import merge_npu_plans
from ...discovery.read.tasks import list_tids, task_comm, thread_count
from ...values.model import Plan
from ...values.threadclass import ThreadClass
from .held import SeenThread

__all__ = ["COMM_SWEEP_PASSES", "comm_due", "observe_threads", "observe_marked", "role_cpus", "sweep_slots",
           "slot_quiet", "Slot"]

COMM_SWEEP_PASSES = 30

_mask = attrgetter("mask")
_young = attrgetter("young")


def comm_due(tid: int, seen: SeenThread | None, pass_no: int, sweep: int = COMM_SWEEP_PASSES) -> bool:
    """Whether pass ``pass_no`` must read the comm of thread ``tid`` (``seen``: what the cache holds)."""
    return seen is None or seen.young > 0 or (tid + pass_no) % sweep == 0


def role_cpus(plan: Plan) -> dict[str, frozenset[int]]:
    """Role (or share class) -> the CPUs its threads belong on under ``plan`` (every NPU's
    roles merged)."""
    merged = merge_npu_plans(plan.npus)
    return {role: cpus_for_role(merged, role, plan.mode) for role in targets_of(plan.thread_classes)}


Look = tuple[list[tuple[int, str]], list[int]]
Slot = tuple[list[int], list[frozenset[int]]]  # (tids, the mask each must have), checked in one sweep


def sweep_slots(pid: int, threads: Mapping[int, SeenThread], passes: int) -> tuple[Slot, ...]:
    """The mask sweep spread over ``passes`` passes: slot ``j`` holds the worker's main
    thread (tid == pid) and its ACL and release threads, which every pass checks,
    and the other threads whose tid is ``j`` modulo ``passes``, so each thread's mask
    is read once in ``passes`` passes. Moving a whole process (``taskset -a``, a
    cpuset change, a runtime re-pinning itself) moves its main thread: the next
    pass sees it whatever the slot."""
    passes = max(1, passes)
    always: list[tuple[int, SeenThread]] = []
    parts: list[list[tuple[int, SeenThread]]] = [[] for _ in range(passes)]
    for tid, seen in threads.items():
        if tid == pid or seen.role != "main":
            always.append((tid, seen))
        else:
            parts[tid % passes].append((tid, seen))
    shares = (always + part for part in parts)
    return tuple(([t for t, _ in share], [s.mask for _, s in share]) for share in shares)


def slot_quiet(slot: Slot) -> bool:
    """Whether every thread of ``slot`` still has its mask (one ``sched_getaffinity``
    each, compared in one sweep); False when one moved or is gone."""
    tids, want = slot
    try:
        return list(map(task_affinity, tids)) == want
    except OSError:  # ESRCH: a thread exited since it was cached; the look that follows forgets it
        return False


def observe_threads(
    pid: int,
    threads: dict[int, SeenThread],
    role_cpus: Mapping[str, frozenset[int]],
    pass_no: int,
    *,
    proc_root: str = "/proc",
    sweep: int = COMM_SWEEP_PASSES,
    reread: bool = False,
    classes: Sequence[ThreadClass] = (),
) -> Look | None:
    """Look at every thread of ``pid`` once.

    Returns (to_pin, drifted): ``to_pin`` lists (tid, role) of threads that are new
    or renamed into another role and not on that role's CPUs; ``drifted`` the known
    threads whose mask differs from the one we set. None when the task list cannot
    be read (the process is gone). New or renamed threads already on their role's
    CPUs are accepted into ``threads`` here. ``reread``: list, and read every
    thread's name afresh (the thread events since the last look are not known).
    ``classes``: the plan's thread classes, which decide a name's role before the built-in rules.
    """
    if reread:
        for seen in threads.values():
            seen.young = max(seen.young, 1)
        return _look_listed(pid, threads, role_cpus, pass_no, proc_root=proc_root, sweep=sweep, classes=classes)
    if threads and thread_count(pid, proc_root) == len(threads):
        known = _look_known(pid, threads, pass_no, proc_root=proc_root, sweep=sweep, classes=classes)
        if known is not None:
            return known
    return _look_listed(pid, threads, role_cpus, pass_no, proc_root=proc_root, sweep=sweep, classes=classes)


def _look_known(pid: int, threads: dict[int, SeenThread], pass_no: int, *, proc_root: str,
                sweep: int, classes: Sequence[ThreadClass] = ()) -> Look | None:
    """The look without a listing, over the cached threads; None (and nothing changed)
    when a listing must decide: a thread gone or not this worker's, or a mask moved."""
    tids = list(threads)
    seen = list(threads.values())
    if not slot_quiet((tids, list(map(_mask, seen)))):  # a cached thread gone (ESRCH), or a mask moved
        return None
    # comm_due, over the whole cache without touching a record unless one is young
    due = [tid for tid in tids if (tid + pass_no) % sweep == 0]
    if any(map(_young, seen)):
        due = [tid for tid, s in zip(tids, seen) if s.young > 0 or (tid + pass_no) % sweep == 0]
    to_pin: list[tuple[int, str]] = []
    looked: list[SeenThread] = []
    for tid in due:
        comm = task_comm(pid, tid, proc_root)
        if comm is None:
            return None
        role = role_of(comm, classes)
        if role != threads[tid].role:
            to_pin.append((tid, role))
        else:
            looked.append(threads[tid])
    for s in looked:
        if s.young > 0:
            s.young -= 1
    return to_pin, []


def _look_listed(pid: int, threads: dict[int, SeenThread], role_cpus: Mapping[str, frozenset[int]],
                 pass_no: int, *, proc_root: str, sweep: int, classes: Sequence[ThreadClass] = ()) -> Look | None:
    names = list_tids(pid, proc_root)
    if names is None:
        return None
    getaff = task_affinity
    to_pin: list[tuple[int, str]] = []
    drifted: list[int] = []
    for tid in names:
        try:
            mask = getaff(tid)
        except OSError:
            continue  # exited since the listing
        seen = threads.get(tid)
        if seen is None or seen.young > 0 or (tid + pass_no) % sweep == 0:  # comm_due, inlined: hot loop
            comm = task_comm(pid, tid, proc_root)
            if comm is None:
                continue
            role = role_of(comm, classes)
            if seen is None or role != seen.role:
                if mask == role_cpus[role]:
                    threads[tid] = SeenThread(frozenset(mask), role)
                else:
                    to_pin.append((tid, role))
                continue
            if seen.young > 0:
                seen.young -= 1
        if mask != seen.mask:
            drifted.append(tid)
    if len(threads) + len(to_pin) != len(names):
        # threads exited (or vanished mid-look): forget them, so a tid the kernel
        # hands out again is treated as the new thread it is
        listed = set(names)
        for tid in [t for t in threads if t not in listed]:
            del threads[tid]
    return to_pin, drifted


def observe_marked(
    pid: int,
    threads: dict[int, SeenThread],
    role_cpus: Mapping[str, frozenset[int]],
    look: Iterable[int] = (),
    *,
    proc_root: str = "/proc",
    classes: Sequence[ThreadClass] = (),
) -> Look:
    """The look when the kernel's process events say which threads changed: ``look``
    (born, renamed or exited since the last look) have their name and mask read (one
    that is gone is forgotten), and every other known thread costs one
    ``sched_getaffinity``, compared in one sweep. No listing and no other name is read.

    A name is read through ``/proc/<pid>/task/<tid>``, which fails for a tid that is
    not (or no longer) this worker's; so is every thread whose mask differs before
    it counts as drift (its tid may have exited after the events were read and been
    handed to another process). Returns (to_pin, drifted) as ``observe_threads``.
    """
    to_pin: list[tuple[int, str]] = []
    moving: set[int] = set()
    for tid in look:
        role = _named(pid, tid, threads, role_cpus, proc_root, classes)
        if role is not None:
            to_pin.append((tid, role))
            moving.add(tid)
    if moving:
        tids = [t for t in threads if t not in moving]
        seen = [threads[t] for t in tids]
    else:  # the usual pass: both straight from the dict, in its order, no loop in the interpreter
        tids, seen = list(threads), list(threads.values())
    try:
        masks = list(map(task_affinity, tids))
    except OSError:  # a thread exited since the events were read: its exit is in the next batch
        masks = [_mask_or_none(t) for t in tids]
    drifted: list[int] = []
    if masks != list(map(_mask, seen)):
        for tid, mask, s in zip(tids, masks, seen):
            if mask == s.mask:
                continue
            if mask is None:
                del threads[tid]
                continue
            role = _named(pid, tid, threads, role_cpus, proc_root, classes)
            if role is not None:
                to_pin.append((tid, role))  # renamed too: its role's CPUs, not the old mask
            elif tid in threads and threads[tid] is s:
                drifted.append(tid)
    return to_pin, drifted


def _mask_or_none(tid: int) -> frozenset[int] | None:
    try:
        return frozenset(task_affinity(tid))
    except OSError:
        return None


def _named(pid: int, tid: int, threads: dict[int, SeenThread], role_cpus: Mapping[str, frozenset[int]],
           proc_root: str, classes: Sequence[ThreadClass] = ()) -> str | None:
    """Read ``tid``'s name (and mask): the role it must be pinned to when it is new or
    renamed into another role and not on that role's CPUs, else None. A new or renamed
    thread already on its role's CPUs is accepted into ``threads``; one that is not
    this worker's any more is forgotten."""
    comm = task_comm(pid, tid, proc_root)
    mask = _mask_or_none(tid) if comm is not None else None
    if mask is None:
        threads.pop(tid, None)
        return None
    role = role_of(comm, classes)
    seen = threads.get(tid)
    if seen is not None and seen.role == role:
        return None  # not renamed into another role: its mask is the sweep's business
    if mask == role_cpus[role]:
        threads[tid] = SeenThread(mask, role, young=0)
        return None
    return role
