"""One bound worker as the state file keeps it: ``Binding`` <-> a small JSON record. Pure.

The record keeps what reconcile, release and status need, in the cheapest
form that reads back exactly: the worker's identity (pid, start time and, where
the kernel has pidfs, its pidfd's inode ``pidfd_ino``: an optional key, absent
from records written before it, which load as before), CPU sets as kernel cpu
lists ("0-23,48"), the plan as its mode and role cpu lists (no copy of the whole plan JSON), the
alignment decision without the hints behind it, the IRQ writes and the UVB
threads' previous masks as typed values, and each step's outcome, reason and
sentence without its data (the data is the report of the moment; what later
steps need from it is in the typed fields).

``binding_from_v1`` reads an entry of the previous format, whose IRQ writes and
UVB masks lived only inside the step reports, so a daemon upgraded in place
keeps its workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...values.cpulist import format_cpulist, parse_cpulist
from ...values.frozen import frozen_map
from ...values.decisions import IrqBinding, PlanAlignment
from ...values.model import Binding, DeviceType, IrqbalanceBans, Mode, NpuPlan, Plan, PlanIssue, PoolChoice, StepResult
from ...values.reasons import Outcome, Reason, Step
from ...values.threadclass import ThreadClass

__all__ = ["binding_to_json", "binding_from_json", "binding_from_v1", "IN_FLIGHT"]

# the key, true, of a bind's record written before its first write (the held record replaces
# it when the bind ends); absent from every held record
IN_FLIGHT = "in_flight"

ROLES = ("pool", "irq", "main", "acl", "release", "numa_nodes")
IRQ_STATUSES = ("ok", "unchangeable", "failed")


def _cl(cpus) -> str:
    return format_cpulist(cpus)


def _cpus(text: Any) -> frozenset[int]:
    if not isinstance(text, str):
        raise TypeError(f"a cpu list must be a string, got {type(text).__name__}")
    return frozenset(parse_cpulist(text))


def _sorted(text: Any) -> tuple[int, ...]:
    return tuple(sorted(_cpus(text)))


def _plan_record(p: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {
        "mode": p.mode.value,
        "device_type": p.device_type.value,
        "allowed": _cl(p.allowed_cpus),
        "npus": {str(n.npu): _npu_record(n) for n in p.npus},
    }
    if p.fallback is not None:
        out["fallback"] = p.fallback
    if p.uvb_cpus or p.uvb_tids:
        out["uvb"] = {"cpus": _cl(p.uvb_cpus), "tids": list(p.uvb_tids)}
    if p.alignment is not None:
        al = p.alignment.to_json()
        del al["providers"]  # the hints explain a plan; status, release and reconcile never read them
        out["alignment"] = al
    if p.warnings:
        out["warnings"] = [w.to_json() for w in p.warnings]
    if p.pool_source is not None:
        out["pool_source"] = p.pool_source.to_json()
    if p.thread_classes:  # a restart pins late threads by the classes the worker was bound with
        out["thread_classes"] = [c.to_json() for c in p.thread_classes]
    return out


def _npu_record(n: NpuPlan) -> dict[str, Any]:
    out = {r: _cl(getattr(n, r)) for r in ROLES}
    if n.classes:
        out["classes"] = {name: _cl(cpus) for name, cpus in n.classes}
    return out


def _npu_from_record(k: str, v: Mapping[str, Any]) -> NpuPlan:
    classes = v.get("classes") or {}
    return NpuPlan(int(k), *(_sorted(v[r]) for r in ROLES),
                   classes=tuple((str(name), _sorted(cpus)) for name, cpus in classes.items()))


def _plan_from_record(d: Mapping[str, Any]) -> Plan:
    uvb = d.get("uvb") or {}
    return Plan(
        mode=Mode(d["mode"]),
        device_type=DeviceType(d["device_type"]),
        fallback=d.get("fallback"),
        allowed_cpus=_sorted(d["allowed"]),
        npus=tuple(_npu_from_record(k, v) for k, v in sorted(d["npus"].items(), key=lambda kv: int(kv[0]))),
        uvb_cpus=_sorted(uvb.get("cpus", "")),
        uvb_tids=tuple(int(t) for t in uvb.get("tids", ())),
        warnings=tuple(PlanIssue(w["npu"], w["code"], w["reason"]) for w in d.get("warnings", ())),
        alignment=PlanAlignment.from_json(d["alignment"]) if d.get("alignment") else None,
        pool_source=PoolChoice.from_json(d["pool_source"]) if d.get("pool_source") else None,
        thread_classes=tuple(ThreadClass.from_json(c) for c in d.get("thread_classes", ())),
    )


def _irq_record(w: IrqBinding) -> dict[str, Any]:
    out: dict[str, Any] = {"npu": w.npu, "irq": w.irq, "cpus": _cl(w.cpus), "previous": w.previous,
                           "status": w.status, "now": w.now}
    if w.error is not None:
        out["error"] = w.error
    return out


def _irq_from(d: Mapping[str, Any], cpus: frozenset[int]) -> IrqBinding:
    npu, irq, status = d["npu"], d["irq"], d.get("status", "ok")
    for name, v in (("npu", npu), ("irq", irq)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"bad IRQ {name} {v!r}")
    if status not in IRQ_STATUSES:
        raise ValueError(f"bad IRQ write status {status!r}")
    text = {k: d.get(k) for k in ("previous", "now", "error")}
    if any(v is not None and not isinstance(v, str) for v in text.values()):
        raise ValueError(f"IRQ {irq}: mask texts must be strings")
    return IrqBinding(npu, irq, cpus, text["previous"], status, text["now"], text["error"])


def _step_record(s: StepResult) -> dict[str, Any]:
    return {"step": s.step.value, "outcome": s.outcome.value, "reason": s.reason.value if s.reason else None,
            "detail": s.detail}


def _step_from(d: Mapping[str, Any]) -> StepResult:
    return StepResult(
        step=Step(d["step"]),
        outcome=Outcome(d["outcome"]),
        reason=Reason(d["reason"]) if d.get("reason") else None,
        detail=str(d.get("detail", "")),
        data=frozen_map(d.get("data") or {}),
    )


def _pid(d: Mapping[str, Any]) -> int:
    pid = d["pid"]
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ValueError(f"bad pid {pid!r}")
    return pid


def binding_to_json(b: Binding, **extra: Any) -> dict[str, Any]:
    """The state record of ``b``; ``extra`` adds the held worker's verdicts beside it."""
    out: dict[str, Any] = {
        "pid": b.pid,
        "start_time": b.start_time,
        "npus": list(b.npus),
        "plan": _plan_record(b.plan),
        "original_cpus": _cl(b.original_cpus),
        "saved_irq_masks": {str(k): v for k, v in sorted(b.saved_irq_masks.items())},
        "irqs": [_irq_record(w) for w in b.irqs],
        "steps": [_step_record(s) for s in b.steps],
    }
    if b.irqbalance_bans is not None:
        out["irqbalance_bans"] = b.irqbalance_bans.to_json()
    if b.uvb_previous:
        out["uvb_previous"] = {str(t): _cl(c) for t, c in sorted(b.uvb_previous.items())}
    if b.pidfd_ino is not None:
        out["pidfd_ino"] = b.pidfd_ino
    out.update(extra)
    return out


def binding_from_json(d: Mapping[str, Any]) -> Binding:
    """Inverse of binding_to_json; KeyError/ValueError/TypeError on a malformed record."""
    return Binding(
        pid=_pid(d),
        start_time=d.get("start_time"),
        npus=tuple(int(n) for n in d["npus"]),
        plan=_plan_from_record(d["plan"]),
        original_cpus=_cpus(d["original_cpus"]),
        saved_irq_masks=frozen_map({int(k): str(v) for k, v in d.get("saved_irq_masks", {}).items()}),
        steps=tuple(_step_from(s) for s in d.get("steps", ())),
        irqbalance_bans=IrqbalanceBans.from_json(d["irqbalance_bans"]) if d.get("irqbalance_bans") else None,
        irqs=tuple(_irq_from(w, _cpus(w["cpus"])) for w in d.get("irqs", ())),
        uvb_previous=frozen_map({int(t): _cpus(c) for t, c in (d.get("uvb_previous") or {}).items()}),
        pidfd_ino=_ino(d.get("pidfd_ino")),
    )


def _ino(v: Any) -> int | None:
    """A recorded pidfd inode: absent in records written before it was kept (or by a kernel
    without pidfs), else a positive integer; anything else makes the record malformed."""
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"bad pidfd inode {v!r}")
    return v


def binding_from_v1(d: Mapping[str, Any]) -> Binding:
    """An entry of the previous format: the whole plan JSON, CPU sets as integer lists,
    the IRQ writes and UVB masks inside the irq and uvb step reports."""
    steps = tuple(_step_from(s) for s in d.get("steps", ()))
    irqs: list[IrqBinding] = []
    uvb_previous: dict[int, frozenset[int]] = {}
    for s in steps:
        if s.step is Step.IRQ:
            for entry in s.data.get("npus", ()) or ():
                for w in entry.get("writes", ()) or ():
                    irqs.append(_irq_from({**w, "npu": entry["npu"]}, frozenset(int(c) for c in w["cpus"])))
        elif s.step is Step.UVB:
            uvb_previous = {int(t): frozenset(int(c) for c in cpus) for t, cpus in (s.data.get("previous") or {}).items()}
    return Binding(
        pid=_pid(d),
        start_time=d.get("start_time"),
        npus=tuple(int(n) for n in d["npus"]),
        plan=Plan.from_json(d["plan"]),
        original_cpus=frozenset(int(c) for c in d["original_cpus"]),
        saved_irq_masks=frozen_map({int(k): str(v) for k, v in d.get("saved_irq_masks", {}).items()}),
        steps=steps,
        irqbalance_bans=IrqbalanceBans.from_json(d["irqbalance_bans"]) if d.get("irqbalance_bans") else None,
        irqs=tuple(irqs),
        uvb_previous=frozen_map(uvb_previous),
    )
