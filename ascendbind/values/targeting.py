"""Which NPUs a worker drives: the request, the evidence about the worker, and the decision,
as frozen values. Pure.

* ``TargetRequest``: what a caller asked for: logical NPU ids, or the device index the
  worker's runtime uses (0.. over the devices it sees), and the ``ASCEND_*`` variables
  the caller sees in the worker (fresher than ``/proc/<pid>/environ``, which holds the
  environment the process was started with).
* ``NpuEvidence``: what discovery read about the worker besides its environment: the
  driver's process-to-device map, the container's device nodes, its devices cgroup,
  and whether it shares the host's mount namespace. A field that is None was not
  available; ``unavailable`` says why.
* ``TargetDecision``: the NPUs the rule (planner/npus/targets.py) picked, the rule that
  picked them, and every piece of evidence as a line (``EvidenceLine``): what it says
  and how it was read. It travels on the plan (``Plan.targets``), so ``plan --explain``,
  the bind answer and ``status`` show the same account.

Device ids come in three kinds, never mixed: the *udevid* a device node's minor and the
driver's process map carry (a physical id below 100; a vNPU is 100 + 16 x physical +
sub-device), the *physical id* (``Chip Phy-ID``), and the *logical id* every plan uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .frozen import frozen_map

__all__ = ["TargetRequest", "DeviceNode", "CgroupDevices", "NpuEvidence", "EvidenceLine", "TargetDecision",
           "evidence_lines",
           "RULES", "SOURCES", "ASCEND_ENV", "VNPU_UDEVID_BASE", "VNPU_PER_DEVICE", "physical_of_udevid"]

# the worker's environment variables the rule reads (and the vLLM plugin sends)
ASCEND_ENV = ("ASCEND_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "ASCEND_RUNTIME_OPTIONS")

# The driver numbers vNPUs after the physical devices: udevid = 100 + 16 x physical id + sub-device.
VNPU_UDEVID_BASE = 100
VNPU_PER_DEVICE = 16

# the rule that picked the NPUs (TargetDecision.rule), in precedence order
RULES = ("request", "device_index", "driver", "process_table", "container_devices", "visible_devices",
         "rt_visible_devices")
# the evidence lines (EvidenceLine.source), in the order they are shown
SOURCES = ("request", "driver", "process_table", "device_nodes", "devices_cgroup", "visible_devices",
           "rt_visible_devices")


def physical_of_udevid(udevid: int) -> int:
    """The physical device a udevid belongs to (itself, or a vNPU's parent)."""
    if udevid >= VNPU_UDEVID_BASE:
        return (udevid - VNPU_UDEVID_BASE) // VNPU_PER_DEVICE
    return udevid


@dataclass(frozen=True)
class TargetRequest:
    npus: tuple[int, ...] | None = None
    device_index: int | None = None
    env: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if self.npus is not None:
            object.__setattr__(self, "npus", tuple(sorted(set(self.npus))) or None)

    @classmethod
    def of(cls, npus) -> TargetRequest:
        """A request naming ``npus`` (an int, ids, or None/empty for none)."""
        if npus is None:
            return cls()
        if isinstance(npus, TargetRequest):
            return npus
        return cls(npus=(npus,) if isinstance(npus, int) else tuple(npus))

    @property
    def names_npus(self) -> bool:
        return bool(self.npus)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.npus:
            out["npu"] = list(self.npus)
        if self.device_index is not None:
            out["device_index"] = self.device_index
        if self.env:
            out["env"] = dict(self.env)
        return out


@dataclass(frozen=True)
class DeviceNode:
    """A character device of the NPU driver's major in the worker's ``/dev``."""

    name: str
    major: int
    minor: int  # the udevid

    def text(self) -> str:
        return f"/dev/{self.name} ({self.major}:{self.minor})"


@dataclass(frozen=True)
class CgroupDevices:
    """What the worker's devices cgroup (v1 ``devices.list``) allows of the driver's major:
    ``minors`` None means every minor."""

    minors: frozenset[int] | None
    path: str


@dataclass(frozen=True)
class NpuEvidence:
    major: int | None = None  # the devdrv-cdev major from /proc/devices
    host_namespace: bool | None = None  # True: the worker shares pid 1's mount namespace
    # True: the worker shares pid 1's user namespace (its mount namespace was made by a privileged
    # process, not by an unprivileged user inside a user namespace of its own)
    host_user_namespace: bool | None = None
    device_nodes: tuple[DeviceNode, ...] | None = None
    cgroup_devices: CgroupDevices | None = None
    driver_udevids: tuple[int, ...] | None = None  # /proc/trs_core/proc entries of the worker
    unavailable: Mapping[str, str] = field(default_factory=frozen_map)  # source -> why it was not read


@dataclass(frozen=True)
class EvidenceLine:
    """One source's word: ``npus`` None means it says nothing (absent, unset, unreadable),
    an empty tuple that it says "none"."""

    source: str
    npus: tuple[int, ...] | None
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "npus": None if self.npus is None else list(self.npus),
                "detail": self.detail}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> EvidenceLine:
        npus = d.get("npus")
        return cls(str(d["source"]), None if npus is None else tuple(int(n) for n in npus), str(d.get("detail", "")))


@dataclass(frozen=True)
class TargetDecision:
    npus: tuple[int, ...]
    rule: str
    reason: str
    evidence: tuple[EvidenceLine, ...] = ()
    warnings: tuple[str, ...] = ()
    # the runtime's devices step by step (found, after each variable, the index): printed by
    # ``plan --explain``; not part of the plan JSON, whose evidence lines carry each source
    steps: tuple[str, ...] = field(default=(), compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"npus": list(self.npus), "rule": self.rule, "reason": self.reason,
                "evidence": [e.to_json() for e in self.evidence], "warnings": list(self.warnings)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TargetDecision:
        return cls(tuple(int(n) for n in d["npus"]), str(d["rule"]), str(d.get("reason", "")),
                   tuple(EvidenceLine.from_json(e) for e in d.get("evidence", ())),
                   tuple(str(w) for w in d.get("warnings", ())))

    def lines(self) -> list[str]:
        """The decision as text: what ``plan --explain`` and ``status --explain`` print."""
        out = [f"targets: NPU {','.join(map(str, self.npus))} by rule {self.rule}: {self.reason}"]
        out.extend(evidence_lines(self.evidence))
        out.extend(f"  runtime: {step}" for step in self.steps)
        out.extend(f"  warning: {w}" for w in self.warnings)
        return out


def evidence_lines(evidence) -> list[str]:
    """One line per source: what it says (``-``: nothing) and how it was read."""
    out = []
    for e in evidence:
        says = "-" if e.npus is None else (",".join(map(str, e.npus)) or "none")
        out.append(f"  {e.source:<18} {says:<8} {e.detail}")
    return out
