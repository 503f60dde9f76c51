"""A bound worker's lifecycle, as rules: what one look at it calls for. No I/O.

The daemon holds a worker from its bind until it is released, exits, is
recycled (its pid now names another process) or replaced. Between, a
reconcile look (``Observation``) may find threads to pin, masks that drifted,
IRQ masks that moved, or its memory's locality; ``decide`` turns the look, the
worker's record (``Record``) and the time into ``actions``, frozen values the
daemon executes. Nothing here reads the host or changes anything: the shell
(reconcile.py, locality.py) observes, calls ``decide``, and hands the actions
to the ``Daemon``, the only code that mutates the held table and its records.

Invariants ``decide`` keeps:

* A gone worker is dropped and nothing else is done for it: ``Drop`` is the
  only action, whatever else the look saw (the threads of a recycled pid are a
  stranger's).
* Threads of a worker that is *left alone* are never pinned nor re-asserted,
  and the shell does not even look at them (``wanted``); the same holds, on its
  own, for its IRQ masks. Being left alone ends only with the binding (a new
  bind, a release, or a re-plan for a changed cpuset).
* A cpuset that is no longer the one the binding was planned from (``CpusetNews``,
  ``cpuset_changed``) calls for a ``Replan`` instead of any thread action, left
  alone or not: the kernel moved the threads into the new set, which is no one's
  drift to fight (blamed ``cpuset``), and the old plan's masks may not even be
  settable. The re-plan starts the binding over (its re-assert budget, its
  verdicts). A changed checkpoint (``checkpoint_changed``) calls for a ``Replan``
  beside the look's other actions: no thread was moved.
* A look that saw nothing (``Observation()``) calls for no action, whatever
  the record says: the shell may skip asking.
* Every drift seen counts as one drift event and gets a culprit from evidence
  only (blame.py): ``self``, ``env`` or ``external`` for threads (``cpuset``
  for the kernel's own move),
  ``irqbalance`` or ``external`` for IRQ masks.
* A drift is re-asserted while fewer than ``Limits.reassert_limit`` re-asserts
  lie within the last ``Limits.window`` seconds; the next one leaves the
  threads (or the IRQs) alone, with a sentence that says how often, whom the
  evidence blames and what to do about it. The culprit never changes whether a
  worker is left alone, only what it is told.
* Threads born or renamed since the last look are pinned by their role even
  when other threads drifted: a late ``acl_thread`` is not drift.
* A measured memory ratio (of the worker's private memory: the only memory a
  move touches) is always recorded; the memory step reruns only for a ratio
  below ``Limits.memory_local_threshold``, never while a move of the worker is
  queued or running, and ``memory_rerun_seconds`` x 2**futile (capped) after
  the last run. A rerun is futile when it leaves the ratio below the threshold
  or raises it by less than ``MEMORY_HYSTERESIS``; only a ratio at the threshold
  plus ``MEMORY_HYSTERESIS`` resets the futile count, so a worker hovering at
  the threshold backs off instead of being moved again and again. Shared pages
  are never moved, so no two workers can take pages from each other.

Restoration (``restoration``): a dropped or released worker's saved IRQ masks
go back to the host only for the NPUs no other *live* worker owns, since the
masks are the host's originals and the other owner still needs its IRQs where
they are; the IRQs it banned in irqbalance go back to irqbalance only when no
other live worker pins them, and otherwise the ban passes to one that does.
The 950 UVB masks are restored by the last 950 worker to go.

Re-binding (``left_behind``): a held worker bound again to other NPUs leaves the
NPUs it no longer drives, so what its earlier binding saved for them goes back
exactly as a release of those NPUs would put it (``restoration`` over them); the
new binding inherits only what belongs to the NPUs it still drives.

Who gives way to a bind, and what a binding inherits, are the held table's
rules (daemon/heart/step.py): they weigh every held worker, not one look.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Union

from ...discovery.parse.numa_maps import NumaResidency
from ...values.frozen import frozen_map
from ...values.model import Binding
from ...values.reasons import Reason, Step
from .bans import split_bans
from ...values.cpulist import format_cpulist
from .blame import Blame, Evidence, blame_cpuset, blame_irqs, blame_threads, left_alone_sentence
from ..api.requests import irq_owners

__all__ = [
    "REASSERT_LIMIT", "MASK_LABELS", "RERUN_BACKOFF_CAP", "MEMORY_HYSTERESIS", "Limits", "Record", "Observation",
    "Looks",
    "PinThreads", "Reassert", "LeaveAlone", "Drop", "NoteLocality", "RerunMemory",
    "CpusetNews", "Replan",
    "Restoration", "decide", "wanted", "memory_rerun_due", "rerun_was_futile", "restoration", "irqs_unproven",
    "left_behind",
]

REASSERT_LIMIT = 3
# each kind of mask a look holds a worker to ("threads", "irqs"), as a sentence names it
MASK_LABELS = {"threads": "thread masks", "irqs": "IRQ masks"}
RERUN_BACKOFF_CAP = 16
# the band a memory ratio must clear: a rerun that gains less was futile, and only a
# ratio this far above the threshold resets the backoff
MEMORY_HYSTERESIS = 0.05


# ------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Limits:
    """The rules' knobs: the re-assert budget and the memory rerun rate."""

    reassert_limit: int = REASSERT_LIMIT
    window: float = 60.0  # seconds over which re-asserts are counted
    memory_local_threshold: float = 0.0
    memory_rerun_seconds: float = 600.0


@dataclass(frozen=True)
class Record:
    """What the rules need to know of a held worker: its verdicts and recent history."""

    pid: int
    left_alone: frozenset[str] = frozenset()  # the kinds of mask ("threads", "irqs") no longer set back
    # per kind of mask, the monotonic times of its recent re-asserts
    reasserts: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: frozen_map({}))
    memory_last_run: float = 0.0  # the last memory step (the bind's own counts)
    memory_futile: int = 0  # reruns in a row that left the ratio below the threshold
    memory_ratio: float | None = None  # the last check's ratio (None: none measured)
    memory_moving: bool = False  # a move of its pages is queued or running


@dataclass(frozen=True)
class CpusetNews:
    """The worker's cpuset (or the checkpoint that proves it its own) changed since its binding
    was planned: ``before`` the CPUs it was planned from, ``after`` its cgroup's CPUs now,
    ``why`` ``cpuset_changed`` (its cgroup's CPUs) or ``checkpoint_changed`` (kubelet's
    CPU manager checkpoint, which may now prove the cpuset its own), ``moved``: CPUs of its plan left the cpuset, so the
    kernel moved threads."""

    before: frozenset[int]
    after: frozenset[int]
    why: str = "cpuset_changed"
    moved: bool = False


@dataclass(frozen=True)
class Observation:
    """What one look at a worker saw. Empty fields: nothing of that kind to report."""

    gone: str | None = None  # "exited" or "recycled": the worker is no more
    to_pin: tuple[tuple[int, str], ...] = ()  # (tid, role): born or renamed, not on its role's CPUs
    drifted: tuple[int, ...] = ()  # tids whose mask is not the one we set
    evidence: Evidence | None = None  # what the worker says about binding itself (read on drift)
    moved_irqs: tuple[tuple[int, frozenset[int]], ...] = ()  # (irq, the CPUs we set it to)
    irqbalance_running: bool = False
    memory_measured: bool = False  # a locality check ran in this look
    memory_ratio: float | None = None  # its result; None: nothing resident or unreadable
    memory_residency: NumaResidency | None = None  # the bytes per node it read, private and shared
    cpuset: CpusetNews | None = None  # its cpuset is not the one its binding was planned from


@dataclass(frozen=True)
class Looks:
    """What a look at a worker should cover (``wanted``)."""

    threads: bool
    irqs: bool


# ------------------------------------------------------------------ actions


@dataclass(frozen=True)
class PinThreads:
    """Pin threads born or renamed since the last look by their role."""

    threads: tuple[tuple[int, str], ...]  # (tid, role)


@dataclass(frozen=True)
class Reassert:
    """Set drifted masks back (``what``: "threads" or "irqs") and count the drift."""

    what: str
    blame: Blame
    times: tuple[float, ...]  # the re-asserts within the window, this one included
    tids: tuple[int, ...] = ()
    irqs: tuple[tuple[int, frozenset[int]], ...] = ()


@dataclass(frozen=True)
class LeaveAlone:
    """Stop re-asserting ``what`` ("threads" or "irqs"); ``why`` goes into the status."""

    what: str
    blame: Blame
    why: str
    times: tuple[float, ...]  # the re-asserts that used up the budget


@dataclass(frozen=True)
class Replan:
    """Plan the worker again from its cpuset now and bind it by the new plan (the shell runs
    it outside the daemon's lock: it reads the worker's facts)."""

    news: CpusetNews
    blame: Blame | None  # the kernel's move (culprit ``cpuset``); None when only the checkpoint changed


@dataclass(frozen=True)
class Drop:
    """Forget the worker (``reason``: exited or recycled); restore what ``restoration`` allows."""

    reason: str


@dataclass(frozen=True)
class NoteLocality:
    """Record a locality check's result (``reset_futile``: the ratio is good again)."""

    ratio: float | None
    at: float
    reset_futile: bool
    residency: NumaResidency | None = None


@dataclass(frozen=True)
class RerunMemory:
    """Run the memory step again (the shell runs at most one per round: the worst ratio's)."""

    ratio: float


# typing.Union: a runtime ``X | Y`` of classes needs Python 3.10
Action = Union[PinThreads, Reassert, LeaveAlone, Drop, NoteLocality, RerunMemory, Replan]


# ------------------------------------------------------------------ rules


def wanted(record: Record) -> Looks:
    """What a look should read: nothing of what is left alone (that costs nothing)."""
    return Looks(threads="threads" not in record.left_alone, irqs="irqs" not in record.left_alone)


def decide(record: Record, obs: Observation, now: float, limits: Limits) -> tuple[Action, ...]:
    """The actions one look at a held worker calls for, in the order to run them."""
    if obs.gone is not None:
        return (Drop(obs.gone),)
    actions: list[Action] = []
    news = obs.cpuset
    moved = news is not None and news.why == "cpuset_changed"  # the kernel's move: no thread action
    if news is not None:
        blame = blame_cpuset(format_cpulist(news.before), format_cpulist(news.after)) if moved else None
        actions.append(Replan(news, blame))
    if not moved and "threads" not in record.left_alone:
        if obs.to_pin:
            actions.append(PinThreads(tuple(obs.to_pin)))
        if obs.drifted:
            blame = blame_threads(obs.evidence if obs.evidence is not None else Evidence())
            actions.append(_drift("threads", blame, record.reasserts.get("threads", ()), now, limits, tids=tuple(obs.drifted)))
    if "irqs" not in record.left_alone and obs.moved_irqs:
        blame = blame_irqs(obs.irqbalance_running)
        actions.append(_drift("irqs", blame, record.reasserts.get("irqs", ()), now, limits, irqs=tuple(obs.moved_irqs)))
    if obs.memory_measured:
        ratio = obs.memory_ratio
        # (a hair of slack: 0.8 + 0.05 is 0.8500000000000001 in binary)
        good = ratio is not None and ratio + 1e-9 >= min(1.0, limits.memory_local_threshold + MEMORY_HYSTERESIS)
        actions.append(NoteLocality(ratio, now, good, obs.memory_residency))
        if memory_rerun_due(ratio, limits.memory_local_threshold, record.memory_last_run, now,
                            limits.memory_rerun_seconds, record.memory_futile, moving=record.memory_moving):
            actions.append(RerunMemory(ratio))
    return tuple(actions)


def _drift(what: str, blame: Blame, times: Iterable[float], now: float, limits: Limits, *,
           tids: tuple[int, ...] = (), irqs: tuple[tuple[int, frozenset[int]], ...] = ()) -> Reassert | LeaveAlone:
    recent = tuple(t for t in times if now - t <= limits.window)
    if len(recent) >= limits.reassert_limit:
        sentence = left_alone_sentence(MASK_LABELS[what], blame, len(recent), limits.window)
        return LeaveAlone(what, blame, sentence, recent)
    return Reassert(what, blame, (*recent, now), tids=tids, irqs=irqs)


def memory_rerun_due(ratio: float | None, threshold: float, last_run: float, now: float,
                     interval: float, futile: int = 0, *, moving: bool = False) -> bool:
    """Run the memory step again? Only for a measured ratio below ``threshold``, never
    while a move is queued or running, and only ``interval`` x 2**``futile`` (capped at
    RERUN_BACKOFF_CAP x) after ``last_run``."""
    if moving or ratio is None or ratio >= threshold:
        return False
    backoff = min(2 ** max(0, min(futile, 30)), RERUN_BACKOFF_CAP)
    return now - last_run >= interval * backoff


def rerun_was_futile(ratio_before: float | None, ratio_after: float | None, limits: Limits) -> bool:
    """A rerun that left the ratio unknown, below the threshold, or raised it by less than
    MEMORY_HYSTERESIS doubles the wait before the next one."""
    if ratio_after is None or ratio_after < limits.memory_local_threshold:
        return True
    return ratio_before is not None and ratio_after - ratio_before < MEMORY_HYSTERESIS


@dataclass(frozen=True)
class Restoration:
    """What going back to the host means for one leaving worker."""

    binding: Binding  # the worker's binding, keeping only the IRQ masks and bans it may restore
    passed_bans: Mapping[int, tuple[int, ...]]  # other live pid -> the banned IRQs it takes over
    restore_uvb: bool  # the last 950 worker restores the UVB masks


def irqs_unproven(binding: Binding) -> bool:
    """Whether ``binding``'s IRQ step was left out because nothing proves it drives its NPU."""
    irq = binding.step(Step.IRQ)
    return irq is not None and irq.reason is Reason.UNPROVEN


def restoration(binding: Binding, others: Mapping[int, Binding], *, is_950: bool) -> Restoration:
    """The leaving worker ``binding``'s restoration, given the ``others`` still alive
    (pid -> binding) and whether it runs a 950 cluster plan. A binding whose IRQ step was
    left out because nothing proves it (``unproven``) owns no IRQ: it never keeps another's
    saved masks from going back."""
    others = {pid: b for pid, b in others.items() if not irqs_unproven(b)}
    other_irqs = {pid: irq_owners(b) for pid, b in others.items()}
    left, passed = (binding.irqbalance_bans, {}) if binding.irqbalance_bans is None else \
        split_bans(binding.irqbalance_bans, other_irqs)
    owned = {n for b in others.values() for n in b.npus}
    free = set(binding.npus) - owned
    masks = binding.saved_irq_masks
    if free != set(binding.npus):
        owner = irq_owners(binding)
        masks = frozen_map({irq: m for irq, m in binding.saved_irq_masks.items() if owner.get(irq) in free})
    last_950 = is_950 and not any(b.plan.mode is binding.plan.mode for b in others.values())
    return Restoration(replace(binding, saved_irq_masks=masks, irqbalance_bans=left), passed, last_950)


def left_behind(old: Binding, npus: Collection[int], others: Mapping[int, Binding]) -> tuple[Restoration, Binding]:
    """A worker held by ``old`` is bound again to ``npus`` (``others``: the other live
    workers, pid -> binding) -> (what goes back for the NPUs it no longer drives, as
    ``restoration`` of those NPUs alone would give back; ``old`` keeping only the saved
    masks and bans of the NPUs it still drives, for the new binding to inherit). A mask
    or ban of an IRQ whose NPU ``old`` does not record stays with the new binding."""
    dropped = set(old.npus) - set(npus)
    owner = irq_owners(old)
    leaving = {irq for irq, npu in owner.items() if npu in dropped}
    bans = old.irqbalance_bans
    gone = replace(old, npus=tuple(sorted(dropped)),
                   saved_irq_masks=frozen_map({i: m for i, m in old.saved_irq_masks.items() if i in leaving}),
                   irqbalance_bans=None if bans is None else bans.only(leaving))
    kept = replace(old, saved_irq_masks=frozen_map({i: m for i, m in old.saved_irq_masks.items() if i not in leaving}),
                   irqbalance_bans=None if bans is None else bans.only(bans.irqs - leaving))
    return restoration(gone, others, is_950=False), kept

