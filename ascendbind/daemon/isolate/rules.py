"""What isolation does to one mask. Pure: values in, a verdict out.

Each mask isolation may touch (an IRQ's, the default for new IRQs, a workqueue's,
a kernel thread's) is weighed with three values: what the state file saved for
it (the original text and every text written since, or nothing), what it holds
now (None: it is gone) and what isolation wants for it (None: nothing, the host's
own value). The verdict:

* ``nothing``: not ours and nothing wanted, or already as wanted;
* ``write``: write the wanted value; the record (original kept, the new text
  added to ``ours``) is saved *before* the write;
* ``keep``: ours and already as wanted;
* ``restore``: ours, no longer wanted, and still holding a value we wrote:
  write the original back;
* ``settled``: ours, no longer wanted, and already holding the original (a
  crash between the record and the write): forget it;
* ``gone``: the IRQ was freed, the thread exited, the workqueue went: forget it;
* ``owner``: it holds neither the original nor a value we wrote, so its owner
  (an operator, irqbalance, the driver) changed it meanwhile: leave it as it
  is, forget it, and say so.

``irq_target`` is where one IRQ goes under ``irqs``: the driver's mailbox IRQ
of a bound NPU to that NPU's IRQ CPUs, any other to ``narrowed`` of the mask the
host gave it (the saved original, not our own earlier value, so a release of
one of two workers puts back the CPUs the other no longer needs).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping

from ...planner.isolate.driverwork import trs_mbox_device
from ...planner.isolate.isolation import IsolationPlan, narrowed
from ..state.isolationrecord import SavedMask

__all__ = ["Act", "mask_act", "irq_target"]


class Act(str, enum.Enum):
    NOTHING = "nothing"
    WRITE = "write"
    KEEP = "keep"
    RESTORE = "restore"
    SETTLED = "settled"
    GONE = "gone"
    OWNER = "owner"


def mask_act(saved: SavedMask | None, current: frozenset[int] | None, wanted: frozenset[int] | None,
             cpus_of: Callable[[str], frozenset[int] | None]) -> Act:
    """The verdict for one mask (see the module docstring); ``cpus_of`` reads a saved text."""
    if saved is None:
        if current is None or wanted is None or wanted == current:
            return Act.NOTHING
        return Act.WRITE
    if current is None:
        return Act.GONE
    original = cpus_of(saved.original)
    ours = [cpus_of(t) for t in saved.ours]
    if current != original and current not in ours:
        return Act.OWNER
    if wanted is None or wanted == original:
        return Act.SETTLED if current == original else Act.RESTORE
    return Act.KEEP if wanted == current else Act.WRITE


def irq_target(base: frozenset[int], name: str | None, iso: IsolationPlan,
               drivers: Mapping[int, frozenset[int]]) -> frozenset[int]:
    """The mask IRQ wants under ``irqs``, from ``base`` (the host's mask for it)."""
    device = trs_mbox_device(name) if name else None
    if device is not None and device in drivers:
        return drivers[device]
    return narrowed(base, iso.protected_cpus, iso.housekeeping)
