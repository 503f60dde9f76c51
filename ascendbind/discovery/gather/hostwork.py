"""What isolation reads of the host: every IRQ and its mask, the default mask of new
IRQs, workqueue masks, the soft-lockup watchdog's CPUs, the NPU driver's kernel
threads, the CPUs the kernel keeps isolated, and the daemon's own threads.

Discovery reads (``read_mask_file`` of a path named here: ``default_affinity_path``,
``workqueue_mask_path``, ``unbound_workqueues_path``, ``watchdog_mask_path``; an
IRQ's mask is irqhost.py's ``irq_mask_path``); the applier writes through the same paths. Every reader answers None (or empty) for what
is absent or unreadable: an IRQ freed, a kernel thread gone, a workqueue not
registered in sysfs are news for the caller, not errors.

Kernel facts these rely on:

* ``/proc/irq/default_smp_affinity`` is the mask a newly requested IRQ starts
  with; it prints like ``smp_affinity`` (32-bit hex groups).
* An unbound workqueue created with ``WQ_SYSFS`` has
  ``/sys/devices/virtual/workqueue/<name>/cpumask``; the kernel's own unbound
  workqueues share ``/sys/devices/virtual/workqueue/cpumask``.
* ``/proc/sys/kernel/watchdog_cpumask`` (a cpu list) names the CPUs the
  soft-lockup detector checks: on each, a timer queues a stopper task every
  ``2 * watchdog_thresh / 5`` seconds (4 s by default), which preempts whatever
  runs there; the kernel leaves ``nohz_full`` CPUs out of it by default.
* A kernel thread has ``PF_KTHREAD`` in field 9 of its stat; its pid names it
  until it exits, and its start time tells a reused pid apart.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ...values.digits import is_ascii_digits
from ...errors import ParseError
from ..parse.irqs import parse_interrupts
from ..read.bounded import read_bounded
from ..parse.procfs import parse_stat
from ..parse.sysfs import parse_cpulist_file

__all__ = ["irq_numbers", "irq_names", "read_mask_file", "default_affinity_path", "workqueue_mask_path",
           "KernelThread", "kernel_threads", "kernel_isolated_cpus", "own_threads", "WORKQUEUE_DIR",
           "unbound_workqueues_path", "watchdog_mask_path"]

WORKQUEUE_DIR = "/sys/devices/virtual/workqueue"


def irq_numbers(proc_root: str = "/proc") -> list[int]:
    """Every IRQ with a directory under ``<proc>/irq``, ascending (empty when unreadable)."""
    try:
        names = os.listdir(f"{proc_root}/irq")
    except OSError:
        return []
    return sorted(int(n) for n in names if is_ascii_digits(n))


def irq_names(proc_root: str = "/proc") -> dict[int, str]:
    """IRQ -> its action name(s) from ``<proc>/interrupts``; {} when unreadable or malformed."""
    text = read_bounded(f"{proc_root}/interrupts", 1 << 24)
    if text is None:
        return {}
    try:
        return dict(parse_interrupts(text))
    except ParseError:
        return {}


def read_mask_file(path: str) -> str | None:
    """The text of a mask file (an IRQ's, the default IRQ mask, a workqueue's, the
    watchdog's), stripped; None when it is absent or unreadable."""
    text = read_bounded(path, 4096, single=True)
    return None if text is None else text.strip()


def default_affinity_path(proc_root: str = "/proc") -> str:
    return f"{proc_root}/irq/default_smp_affinity"


def workqueue_mask_path(name: str, sys_root: str = "/sys") -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"not a workqueue name: {name!r}")
    return f"{sys_root}/devices/virtual/workqueue/{name}/cpumask"


def unbound_workqueues_path(sys_root: str = "/sys") -> str:
    """The mask the kernel's unbound workqueues share (those without a sysfs mask of their own)."""
    return f"{sys_root}/devices/virtual/workqueue/cpumask"


def watchdog_mask_path(proc_root: str = "/proc") -> str:
    """The CPUs the soft-lockup watchdog checks (a cpu list): on each, a stopper task runs
    every few seconds and preempts whatever runs there."""
    return f"{proc_root}/sys/kernel/watchdog_cpumask"


@dataclass(frozen=True)
class KernelThread:
    pid: int
    start_time: int
    comm: str


def kernel_threads(wanted: Callable[[str], bool], proc_root: str = "/proc") -> list[KernelThread]:
    """The kernel threads whose name ``wanted`` accepts (a scan of ``<proc>/*/stat``)."""
    try:
        names = os.listdir(proc_root)
    except OSError:
        return []
    found = []
    for name in names:
        if not is_ascii_digits(name):
            continue
        text = read_bounded(f"{proc_root}/{name}/stat", 4096, single=True)
        if text is None:
            continue
        try:
            st = parse_stat(text)
        except ParseError:
            continue
        if st.is_kthread and wanted(st.comm):
            found.append(KernelThread(int(name), st.start_time, st.comm))
    return sorted(found, key=lambda t: t.pid)


def kernel_isolated_cpus(sys_root: str = "/sys") -> frozenset[int]:
    """CPUs the kernel keeps isolated (``isolcpus=``) or tickless (``nohz_full=``): the
    set irqbalance bans by default when nothing else names its banned CPUs."""
    out: frozenset[int] = frozenset()
    for name in ("isolated", "nohz_full"):
        text = read_bounded(f"{sys_root}/devices/system/cpu/{name}", 65536, single=True)
        if text is None:
            continue
        try:
            out |= parse_cpulist_file(text, f"/sys/devices/system/cpu/{name}")
        except ParseError:
            continue
    return out


def own_threads(proc_root: str = "/proc") -> list[int] | None:
    """The thread ids of this process (None when its task list cannot be read)."""
    try:
        names = os.listdir(f"{proc_root}/self/task")
    except OSError:
        return None
    return sorted(int(n) for n in names if is_ascii_digits(n))
