"""Which NPUs a worker drives. Pure: facts in, ids out."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import PlanImpossible
from ..model import HostFacts, WorkerFacts
from .layout import cl

__all__ = ["select_targets", "visible_devices"]


def visible_devices(worker: WorkerFacts) -> tuple[int, ...] | None:
    """The worker's ``ASCEND_RT_VISIBLE_DEVICES`` as logical ids; None when unset or blank.

    A malformed value is a PlanImpossible naming it: guessing which NPUs a
    worker meant would bind it to the wrong CPUs.
    """
    raw = worker.env.get("ASCEND_RT_VISIBLE_DEVICES")
    if raw is None or not raw.strip():
        return None
    ids: list[int] = []
    for item in raw.split(","):
        item = item.strip()
        if not item.isdigit():
            raise PlanImpossible(
                f"pid {worker.pid}: ASCEND_RT_VISIBLE_DEVICES={raw!r} is not a comma-separated list of NPU ids",
                code="no_target_npu")
        ids.append(int(item))
    return tuple(sorted(set(ids)))


def select_targets(host: HostFacts, worker: WorkerFacts, requested: Sequence[int] | None) -> tuple[int, ...]:
    """The target NPUs: ``requested`` if given (each must be a known logical id
    when the host lists any); else the NPUs the process table lists for worker.pid;
    else the running NPUs filtered by the worker's ASCEND_RT_VISIBLE_DEVICES;
    else PlanImpossible(code="no_target_npu") saying which it tried.
    """
    known = set(host.logic_ids)
    if requested:
        ids = tuple(sorted(set(requested)))
        bad = [n for n in ids if n < 0 or (known and n not in known)]
        if bad:
            listed = f"npu-smi info -m lists {cl(known)}" if known else "ids are never negative"
            raise PlanImpossible(
                f"NPU {', '.join(map(str, bad))} {'is' if len(bad) == 1 else 'are'} not a logical NPU of this "
                f"host ({listed})", code="unknown_npu")
        return ids

    own = sorted({p.npu for p in host.processes if p.pid == worker.pid})
    if own:
        return tuple(own)

    running = sorted({p.npu for p in host.processes})
    visible = visible_devices(worker)
    tried = f"pid {worker.pid} is not in npu-smi info's process table"
    if visible is None:
        raise PlanImpossible(
            f"no target NPU: {tried}, and it has no ASCEND_RT_VISIBLE_DEVICES; pass --npu", code="no_target_npu")
    chosen = tuple(n for n in running if n in visible)
    if not chosen:
        shown = cl(running) if running else "none"
        raise PlanImpossible(
            f"no target NPU: {tried}, and no running NPU (running: {shown}) is in its "
            f"ASCEND_RT_VISIBLE_DEVICES={','.join(map(str, visible))}; pass --npu", code="no_target_npu")
    return chosen
