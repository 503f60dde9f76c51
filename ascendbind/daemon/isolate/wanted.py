"""What each level wants of the host's masks, mask by mask: key -> (the text it
holds now, the CPUs the level wants for it). Each is weighed afterwards by
rules.py against the record; a mask is always narrowed from its *original* (the
record's, else its text now), so a release of one of two workers puts back the
CPUs the other no longer needs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from ...applier.taskmask import task_cpus
from ...values.config import Config
from ...values.cpulist import format_cpulist
from ...discovery.gather.hostwork import (irq_names, irq_numbers, kernel_threads, read_default_affinity,
                                          read_unbound_workqueues, read_watchdog_mask, read_workqueue_mask)
from ...discovery.gather.irqhost import read_irq_mask
from ...values.model import HostFacts
from ...planner.isolate.driverwork import driver_cpus, sq_send_wq_name, sq_task_device
from ...planner.isolate.isolation import IsolationPlan, narrowed
from ..state.isolationrecord import SavedMask, mask_key
from .masks import hex_cpus, list_cpus
from .rules import irq_target

__all__ = ["irq_wanted", "host_wide_wanted"]


def _original(saved: Mapping[str, SavedMask], key: str, current: str,
              parse: Callable[[str], frozenset[int] | None]) -> frozenset[int] | None:
    """The CPUs of the mask ``key`` as the host had it: the record's original, else its text now."""
    mine = saved.get(key)
    return parse(mine.original if mine is not None else current)


def irq_wanted(iso: IsolationPlan, host: HostFacts, config: Config, pinned: frozenset[int],
               saved: Mapping[str, SavedMask], refused: Collection[str]) -> dict[str, tuple[str, frozenset[int]]]:
    """key -> (text now, wanted CPUs) of each mask the ``irqs`` level sets: every IRQ but
    the ``pinned`` ones, the default for new IRQs, the bound NPUs' driver threads and
    workqueues; none ``refused`` for good."""
    proc = config.proc_root
    drivers = driver_cpus(host, iso)
    names = irq_names(proc) if drivers else {}
    out: dict[str, tuple[str, frozenset[int]]] = {}
    for irq in irq_numbers(proc):
        key = mask_key("irq", irq)
        current = read_irq_mask(irq, proc_root=proc)
        if irq in pinned or key in refused or current is None:
            continue
        cpus = _original(saved, key, current, hex_cpus)
        if cpus is not None:
            out[key] = (current, irq_target(cpus, names.get(irq), iso, drivers))
    current = read_default_affinity(proc)
    if current is not None and (cpus := _original(saved, "default", current, hex_cpus)) is not None:
        out["default"] = (current, narrowed(cpus, iso.protected_cpus, iso.housekeeping))
    for t in kernel_threads(lambda comm: sq_task_device(comm) in drivers, proc) if drivers else ():
        key = mask_key("task", t.pid, t.start_time)
        now = task_cpus(t.pid)
        if key not in refused and now is not None:
            out[key] = (format_cpulist(now), drivers[sq_task_device(t.comm)])
    for device, cpus in drivers.items():
        name = sq_send_wq_name(device)
        current = read_workqueue_mask(name, config.sys_root)
        key = mask_key("workqueue", name)
        if current is not None and key not in refused:
            out[key] = (current, cpus)
    return out


def host_wide_wanted(iso: IsolationPlan, config: Config, saved: Mapping[str, SavedMask],
                     refused: Collection[str]) -> dict[str, tuple[str, frozenset[int]]]:
    """The ``host`` level's wish for the two host-wide masks of the kernel's own work: the
    one the unbound workqueues share, and the CPUs the soft-lockup watchdog checks."""
    out: dict[str, tuple[str, frozenset[int]]] = {}
    for key, current, parse in (("workqueues", read_unbound_workqueues(config.sys_root), hex_cpus),
                                ("watchdog", read_watchdog_mask(config.proc_root), list_cpus)):
        if current is None or key in refused:
            continue
        cpus = _original(saved, key, current, parse)
        if cpus is not None:
            out[key] = (current, narrowed(cpus, iso.protected_cpus, iso.housekeeping))
    return out
