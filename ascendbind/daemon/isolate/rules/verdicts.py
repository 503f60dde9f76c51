"""What isolation does to one mask. Pure: values in, a verdict out.

**Still ours?** One rule answers it for every kind of mask, irqbalance's banned
CPUs included (``holds``): given the record (the original and every text
isolation wrote or was about to write) and the CPUs the mask holds now, it
holds

* ``gone``: nothing (the IRQ was freed, the thread exited, the workqueue went);
* ``original``: the host's own value again (a crash between the record and the
  write, or a value put back);
* ``ours``: one of the values isolation wrote;
* ``owner``: neither, so its owner (an operator, irqbalance, the driver, the
  process itself) changed it meanwhile. It is left as it is, forgotten, and
  said: a second write would be a fight.

Texts are compared as CPUs, read by the record's own type (records.py): the
kernel prints a mask at its own width.

**What to do** with one mask (``mask_act``) follows from that and what the
level wants for it (None: nothing, the host's own value):

* ``nothing``: not ours and nothing wanted, or already as wanted;
* ``write``: write the wanted value; the record (original kept, the new text
  added to ``ours``) is saved *before* the write;
* ``keep``: ours and already as wanted;
* ``restore``: ours, no longer wanted: write the original back;
* ``settled``: no longer wanted and already holding the original: forget it;
* ``gone``: forget it;
* ``owner``: left to its owner (above).

``irq_target`` is where one IRQ goes under ``irqs``: the driver's mailbox IRQ
of a bound NPU to that NPU's IRQ CPUs, any other to ``narrowed`` of the mask the
host gave it (the saved original, not our own earlier value, so a release of
one of two workers puts back the CPUs the other no longer needs).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from ....planner.isolate.driverwork import trs_mbox_device
from ....planner.isolate.isolation import IsolationPlan, narrowed
from .records import SavedBan, SavedMask

__all__ = ["Holds", "holds", "Act", "mask_act", "irq_target"]


# (the functional form: the names are the values, upper-cased)
Holds = enum.Enum("Holds", [(v.upper(), v) for v in ("gone", "original", "ours", "owner")], type=str,
                  module=__name__)


def holds(saved: SavedMask | SavedBan, now: frozenset[int] | None) -> Holds:
    """What a mask recorded as ``saved`` holds ``now`` (None: it is gone); see the module docstring."""
    if now is None:
        return Holds.GONE
    if now == saved.original_cpus():
        return Holds.ORIGINAL
    if now in saved.ours_cpus():
        return Holds.OURS
    return Holds.OWNER


Act = enum.Enum("Act", [(v.upper(), v) for v in ("nothing", "write", "keep", "restore", "settled", "gone", "owner")],
                type=str, module=__name__)


def mask_act(saved: SavedMask | None, current: frozenset[int] | None, wanted: frozenset[int] | None) -> Act:
    """The verdict for one mask (see the module docstring)."""
    if saved is None:
        if current is None or wanted is None or wanted == current:
            return Act.NOTHING
        return Act.WRITE
    now = holds(saved, current)
    if now is Holds.GONE:
        return Act.GONE
    if now is Holds.OWNER:
        return Act.OWNER
    if wanted is None or wanted == saved.original_cpus():
        return Act.SETTLED if now is Holds.ORIGINAL else Act.RESTORE
    return Act.KEEP if wanted == current else Act.WRITE


def irq_target(base: frozenset[int], name: str | None, iso: IsolationPlan,
               drivers: Mapping[int, frozenset[int]]) -> frozenset[int]:
    """The mask IRQ wants under ``irqs``, from ``base`` (the host's mask for it)."""
    device = trs_mbox_device(name) if name else None
    if device is not None and device in drivers:
        return drivers[device]
    return narrowed(base, iso.protected_cpus, iso.housekeeping)
