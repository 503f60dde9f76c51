"""irqbalance bans and IRQ ownership: who lifts a ban when workers come and go. Pure.

A ban ascendbind added is lifted by the last worker that pins its IRQ, the way
the saved IRQ masks are restored only for NPUs no live worker owns.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from ...values.model import IrqbalanceBans

__all__ = ["carried_bans", "split_bans"]


def carried_bans(new: IrqbalanceBans | None, older: Iterable[IrqbalanceBans | None]) -> IrqbalanceBans | None:
    """The bans a binding holds after taking over from ``older`` holders: its own plus
    theirs on the same irqbalance. A new bind finds the IRQs banned already (by the
    holder it replaces) and adds none, so without this nobody would lift them.
    Bans on another irqbalance process went with that process's memory."""
    out = new
    for bans in older:
        if bans is None:
            continue
        if out is None:
            out = bans
        elif out.same_irqbalance(bans):
            out = IrqbalanceBans(out.pid, out.start_time, out.irqs | bans.irqs)
    return out


def split_bans(bans: IrqbalanceBans, others: Mapping[int, Collection[int]]
               ) -> tuple[IrqbalanceBans | None, dict[int, IrqbalanceBans]]:
    """A departing binding's bans -> (those to lift now, pid -> those passed on).
    ``others``: each other live worker's IRQs. An IRQ another worker still pins stays
    banned and becomes that worker's to lift; the first such worker takes it."""
    left: IrqbalanceBans | None = bans
    passed: dict[int, IrqbalanceBans] = {}
    for pid, irqs in sorted(others.items()):
        if left is None:
            break
        taken = left.only(irqs)
        if taken is not None:
            passed[pid] = taken
            left = left.only(left.irqs - taken.irqs)
    return left, passed
