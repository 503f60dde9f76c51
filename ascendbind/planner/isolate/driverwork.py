"""The NPU driver's own per-device work, by name, and where it goes under isolation. Pure.

Besides the SQ/CQ interrupts the IRQ step pins, the Ascend driver runs work
for each device that lands wherever the kernel puts it unless it is placed
(names as the open CANN driver creates them; ``N`` is the driver's device id):

* ``devN_sq_task``: a kernel thread feeding the device's submission queues;
* ``devN_sq_send_wq``: an unbound workqueue registered in sysfs
  (``/sys/devices/virtual/workqueue/devN_sq_send_wq/cpumask``);
* ``trs-mbox-N-T``: the mailbox interrupt of the device's task scheduler ``T``.

The driver's device id is the NPU's physical id (its ``/dev/davinciN``), which
``npu-smi info -m`` prints as ``Chip Phy-ID``; a host that prints no such
column numbers them like the logical ids. Under ``isolation = irqs`` each goes
to its NPU's IRQ CPUs, less any protected CPU (with small pools the IRQ CPU
can be a worker's main CPU too); an NPU with no such CPU leaves its work to
the ordinary rule (``narrowed``), and work of an NPU nobody has bound is
treated like any other task or interrupt.
"""

from __future__ import annotations

import re

from ...values.model import HostFacts
from .isolation import IsolationPlan

__all__ = ["sq_task_device", "sq_send_wq_device", "sq_send_wq_name", "trs_mbox_device", "device_id",
           "driver_cpus"]

_SQ_TASK = re.compile(r"dev([0-9]{1,5})_sq_task")
_SQ_SEND_WQ = re.compile(r"dev([0-9]{1,5})_sq_send_wq")
_TRS_MBOX = re.compile(r"trs-mbox-([0-9]{1,5})-([0-9]{1,5})")


def sq_task_device(comm: str) -> int | None:
    """The device id of a ``devN_sq_task`` kernel thread's name, else None."""
    m = _SQ_TASK.fullmatch(comm.strip())
    return int(m.group(1)) if m else None


def sq_send_wq_device(name: str) -> int | None:
    """The device id of a ``devN_sq_send_wq`` workqueue's name, else None."""
    m = _SQ_SEND_WQ.fullmatch(name.strip())
    return int(m.group(1)) if m else None


def sq_send_wq_name(device: int) -> str:
    return f"dev{int(device)}_sq_send_wq"


def trs_mbox_device(irq_name: str) -> int | None:
    """The device id of a ``trs-mbox-N-T`` interrupt (its name in ``/proc/interrupts``), else None."""
    m = _TRS_MBOX.fullmatch(irq_name.strip())
    return int(m.group(1)) if m else None


def device_id(host: HostFacts, npu: int) -> int:
    """The driver's device id of logical NPU ``npu``: its Chip Phy-ID when npu-smi prints one."""
    chip = host.chip(npu)
    return chip.phy_id if chip is not None and chip.phy_id is not None else npu


def driver_cpus(host: HostFacts, iso: IsolationPlan) -> dict[int, frozenset[int]]:
    """Device id -> the CPUs its driver work goes to: its bound NPU's IRQ CPUs less the
    protected ones; NPUs left with none are absent (their work follows ``narrowed``)."""
    out: dict[int, frozenset[int]] = {}
    for npu, cpus in iso.npu_irq_cpus.items():
        kept = frozenset(cpus) - iso.protected_cpus
        if kept:
            out[device_id(host, npu)] = kept
    return out
