"""The IRQ step's host facts: which interrupts each NPU owns, their masks, a running irqbalance.

Discovery reads; the applier only writes. Everything the IRQ step needs to
know goes through here:

* ``discover_npu_irqs(source, host, npus)``: each NPU's MSI vectors
  (``/sys/bus/pci/devices/<addr>/msi_irqs/``, listed through ``source``) and
  ``/proc/interrupts`` (read through ``source``, once, and only when some NPU
  has MSI vectors), matched by the pure rule of ``irqs.npu_irqs_from``. It runs
  on the live host, on a snapshot directory and under the snapshot recorder
  alike, so ``plan --snapshot`` shows the IRQs a bind would move.
* ``irq_mask_path`` names ``<proc>/irq/<n>/smp_affinity`` for the applier's
  write; ``read_irq_mask`` reads a mask (before a write, to read it back, and
  in the reconcile loop). ``os.open``/``os.read``: one syscall each, and a
  procfs error surfaces at the read, not at a later close.
* ``irq_masks_writable``: ``/proc/irq`` is read-only under systemd's
  ``ProtectKernelTunables=yes``, which ``access(W_OK)`` reports.
* ``irqbalance_pids`` scans ``<proc>/*/comm``; ``irqbalance_socket_dir`` names
  the directory of irqbalance's socket as that process sees it
  (``<proc>/<pid>/root/...``: systemd runs it in a mount namespace of its own).

IRQ numbers are assigned when the driver probes the device, so they change
only with a hot-plug or a driver reload (a PCI uevent either way): the daemon
keeps what ``discover_npu_irqs`` found for each host discovery
(daemon/host/hostcache.py) instead of listing ``msi_irqs`` and reading
``/proc/interrupts``, whose size grows with CPUs x IRQs, on every bind.
``NpuIrqLookup`` is that cached lookup's shape.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence

from ...values.decisions import NpuIrqs
from ...values.model import HostFacts
from ..parse.irqs import npu_irqs_from, parse_interrupts
from ..read.bounded import read_bounded
from ..read.sources import HostSource, read_parsed

__all__ = ["discover_npu_irqs", "NpuIrqLookup", "msi_dir", "irq_mask_path", "read_irq_mask", "irq_masks_writable",
           "irqbalance_pids", "irqbalance_socket_dir", "socket_in_dir_fd", "INTERRUPTS"]

INTERRUPTS = "/proc/interrupts"

# (host, npus) -> NPU -> its IRQs: ``discover_npu_irqs`` with the source bound, or a cache of it
NpuIrqLookup = Callable[[HostFacts, Sequence[int]], Mapping[int, NpuIrqs]]


def msi_dir(pci: str) -> str:
    return f"/sys/bus/pci/devices/{pci.lower()}/msi_irqs"


def _msi_irqs(source: HostSource, pci: str | None) -> frozenset[int]:
    if not pci:
        return frozenset()
    names = source.listdir(msi_dir(pci)) or ()
    return frozenset(int(n) for n in names if n.isdigit())


def discover_npu_irqs(source: HostSource, host: HostFacts, npus: Iterable[int]) -> dict[int, NpuIrqs]:
    """NPU -> its SQ/CQ IRQs (or why they cannot be found), for each of ``npus``."""
    msi = {n: _msi_irqs(source, host.pci_addresses.get(n)) for n in npus}
    rows: tuple[tuple[int, str], ...] | None = None
    problem = None
    if any(msi.values()):
        rows, problem = read_parsed(source, INTERRUPTS, parse_interrupts)
    out: dict[int, NpuIrqs] = {}
    for n, vectors in msi.items():
        pci = host.pci_addresses.get(n)
        out[n] = npu_irqs_from(n, pci, vectors, rows, msi_dir=msi_dir(pci) if pci else "",
                               why_no_pci=host.pci_unknown.get(n), rows_problem=problem)
    return out


def irq_mask_path(irq: int, proc_root: str = "/proc") -> str:
    return f"{proc_root}/irq/{int(irq)}/smp_affinity"


def read_irq_mask(irq: int, *, proc_root: str = "/proc") -> str | None:
    """The mask text of ``<proc>/irq/<irq>/smp_affinity`` (stripped), or None when unreadable."""
    text = read_bounded(irq_mask_path(irq, proc_root), 4096, single=True)
    return None if text is None else text.strip()


def irq_masks_writable(proc_root: str = "/proc") -> tuple[bool, str]:
    """(whether ``<proc>/irq`` may be written, the directory as named)."""
    path = f"{proc_root}/irq"
    return os.access(path, os.W_OK), path


def irqbalance_pids(proc_root: str = "/proc") -> list[int]:
    """Pids whose comm is ``irqbalance`` (a scan of <proc>/*/comm)."""
    found = []
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        comm = read_bounded(f"{proc_root}/{name}/comm", 64, single=True)
        if comm is not None and comm.strip() == "irqbalance":
            found.append(int(name))
    return sorted(found)


def irqbalance_socket_dir(pid: int, directory: str, proc_root: str = "/proc") -> str:
    """``directory`` (an absolute path) as irqbalance ``pid`` sees it, through its root."""
    return f"{proc_root}/{int(pid)}/root{directory}"


def socket_in_dir_fd(dir_fd: int, name: str) -> str:
    """An address for the socket ``name`` in the directory open as ``dir_fd``: through
    ``/proc/self/fd``, which stays short of sun_path's 108 bytes whatever the directory."""
    return f"/proc/self/fd/{int(dir_fd)}/{name}"
