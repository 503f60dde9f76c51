"""``Held``: one bound worker as the daemon holds it, with the reconcile loop's memory of it.

A record is changed only by the ``Daemon`` (heart/), from the effects its table's rules
(heart/step.py) return; the one exception is the thread cache (``threads``),
which the observer (observe.py) keeps current as it looks."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...applier.affinity import role_of
from ...values.config import CHOICES
from ...values.cpulist import format_cpulist
from ...discovery.read.pin import ProcessPin
from ...discovery.parse.numa_maps import NumaResidency
from ...values.frozen import frozen_map, plain
from ...values.model import Binding, NpuPlan
from ...values.reasons import Step
from ...values.threadclass import ThreadClass
from .lifecycle import Record
from .proof import Proof
from ..api.requests import PlanAsk, alignment_of
from ..state.staterecord import binding_to_json
from ..state.state import encode_record

__all__ = ["Held", "Drift", "KINDS", "SeenThread", "YOUNG_PASSES", "accepted", "cpulists", "memory_state"]

# passes during which a newly seen thread's comm is read again (see reconcile.comm_due)
YOUNG_PASSES = 3


class SeenThread:
    """What the reconcile loop knows of one thread: the mask we set or accepted, the
    role its comm gave it, and how many more passes its comm is read again."""

    __slots__ = ("mask", "role", "young")

    def __init__(self, mask: frozenset[int], role: str, young: int = YOUNG_PASSES) -> None:
        self.mask, self.role, self.young = mask, role, young

    def __repr__(self) -> str:
        return f"SeenThread({format_cpulist(self.mask)!r}, {self.role!r}, young={self.young})"


# the two kinds of mask the reconcile loop holds a worker to: its threads' and its NPU's IRQs'
KINDS = ("threads", "irqs")

# where each kind's verdict lives in the state file and in /v1/workers' "drift": (culprit, blame,
# left alone, why); None: not kept (an IRQ mask's culprit says it all). The names are the file's
# since before the kinds shared one record: an existing state file loads as it always did.
_KEYS = {"threads": ("culprit", "blame", "left_alone", "left_alone_why"),
         "irqs": ("irq_culprit", None, "irqs_left_alone", "irqs_left_alone_why")}


@dataclass
class Drift:
    """What the reconcile loop concluded about one kind of mask of a worker."""

    reasserts: deque = field(default_factory=deque)  # monotonic times of recent re-asserts
    culprit: str | None = None  # who moved the masks last (metrics.CULPRITS)
    blame: str | None = None  # the sentence behind ``culprit``: the evidence, or its absence
    left_alone: bool = False  # re-asserted too often: no longer set back
    why: str | None = None  # why it is left alone, for the status

    def to_json(self, kind: str) -> dict[str, Any]:
        return {k: v for k, v in zip(_KEYS[kind], (self.culprit, self.blame, self.left_alone, self.why))
                if k is not None}

    @classmethod
    def from_json(cls, kind: str, raw: Mapping[str, Any]) -> Drift:
        def text(key: str | None) -> str | None:
            v = raw.get(key) if key is not None else None
            return v[:2000] if isinstance(v, str) else None

        culprit, blame, alone, why = _KEYS[kind]
        # "unknown" was the label before blame needed evidence: it meant "no evidence"
        label = "external" if raw.get(culprit) == "unknown" else text(culprit)
        return cls(culprit=label, blame=text(blame), left_alone=bool(raw.get(alone)), why=text(why))


def _drifts() -> dict[str, Drift]:
    return {kind: Drift() for kind in KINDS}


@dataclass
class Held:
    """One bound worker and what the reconcile loop remembers about it."""

    binding: Binding
    bound_at: float
    policy: str | None = None  # the request's topology_policy, None: the node's
    threads: dict[int, SeenThread] = field(default_factory=dict)  # tid -> mask/role we set or accepted
    drift: dict[str, Drift] = field(default_factory=_drifts)  # kind (KINDS) -> the loop's verdict on it
    drift_events: int = 0
    late_threads: int = 0
    # the locality check (locality.py); times are time.monotonic()
    memory_local_ratio: float | None = None  # None: not measured yet, unreadable, or nothing resident
    memory_checked_at: float | None = None
    memory_last_run: float = field(default_factory=time.monotonic)  # the bind itself ran the memory step
    memory_reruns: int = 0
    memory_futile: int = 0  # reruns in a row that left the ratio below the threshold
    memory_residency: NumaResidency | None = None  # the last check's bytes per node, private and shared
    # (node, why) of a memory move queued or running (memmove.py); kept in the state file
    # so that a daemon stopped before the move ended starts it again
    memory_move: tuple[int, str] | None = None
    # (host, worker, config) the plan was made from: explains it without a new discovery.
    # Not persisted; a binding restored from the state file is explained from fresh facts.
    facts: tuple | None = field(default=None, repr=False)
    # npu-smi's verdict on a bind that named its NPU (npucheck.py); None: not checked. Not persisted.
    npu_check: dict | None = None
    # the worker held by its own pidfd (discovery/read/pin.py): what says it is still the process
    # bound, whatever the number names now; None where no pidfd can be had. Closed by the
    # daemon when the record leaves the held table (``close``).
    pin: ProcessPin | None = field(default=None, repr=False, compare=False)
    # the request's pool_source, None: the node's
    pool_source: str | None = None
    # what proves the worker drives its NPUs (proof.py): only a proven binding is isolated and
    # holds its NPUs against others. Kept in the state file.
    proof: Proof = field(default_factory=lambda: Proof(False, "claim", "nothing weighed yet"))
    # the cgroup cpuset the binding was last planned (or re-planned) for; None: the plan's
    # allowed CPUs. The reconcile loop plans the worker again when its cpuset is not this one.
    cpuset_seen: frozenset[int] | None = None
    # why the last re-plan for a changed cpuset found no plan (its threads are left alone
    # until the cpuset, or kubelet's checkpoint, changes again); None: it found one
    cpuset_stuck: str | None = None
    # (binding, state_json(), its encoded record): a save re-encodes only the records that changed
    _saved: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def ask(self) -> PlanAsk:
        """What the bind request asked of its plan, for planning it again."""
        return PlanAsk(self.policy, self.pool_source)

    def close(self) -> None:
        """Let go of the worker's pidfd: the record has left the held table."""
        if self.pin is not None:
            self.pin.close()

    def record(self) -> Record:
        """What the lifecycle rules weigh of this worker, as a frozen value."""
        return Record(self.binding.pid, left_alone=frozenset(k for k, d in self.drift.items() if d.left_alone),
                      reasserts=frozen_map({k: tuple(d.reasserts) for k, d in self.drift.items()}),
                      memory_last_run=self.memory_last_run, memory_futile=self.memory_futile,
                      memory_ratio=self.memory_local_ratio, memory_moving=self.memory_move is not None)

    def count_drift(self, what: str, blame, times) -> None:
        """One more drift of ``what`` ("threads" or "irqs"), blamed on ``blame``; ``times``:
        the re-asserts within the window."""
        self.drift_events += 1
        d = self.drift[what]
        d.culprit, d.reasserts = blame.culprit, deque(times)
        if _KEYS[what][1] is not None:
            d.blame = blame.why

    def leave_alone(self, what: str, why: str) -> None:
        """Stop re-asserting ``what``; ``why`` is what the status says."""
        self.drift[what].left_alone, self.drift[what].why = True, why

    def note_locality(self, ratio: float | None, at: float, residency, *, reset_futile: bool) -> None:
        self.memory_checked_at, self.memory_local_ratio, self.memory_residency = at, ratio, residency
        if reset_futile:
            self.memory_futile = 0

    def remember_threads(self, masks: Mapping[int, tuple[str, frozenset[int]]],
                         role_cpus: Mapping[str, frozenset[int]], classes: Sequence[ThreadClass] = ()) -> None:
        """Start the thread cache from the masks the affinity step read back right after
        writing them (tid -> (comm, mask)); nothing is read here. One more look at each
        name: a thread created just before the bind may not be named yet."""
        threads: dict[int, SeenThread] = {}
        for tid, (comm, mask) in masks.items():
            role = role_of(comm, classes)
            wanted = role_cpus[role]
            threads[tid] = SeenThread(wanted if mask == wanted else accepted(mask, wanted), role, young=1)
        self.threads = threads

    def state_json(self) -> dict[str, Any]:
        """What the state file keeps beside the binding, so a restart remembers the verdicts."""
        return {"bound_at": self.bound_at, "topology_policy": self.policy, "pool_source": self.pool_source,
                **self.drift["threads"].to_json("threads"), **self.drift["irqs"].to_json("irqs"),
                "proof": self.proof.to_json(),
                "memory_move": None if self.memory_move is None else
                {"node": self.memory_move[0], "why": self.memory_move[1]}}

    def state_record(self) -> str:
        """This worker's record in the state file, encoded; built again only when the
        binding or the verdicts changed since the last save (every save writes every
        worker, and most of them have not changed)."""
        extra = self.state_json()
        saved = self._saved
        if saved is not None and saved[0] is self.binding and saved[1] == extra:
            return saved[2]
        text = encode_record(binding_to_json(self.binding, **extra))
        self._saved = (self.binding, extra, text)
        return text

    @classmethod
    def from_state(cls, binding: Binding, raw: Mapping[str, Any], now: float) -> Held:
        """Inverse of state_json (entries written before a field existed get its default)."""
        h = cls(binding, float(raw.get("bound_at") or now), raw.get("topology_policy"))
        source = raw.get("pool_source")
        h.pool_source = source if source in CHOICES["pool_source"] else None
        h.drift = {kind: Drift.from_json(kind, raw) for kind in KINDS}
        h.proof = Proof.from_json(raw.get("proof"))
        move = raw.get("memory_move")
        if isinstance(move, dict) and type(move.get("node")) is int and move["node"] >= 0:
            h.memory_move = (move["node"], "restart")
        return h

    def to_json(self, move=None) -> dict[str, Any]:
        """The worker as ``/v1/workers`` lists it; ``move``: its memory move job, if one is
        queued or running (memmove.py)."""
        b = self.binding
        aligned, failure = alignment_of(b.plan)
        al = b.plan.alignment
        return {
            "pid": b.pid,
            "start_time": b.start_time,
            "npus": list(b.npus),
            "bound_at": self.bound_at,
            "topology_policy": self.policy,
            "pool_source": self.pool_source,
            "outcome": "aligned" if aligned else "unaligned",
            "alignment": {"aligned": aligned, "policy": al.policy if al else None, "failure": failure,
                          "reason": al.reason if al and not aligned else None},
            "cpulists": cpulists(b),
            "plan": b.plan.to_json(),
            "original_cpus": sorted(b.original_cpus),
            "steps": [s.to_json() for s in b.steps],
            "drift": {"events": self.drift_events, **self.drift["threads"].to_json("threads"),
                      **self.drift["irqs"].to_json("irqs")},
            "late_threads_pinned": self.late_threads,
            "npu_check": self.npu_check,
            "proof": self.proof.to_json(),
            "memory_local_ratio": None if self.memory_local_ratio is None else round(self.memory_local_ratio, 4),
            "memory_reruns": self.memory_reruns,
            "memory": memory_state(self, move),
            "memory_kib_by_node": None if self.memory_residency is None else {
                "private": {str(n): v for n, v in self.memory_residency.private_kib.items()},
                "shared": {str(n): v for n, v in self.memory_residency.shared_kib.items()}},
            "contention": None,  # what its threads got of their CPUs: the daemon's status answer fills it in
            "thread_events": None,  # how the reconcile loop learns of its threads: filled in the same way
        }


_MOVE_STATES = {"applied": "done", "failed": "failed", "skipped": "skipped", "pending": "pending"}


def memory_state(h: Held, job) -> dict[str, Any]:
    """Where ``h``'s memory step stands: the move job's state and progress while one is
    queued or running (``pending`` / ``moving``), else the step's outcome (``done``,
    ``failed`` or ``skipped``, with its reason, sentence and figures)."""
    if job is not None and job.held is h:
        return job.to_json()
    step = h.binding.step(Step.MEMORY)
    if step is None:
        return {"state": None}
    out = {"state": _MOVE_STATES[step.outcome.value], "reason": step.reason.value if step.reason else None,
           "detail": step.detail, **{k: v for k, v in plain(step.data).items() if k != "state"}}
    if h.memory_move is not None:
        out.update(state="pending", target_node=h.memory_move[0], why=h.memory_move[1])
    return out


def accepted(mask, wanted: frozenset[int]) -> frozenset[int]:
    """The mask to hold a thread to, read back right after we set ``wanted``: what the kernel
    kept when it is inside ``wanted`` (a cpuset narrows a mask to the part it allows), else
    ``wanted`` itself. An in-process binder may move the thread between our write and the
    read; that mask is not ours to keep, and the next pass sees it as drift."""
    mask = frozenset(mask)
    return mask if mask and mask <= wanted else frozenset(wanted)


def _npu_cpulists(p: NpuPlan) -> dict[str, Any]:
    out: dict[str, Any] = {role: format_cpulist(getattr(p, role)) for role in ("pool", "irq", "main", "acl", "release")}
    if p.classes:  # the share classes carved from main, under their own names; absent without any
        out["classes"] = {name: format_cpulist(cpus) for name, cpus in p.classes}
    return out


def cpulists(b: Binding) -> dict[str, Any]:
    """The binding's CPU sets as kernel cpulist strings ("0-23,48"): what an operator reads."""
    return {
        "original": format_cpulist(b.original_cpus),
        "allowed": format_cpulist(b.plan.allowed_cpus),
        "npus": {str(p.npu): _npu_cpulists(p) for p in b.plan.npus},
        "uvb": format_cpulist(b.plan.uvb_cpus),
    }
