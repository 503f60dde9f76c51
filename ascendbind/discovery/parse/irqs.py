"""``/proc/interrupts`` -> (irq, action name) rows, in the order the kernel prints them. Pure.

The kernel prints one header row of CPU columns, then one row per IRQ:

               CPU0       CPU1
     420:         0          0   ITS-MSI 1049600 Edge      sq_send_trigger_irq
      28:         0          0 PCI-MSIX-0000:00:01.0   0-edge      virtio0-config
     NMI:         0          0   Non-maskable interrupts

Numeric rows carry one count per CPU column, then the chip, hwirq and trigger
columns, then the action name(s); shared IRQs list several actions joined by
", ". Rows keyed by a name (NMI, LOC, ERR, …) are architecture counters, not
device IRQs, and are ignored. The order matters: the IRQ step takes the *first*
``sq_send_trigger_irq`` of an NPU's MSI set in this order (``npu_irqs_from``).
"""

from __future__ import annotations

from ...values.decisions import NpuIrqs
from ...errors import ParseError
from ...values.reasons import Reason

__all__ = ["parse_interrupts", "npu_irqs_from", "SOURCE", "SQ_NAME", "CQ_NAME"]

SOURCE = "/proc/interrupts"


def _action_name(tokens: list[str]) -> str:
    """The trailing action column: the last token, plus earlier ones joined by ", "."""
    i = len(tokens) - 1
    while i > 0 and tokens[i - 1].endswith(","):
        i -= 1
    return " ".join(tokens[i:])


def parse_interrupts(text: str) -> tuple[tuple[int, str], ...]:
    """Rows ``(irq, name)`` of every numeric IRQ, in printed order.

    ``name`` is the action column (``sq_send_trigger_irq``, ``virtio0-config``,
    ``ehci_hcd:usb1, uhci_hcd:usb2``). A numeric row without its CPU counts or
    without a name is malformed: ParseError naming /proc/interrupts and the line.
    """
    lines = text.splitlines()
    n_cpus: int | None = None
    rows: list[tuple[int, str]] = []
    for lineno, line in enumerate(lines, start=1):
        stripped = line.strip()
        if not stripped:
            continue
        if n_cpus is None and ":" not in stripped and stripped.startswith("CPU"):
            n_cpus = len(stripped.split())
            continue
        key, sep, rest = stripped.partition(":")
        if not sep:
            raise ParseError(SOURCE, "row without 'IRQ:'", line=lineno, text=line)
        if not key.isdigit():
            continue  # NMI, LOC, ERR, MIS, IPI0 … are counters, not device IRQs
        tokens = rest.split()
        counts = 0
        while counts < len(tokens) and tokens[counts].isdigit() and (n_cpus is None or counts < n_cpus):
            counts += 1
        if n_cpus is not None and counts != n_cpus:
            raise ParseError(SOURCE, f"IRQ {key} has {counts} CPU counts, header has {n_cpus}", line=lineno, text=line)
        if counts == 0:
            raise ParseError(SOURCE, f"IRQ {key} has no CPU counts", line=lineno, text=line)
        desc = tokens[counts:]
        if not desc:
            raise ParseError(SOURCE, f"IRQ {key} has no name", line=lineno, text=line)
        rows.append((int(key), _action_name(desc)))
    return tuple(rows)


SQ_NAME = "sq_send_trigger_irq"
CQ_NAME = "cq_update_irq"


def npu_irqs_from(npu: int, pci: str | None, msi: frozenset[int] | None, rows: tuple[tuple[int, str], ...] | None,
                  *, msi_dir: str, why_no_pci: str | None = None, rows_problem: str | None = None) -> NpuIrqs:
    """One NPU's SQ/CQ IRQs from its MSI vectors and the ``/proc/interrupts`` rows.

    The first ``sq_send_trigger_irq`` of the NPU's MSI set in printed order is
    its SQ, the first ``cq_update_irq`` its CQ; a driver that prints no CQ name
    gets the IRQ after the SQ (``cq_guessed``). Without an address, MSI vectors,
    readable rows or an SQ name, the value says why (``reason``, ``detail``).
    """
    if not pci:
        why = why_no_pci or "npu-smi info -t board gave no PCIe Bus Info"
        return NpuIrqs(npu, None, reason=Reason.NO_PCI_ADDRESS, detail=f"NPU {npu}: {why}")
    if not msi:
        return NpuIrqs(npu, pci, reason=Reason.NO_MSI_IRQS, detail=f"NPU {npu}: no MSI IRQs under {msi_dir}")
    if rows is None:
        return NpuIrqs(npu, pci, reason=Reason.INTERRUPTS_UNREADABLE, detail=rows_problem or f"{SOURCE} is unreadable")
    sq = cq = None
    for irq, name in rows:
        if irq not in msi:
            continue
        if sq is None and name == SQ_NAME:
            sq = irq
        elif cq is None and name == CQ_NAME:
            cq = irq
    if sq is None:
        return NpuIrqs(npu, pci, reason=Reason.NO_SQ_IRQ,
                       detail=f"NPU {npu} ({pci}): none of its {len(msi)} MSI IRQs is named {SQ_NAME}")
    if cq is None:
        return NpuIrqs(npu, pci, sq, sq + 1, True)
    return NpuIrqs(npu, pci, sq, cq, False)
