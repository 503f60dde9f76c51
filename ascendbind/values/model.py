"""Frozen values shared by every layer: host facts, worker facts, plans, step results.

Invariants:
* CPU sets are ``frozenset[int]``; ordered CPU lists (pools, roles) are sorted
  ``tuple[int, ...]``.
* NPU ids in a ``Plan`` are *logical* ids (``Chip Logic ID`` of ``npu-smi info -m``;
  on Ascend 950, the ``NPU ID``). Card and chip ids appear only in ``NpuChip``.
* Nothing here does I/O. ``Plan.to_json()`` is the plan JSON of docs/plan-json.md.

The step vocabulary (``Step``, ``Outcome``, ``Reason``) lives in reasons.py, the
planner's and the IRQ step's decisions (alignment, IRQ moves, IRQ writes) in
decisions.py, a bind's target request and the NPU evidence in targeting.py, and
``frozen_map`` in frozen.py: import each from its own module. This one holds the
facts and the plans built from them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .decisions import IrqBinding, NpuIrqPlan, PlanAlignment
from .frozen import frozen_map
from .frozen import plain as _plain
from .reasons import Outcome, Reason, Step
from .targeting import NpuEvidence, TargetDecision
from .threadclass import ThreadClass

__all__ = [
    "DeviceType",
    "Mode",
    "CpuInfo",
    "NpuChip",
    "NpuProcess",
    "CpuFacts",
    "HostFacts",
    "WorkerFacts",
    "PoolEvidence",
    "PoolChoice",
    "ThreadInfo",
    "ProcessIdentity",
    "NpuPlan",
    "PlanIssue",
    "Plan",
    "StepResult",
    "IrqbalanceBans",
    "Binding",
]


class DeviceType(str, enum.Enum):
    A2 = "A2"
    A3 = "A3"
    P310 = "310P"
    A950 = "950"
    UNKNOWN = "unknown"


class Mode(str, enum.Enum):
    GLOBAL_SLICE = "global_slice"
    TOPO_AFFINITY = "topo_affinity"
    ASCEND950_CLUSTER = "ascend950_cluster"


# ---------------------------------------------------------------- host facts


@dataclass(frozen=True)
class CpuInfo:
    """One row of ``lscpu -e``. ``node``/``core``/``socket`` are None when the
    column is absent or the cell is ``-`` (offline CPUs print dashes)."""

    cpu: int
    node: int | None
    socket: int | None
    core: int | None
    online: bool


@dataclass(frozen=True)
class NpuChip:
    """One compute die from ``npu-smi info -m`` (``Mcu`` rows are not chips).

    ``card`` is the ``NPU ID`` column (310P: 32768, 32896, …), ``chip`` the
    ``Chip ID``, ``logic_id`` the ``Chip Logic ID`` (950: = card), ``phy_id``
    the ``Chip Phy-ID`` column when printed.
    """

    card: int
    chip: int
    logic_id: int
    name: str
    phy_id: int | None = None


@dataclass(frozen=True)
class NpuProcess:
    """One row of the ``npu-smi info`` process table, mapped to a logical NPU."""

    npu: int  # logical id
    pid: int  # as printed in ``Process id`` (host pid namespace)
    name: str
    container_pid: int | None = None


@dataclass(frozen=True)
class CpuFacts:
    """The CPU half of a host's facts: what ``lscpu`` and sysfs say of its CPUs and NUMA nodes."""

    cpus: tuple[CpuInfo, ...]
    threads_per_core: int | None
    # NUMA node -> its online CPUs (from lscpu -e NODE, else sysfs node*/cpulist)
    numa_nodes: Mapping[int, frozenset[int]]
    # NUMA node -> distances to nodes in ascending node order (sysfs node*/distance); may be empty
    numa_distances: Mapping[int, tuple[int, ...]]

    def node_of_cpu(self, cpu: int) -> int | None:
        for node, cpus in self.numa_nodes.items():
            if cpu in cpus:
                return node
        return None


@dataclass(frozen=True)
class HostFacts(CpuFacts):
    """The static facts of a host: what ``npu-smi`` and ``lscpu`` say, plus sysfs."""

    chips: tuple[NpuChip, ...]
    # npu-smi chip name of the first chip (e.g. "Ascend 910B3"), informational
    chip_name: str | None
    device_type: DeviceType
    # logical NPU id -> CPU affinity from ``npu-smi info -t topo`` (absent when no column)
    topo_affinity: Mapping[int, frozenset[int]]
    # number of rows in the topo matrix (used by global_slice's NPU count fallback)
    topo_rows: int
    processes: tuple[NpuProcess, ...]
    # logical NPU id -> PCI address ("0000:c1:00.0"), when known
    pci_addresses: Mapping[int, str] = field(default_factory=frozen_map)
    warnings: tuple[str, ...] = ()
    # logical NPU id -> NUMA node of its PCI device (sysfs <addr>/numa_node; -1 there means
    # unknown and is left out). The alignment's device hint when topo has no affinity.
    pci_numa_nodes: Mapping[int, int] = field(default_factory=frozen_map)
    # logical NPU id -> why its PCI address is unknown (the board query failed, printed
    # nothing or no PCIe Bus Info, or was not asked): the IRQ step's skip sentence
    pci_unknown: Mapping[int, str] = field(default_factory=frozen_map)

    @property
    def logic_ids(self) -> tuple[int, ...]:
        return tuple(sorted(c.logic_id for c in self.chips))

    def chip(self, logic_id: int) -> NpuChip | None:
        for c in self.chips:
            if c.logic_id == logic_id:
                return c
        return None

    def chips_on_card(self, card: int) -> tuple[NpuChip, ...]:
        return tuple(sorted((c for c in self.chips if c.card == card), key=lambda c: c.chip))


@dataclass(frozen=True)
class ThreadInfo:
    tid: int
    comm: str


@dataclass(frozen=True)
class ProcessIdentity:
    """One process as read once from ``/proc/<pid>``: what authorization, discovery and
    binding all check against, so a pid recycled between them is noticed, not bound.

    (pid, start_time) names the process across pid reuse; the rest is what the
    authorization rules need from the same read.
    """

    pid: int
    start_time: int  # field 22 of /proc/<pid>/stat, clock ticks since boot
    tgid: int  # differs from pid when the number names a thread of another process
    ppid: int
    state: str  # R, S, D, Z, …
    is_kthread: bool  # PF_KTHREAD in the stat flags
    uids: tuple[int, ...] = ()  # real, effective, saved, filesystem
    comm: str = ""

    def not_a_worker(self, binder_pid: int) -> str | None:
        """Why this process must never be bound (None: it may be). ``binder_pid`` is the
        binding process itself: binding it would pin the daemon to one NPU's CPUs."""
        if self.is_kthread:
            return f"pid {self.pid} ({self.comm}) is a kernel thread"
        if 1 in (self.pid, self.tgid):
            return f"pid {self.pid} is init (pid 1) of this pid namespace"
        if binder_pid in (self.pid, self.tgid):
            return f"pid {self.pid} is ascendbind itself"
        return None


@dataclass(frozen=True)
class PoolEvidence:
    """Whether a worker's cpuset is its own to use whole, and what says so (or why not).
    ``proof``: ``kubelet_checkpoint`` or ``none``; ``detail``: the sentence with the names."""

    own: bool
    proof: str
    detail: str


@dataclass(frozen=True)
class WorkerFacts:
    """Per-request facts about one worker process."""

    pid: int
    start_time: int | None  # field 22 of /proc/<pid>/stat, clock ticks since boot
    allowed_cpus: frozenset[int]
    allowed_source: str  # "cgroup" | "status"
    mems_allowed: frozenset[int]
    env: Mapping[str, str]
    threads: tuple[ThreadInfo, ...] = ()
    cpuset_path: str | None = None  # the cgroup cpuset the worker lives in, when known
    # host-wide uvb_poll_window_thread tids (Ascend 950 only; from ps -Te / /proc/*/task/*/comm)
    uvb_tids: tuple[int, ...] = ()
    warnings: tuple[str, ...] = ()
    # what says which NPUs it drives, besides its environment (None: not read)
    npu_evidence: NpuEvidence | None = None
    # whether its cpuset is its own (kubelet's static CPU manager), None: not looked at
    pool_evidence: PoolEvidence | None = None


# ---------------------------------------------------------------- plans


@dataclass(frozen=True)
class NpuPlan:
    npu: int
    pool: tuple[int, ...]
    irq: tuple[int, ...]
    main: tuple[int, ...]
    acl: tuple[int, ...]
    release: tuple[int, ...]
    numa_nodes: tuple[int, ...]
    # (class name, its CPUs carved from main) per share class of ``Plan.thread_classes``, in config order
    classes: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pool": list(self.pool),
            "irq": list(self.irq),
            "main": list(self.main),
            "acl": list(self.acl),
            "release": list(self.release),
            "numa_nodes": list(self.numa_nodes),
        }
        if self.classes:  # only where thread classes are configured: a plan without them is unchanged
            out["classes"] = {name: list(cpus) for name, cpus in self.classes}
        return out

    def class_cpus(self, name: str) -> tuple[int, ...]:
        """The CPUs of share class ``name`` (() when this plan has no such class)."""
        for n, cpus in self.classes:
            if n == name:
                return cpus
        return ()


@dataclass(frozen=True)
class PlanIssue:
    """An error (NPU not planned) or a warning (planned, but note this)."""

    npu: int | None
    code: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"npu": self.npu, "code": self.code, "reason": self.reason}


@dataclass(frozen=True)
class PoolChoice:
    """Where a plan's pools came from: ``source`` ``slice`` (the placement rules) or ``cpuset``
    (the worker's own cpuset), for ``requested`` ``slice``, ``cpuset`` or ``auto``, and why."""

    source: str
    requested: str
    evidence: str

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "requested": self.requested, "evidence": self.evidence}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PoolChoice:
        return cls(str(d["source"]), str(d["requested"]), str(d.get("evidence", "")))


@dataclass(frozen=True)
class Plan:
    mode: Mode
    device_type: DeviceType
    fallback: str | None
    allowed_cpus: tuple[int, ...]
    npus: tuple[NpuPlan, ...]  # target NPUs only, ascending logical id
    uvb_cpus: tuple[int, ...] = ()
    uvb_tids: tuple[int, ...] = ()
    errors: tuple[PlanIssue, ...] = ()
    warnings: tuple[PlanIssue, ...] = ()
    # keys a newer planner added that this one does not know: kept, passed through to_json
    extra: Mapping[str, Any] = field(default_factory=frozen_map)
    # the NUMA alignment decision (None: never evaluated, e.g. a plan made before it existed)
    alignment: PlanAlignment | None = None
    # NPU -> what its IRQ step would move; None when the IRQs were not looked up (the
    # daemon's bind decides them in the IRQ step itself, from its cache of the NPUs' IRQs)
    irqs: Mapping[int, NpuIrqPlan] | None = None
    # which NPUs were targeted and why (None: the caller named them without the rule)
    targets: TargetDecision | None = None
    # where the pools came from; None for the placement rules (the JSON key is then absent)
    pool_source: PoolChoice | None = None
    # the thread classes the plan was made with (config ``thread_classes``); () adds no JSON key
    thread_classes: tuple[ThreadClass, ...] = ()

    def npu(self, logic_id: int) -> NpuPlan | None:
        for p in self.npus:
            if p.npu == logic_id:
                return p
        return None

    @property
    def ok(self) -> bool:
        return not self.errors

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Plan:
        """Inverse of to_json (used by the daemon's state file)."""
        known = {"mode", "device_type", "fallback", "allowed_cpus", "npus", "uvb", "errors", "warnings", "alignment",
                 "irqs", "targets", "pool_source", "thread_classes"}
        npus = tuple(
            NpuPlan(
                npu=int(k),
                pool=tuple(v["pool"]),
                irq=tuple(v["irq"]),
                main=tuple(v["main"]),
                acl=tuple(v["acl"]),
                release=tuple(v["release"]),
                numa_nodes=tuple(v["numa_nodes"]),
                classes=tuple((str(n), tuple(c)) for n, c in v.get("classes", {}).items()),
            )
            for k, v in sorted(d["npus"].items(), key=lambda kv: int(kv[0]))
        )
        return cls(
            mode=Mode(d["mode"]),
            device_type=DeviceType(d["device_type"]),
            fallback=d.get("fallback"),
            allowed_cpus=tuple(d["allowed_cpus"]),
            npus=npus,
            uvb_cpus=tuple(d.get("uvb", {}).get("cpus", ())),
            uvb_tids=tuple(d.get("uvb", {}).get("tids", ())),
            errors=tuple(PlanIssue(e["npu"], e["code"], e["reason"]) for e in d.get("errors", ())),
            warnings=tuple(PlanIssue(w["npu"], w["code"], w["reason"]) for w in d.get("warnings", ())),
            extra=frozen_map({k: v for k, v in d.items() if k not in known}),
            alignment=PlanAlignment.from_json(d["alignment"]) if d.get("alignment") else None,
            irqs=None if d.get("irqs") is None else frozen_map(
                {int(k): NpuIrqPlan.from_json(int(k), v) for k, v in d["irqs"].items()}),
            targets=TargetDecision.from_json(d["targets"]) if d.get("targets") else None,
            pool_source=PoolChoice.from_json(d["pool_source"]) if d.get("pool_source") else None,
            thread_classes=tuple(ThreadClass.from_json(c) for c in d.get("thread_classes", ())),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode.value,
            "device_type": self.device_type.value,
            "fallback": self.fallback,
            "allowed_cpus": list(self.allowed_cpus),
            "npus": {str(p.npu): p.to_json() for p in self.npus},
            "uvb": {"tids": list(self.uvb_tids), "cpus": list(self.uvb_cpus)},
            "errors": [e.to_json() for e in self.errors],
            "warnings": [w.to_json() for w in self.warnings],
        }
        if self.alignment is not None:
            out["alignment"] = self.alignment.to_json()
        for k, v in self.extra.items():
            out[k] = _plain(v)
        if self.irqs is not None:
            out["irqs"] = {str(n): self.irqs[n].to_json() for n in sorted(self.irqs)}
        if self.targets is not None:
            out["targets"] = self.targets.to_json()
        if self.pool_source is not None:
            out["pool_source"] = self.pool_source.to_json()
        if self.thread_classes:
            out["thread_classes"] = [c.to_json() for c in self.thread_classes]
        return out


# ---------------------------------------------------------------- applier results


@dataclass(frozen=True)
class StepResult:
    step: Step
    outcome: Outcome
    reason: Reason | None
    detail: str
    # step-specific facts worth keeping (IRQ numbers and previous masks, tids bound, …)
    data: Mapping[str, Any] = field(default_factory=frozen_map)

    def to_json(self) -> dict[str, Any]:
        out = {
            "step": self.step.value,
            "outcome": self.outcome.value,
            "reason": self.reason.value if self.reason else None,
            "detail": self.detail,
        }
        if self.data:
            out["data"] = _plain(self.data)
        return out


@dataclass(frozen=True)
class IrqbalanceBans:
    """The IRQs ascendbind added to one running irqbalance's ban list.

    Only those it added: an IRQ it found banned already is someone else's
    (irqbalance's ``--banirq``, an operator) and stays banned when ascendbind
    lets go. ``pid`` and ``start_time`` name the irqbalance that was told: the
    list lives in that process's memory only, so a restarted irqbalance holds
    none of these bans and is never asked to drop them.
    """

    pid: int
    start_time: int | None
    irqs: frozenset[int]

    def only(self, irqs) -> IrqbalanceBans | None:
        """These bans narrowed to ``irqs`` (None when nothing is left)."""
        kept = self.irqs & frozenset(irqs)
        return IrqbalanceBans(self.pid, self.start_time, kept) if kept else None

    def same_irqbalance(self, other: IrqbalanceBans) -> bool:
        return (self.pid, self.start_time) == (other.pid, other.start_time)

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time, "irqs": sorted(self.irqs)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> IrqbalanceBans | None:
        """Inverse of to_json; None for an empty list. ValueError/TypeError/KeyError when malformed."""
        pid, start = d["pid"], d.get("start_time")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise ValueError(f"bad irqbalance pid {pid!r}")
        if start is not None and (not isinstance(start, int) or isinstance(start, bool)):
            raise ValueError(f"bad irqbalance start time {start!r}")
        irqs = frozenset(d["irqs"])
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in irqs):
            raise ValueError(f"bad IRQ numbers {sorted(irqs, key=str)!r}")
        return cls(pid, start, irqs) if irqs else None


@dataclass(frozen=True)
class Binding:
    """What the applier did to one worker, and what it needs to undo it.

    ``original_cpus`` is the worker's allowed CPUs before binding (what release
    restores); ``saved_irq_masks`` maps IRQ number -> the mask text read before
    the first write (what release writes back); ``irqbalance_bans`` the IRQs it
    added to a running irqbalance's ban list (what release takes off again).
    ``irqs`` are the IRQ step's writes (which NPU owns which IRQ, and where the
    reconcile loop holds it); ``uvb_previous`` maps each Ascend 950 UVB poll
    thread bound to its mask before binding (restored when the last 950 worker goes).

    ``pidfd_ino`` is the worker's pidfd inode where the kernel makes it unique (pidfs):
    a restarted daemon compares it beside the start time, which counts clock ticks.

    ``saved_irq_masks`` starts as the ``previous`` of the writes that changed a
    mask, but a worker that takes over an NPU inherits the older holder's saved
    masks (the host's, not an earlier bind's), so it is kept beside ``irqs``
    rather than derived from them.
    """

    pid: int
    start_time: int | None
    npus: tuple[int, ...]
    plan: Plan
    original_cpus: frozenset[int]
    saved_irq_masks: Mapping[int, str]
    steps: tuple[StepResult, ...]
    irqbalance_bans: IrqbalanceBans | None = None
    irqs: tuple[IrqBinding, ...] = ()
    uvb_previous: Mapping[int, frozenset[int]] = field(default_factory=frozen_map)
    # the inode of the worker's pidfd where pidfs makes it unique to the process (Linux 6.9+),
    # else None: what tells the worker from a newcomer forked in the tick it was born in
    pidfd_ino: int | None = None

    @property
    def failed(self) -> bool:
        return any(s.outcome is Outcome.FAILED for s in self.steps)

    def step(self, step: Step) -> StepResult | None:
        """The result of ``step`` (the last, should there be several), or None."""
        return next((s for s in reversed(self.steps) if s.step is step), None)
