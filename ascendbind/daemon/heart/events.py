"""What happens to the held table: the events ``step`` (step.py) takes, as frozen values.

The ``Daemon`` observes first (the I/O: a bind's writes, a pidfd's poll, npu-smi's
table), then says what it saw as one of these. Every event that weighs other
workers carries ``live``: the pids whose pidfd (or start time) said, just before,
that they are still the process bound; ``step`` counts nobody else as alive. A
pid that an event names but the table does not hold is a no-op (the worker was
released or bound again meanwhile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ...values.model import Binding, StepResult
from ..watch.lifecycle import LeaveAlone, NoteLocality, PinThreads, Reassert
from ..watch.proof import Proof

__all__ = ["Bound", "Released", "Gone", "Looked", "MemoryMoved", "Replanned", "NpuChecked", "Event"]


@dataclass(frozen=True)
class Bound:
    """``binding`` was just applied to ``binding.pid`` (its writes done), proven by
    ``proof``; ``replaced``: dead holders of its NPUs it takes over, ``evicted``: live
    ones that give way (``claim`` said so before the writes). ``memory_node``: where its
    pages are to move, None when its memory step needs no move."""

    binding: Binding
    proof: Proof
    live: frozenset[int] = frozenset()
    replaced: tuple[int, ...] = ()
    evicted: tuple[int, ...] = ()
    memory_node: int | None = None
    threads: tuple[int, ...] = ()  # its threads' tids: isolation's no longer


@dataclass(frozen=True)
class Released:
    """The worker asked to be let go (``reason``: released, npu_mismatch, evicted); its
    threads go back to their CPUs, and what nobody live needs goes back to the host."""

    pid: int
    live: frozenset[int] = frozenset()
    reason: str = "released"


@dataclass(frozen=True)
class Gone:
    """The worker is no more (``reason``: exited, recycled, or, at start, interrupted /
    not a worker): only what it saved for the host goes back; its threads are a stranger's."""

    pid: int
    live: frozenset[int] = frozenset()
    reason: str = "exited"


@dataclass(frozen=True)
class Looked:
    """A reconcile look's actions for the worker (lifecycle.decide), but ``Drop`` (a
    ``Gone``) and ``Replan`` (planned outside the lock, then ``Replanned``)."""

    pid: int
    actions: tuple[Union[PinThreads, Reassert, LeaveAlone, NoteLocality], ...] = ()


@dataclass(frozen=True)
class MemoryMoved:
    """A memory move of the worker ended with ``result`` (the binding's memory step from now on)."""

    pid: int
    result: StepResult


@dataclass(frozen=True)
class Replanned:
    """The worker was planned and bound again (a cpuset or host change): ``binding`` is
    what the applier did; it keeps the host's originals of the binding it replaces."""

    pid: int
    binding: Binding
    memory_node: int | None = None


@dataclass(frozen=True)
class NpuChecked:
    """npu-smi's process table said ``verdict`` (confirmed, contradicted, unlisted, ...)
    of the binding of ``pid`` to ``npus`` started at ``start_time``. ``refused``: why
    isolating it too would leave no housekeeping CPU (None: it would not)."""

    pid: int
    start_time: int
    npus: tuple[int, ...]
    verdict: str
    why: str
    live: frozenset[int] = frozenset()
    refused: str | None = None
    allow_shared: bool = False


Event = Union[Bound, Released, Gone, Looked, MemoryMoved, Replanned, NpuChecked]
