"""What ``step`` asks the ``Daemon`` to do on the host, as frozen values.

``step`` (step.py) decides; the effect runner (run.py) does, in order, under the
daemon's lock. A binding inside an effect is already cut to what may go back
(the saved IRQ masks of NPUs nobody live owns, the bans nobody live pins), so
the runner restores exactly what it is handed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from ...values.frozen import frozen_map
from ...values.model import Binding
from ..watch.lifecycle import LeaveAlone, NoteLocality, PinThreads, Reassert

__all__ = ["RestoreAffinity", "RestoreIrqs", "QueueMove", "CancelMove", "Forget", "Persist", "FollowIsolation",
           "Metric", "Note", "BindIrqs", "Remember", "Effect"]


@dataclass(frozen=True)
class RestoreAffinity:
    """Put the worker's threads back on ``binding.original_cpus`` (through its pidfd), and
    with ``restore_irqs`` the IRQ masks and bans the binding still carries; ``restore_uvb``:
    the 950 UVB poll threads too (the last 950 worker)."""

    binding: Binding
    restore_irqs: bool = True
    restore_uvb: bool = False


@dataclass(frozen=True)
class RestoreIrqs:
    """Give back the IRQ masks and bans ``binding`` carries, and, with ``restore_uvb``,
    the UVB masks; its threads are not touched (the worker is gone, or keeps them)."""

    binding: Binding
    restore_uvb: bool = False
    why: str = "gone"  # "gone": a gone worker's; "left": the NPUs a re-bound worker no longer drives


@dataclass(frozen=True)
class QueueMove:
    """Move the worker's pages to NUMA node ``node`` on the mover (``why``: bind, replan)."""

    pid: int
    node: int
    why: str


@dataclass(frozen=True)
class CancelMove:
    pid: int
    why: str


@dataclass(frozen=True)
class Forget:
    """The worker's record leaves the table: let go of its pidfd; ``why`` labels
    ``ascendbind_dropped_workers_total`` (None: not counted, a record bound again)."""

    pid: int
    why: str | None


@dataclass(frozen=True)
class Persist:
    """Write the state file (and follow isolation: the table changed)."""


@dataclass(frozen=True)
class FollowIsolation:
    """Tell isolation what changed besides the table: ``adopt``: released workers, other
    tasks now; ``hand_over``: a bound worker's threads, no longer isolation's to move."""

    adopt: tuple[int, ...] = ()
    hand_over: tuple[int, ...] = ()


@dataclass(frozen=True)
class Metric:
    """Count ``name`` (a ``Metrics`` counter method) with ``label``."""

    name: str
    label: str


@dataclass(frozen=True)
class Note:
    """A log line: ``level`` (info, warning), ``event``, and its fields."""

    level: str
    event: str
    fields: Mapping[str, Any] = field(default_factory=lambda: frozen_map({}))


@dataclass(frozen=True)
class BindIrqs:
    """Run the IRQ step the worker's binding left out while nothing proved it (it is now),
    keeping what the live ``sharers`` of its NPUs saved."""

    pid: int
    sharers: tuple[int, ...] = ()


@dataclass(frozen=True)
class Remember:
    """A look's action on the worker's loop memory (pin late threads, re-assert, leave
    alone, note locality): the runner does it and records it on the ``Held`` record."""

    pid: int
    action: Union[PinThreads, Reassert, LeaveAlone, NoteLocality]


Effect = Union[RestoreAffinity, RestoreIrqs, QueueMove, CancelMove, Forget, Persist, FollowIsolation, Metric, Note,
               BindIrqs, Remember]
