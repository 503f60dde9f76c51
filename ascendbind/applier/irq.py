"""The IRQ step: put each target NPU's SQ/CQ interrupts on the CPUs its plan reserved.

The NPU's PCI address comes from ``npu-smi info -t board``
(discovery put it in ``HostFacts.pci_addresses``), its MSI vectors from
``<sys>/bus/pci/devices/<addr>/msi_irqs/``; among those, the first
``sq_send_trigger_irq`` in ``/proc/interrupts`` order goes to ``irq[0]`` and the
first ``cq_update_irq`` to ``irq[1]`` (the IRQ after the SQ only when the driver
prints no CQ name). With ``small_pool = "share"`` a 1-CPU ``irq`` role takes both.

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

Every mask is read before the first write (kept in ``data["previous"]`` and
``Binding.saved_irq_masks`` so release can restore it) and read back after.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import Config
from ..cpulist import format_cpulist, format_mask, parse_mask
from ..discovery.irqs import parse_interrupts
from ..errors import ParseError
from ..model import HostFacts, IrqbalanceBans, Mode, Outcome, Plan, Reason, Step, StepResult, frozen_map
from .irqbalance import BanResult, Unreachable, ban_irqs, hand_back, irqbalance_pids, stop_irqbalance, unban_irqs

__all__ = [
    "IrqWrite",
    "NpuIrqs",
    "read_irq_mask",
    "set_irq_affinity",
    "find_npu_irqs",
    "irqbalance_pids",
    "stop_irqbalance",
    "bind_irqs",
    "restore_irq_masks",
    "hand_back_bans",
]

SQ_NAME = "sq_send_trigger_irq"
CQ_NAME = "cq_update_irq"
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
class NpuIrqs:
    sq: int
    cq: int
    cq_guessed: bool  # no cq_update_irq printed: the CQ is taken to be the IRQ after the SQ


class _Skip(Exception):
    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _mask_path(irq: int, proc_root: str) -> str:
    return f"{proc_root}/irq/{irq}/smp_affinity"


def read_irq_mask(irq: int, *, proc_root: str = "/proc") -> str | None:
    """The mask text of ``/proc/irq/<irq>/smp_affinity`` (stripped), or None when unreadable."""
    try:
        fd = os.open(_mask_path(irq, proc_root), os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 4096).decode("ascii", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)


def _write_mask(irq: int, text: str, proc_root: str) -> None:
    # O_TRUNC is what a shell's `>` does (procfs ignores it); it keeps fixture files exact
    fd = os.open(_mask_path(irq, proc_root), os.O_WRONLY | os.O_TRUNC)
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


def _msi_irqs(npu: int, host: HostFacts, sys_root: str) -> set[int]:
    pci = host.pci_addresses.get(npu)
    if not pci:
        return set()
    try:
        return {int(n) for n in os.listdir(f"{sys_root}/bus/pci/devices/{pci.lower()}/msi_irqs") if n.isdigit()}
    except OSError:
        return set()


def _read_interrupts(proc_root: str) -> tuple[tuple[int, str], ...]:
    try:
        with open(f"{proc_root}/interrupts", encoding="utf-8", errors="replace") as fh:
            return parse_interrupts(fh.read())
    except OSError as exc:
        raise _Skip(Reason.INTERRUPTS_UNREADABLE, f"{proc_root}/interrupts: {exc.strerror}") from None
    except ParseError as exc:
        raise _Skip(Reason.INTERRUPTS_UNREADABLE, str(exc)) from None


def find_npu_irqs(npu: int, host: HostFacts, rows: tuple[tuple[int, str], ...], *, sys_root: str) -> NpuIrqs:
    """SQ/CQ IRQs of one NPU, or _Skip with the reason the IRQ step cannot run for it."""
    pci = host.pci_addresses.get(npu)
    if not pci:
        why = host.pci_unknown.get(npu) or "npu-smi info -t board gave no PCIe Bus Info"
        raise _Skip(Reason.NO_PCI_ADDRESS, f"NPU {npu}: {why}")
    msi_dir = f"{sys_root}/bus/pci/devices/{pci.lower()}/msi_irqs"
    msi = _msi_irqs(npu, host, sys_root)
    if not msi:
        raise _Skip(Reason.NO_MSI_IRQS, f"NPU {npu}: no MSI IRQs under {msi_dir}")
    sq = cq = None
    for irq, name in rows:
        if irq not in msi:
            continue
        if sq is None and name == SQ_NAME:
            sq = irq
        elif cq is None and name == CQ_NAME:
            cq = irq
    if sq is None:
        raise _Skip(Reason.NO_SQ_IRQ, f"NPU {npu} ({pci}): none of its {len(msi)} MSI IRQs is named {SQ_NAME}")
    if cq is None:
        return NpuIrqs(sq, sq + 1, True)
    return NpuIrqs(sq, cq, False)


def bind_irqs(plan: Plan, host: HostFacts, config: Config) -> StepResult:
    """The IRQ step for every NPU of ``plan``; see the module docstring."""
    proc_root, sys_root = config.proc_root, config.sys_root
    if plan.mode == Mode.ASCEND950_CLUSTER:
        return _result(Outcome.SKIPPED, Reason.NOT_APPLICABLE, "Ascend 950 does not bind NPU IRQs")
    if not config.irq_binding:
        return _result(Outcome.SKIPPED, Reason.IRQ_BINDING_DISABLED, "irq_binding = false in config")
    if not os.access(f"{proc_root}/irq", os.W_OK):
        return _result(Outcome.SKIPPED, Reason.IRQ_NOT_WRITABLE, f"{proc_root}/irq is not writable (read-only mount?)")
    rows: tuple[tuple[int, str], ...] | None = None  # /proc/interrupts, read once and only if needed

    per_npu: list[dict] = []
    targets: list[tuple[int, int, frozenset[int], dict]] = []  # (npu, irq, cpus, entry)
    for npu_plan in plan.npus:
        entry: dict = {"npu": npu_plan.npu, "pci": host.pci_addresses.get(npu_plan.npu)}
        per_npu.append(entry)
        if not npu_plan.irq:
            entry.update(outcome="skipped", reason=Reason.NO_IRQ_CPUS.value)
            entry["detail"] = f"NPU {npu_plan.npu}: the plan reserves no IRQ CPUs"
            continue
        try:
            if rows is None and _msi_irqs(npu_plan.npu, host, sys_root):
                rows = _read_interrupts(proc_root)
            found = find_npu_irqs(npu_plan.npu, host, rows or (), sys_root=sys_root)
        except _Skip as skip:
            entry.update(outcome="skipped", reason=skip.reason.value, detail=skip.detail)
            continue
        sq_cpu = npu_plan.irq[0]
        cq_cpu = npu_plan.irq[1] if len(npu_plan.irq) > 1 else npu_plan.irq[0]
        entry.update(sq=found.sq, cq=found.cq, cq_guessed=found.cq_guessed, sq_cpu=sq_cpu, cq_cpu=cq_cpu)
        targets.append((npu_plan.npu, found.sq, frozenset({sq_cpu}), entry))
        targets.append((npu_plan.npu, found.cq, frozenset({cq_cpu}), entry))

    data: dict = {"npus": per_npu}
    irqbalance_reason, irqbalance_note, ban = None, None, None
    if targets:
        irqbalance_reason, irqbalance_note, ban = _tell_irqbalance(
            {irq for _npu, irq, _cpus, _entry in targets}, config, data)

    writes: list[IrqWrite] = []
    previous: dict[int, str] = {}
    for npu, irq, cpus, entry in targets:
        w = set_irq_affinity(irq, cpus, proc_root=proc_root)
        writes.append(w)
        entry.setdefault("writes", []).append(
            {"irq": irq, "cpus": sorted(cpus), "status": w.status, "previous": w.previous, "now": w.now, "error": w.error}
        )
        if w.status == "ok" and w.previous is not None:
            previous[irq] = w.previous
        elif w.status == "failed" and w.now != w.previous and w.previous is not None:
            # partly effective: keep the old text so release still restores it
            previous[irq] = w.previous
    data["previous"] = previous
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
    return _summarise(writes, per_npu, data, irqbalance_reason, irqbalance_note)


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
