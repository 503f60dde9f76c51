"""Every kind of mask isolation changes, behind one interface.

Like a tuned plugin, each kind knows four things about its masks and nothing
about the others:

* ``read(key)``: the text the mask holds now, in its own format (None: gone);
* ``apply(key, text)``: write ``text`` and read it back (CPU sets compared: the
  kernel prints a mask at its own width);
* ``verify(key, saved)``: whether the mask still holds what isolation wrote,
  by the one rule (rules/verdicts.py ``holds``) on what ``read`` finds;
* ``restore(key, saved)``: write the original back and read it back byte for
  byte.

and its record type (rules/records.py), the reasons a refused or failed write
is listed with, and how a wanted CPU set is printed (``text``). The keeper
saves the record before any ``apply``, so the original is on disk before the
mask changes.

The kinds: an IRQ's ``smp_affinity``, the default mask of new IRQs, one
workqueue's ``cpumask`` and the one unbound workqueues share are hex mask
files; the soft-lockup watchdog's CPUs a cpu-list file (all written by
applier/hostmasks.py); a thread's affinity is a cpu list set with
``sched_setaffinity`` (applier/taskmask.py), and reads as gone once its id
names a task with another start time. irqbalance's banned CPUs are the same
interface over its socket (banned.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from ...applier.hostmasks import write_mask_file
from ...applier.taskmask import set_task_cpus, task_cpus
from ...values.config import Config
from ...values.cpulist import format_cpulist, format_mask, parse_cpulist, parse_mask
from ...values.decisions import MaskWrite
from ...discovery.gather.hostwork import (default_affinity_path, read_mask_file, unbound_workqueues_path,
                                          watchdog_mask_path, workqueue_mask_path)
from ...discovery.gather.irqhost import irq_mask_path
from ...discovery.gather.process import stat_of
from ...values.reasons import Reason
from .rules.keys import MaskKey
from .rules.records import (DefaultSaved, IrqSaved, SavedBan, SavedMask, TaskSaved, WatchdogSaved, WorkqueueSaved,
                            WorkqueuesSaved)
from .rules.verdicts import Holds, holds

__all__ = ["MaskKind", "IrqMask", "DefaultIrqMask", "WorkqueueMask", "WorkqueuesMask", "WatchdogMask", "TaskMask",
           "mask_kinds"]


class MaskKind:
    """One kind of mask: read / apply / verify / restore (see the module docstring)."""

    kind: ClassVar[str]
    record: ClassVar[type[SavedMask] | type[SavedBan]]
    unchangeable: ClassVar[Reason] = Reason.MASK_UNCHANGEABLE  # a value the kernel refuses: never tried again
    failed: ClassVar[Reason] = Reason.MASK_WRITE_FAILED  # any other failed write: tried again

    def __init__(self, config: Config) -> None:
        self.proc, self.sys = config.proc_root, config.sys_root

    def read(self, key: MaskKey) -> str | None:
        """The text the mask holds now (None: it is gone)."""
        raise NotImplementedError

    def apply(self, key: MaskKey, text: str) -> MaskWrite:
        """Write ``text`` and read it back (the record is on disk before this is called)."""
        raise NotImplementedError

    def restore(self, key: MaskKey, saved: SavedMask) -> MaskWrite:
        """Write ``saved.original`` back and read it back byte for byte."""
        raise NotImplementedError

    def verify(self, key: MaskKey, saved: SavedMask) -> Holds:
        return holds(saved, self.cpus(self.read(key)))

    def cpus(self, text: str | None) -> frozenset[int] | None:
        """The CPUs of a text in this kind's format (None: gone, or not a mask)."""
        return None if text is None else self.record.ours_format(text)

    def text(self, cpus: frozenset[int], current: str) -> str:
        """``cpus`` as this kind writes them, at the width of ``current``."""
        return format_mask(cpus, min_groups=len(current.split(",")))


class _FileMask(MaskKind):
    """A mask that is a file under ``/proc`` or ``/sys`` (``path``); None reads as gone."""

    parse: ClassVar[Callable[[str], frozenset[int]]] = staticmethod(parse_mask)

    def path(self, key: MaskKey) -> str:
        raise NotImplementedError

    def read(self, key: MaskKey) -> str | None:
        return read_mask_file(self.path(key))

    def apply(self, key: MaskKey, text: str) -> MaskWrite:
        return write_mask_file(key, self.path(key), text, exact=False, parse=self.parse)

    def restore(self, key: MaskKey, saved: SavedMask) -> MaskWrite:
        return write_mask_file(key, self.path(key), saved.original, exact=True, parse=self.parse)


class IrqMask(_FileMask):
    kind, record = "irq", IrqSaved
    unchangeable, failed = Reason.IRQ_UNCHANGEABLE, Reason.IRQ_WRITE_FAILED

    def path(self, key: MaskKey) -> str:
        return irq_mask_path(key.irq, self.proc)


class DefaultIrqMask(_FileMask):
    kind, record = "default", DefaultSaved
    unchangeable, failed = Reason.IRQ_UNCHANGEABLE, Reason.IRQ_WRITE_FAILED

    def path(self, key: MaskKey) -> str:
        return default_affinity_path(self.proc)


class WorkqueueMask(_FileMask):
    kind, record = "workqueue", WorkqueueSaved

    def path(self, key: MaskKey) -> str:
        return workqueue_mask_path(key.name, self.sys)


class WorkqueuesMask(_FileMask):
    kind, record = "workqueues", WorkqueuesSaved

    def path(self, key: MaskKey) -> str:
        return unbound_workqueues_path(self.sys)


class WatchdogMask(_FileMask):
    """A cpu list; a kernel built without the lockup detector has no such file (gone)."""

    kind, record = "watchdog", WatchdogSaved
    parse = staticmethod(parse_cpulist)

    def path(self, key: MaskKey) -> str:
        return watchdog_mask_path(self.proc)

    def text(self, cpus: frozenset[int], current: str) -> str:
        return format_cpulist(cpus)


class TaskMask(MaskKind):
    """A thread's affinity; its key's start time must still be the thread's."""

    kind, record = "task", TaskSaved

    def _alive(self, key: MaskKey) -> bool:
        st = stat_of(key.tid, self.proc)
        return st is not None and st[1] == key.start_time

    def read(self, key: MaskKey) -> str | None:
        cpus = task_cpus(key.tid) if self._alive(key) else None
        return None if cpus is None else format_cpulist(cpus)

    def apply(self, key: MaskKey, text: str) -> MaskWrite:
        # the id names this task only while its start time is the recorded one
        if not self._alive(key):
            return MaskWrite(key, "gone", None, None, f"task {key.tid} started at {key.start_time} is gone")
        return set_task_cpus(key, key.tid, parse_cpulist(text))

    def restore(self, key: MaskKey, saved: SavedMask) -> MaskWrite:
        return self.apply(key, saved.original)

    def text(self, cpus: frozenset[int], current: str) -> str:
        return format_cpulist(cpus)


_KINDS: tuple[type[MaskKind], ...] = (IrqMask, DefaultIrqMask, WorkqueueMask, WorkqueuesMask, WatchdogMask, TaskMask)


def mask_kinds(config: Config) -> dict[str, MaskKind]:
    """kind -> its ``MaskKind`` on ``config``'s host roots."""
    return {k.kind: k(config) for k in _KINDS}
