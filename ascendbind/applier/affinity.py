"""Per-thread CPU affinity of one worker: the role split by thread name, applied and read back.

Kernel facts this module is built on (measured on the CI host):

* ``sched_setaffinity(tid)`` changes ONE thread. A process is bound only when
  every ``/proc/<pid>/task/<tid>`` has been set, so we loop over the task list.
* Threads come and go while we loop. A thread that exits under us answers
  ESRCH (or its ``comm`` vanishes): that is not an error. A thread created while
  we loop inherits its creator's mask, which may predate our write, so the task
  list is re-read until a pass finds nothing new (bounded by ``MAX_PASSES``).
* A mask partly outside the thread's cpuset is silently narrowed to the
  intersection; a mask wholly outside it is refused with EINVAL. Neither is
  visible without reading the mask back, so every write is read back and a
  difference is reported (``mask_narrowed`` / ``mask_refused``) with the CPUs
  the kernel kept.

Roles: every thread -> ``main``; comm ``acl_thread*`` -> ``acl``;
``release_thread*`` -> ``release``; in front of those rules, the plan's thread
classes (values/threadclass.py): a class sends its threads to a role or to its
own share of main (``NpuPlan.classes``). On Ascend 950 (``ascend950_cluster``)
every thread goes to the whole cluster (``pool``).

The first pass binds the threads of the request's observation of the process
(discovery's ``ProcessView``: listed and named once); later passes list the task
directory again, through discovery, and bind only threads it did not hold. Every
write is read back, and those read-back masks are the step's second result
(``AffinityResult.threads``), so nobody lists the threads again to learn them.
The hot loop is deliberately plain (no helpers per thread): the bind benchmark
holds it to 1.5x of a bare loop doing the same syscalls.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..discovery.read.bounded import task_affinity
from ..values.cpulist import format_cpulist
from ..discovery.read.pin import ProcessPin
from ..discovery.gather.process import new_tasks, task_comm
from ..values.frozen import frozen_map
from ..values.model import Mode, NpuPlan, StepResult
from ..values.reasons import Outcome, Reason, Step
from ..values.threadclass import ThreadClass, class_names
from ..values.threadclass import role_of as _class_role
from .confirm import Confirmation, confirm_writes

__all__ = [
    "ROLES",
    "MAX_PASSES",
    "role_of",
    "targets_of",
    "cpus_for_role",
    "bind_threads",
    "bind_tasks",
    "set_all_threads",
    "ThreadMask",
    "AffinityResult",
    "set_tid_affinity",
]

ROLES = ("main", "acl", "release")
# Re-list passes before giving up on a process that keeps spawning threads; the
# daemon's reconcile loop catches whatever is born after the last pass.
MAX_PASSES = 8
# failure entries kept in StepResult.data (the counts are always complete)
_MAX_REPORTED = 20


def role_of(comm: str, classes: Sequence[ThreadClass] = ()) -> str:
    """Where a thread goes by its name: the first matching class's role or share (its
    name), else ``acl_thread*`` -> acl, ``release_thread*`` -> release, else main."""
    return _class_role(comm, classes)


def targets_of(classes: Sequence[ThreadClass] = ()) -> tuple[str, ...]:
    """Every place a thread can go under ``classes``: the roles, then the share classes."""
    return ROLES + class_names(classes)


def _is_950(mode: Mode | str) -> bool:
    return mode == Mode.ASCEND950_CLUSTER or mode == Mode.ASCEND950_CLUSTER.value


def cpus_for_role(npu_plan: NpuPlan, role: str, mode: Mode | str) -> frozenset[int]:
    """The CPUs a thread of ``role`` is bound to under ``npu_plan``.

    Ascend 950 binds every thread to the whole cluster. An empty role (a plan
    that does not split it) falls back to ``main``, then to the pool, so no
    thread is ever given an empty mask.
    """
    if _is_950(mode) or role == "pool":
        return frozenset(npu_plan.pool)
    if role in ROLES:
        own = getattr(npu_plan, role)
    elif any(name == role for name, _ in npu_plan.classes):
        own = npu_plan.class_cpus(role)
    else:
        raise ValueError(f"unknown thread role {role!r}")
    for cpus in (own, npu_plan.main, npu_plan.pool):
        if cpus:
            return frozenset(cpus)
    return frozenset()


class ThreadMask(NamedTuple):
    """One thread as the affinity step left it: its name and the mask the kernel holds."""

    comm: str
    mask: frozenset[int]


@dataclass(frozen=True)
class AffinityResult:
    """The affinity step's outcome and, per thread of the worker it reached, the mask it
    read back right after writing (tid -> ThreadMask): the held record starts from these.
    ``confirmed``: with a pin, what the check after the writes found (confirm.py)."""

    result: StepResult
    threads: Mapping[int, ThreadMask]
    confirmed: Confirmation | None = None


def set_tid_affinity(tid: int, cpus: frozenset[int]) -> tuple[str, frozenset[int]]:
    """Set one thread's mask and read it back.

    Returns (status, kept): status is ``ok``, ``gone``, ``narrowed``, ``refused``
    or ``denied``; ``kept`` is the mask the kernel holds afterwards.
    """
    try:
        os.sched_setaffinity(tid, cpus)
    except ProcessLookupError:
        return "gone", frozenset()
    except PermissionError:
        return "denied", _mask_or_empty(tid)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return "refused", _mask_or_empty(tid)
        raise
    try:
        got = task_affinity(tid)
    except ProcessLookupError:
        return "gone", frozenset()
    if got == cpus:
        return "ok", cpus
    return "narrowed", frozenset(got)


def _mask_or_empty(tid: int) -> frozenset[int]:
    try:
        return frozenset(task_affinity(tid))
    except OSError:
        return frozenset()


def bind_threads(pid: int, npu_plan: NpuPlan, mode: Mode | str, **how) -> StepResult:
    """Bind every thread of ``pid`` by role (or only ``only_tids``, for the reconcile loop):
    ``bind_tasks``'s step result, with the same keywords."""
    return bind_tasks(pid, npu_plan, mode, **how).result


def bind_tasks(
    pid: int,
    npu_plan: NpuPlan,
    mode: Mode | str,
    *,
    proc_root: str = "/proc",
    only_tids: Collection[int] | None = None,
    tasks: Iterable[tuple] | None = None,
    pin: ProcessPin | None = None,
    classes: Sequence[ThreadClass] = (),
) -> AffinityResult:
    """``bind_threads``, with the masks read back. ``tasks``: (tid, comm, ...) of the threads as
    already observed; the first pass binds those without listing or reading a name, later
    passes list the task directory for threads born meanwhile. ``pin``: the worker held by
    its pidfd; each thread's mask is read before it is written, later passes list through
    the pin, and once done every write is confirmed (confirm.py): one that reached another
    process's thread is undone, and the step fails ``pid_recycled`` (``pid_gone`` when the
    worker exited and nothing of it was written elsewhere). ``classes``: the plan's thread
    classes, matched before the built-in rules."""
    by_role = not _is_950(mode)
    classes = tuple(classes) if by_role else ()
    role_cpus = {role: cpus_for_role(npu_plan, role, mode) for role in targets_of(classes)}
    return _bind(pid, role_cpus, proc_root=proc_root, only_tids=only_tids, by_role=by_role, tasks=tasks,
                 pin=pin, classes=classes)


def set_all_threads(
    pid: int, cpus: frozenset[int], *, proc_root: str = "/proc", step: Step = Step.AFFINITY,
    pin: ProcessPin | None = None,
) -> StepResult:
    """Give every thread of ``pid`` the same mask (release: back to the allowed CPUs)."""
    cpus = frozenset(cpus)
    return _bind(pid, {r: cpus for r in ROLES}, proc_root=proc_root, only_tids=None, by_role=False,
                 step=step, pin=pin).result


@dataclass
class _Tally:
    """What the passes of one bind have done so far, thread by thread."""

    counts: dict[str, int]  # role -> threads left on its CPUs
    seen: set[str] = field(default_factory=set)  # tids (as listed) already handled
    named: dict[str, str] = field(default_factory=dict)  # comm -> its class's target: threads share a few names
    vanished: int = 0
    problems: dict[str, list[dict]] = field(default_factory=lambda: {"denied": [], "refused": [], "narrowed": []})
    readback: dict[int, ThreadMask] = field(default_factory=dict)
    before: dict[int, set[int]] = field(default_factory=dict)  # with a pin: tid -> its mask before our write
    passes: int = 0
    stable: bool = False
    listed_any: bool = False
    listed_after: frozenset[int] | None = None  # with a pin: the last pass's task list, after every write


def _bind(
    pid: int,
    role_cpus: Mapping[str, frozenset[int]],
    *,
    proc_root: str,
    only_tids: Collection[int] | None,
    by_role: bool,
    step: Step = Step.AFFINITY,
    tasks: Iterable[tuple] | None = None,
    pin: ProcessPin | None = None,
    classes: tuple[ThreadClass, ...] = (),
) -> AffinityResult:
    tally = _Tally(dict.fromkeys(role_cpus, 0), stable=only_tids is not None)
    while tally.passes < (1 if only_tids is not None else MAX_PASSES):
        tally.passes += 1
        if only_tids is not None:
            batch = [(str(t), task_comm(pid, t, proc_root)) for t in sorted(only_tids)]
        elif tally.passes == 1 and tasks is not None:
            batch = [(str(t[0]), t[1]) for t in tasks]
        else:
            batch = new_tasks(pid, tally.seen, proc_root) if pin is None else pin.new_tasks(tally.seen)
            if batch is None:
                break
        tally.listed_any = tally.listed_any or bool(batch) or bool(tally.seen)
        if not batch:
            tally.stable = True
            if pin is not None and only_tids is None:
                tally.listed_after = pin.listed
            break
        _write_batch(batch, role_cpus, tally, by_role=by_role, classes=classes if by_role else (),
                     read_first=pin is not None)
    confirmed = _confirm(pin, tally, role_cpus, classes if by_role else None)
    result = _result(step, pid, role_cpus, by_role, tally, listed_any=tally.listed_any or only_tids is not None,
                     whole=only_tids is None)
    if confirmed is not None and (confirmed.exited or confirmed.landed_elsewhere):
        result = _unconfirmed(result, pid, confirmed, len(tally.readback))
    return AffinityResult(result, frozen_map(tally.readback), confirmed)


def _write_batch(batch: list[tuple[str, str | None]], role_cpus: Mapping[str, frozenset[int]], tally: _Tally, *,
                 by_role: bool, classes: tuple[ThreadClass, ...], read_first: bool) -> None:
    """Sets the mask of each (tid, comm) of ``batch`` by its role and reads it back; one plain
    loop over locals, since a bind of a large worker spends its time here, thread by thread.
    ``read_first``: each mask is read before it is written, for the check after the writes."""
    main_cpus, acl_cpus, rel_cpus = role_cpus["main"], role_cpus["acl"], role_cpus["release"]
    counts, named, seen, readback, before = tally.counts, tally.named, tally.seen, tally.readback, tally.before
    setaff, getaff = os.sched_setaffinity, task_affinity
    for name, comm in batch:
        seen.add(name)
        if comm is None:
            tally.vanished += 1
            continue
        if classes:
            role = named.get(comm)
            if role is None:
                role = named[comm] = _class_role(comm, classes)
            cpus = role_cpus[role]
        elif by_role and comm.startswith("acl_thread"):
            role, cpus = "acl", acl_cpus
        elif by_role and comm.startswith("release_thread"):
            role, cpus = "release", rel_cpus
        else:
            role, cpus = "main", main_cpus
        tid = int(name)
        try:
            if read_first:
                before[tid] = getaff(tid)
            setaff(tid, cpus)
            got = getaff(tid)
        except ProcessLookupError:
            tally.vanished += 1
            continue
        except OSError:
            status, kept = set_tid_affinity(tid, cpus)  # classify the error once, off the hot path
            if status == "gone":
                tally.vanished += 1
            else:
                _note(tally.problems[status], tid, comm, role, cpus, kept)
                readback[tid] = ThreadMask(comm, kept)
            continue
        if got != cpus:
            kept = frozenset(got)
            _note(tally.problems["narrowed"], tid, comm, role, cpus, kept)
            readback[tid] = ThreadMask(comm, kept)
            continue
        readback[tid] = ThreadMask(comm, cpus)
        counts[role] += 1


def _confirm(pin: ProcessPin | None, tally: _Tally, role_cpus: Mapping[str, frozenset[int]],
             classes: tuple[ThreadClass, ...] | None) -> Confirmation | None:
    """With a pin, the check after the writes (confirm.py); a write it found on another process's
    thread leaves the read-back masks and the counts. ``classes`` None: bound without roles."""
    if pin is None or not tally.readback:
        return None
    confirmed = confirm_writes(pin, {tid: (frozenset(tally.before[tid]), m.mask) for tid, m in tally.readback.items()
                                     if tid in tally.before}, tally.listed_after)
    for s in confirmed.stray:
        gone = tally.readback.pop(s.tid)
        role = _class_role(gone.comm, classes) if classes is not None else "main"
        if gone.mask == role_cpus[role]:
            tally.counts[role] -= 1
    return confirmed


def _unconfirmed(result: StepResult, pid: int, c: Confirmation, kept: int) -> StepResult:
    """The step's result once the check after the writes found the worker gone, or a write on
    another process's thread (undone): failed, ``pid_recycled`` when anything of ours reached
    another process, else ``pid_gone``."""
    data = {**result.data, "confirmed": c.to_json()}
    elsewhere, undone = c.landed_elsewhere, c.count("undone")
    if elsewhere:
        what = (f"{elsewhere} of the writes reached threads of another process (their ids recycled since "
                f"process {pid} was observed); {undone} undone, their masks set back as read before the write")
        if c.count("failed"):
            what += f", {c.count('failed')} could not be"
        reason = Reason.PID_RECYCLED
    else:
        what, reason = "nothing was written to another process", Reason.PID_GONE
    if c.exited:
        head = f"process {pid} exited while it was being bound"
    else:
        head = f"process {pid} kept {kept} thread masks, but {elsewhere} thread ids were recycled"
    return StepResult(result.step, Outcome.FAILED, reason, f"{head}: {what}", frozen_map(data))


def _note(bucket: list[dict], tid: int, comm: str, role: str, wanted: frozenset[int], kept: frozenset[int]) -> None:
    bucket.append({"tid": tid, "comm": comm, "role": role, "wanted": sorted(wanted), "kept": sorted(kept)})


def _result(step: Step, pid: int, role_cpus: Mapping[str, frozenset[int]], by_role: bool, tally: _Tally, *,
            listed_any: bool, whole: bool) -> StepResult:
    counts, vanished, problems = tally.counts, tally.vanished, tally.problems
    bound = sum(counts.values())
    data: dict = {
        "bound": bound,
        "counts": dict(counts),
        "vanished": vanished,
        "passes": tally.passes,
        "stable": tally.stable,
        "cpus": {r: sorted(c) for r, c in role_cpus.items()} if by_role else sorted(role_cpus["main"]),
    }
    for kind, entries in problems.items():
        if entries:
            data[kind] = entries[:_MAX_REPORTED]
            data[f"{kind}_count"] = len(entries)

    # binding a whole process that has (or keeps) no thread means it exited; a
    # named set of tids that all vanished is just threads that came and went
    if whole and (not listed_any or (bound == 0 and not any(problems.values()))):
        return StepResult(
            step,
            Outcome.FAILED,
            Reason.PID_GONE,
            f"process {pid} has no threads left to bind ({vanished} vanished while binding)",
            frozen_map(data),
        )

    if by_role:
        parts = [f"{counts[r]} {r} -> {format_cpulist(role_cpus[r])}" for r in role_cpus if counts[r]]
        summary = f"bound {bound} threads of {pid} ({', '.join(parts)})"
    else:
        summary = f"bound {bound} threads of {pid} to {format_cpulist(role_cpus['main'])}"
    if vanished:
        summary += f"; {vanished} exited meanwhile"
    if not tally.stable:
        summary += f"; threads were still appearing after {tally.passes} passes"
    failed = _first_problem(problems, len(tally.seen), summary)
    if failed is not None:
        return StepResult(step, Outcome.FAILED, failed[0], failed[1], frozen_map(data))
    return StepResult(step, Outcome.APPLIED, None, summary, frozen_map(data))


def _first_problem(problems: Mapping[str, list[dict]], n_seen: int, summary: str) -> tuple[Reason, str] | None:
    """(reason, detail) of the first kind of thread the kernel did not take the mask for."""
    for kind, reason, why in (
        ("denied", Reason.NOT_PERMITTED, "not permitted to set the mask"),
        ("refused", Reason.MASK_REFUSED, "the kernel refused the mask (no CPU of it is in the thread's cpuset)"),
        ("narrowed", Reason.MASK_NARROWED, "the kernel narrowed the mask (cpuset)"),
    ):
        if problems[kind]:
            first = problems[kind][0]
            kept = format_cpulist(first["kept"]) or "none"
            return reason, (f"{len(problems[kind])} of {n_seen} threads: {why}; e.g. tid {first['tid']} "
                            f"({first['comm']}) wanted {format_cpulist(first['wanted'])}, kernel kept {kept}. {summary}")
    return None
