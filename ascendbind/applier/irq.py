"""The IRQ step: put each target NPU's SQ/CQ interrupts on the CPUs its plan reserved.

Discovery finds each NPU's SQ/CQ interrupts (discovery/gather/irqhost.py: its PCI
address from ``npu-smi info -t board``, its MSI vectors, ``/proc/interrupts``)
and the planner's rule says where they go (planner/npus/irqs.py: the SQ to
``irq[0]``, the CQ to ``irq[1]``, both to a 1-CPU ``irq`` role), exactly as
``plan`` shows them. This module only writes the masks and reads back the ones
it wrote, through discovery's reader.

Kernel behaviour this code respects:

* ``/proc/irq/<n>/smp_affinity`` errors surface at write(2): buffered ``open()``
  would report them only at close, after we believed the write happened, so we
  use ``os.open``/``os.write``.
* A managed IRQ (or IRQ 0) rejects any write with EPERM or EIO. That will never
  change, so it is skipped (``irq_unchangeable``) and never retried.
* ``/proc/irq`` is read-only under systemd's ``ProtectKernelTunables=yes``;
  ``os.access(W_OK)`` reports the read-only mount (``irq_not_writable``).
* A running irqbalance rewrites these masks on its next pass. With
  ``irqbalance = "ban"`` (the default) it is told, before the first write, to
  leave the target IRQs alone, and the ban is lifted again for any IRQ whose
  write did not go through, so exactly the pinned IRQs stay banned
  (``data["irqbalance_bans"]``, ``Binding.irqbalance_bans``); when it cannot be
  told the masks are still written (``irqbalance_unreachable``). ``warn`` only
  reports it (``irqbalance_active``); ``stop`` stops it (applier/irqbalance.py).

What the step will write, and every target IRQ's mask as it stands, can be
decided before any write (``prepare_npu_irqs``): the daemon records those
masks in its state file before the bind's first write, so a daemon killed
among the writes still knows what to put back.

Every mask is read before the first write (kept in ``data["previous"]``,
``IrqBinding.previous`` and ``Binding.saved_irq_masks`` so release can restore
it) and read back after. ``bind_npu_irqs`` returns the writes as typed values
(``IrqBinding``) beside the step's report; ``data`` is the report's JSON.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..values.config import Config
from ..values.cpulist import format_cpulist, format_mask, parse_mask
from ..values.decisions import IrqBinding, NpuIrqPlan
from ..discovery.gather.irqhost import NpuIrqLookup, discover_npu_irqs, irq_mask_path, irq_masks_writable, irqbalance_pids, read_irq_mask
from ..discovery.read.sources import HostSource, LiveHost
from ..values.frozen import frozen_map
from ..values.model import HostFacts, IrqbalanceBans, Plan, StepResult
from ..planner.npus.irqs import plan_irqs, step_off
from ..values.reasons import Outcome, Reason, Step
from .irqbalance import BanResult, Unreachable, ban_irqs, hand_back, stop_irqbalance, unban_irqs

__all__ = [
    "IrqWrite",
    "IrqStep",
    "IrqPrep",
    "prepare_npu_irqs",
    "set_irq_affinity",
    "bind_irqs",
    "bind_npu_irqs",
    "planned_irqs",
    "with_planned_irqs",
    "restore_irq_masks",
    "hand_back_bans",
]

_UNCHANGEABLE = (errno.EPERM, errno.EIO)


@dataclass(frozen=True)
class IrqWrite:
    """One smp_affinity write. ``status``: ok | unchangeable | failed."""

    irq: int
    status: str
    previous: str | None
    now: str | None
    error: str | None = None


@dataclass(frozen=True)
class IrqStep:
    """The IRQ step's outcome: the report, the writes as typed values, the masks
    release must write back, and the IRQs added to irqbalance's ban list."""

    result: StepResult
    bindings: tuple[IrqBinding, ...] = ()
    saved: Mapping[int, str] = field(default_factory=frozen_map)
    bans: IrqbalanceBans | None = None


def _write_mask(irq: int, text: str, proc_root: str) -> None:
    # O_TRUNC is what a shell's `>` does (procfs ignores it); it keeps fixture files exact
    fd = os.open(irq_mask_path(irq, proc_root), os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def set_irq_affinity(irq: int, cpus: frozenset[int] | set[int], *, proc_root: str = "/proc") -> IrqWrite:
    """Save, write and read back one IRQ mask. EPERM/EIO -> ``unchangeable`` (never retried)."""
    cpus = frozenset(cpus)
    previous = read_irq_mask(irq, proc_root=proc_root)
    groups = len(previous.split(",")) if previous else 1
    return _write_checked(irq, format_mask(cpus, min_groups=groups), cpus, previous, proc_root)


def _write_checked(irq: int, text: str, cpus: frozenset[int], previous: str | None, proc_root: str) -> IrqWrite:
    try:
        _write_mask(irq, text, proc_root)
    except OSError as exc:
        status = "unchangeable" if exc.errno in _UNCHANGEABLE else "failed"
        return IrqWrite(irq, status, previous, read_irq_mask(irq, proc_root=proc_root), exc.strerror or str(exc))
    now = read_irq_mask(irq, proc_root=proc_root)
    try:
        ok = now is not None and parse_mask(now) == cpus
    except ValueError:
        ok = False
    if not ok:
        return IrqWrite(irq, "failed", previous, now, f"wrote {text}, read back {now!r}")
    return IrqWrite(irq, "ok", previous, now)


def planned_irqs(plan: Plan, host: HostFacts, config: Config, source: HostSource, *,
                 lookup: NpuIrqLookup | None = None) -> dict[int, NpuIrqPlan]:
    """NPU -> what its IRQ step would move: discovery's IRQs (through ``source``, or
    ``lookup`` when given: the daemon's cache of them; only for NPUs with IRQ CPUs and
    only when the step is on) under the planner's rule. ``plan`` shows this; the step
    writes exactly this."""
    wanted = [p.npu for p in plan.npus if p.irq] if step_off(plan, config.irq_binding) is None else []
    if not wanted:
        found = {}
    elif lookup is not None:
        found = dict(lookup(host, wanted))
    else:
        found = discover_npu_irqs(source, host, wanted)
    return plan_irqs(plan, found, config.irq_binding)


def with_planned_irqs(plan: Plan, host: HostFacts, config: Config, source: HostSource | None, *,
                      lookup: NpuIrqLookup | None = None) -> Plan:
    """``plan`` carrying ``planned_irqs`` (its ``irqs`` field, the plan JSON's ``irqs``)."""
    return dataclasses.replace(plan, irqs=frozen_map(planned_irqs(plan, host, config, source, lookup=lookup)))


def bind_irqs(plan: Plan, host: HostFacts, config: Config, source: HostSource | None = None) -> StepResult:
    """The IRQ step for every NPU of ``plan``, as a report; see ``bind_npu_irqs``."""
    return bind_npu_irqs(plan, host, config, source).result


@dataclass(frozen=True)
class IrqPrep:
    """The IRQ step decided before its first write: ``skipped`` (the step's report when
    it writes nothing: off, or ``/proc/irq`` read-only), else the planned moves per NPU
    and ``originals``, each target IRQ's mask text as read now (what undoing the step
    writes back)."""

    skipped: StepResult | None
    planned: Mapping[int, NpuIrqPlan] = field(default_factory=frozen_map)
    originals: Mapping[int, str] = field(default_factory=frozen_map)


def prepare_npu_irqs(plan: Plan, host: HostFacts, config: Config, source: HostSource | None = None, *,
                     lookup: NpuIrqLookup | None = None) -> IrqPrep:
    """What ``bind_npu_irqs`` will write for ``plan``, and the masks it will change as
    they are now; reads only."""
    off = step_off(plan, config.irq_binding)
    if off is not None:
        return IrqPrep(_result(Outcome.SKIPPED, off[0], off[1]))
    writable, where = irq_masks_writable(config.proc_root)
    if not writable:
        return IrqPrep(_result(Outcome.SKIPPED, Reason.IRQ_NOT_WRITABLE, f"{where} is not writable (read-only mount?)"))
    planned = planned_irqs(plan, host, config, source or LiveHost.from_config(config), lookup=lookup)
    originals = {}
    for p in planned.values():
        for irq, _cpus in p.moves:
            mask = read_irq_mask(irq, proc_root=config.proc_root)
            if mask is not None:
                originals[irq] = mask
    return IrqPrep(None, frozen_map(planned), frozen_map(originals))


def bind_npu_irqs(plan: Plan, host: HostFacts, config: Config, source: HostSource | None = None, *,
                  lookup: NpuIrqLookup | None = None, prepared: IrqPrep | None = None) -> IrqStep:
    """The IRQ step for every NPU of ``plan``; see the module docstring. ``source``
    answers the discovery reads (default: this host under ``config``'s roots);
    ``lookup``, when given, answers which IRQs each NPU owns. ``prepared``: the step
    as ``prepare_npu_irqs`` decided it earlier (its masks are read again right before
    each write all the same: that is the ``previous`` release restores)."""
    proc_root = config.proc_root
    prep = prepared or prepare_npu_irqs(plan, host, config, source, lookup=lookup)
    if prep.skipped is not None:
        return IrqStep(prep.skipped)
    planned = prep.planned

    per_npu: list[dict] = []
    targets: list[tuple[int, int, frozenset[int], dict]] = []  # (npu, irq, cpus, entry)
    for npu_plan in plan.npus:
        p = planned[npu_plan.npu]
        entry: dict = {"npu": p.npu, "pci": host.pci_addresses.get(p.npu)}
        per_npu.append(entry)
        if p.reason is not None:
            entry.update(outcome="skipped", reason=p.reason.value, detail=p.detail)
            continue
        entry.update(sq=p.sq, cq=p.cq, cq_guessed=p.cq_guessed, sq_cpu=p.sq_cpu, cq_cpu=p.cq_cpu)
        targets.extend((p.npu, irq, cpus, entry) for irq, cpus in p.moves)

    data: dict = {"npus": per_npu}
    irqbalance_reason, irqbalance_note, ban = None, None, None
    if targets:
        irqbalance_reason, irqbalance_note, ban = _tell_irqbalance(
            {irq for _npu, irq, _cpus, _entry in targets}, config, data)

    writes: list[IrqWrite] = []
    bindings: list[IrqBinding] = []
    for npu, irq, cpus, entry in targets:
        w = set_irq_affinity(irq, cpus, proc_root=proc_root)
        writes.append(w)
        bindings.append(IrqBinding(npu, irq, cpus, w.previous, w.status, w.now, w.error))
        entry.setdefault("writes", []).append(
            {"irq": irq, "cpus": sorted(cpus), "status": w.status, "previous": w.previous, "now": w.now, "error": w.error}
        )
    # a failed write that still changed the mask keeps its old text too, so release restores it
    previous = {b.irq: b.previous for b in bindings if b.changed}
    data["previous"] = previous
    bans = None
    if ban is not None and ban.bans is not None:
        bans = ban.bans
        not_pinned = {w.irq for w in writes if w.status != "ok"}
        if bans.irqs & not_pinned:
            # banned before the write so that no pass of irqbalance falls in between;
            # what did not get pinned is irqbalance's to balance again
            try:
                bans = unban_irqs(bans, not_pinned, proc_root=proc_root, timeout=config.command_timeout_seconds)
            except Unreachable as exc:
                irqbalance_note += f"; IRQs not pinned stay banned until release: {exc}"
        if bans is not None:
            data["irqbalance_bans"] = bans.to_json()
    result = _summarise(writes, per_npu, data, irqbalance_reason, irqbalance_note)
    return IrqStep(result, tuple(bindings), frozen_map(previous), bans)


def _tell_irqbalance(irqs: set[int], config: Config, data: dict) -> tuple[Reason | None, str | None, BanResult | None]:
    """Deal with a running irqbalance as config says; (reason, sentence, ban) and
    ``data["irqbalance"]``: not running | running | stopped | banned | unreachable."""
    pids = irqbalance_pids(config.proc_root)
    if not pids:
        data["irqbalance"] = "not running"
        return None, None, None
    if config.irqbalance == "stop":
        stopped, sentence = stop_irqbalance(config.command_timeout_seconds)
        data["irqbalance"] = "stopped" if stopped else "running"
        return (None if stopped else Reason.IRQBALANCE_ACTIVE), sentence, None
    if config.irqbalance == "ban":
        ban = ban_irqs(pids[0], irqs, proc_root=config.proc_root, timeout=config.command_timeout_seconds)
        data["irqbalance"] = ban.status
        return (None if ban.status == "banned" else Reason.IRQBALANCE_UNREACHABLE), ban.sentence, ban
    data["irqbalance"] = "running"
    return Reason.IRQBALANCE_ACTIVE, f"irqbalance (pid {pids[0]}) is running and will move these IRQs again", None


def _summarise(
    writes: list[IrqWrite], per_npu: list[dict], data: dict, irqbalance_reason: Reason | None,
    irqbalance_note: str | None
) -> StepResult:
    ok = [w for w in writes if w.status == "ok"]
    failed = [w for w in writes if w.status == "failed"]
    unchangeable = [w for w in writes if w.status == "unchangeable"]
    parts = []
    for e in per_npu:
        if "writes" in e:
            ws = ", ".join(f"IRQ {w['irq']} -> CPU {format_cpulist(w['cpus'])} {w['status']}" for w in e["writes"])
            parts.append(f"NPU {e['npu']} ({e['pci']}): {ws}" + (" (CQ = SQ+1)" if e.get("cq_guessed") else ""))
        else:
            parts.append(e["detail"])
    detail = "; ".join(parts)
    if irqbalance_note:
        detail += f"; {irqbalance_note}"
    if failed:
        w = failed[0]
        return _result(
            Outcome.FAILED, Reason.IRQ_WRITE_FAILED, f"IRQ {w.irq}: {w.error}. {detail}", data
        )
    if ok:
        if irqbalance_reason is not None:
            reason = irqbalance_reason
        elif unchangeable:
            reason = Reason.IRQ_UNCHANGEABLE
        else:
            reason = next((Reason(e["reason"]) for e in per_npu if "reason" in e), None)
        return _result(Outcome.APPLIED, reason, detail, data)
    if unchangeable:
        return _result(Outcome.SKIPPED, Reason.IRQ_UNCHANGEABLE, detail, data)
    return _result(Outcome.SKIPPED, Reason(per_npu[0]["reason"]) if per_npu else Reason.NO_IRQ_CPUS, detail, data)


def _result(outcome: Outcome, reason: Reason | None, detail: str, data: Mapping | None = None) -> StepResult:
    return StepResult(Step.IRQ, outcome, reason, detail, frozen_map(data))


def restore_irq_masks(saved: Mapping[int, str], *, proc_root: str = "/proc") -> StepResult:
    """Write back the masks saved by ``bind_irqs`` (release)."""
    if not saved:
        return _result(Outcome.SKIPPED, Reason.NOTHING_TO_RESTORE, "no IRQ mask was changed")
    results = []
    for irq, text in sorted(saved.items()):
        try:
            cpus = parse_mask(text)
        except ValueError:
            results.append(IrqWrite(irq, "failed", None, None, f"saved mask {text!r} is not a mask"))
            continue
        results.append(_write_checked(irq, text, cpus, read_irq_mask(irq, proc_root=proc_root), proc_root))
    detail = ", ".join(f"IRQ {w.irq} -> {saved[w.irq]} {w.status}" for w in results)
    data = {"restored": {w.irq: w.now for w in results}}
    failed = [w for w in results if w.status != "ok"]
    if failed:
        reason = Reason.IRQ_UNCHANGEABLE if all(w.status == "unchangeable" for w in failed) else Reason.IRQ_WRITE_FAILED
        return _result(Outcome.FAILED, reason, f"IRQ {failed[0].irq}: {failed[0].error}; {detail}", data)
    return _result(Outcome.APPLIED, None, f"restored {detail}", data)


def hand_back_bans(restored: StepResult, bans: IrqbalanceBans, config: Config) -> StepResult:
    """Release, after ``restore_irq_masks``: take our bans off irqbalance's list. The
    step fails (``irqbalance_unreachable``) when that irqbalance runs and could not
    be told; a mask failure keeps its own reason."""
    status, sentence = hand_back(bans, proc_root=config.proc_root, timeout=config.command_timeout_seconds)
    data = {**restored.data, "irqbalance_bans": {**bans.to_json(), "status": status}}
    detail = f"{restored.detail}; {sentence}"
    if restored.outcome is Outcome.FAILED:
        return _result(Outcome.FAILED, restored.reason, detail, data)
    if status == "unreachable":
        return _result(Outcome.FAILED, Reason.IRQBALANCE_UNREACHABLE, detail, data)
    if status == "handed back" and restored.outcome is Outcome.SKIPPED:
        return _result(Outcome.APPLIED, None, detail, data)
    return _result(restored.outcome, restored.reason, detail, data)
