"""What each level wants of the host's masks, mask by mask: key -> (the text it
holds now, the CPUs the level wants for it). Each is weighed afterwards by
rules/verdicts.py against the record; every mask is read through its kind
(kinds.py); a mask is always narrowed from its *original* (the
record's, else its text now), so a release of one of two workers puts back the
CPUs the other no longer needs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ...applier.taskmask import task_cpus
from ...values.config import Config
from ...values.cpulist import format_cpulist
from ...discovery.gather.hostwork import irq_names, irq_numbers, kernel_threads
from ...values.model import HostFacts
from ...planner.isolate.driverwork import driver_cpus, sq_send_wq_name, sq_task_device
from ...planner.isolate.isolation import IsolationPlan, narrowed
from .kinds import MaskKind, mask_kinds
from .rules.keys import MaskKey
from .rules.records import SavedMask
from .rules.verdicts import irq_target

__all__ = ["irq_wanted", "host_wide_wanted", "Wanted"]

Wanted = dict[MaskKey, tuple[str, frozenset[int]]]  # key -> (the text it holds now, the CPUs wanted)


def _original(saved: Mapping[MaskKey, SavedMask], key: MaskKey, current: str,
              kind: MaskKind) -> frozenset[int] | None:
    """The CPUs of the mask ``key`` as the host had it: the record's original, else its text now."""
    mine = saved.get(key)
    return mine.original_cpus() if mine is not None else kind.cpus(current)


def irq_wanted(iso: IsolationPlan, host: HostFacts, config: Config, pinned: frozenset[int],
               saved: Mapping[MaskKey, SavedMask], refused: Collection[str]) -> Wanted:
    """key -> (text now, wanted CPUs) of each mask the ``irqs`` level sets: every IRQ but
    the ``pinned`` ones, the default for new IRQs, the bound NPUs' driver threads and
    workqueues; none ``refused`` for good."""
    proc, kinds = config.proc_root, mask_kinds(config)
    drivers = driver_cpus(host, iso)
    names = irq_names(proc) if drivers else {}
    out: Wanted = {}
    for irq in irq_numbers(proc):
        key = MaskKey.of("irq", irq)
        if irq in pinned or key in refused or (current := kinds["irq"].read(key)) is None:
            continue
        cpus = _original(saved, key, current, kinds["irq"])
        if cpus is not None:
            out[key] = (current, irq_target(cpus, names.get(irq), iso, drivers))
    key = MaskKey.of("default")
    if (current := kinds["default"].read(key)) is not None and \
            (cpus := _original(saved, key, current, kinds["default"])) is not None:
        out[key] = (current, narrowed(cpus, iso.protected_cpus, iso.housekeeping))
    for t in kernel_threads(lambda comm: sq_task_device(comm) in drivers, proc) if drivers else ():
        key = MaskKey.of("task", t.pid, t.start_time)
        now = task_cpus(t.pid)
        if key not in refused and now is not None:
            out[key] = (format_cpulist(now), drivers[sq_task_device(t.comm)])
    for device, cpus in drivers.items():
        key = MaskKey.of("workqueue", sq_send_wq_name(device))
        current = kinds["workqueue"].read(key)
        if current is not None and key not in refused:
            out[key] = (current, cpus)
    return out


def host_wide_wanted(iso: IsolationPlan, config: Config, saved: Mapping[MaskKey, SavedMask],
                     refused: Collection[str]) -> Wanted:
    """The ``host`` level's wish for the two host-wide masks of the kernel's own work: the
    one the unbound workqueues share, and the CPUs the soft-lockup watchdog checks."""
    kinds = mask_kinds(config)
    out: Wanted = {}
    for kind in ("workqueues", "watchdog"):
        key = MaskKey.of(kind)
        current = kinds[kind].read(key)
        if current is None or key in refused:
            continue
        cpus = _original(saved, key, current, kinds[kind])
        if cpus is not None:
            out[key] = (current, narrowed(cpus, iso.protected_cpus, iso.housekeeping))
    return out
