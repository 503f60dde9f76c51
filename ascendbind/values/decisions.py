"""Decisions passed between steps as frozen values. Pure.

* The planner's NUMA alignment (``PlanAlignment``, per NPU ``NpuAlignmentResult``,
  the hints behind it as ``ProviderHint``): on ``Plan.alignment``.
* The IRQ step's facts and plan: ``NpuIrqs`` (an NPU's SQ/CQ as discovery found
  them), ``NpuIrqPlan`` (where they go: ``Plan.irqs``), and ``IrqBinding`` (one
  mask write and what it replaced: ``Binding.irqs``).
* Isolation's writes of other masks (an IRQ's, the default for new IRQs, a
  workqueue's, a kernel thread's): ``MaskWrite``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .frozen import frozen_map
from .reasons import Reason

__all__ = ["ProviderHint", "NpuAlignmentResult", "PlanAlignment", "ALIGNMENT_PROVIDERS", "NpuIrqs", "NpuIrqPlan",
           "IrqBinding", "MaskWrite"]


@dataclass(frozen=True)
class ProviderHint:
    """One topology hint a provider (device, cpu, memory) offered for one NPU."""

    npu: int
    numa_nodes: tuple[int, ...] | None  # None: the provider has no preference
    preferred: bool
    score: int

    def to_json(self) -> dict[str, Any]:
        nodes = None if self.numa_nodes is None else list(self.numa_nodes)
        return {"npu": self.npu, "numa_nodes": nodes, "preferred": self.preferred, "score": self.score}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ProviderHint:
        nodes = d.get("numa_nodes")
        return cls(int(d["npu"]), None if nodes is None else tuple(int(n) for n in nodes), bool(d["preferred"]),
                   int(d.get("score") or 0))


@dataclass(frozen=True)
class NpuAlignmentResult:
    """The alignment decision for one NPU (docs/plan-json.md, the alignment block)."""

    aligned: bool
    admitted: bool
    numa_nodes: tuple[int, ...]  # the merged hint's nodes
    preferred: bool
    score: int
    pool_numa_nodes: tuple[int, ...]
    rebuilt: bool
    failure: str | None
    reason: str | None

    def to_json(self) -> dict[str, Any]:
        return {"aligned": self.aligned, "admitted": self.admitted, "numa_nodes": list(self.numa_nodes),
                "preferred": self.preferred, "score": self.score, "pool_numa_nodes": list(self.pool_numa_nodes),
                "rebuilt": self.rebuilt, "failure": self.failure, "reason": self.reason}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NpuAlignmentResult:
        return cls(bool(d["aligned"]), bool(d.get("admitted", d["aligned"])),
                   tuple(int(n) for n in d.get("numa_nodes") or ()), bool(d.get("preferred")),
                   int(d.get("score") or 0), tuple(int(n) for n in d.get("pool_numa_nodes") or ()),
                   bool(d.get("rebuilt")), _text_or_none(d.get("failure")), _text_or_none(d.get("reason")))


ALIGNMENT_PROVIDERS = ("device", "cpu", "memory")


@dataclass(frozen=True)
class PlanAlignment:
    """The planner's NUMA alignment decision for a whole plan.

    ``aligned`` holds when every target NPU is aligned; ``failure`` is the first
    NPU's failure code (the metric label), ``reason`` the sentence behind it.
    ``providers`` keeps every hint offered, by provider; a binding read back from
    the daemon's state file carries none (the hints explain a plan, they do not
    change what was bound).
    """

    policy: str
    aligned: bool
    numa_nodes: tuple[int, ...] = ()
    reason: str | None = None
    failure: str | None = None
    npus: Mapping[int, NpuAlignmentResult] = field(default_factory=frozen_map)
    providers: Mapping[str, tuple[ProviderHint, ...]] = field(default_factory=frozen_map)

    def without_hints(self) -> PlanAlignment:
        return PlanAlignment(self.policy, self.aligned, self.numa_nodes, self.reason, self.failure, self.npus)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "aligned": self.aligned,
            "numa_nodes": list(self.numa_nodes),
            "providers": {p: [h.to_json() for h in self.providers.get(p, ())] for p in ALIGNMENT_PROVIDERS},
            "reason": self.reason,
            "failure": self.failure,
            "npus": {str(n): self.npus[n].to_json() for n in sorted(self.npus)},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PlanAlignment:
        """Inverse of to_json; ValueError/TypeError/KeyError when malformed."""
        if not isinstance(d, Mapping):
            raise TypeError(f"alignment is not an object: {type(d).__name__}")
        providers = d.get("providers") or {}
        return cls(
            policy=str(d["policy"]),
            aligned=bool(d["aligned"]),
            numa_nodes=tuple(int(n) for n in d.get("numa_nodes") or ()),
            reason=_text_or_none(d.get("reason")),
            failure=_text_or_none(d.get("failure")),
            npus=frozen_map({int(k): NpuAlignmentResult.from_json(v) for k, v in (d.get("npus") or {}).items()}),
            providers=frozen_map({p: tuple(ProviderHint.from_json(h) for h in providers[p])
                                  for p in ALIGNMENT_PROVIDERS if providers.get(p)}),
        )


def _text_or_none(v: Any) -> str | None:
    return None if v is None else str(v)


@dataclass(frozen=True)
class NpuIrqs:
    """One NPU's SQ/CQ interrupts as discovery found them, or why they cannot be found.

    ``sq`` is None exactly when ``reason`` says why (no PCI address, no MSI
    vectors, no SQ name, ``/proc/interrupts`` unreadable); ``detail`` is the
    sentence. ``cq_guessed``: the driver printed no CQ name, so the CQ is taken
    to be the IRQ after the SQ.
    """

    npu: int
    pci: str | None
    sq: int | None = None
    cq: int | None = None
    cq_guessed: bool = False
    reason: Reason | None = None
    detail: str = ""


@dataclass(frozen=True)
class NpuIrqPlan:
    """What one NPU's IRQ step would do: its SQ to ``sq_cpu`` and its CQ to ``cq_cpu``,
    or, when ``reason`` is set, nothing (``detail`` says why)."""

    npu: int
    pci: str | None
    sq: int | None = None
    cq: int | None = None
    sq_cpu: int | None = None
    cq_cpu: int | None = None
    cq_guessed: bool = False
    reason: Reason | None = None
    detail: str = ""

    @property
    def moves(self) -> tuple[tuple[int, frozenset[int]], ...]:
        """(irq, cpus) for each write the step makes, SQ first."""
        if self.reason is not None or self.sq is None or self.cq is None:
            return ()
        return ((self.sq, frozenset({self.sq_cpu})), (self.cq, frozenset({self.cq_cpu})))

    def to_json(self) -> dict[str, Any]:
        return {"pci": self.pci, "sq": self.sq, "cq": self.cq, "cq_guessed": self.cq_guessed,
                "cpus": {str(irq): sorted(cpus) for irq, cpus in self.moves},
                "skipped": self.reason.value if self.reason else None, "detail": self.detail}

    @classmethod
    def from_json(cls, npu: int, d: Mapping[str, Any]) -> NpuIrqPlan:
        cpus = {int(k): v for k, v in (d.get("cpus") or {}).items()}
        sq, cq = d.get("sq"), d.get("cq")
        return cls(npu, d.get("pci"), sq, cq, (cpus.get(sq) or [None])[0], (cpus.get(cq) or [None])[0],
                   bool(d.get("cq_guessed")), Reason(d["skipped"]) if d.get("skipped") else None,
                   str(d.get("detail") or ""))


@dataclass(frozen=True)
class IrqBinding:
    """One SQ/CQ mask write of the IRQ step: the NPU it serves, the IRQ, the CPUs it
    was set to, the mask text read before the write and how the write went.

    ``status``: ok | unchangeable (EPERM/EIO: a managed IRQ, never retried) |
    failed (another error, or the read-back differed). ``now`` is the mask read
    back after the write.
    """

    npu: int
    irq: int
    cpus: frozenset[int]
    previous: str | None
    status: str
    now: str | None = None
    error: str | None = None

    @property
    def pinned(self) -> bool:
        return self.status == "ok"

    @property
    def changed(self) -> bool:
        """The mask may differ from ``previous``: release must write it back."""
        if self.previous is None:
            return False
        return self.status == "ok" or (self.status == "failed" and self.now != self.previous)


@dataclass(frozen=True)
class MaskWrite:
    """One write of a mask isolation changes, and how it went.

    ``status``: ok (read back as written) | unchangeable (the kernel refuses any
    value here: a managed IRQ, a kernel thread bound to its CPU; never retried) |
    gone (the IRQ, thread or workqueue no longer exists) | failed (another error,
    or the read-back differed). ``previous`` and ``now`` are the texts read
    before and after, in the file's own format.
    """

    key: str
    status: str
    previous: str | None
    now: str | None
    error: str | None = None
