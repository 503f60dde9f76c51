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
``release_thread*`` -> ``release``. On Ascend 950 (``ascend950_cluster``) every
thread goes to the whole cluster (``pool``).

The hot loop is deliberately plain (os.open/os.read, no helpers per thread): the
bind benchmark holds it to 1.5x of a bare loop doing the same syscalls.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Collection, Mapping

from ..cpulist import format_cpulist
from ..model import Mode, NpuPlan, Outcome, Reason, Step, StepResult, frozen_map

__all__ = [
    "ROLES",
    "MAX_PASSES",
    "role_of",
    "cpus_for_role",
    "bind_threads",
    "set_all_threads",
    "set_tid_affinity",
    "thread_masks",
    "read_comm",
]

ROLES = ("main", "acl", "release")
# Re-list passes before giving up on a process that keeps spawning threads; the
# daemon's reconcile loop catches whatever is born after the last pass.
MAX_PASSES = 8
# failure entries kept in StepResult.data (the counts are always complete)
_MAX_REPORTED = 20


def role_of(comm: str) -> str:
    """Thread roles by name: ``acl_thread*`` -> acl, ``release_thread*`` -> release, else main."""
    if comm.startswith("acl_thread"):
        return "acl"
    if comm.startswith("release_thread"):
        return "release"
    return "main"


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
    if role not in ROLES:
        raise ValueError(f"unknown thread role {role!r}")
    for cpus in (getattr(npu_plan, role), npu_plan.main, npu_plan.pool):
        if cpus:
            return frozenset(cpus)
    return frozenset()


def read_comm(path: str) -> str | None:
    """A thread's ``comm`` (one read, at most 64 bytes); None once the thread is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 64).decode("utf-8", "replace").rstrip("\n")
    except OSError:
        return None
    finally:
        os.close(fd)


def thread_masks(pid: int, *, proc_root: str = "/proc") -> dict[int, tuple[str, frozenset[int]]]:
    """tid -> (comm, current CPU mask) for every live thread of ``pid`` ({} when gone)."""
    task_dir = f"{proc_root}/{pid}/task"
    try:
        names = os.listdir(task_dir)
    except OSError:
        return {}
    out: dict[int, tuple[str, frozenset[int]]] = {}
    for name in names:
        comm = read_comm(f"{task_dir}/{name}/comm")
        if comm is None:
            continue
        tid = int(name)
        try:
            out[tid] = (comm, frozenset(os.sched_getaffinity(tid)))
        except OSError:
            continue
    return out


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
        got = os.sched_getaffinity(tid)
    except ProcessLookupError:
        return "gone", frozenset()
    if got == cpus:
        return "ok", cpus
    return "narrowed", frozenset(got)


def _mask_or_empty(tid: int) -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(tid))
    except OSError:
        return frozenset()


def bind_threads(
    pid: int,
    npu_plan: NpuPlan,
    mode: Mode | str,
    *,
    proc_root: str = "/proc",
    only_tids: Collection[int] | None = None,
) -> StepResult:
    """Bind every thread of ``pid`` by role (or only ``only_tids``, for the reconcile loop)."""
    role_cpus = {role: cpus_for_role(npu_plan, role, mode) for role in ROLES}
    return _bind(pid, role_cpus, proc_root=proc_root, only_tids=only_tids, by_role=not _is_950(mode))


def set_all_threads(
    pid: int, cpus: frozenset[int], *, proc_root: str = "/proc", step: Step = Step.AFFINITY
) -> StepResult:
    """Give every thread of ``pid`` the same mask (release: back to the allowed CPUs)."""
    cpus = frozenset(cpus)
    return _bind(pid, {r: cpus for r in ROLES}, proc_root=proc_root, only_tids=None, by_role=False, step=step)


def _bind(
    pid: int,
    role_cpus: Mapping[str, frozenset[int]],
    *,
    proc_root: str,
    only_tids: Collection[int] | None,
    by_role: bool,
    step: Step = Step.AFFINITY,
) -> StepResult:
    task_dir = f"{proc_root}/{pid}/task"
    main_cpus = role_cpus["main"]
    acl_cpus = role_cpus["acl"]
    rel_cpus = role_cpus["release"]
    counts = {"main": 0, "acl": 0, "release": 0}
    seen: set[str] = set()
    vanished = 0
    problems: dict[str, list[dict]] = {"denied": [], "refused": [], "narrowed": []}
    listed_any = False
    stable = only_tids is not None
    passes = 0
    setaff = os.sched_setaffinity
    getaff = os.sched_getaffinity
    wanted = {str(t) for t in only_tids} if only_tids is not None else None

    while passes < (1 if wanted is not None else MAX_PASSES):
        passes += 1
        if wanted is not None:
            names = sorted(wanted, key=int)
        else:
            try:
                names = os.listdir(task_dir)
            except OSError:
                break
        listed_any = listed_any or bool(names)
        new = [n for n in names if n not in seen]
        if not new:
            stable = True
            break
        for name in new:
            seen.add(name)
            try:
                fd = os.open(f"{task_dir}/{name}/comm", os.O_RDONLY)
            except OSError:
                vanished += 1
                continue
            try:
                comm = os.read(fd, 64).decode("utf-8", "replace").rstrip("\n")
            except OSError:
                vanished += 1
                continue
            finally:
                os.close(fd)
            if by_role and comm.startswith("acl_thread"):
                role, cpus = "acl", acl_cpus
            elif by_role and comm.startswith("release_thread"):
                role, cpus = "release", rel_cpus
            else:
                role, cpus = "main", main_cpus
            tid = int(name)
            try:
                setaff(tid, cpus)
                got = getaff(tid)
            except ProcessLookupError:
                vanished += 1
                continue
            except OSError:
                status, kept = set_tid_affinity(tid, cpus)  # classify the error once, off the hot path
                if status == "gone":
                    vanished += 1
                else:
                    _note(problems[status], tid, comm, role, cpus, kept)
                continue
            if got != cpus:
                _note(problems["narrowed"], tid, comm, role, cpus, frozenset(got))
                continue
            counts[role] += 1

    return _result(
        step, pid, role_cpus, by_role, counts, vanished, problems, listed_any or wanted is not None,
        stable, passes, len(seen), whole=wanted is None,
    )


def _note(bucket: list[dict], tid: int, comm: str, role: str, wanted: frozenset[int], kept: frozenset[int]) -> None:
    bucket.append({"tid": tid, "comm": comm, "role": role, "wanted": sorted(wanted), "kept": sorted(kept)})


def _result(
    step: Step,
    pid: int,
    role_cpus: Mapping[str, frozenset[int]],
    by_role: bool,
    counts: dict[str, int],
    vanished: int,
    problems: dict[str, list[dict]],
    listed_any: bool,
    stable: bool,
    passes: int,
    n_seen: int,
    *,
    whole: bool,
) -> StepResult:
    bound = sum(counts.values())
    n_bad = {k: len(v) for k, v in problems.items()}
    data: dict = {
        "bound": bound,
        "counts": dict(counts),
        "vanished": vanished,
        "passes": passes,
        "stable": stable,
        "cpus": {r: sorted(c) for r, c in role_cpus.items()} if by_role else sorted(role_cpus["main"]),
    }
    for kind, entries in problems.items():
        if entries:
            data[kind] = entries[:_MAX_REPORTED]
            data[f"{kind}_count"] = len(entries)

    # binding a whole process that has (or keeps) no thread means it exited; a
    # named set of tids that all vanished is just threads that came and went
    if whole and (not listed_any or (bound == 0 and not any(n_bad.values()))):
        return StepResult(
            step,
            Outcome.FAILED,
            Reason.PID_GONE,
            f"process {pid} has no threads left to bind ({vanished} vanished while binding)",
            frozen_map(data),
        )

    if by_role:
        parts = [f"{counts[r]} {r} -> {format_cpulist(role_cpus[r])}" for r in ROLES if counts[r]]
        summary = f"bound {bound} threads of {pid} ({', '.join(parts)})"
    else:
        summary = f"bound {bound} threads of {pid} to {format_cpulist(role_cpus['main'])}"
    if vanished:
        summary += f"; {vanished} exited meanwhile"
    if not stable:
        summary += f"; threads were still appearing after {passes} passes"

    for kind, reason, why in (
        ("denied", Reason.NOT_PERMITTED, "not permitted to set the mask"),
        ("refused", Reason.MASK_REFUSED, "the kernel refused the mask (no CPU of it is in the thread's cpuset)"),
        ("narrowed", Reason.MASK_NARROWED, "the kernel narrowed the mask (cpuset)"),
    ):
        if problems[kind]:
            first = problems[kind][0]
            kept = format_cpulist(first["kept"]) or "none"
            detail = (
                f"{n_bad[kind]} of {n_seen} threads: {why}; e.g. tid {first['tid']} ({first['comm']}) "
                f"wanted {format_cpulist(first['wanted'])}, kernel kept {kept}. {summary}"
            )
            return StepResult(step, Outcome.FAILED, reason, detail, frozen_map(data))
    return StepResult(step, Outcome.APPLIED, None, summary, frozen_map(data))
