"""The UVB step (Ascend 950 only): host ``uvb_poll_window_thread`` threads -> the UVB pool.

These threads belong to the driver, not to the worker: they are found host-wide
(``ps -Te`` / ``/proc/*/task/*/comm``; a container needs ``--pid=host`` to see
them) and the plan lists their tids. Every 950 worker plans the same UVB pool,
so binding them again is harmless. Their masks before the first write are kept
(``UvbStep.previous``, ``Binding.uvb_previous``; ``data["previous"]`` in the
report); release puts them back only when asked (the daemon does so when the
last 950 worker goes), since other workers still rely on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..discovery.read.bounded import task_affinity
from ..values.cpulist import format_cpulist
from ..values.frozen import frozen_map
from ..values.model import Mode, Plan, StepResult
from ..values.reasons import Outcome, Reason, Step
from .affinity import set_tid_affinity

__all__ = ["bind_uvb_threads", "bind_uvb", "restore_uvb_threads", "UvbStep"]


@dataclass(frozen=True)
class UvbStep:
    """The UVB step's report and, per thread bound, its mask before binding."""

    result: StepResult
    previous: Mapping[int, frozenset[int]] = field(default_factory=frozen_map)


def bind_uvb_threads(plan: Plan) -> StepResult:
    return bind_uvb(plan).result


def bind_uvb(plan: Plan) -> UvbStep:
    if plan.mode != Mode.ASCEND950_CLUSTER:
        return UvbStep(_result(Outcome.SKIPPED, Reason.NOT_APPLICABLE, "UVB poll threads exist on Ascend 950 only"))
    if not plan.uvb_tids:
        return UvbStep(_result(
            Outcome.SKIPPED, Reason.NO_UVB_THREADS,
            "no uvb_poll_window_thread visible (a container needs --pid=host)",
        ))
    if not plan.uvb_cpus:
        return UvbStep(_result(Outcome.SKIPPED, Reason.NO_UVB_THREADS, "the plan has no UVB CPUs"))
    result, previous = _set(plan.uvb_tids, frozenset(plan.uvb_cpus), save=True)
    return UvbStep(result, frozen_map({t: frozenset(c) for t, c in previous.items()}))


def restore_uvb_threads(previous: Mapping[int, frozenset[int] | list[int]]) -> StepResult:
    """Put each UVB thread back on the mask it had before ``bind_uvb_threads``."""
    if not previous:
        return _result(Outcome.SKIPPED, Reason.NOTHING_TO_RESTORE, "no UVB thread was bound")
    groups: dict[frozenset[int], list[int]] = {}
    for tid, cpus in previous.items():
        groups.setdefault(frozenset(cpus), []).append(int(tid))
    results = [_set(tids, cpus, save=False)[0] for cpus, tids in groups.items()]
    bad = [r for r in results if r.outcome is not Outcome.APPLIED]
    return bad[0] if bad else results[0]


def _set(tids, cpus: frozenset[int], *, save: bool) -> tuple[StepResult, dict[int, list[int]]]:
    bound, gone = [], []
    problems: list[dict] = []
    previous: dict[int, list[int]] = {}
    for tid in tids:
        if save:
            try:
                previous[tid] = sorted(task_affinity(tid))
            except OSError:
                gone.append(tid)
                continue
        status, kept = set_tid_affinity(tid, cpus)
        if status == "ok":
            bound.append(tid)
        elif status == "gone":
            gone.append(tid)
            previous.pop(tid, None)
        else:
            problems.append({"tid": tid, "status": status, "kept": sorted(kept)})
    data = {"bound": bound, "vanished": gone, "cpus": sorted(cpus)}
    if save:
        data["previous"] = previous
    detail = f"{len(bound)} uvb_poll_window_thread -> {format_cpulist(cpus)}"
    if gone:
        detail += f"; {len(gone)} exited meanwhile"
    if problems:
        data["problems"] = problems
        p = problems[0]
        reason = {"denied": Reason.NOT_PERMITTED, "refused": Reason.MASK_REFUSED}.get(p["status"], Reason.MASK_NARROWED)
        return _result(
            Outcome.FAILED, reason,
            f"tid {p['tid']}: {p['status']}, kernel kept {format_cpulist(p['kept']) or 'none'}; {detail}", data,
        ), previous
    if not bound:
        return _result(Outcome.SKIPPED, Reason.NO_UVB_THREADS, f"all {len(gone)} UVB threads exited", data), previous
    return _result(Outcome.APPLIED, None, detail, data), previous


def _result(outcome: Outcome, reason: Reason | None, detail: str, data: dict | None = None) -> StepResult:
    return StepResult(Step.UVB, outcome, reason, detail, frozen_map(data))
