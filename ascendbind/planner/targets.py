"""Which NPUs a worker drives (OWNER: planner helper — replace this stub)."""

from __future__ import annotations

from collections.abc import Sequence

from ..model import HostFacts, WorkerFacts


def select_targets(host: HostFacts, worker: WorkerFacts, requested: Sequence[int] | None) -> tuple[int, ...]:
    """SPEC §3 'Target NPUs': ``requested`` if given (each must be a known logical id
    when the host lists any); else the NPUs the process table lists for worker.pid;
    else the running NPUs filtered by the worker's ASCEND_RT_VISIBLE_DEVICES;
    else PlanImpossible(code="no_target_npu") saying which it tried.
    """
    raise NotImplementedError
