"""The IRQ step's plan: which interrupts each NPU's step moves, and to which CPU. Pure.

Rules, the same for ``plan`` and for the applier (which writes what this says):

* Ascend 950 binds no NPU IRQs (``not_applicable``); ``irq_binding = false``
  turns the step off (``irq_binding_disabled``); an NPU whose plan reserves no
  IRQ CPU moves nothing (``no_irq_cpus``).
* Otherwise the NPU's SQ goes to ``irq[0]`` and its CQ to ``irq[1]``; a 1-CPU
  ``irq`` role (``small_pool = "share"``) takes both.
* An NPU whose SQ/CQ discovery could not find keeps discovery's reason
  (``no_pci_address``, ``no_msi_irqs``, ``no_sq_irq``, ``interrupts_unreadable``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ...values.decisions import NpuIrqPlan, NpuIrqs
from ...values.model import Mode, Plan
from ...values.reasons import Reason

__all__ = ["plan_irqs", "step_off"]


def step_off(plan: Plan, irq_binding: bool) -> tuple[Reason, str] | None:
    """Why the IRQ step does nothing for the whole plan, or None."""
    if plan.mode == Mode.ASCEND950_CLUSTER:
        return Reason.NOT_APPLICABLE, "Ascend 950 does not bind NPU IRQs"
    if not irq_binding:
        return Reason.IRQ_BINDING_DISABLED, "irq_binding = false in config"
    return None


def plan_irqs(plan: Plan, found: Mapping[int, NpuIrqs], irq_binding: bool) -> dict[int, NpuIrqPlan]:
    """NPU -> what its IRQ step moves, for every NPU of ``plan`` (``found``: discovery's answer)."""
    off = step_off(plan, irq_binding)
    out: dict[int, NpuIrqPlan] = {}
    for p in plan.npus:
        irqs = found.get(p.npu)
        pci = irqs.pci if irqs is not None else None
        if off is not None:
            out[p.npu] = NpuIrqPlan(p.npu, pci, reason=off[0], detail=off[1])
        elif not p.irq:
            out[p.npu] = NpuIrqPlan(p.npu, pci, reason=Reason.NO_IRQ_CPUS,
                                    detail=f"NPU {p.npu}: the plan reserves no IRQ CPUs")
        elif irqs is None or irqs.reason is not None or irqs.sq is None or irqs.cq is None:
            reason = irqs.reason if irqs is not None and irqs.reason else Reason.NO_PCI_ADDRESS
            out[p.npu] = NpuIrqPlan(p.npu, pci, reason=reason,
                                    detail=irqs.detail if irqs is not None else f"NPU {p.npu}: not looked up")
        else:
            sq_cpu = p.irq[0]
            cq_cpu = p.irq[1] if len(p.irq) > 1 else p.irq[0]
            out[p.npu] = NpuIrqPlan(p.npu, pci, irqs.sq, irqs.cq, sq_cpu, cq_cpu, irqs.cq_guessed)
    return out
