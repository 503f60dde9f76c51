"""The kinds of mask isolation changes, each as read / write / parse / format.

``mask_of(key, config)`` gives the four for a record key (isolationrecord.py):
an IRQ's ``smp_affinity``, the default for new IRQs, a workqueue's ``cpumask``
and the one unbound workqueues share are hex masks written as files
(applier/hostmasks.py), the soft-lockup watchdog's CPUs a cpu list in a file; a
thread's affinity is a cpu list set with ``sched_setaffinity``
(applier/taskmask.py), and reads as gone once its pid names a task with another
start time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ...applier.hostmasks import write_mask_file
from ...applier.taskmask import set_task_cpus, task_cpus
from ...values.config import Config
from ...values.cpulist import format_cpulist, format_mask, parse_cpulist, parse_mask
from ...values.decisions import MaskWrite
from ...discovery.gather.hostwork import (default_affinity_path, read_default_affinity, read_unbound_workqueues,
                                          read_watchdog_mask, read_workqueue_mask, unbound_workqueues_path,
                                          watchdog_mask_path, workqueue_mask_path)
from ...discovery.gather.irqhost import irq_mask_path, read_irq_mask
from ...discovery.gather.process import stat_of
from ...values.reasons import Reason

__all__ = ["Mask", "mask_of", "hex_cpus", "list_cpus", "SKIP_REASONS"]


def hex_cpus(text: str) -> frozenset[int] | None:
    try:
        return parse_mask(text)
    except ValueError:
        return None


def list_cpus(text: str) -> frozenset[int] | None:
    try:
        return parse_cpulist(text)
    except ValueError:
        return None


class Mask(NamedTuple):
    read: Callable[[], str | None]
    write: Callable[[str, bool], MaskWrite]
    parse: Callable[[str], frozenset[int] | None]
    text: Callable[[frozenset[int], str], str]  # the wanted set as text, at the width of the current one


def _hex_text(cpus: frozenset[int], current: str) -> str:
    return format_mask(cpus, min_groups=len(current.split(",")))


def _list_text(cpus: frozenset[int], _current: str) -> str:
    return format_cpulist(cpus)


def mask_of(key: str, config: Config) -> Mask:
    """How to read, write and compare the mask a record key names."""
    kind, _, rest = key.partition(":")
    proc, sys_ = config.proc_root, config.sys_root
    if kind == "workqueues":
        path = unbound_workqueues_path(sys_)
        return Mask(lambda: read_unbound_workqueues(sys_), lambda text, exact: write_mask_file(key, path, text, exact=exact),
                    hex_cpus, _hex_text)
    if kind == "watchdog":
        path = watchdog_mask_path(proc)
        return Mask(lambda: read_watchdog_mask(proc),
                    lambda text, exact: write_mask_file(key, path, text, exact=exact, parse=parse_cpulist),
                    list_cpus, _list_text)
    if kind in ("irq", "default", "workqueue"):
        path = (irq_mask_path(int(rest), proc) if kind == "irq" else default_affinity_path(proc) if kind == "default"
                else workqueue_mask_path(rest, sys_))
        read = ((lambda: read_irq_mask(int(rest), proc_root=proc)) if kind == "irq" else
                (lambda: read_default_affinity(proc)) if kind == "default" else (lambda: read_workqueue_mask(rest, sys_)))
        return Mask(read, lambda text, exact: write_mask_file(key, path, text, exact=exact), hex_cpus, _hex_text)
    pid, _, start = rest.partition(":")

    def read_task() -> str | None:
        st = stat_of(int(pid), proc)
        cpus = task_cpus(int(pid)) if st is not None and st[1] == int(start) else None
        return None if cpus is None else format_cpulist(cpus)

    def write_task(text: str, _exact: bool) -> MaskWrite:
        # the id names this task only while its start time is the recorded one
        st = stat_of(int(pid), proc)
        if st is None or st[1] != int(start):
            return MaskWrite(key, "gone", None, None, f"task {pid} started at {start} is gone")
        return set_task_cpus(key, int(pid), parse_cpulist(text))

    return Mask(read_task, write_task, list_cpus, _list_text)


# kind -> (the reason of a value the kernel refuses, the reason of any other failed write)
SKIP_REASONS = {"irq": (Reason.IRQ_UNCHANGEABLE, Reason.IRQ_WRITE_FAILED),
                "default": (Reason.IRQ_UNCHANGEABLE, Reason.IRQ_WRITE_FAILED),
                "workqueue": (Reason.MASK_UNCHANGEABLE, Reason.MASK_WRITE_FAILED),
                "workqueues": (Reason.MASK_UNCHANGEABLE, Reason.MASK_WRITE_FAILED),
                "watchdog": (Reason.MASK_UNCHANGEABLE, Reason.MASK_WRITE_FAILED),
                "task": (Reason.MASK_UNCHANGEABLE, Reason.MASK_WRITE_FAILED)}


