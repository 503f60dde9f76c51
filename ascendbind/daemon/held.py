"""``Held``: one bound worker as the daemon holds it, with the reconcile loop's memory of it."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..model import Binding
from .requests import alignment_of

__all__ = ["Held"]


@dataclass
class Held:
    """One bound worker and what the reconcile loop remembers about it."""

    binding: Binding
    bound_at: float
    policy: str | None = None
    known: dict[int, frozenset[int]] = field(default_factory=dict)  # tid -> mask we set / accepted
    reasserts: deque = field(default_factory=deque)  # monotonic times of recent thread re-asserts
    irq_reasserts: deque = field(default_factory=deque)
    culprit: str | None = None
    left_alone: bool = False
    irqs_left_alone: bool = False
    drift_events: int = 0
    late_threads: int = 0
    # the locality check (daemon/locality.py); times are time.monotonic()
    memory_local_ratio: float | None = None  # None: not measured yet, unreadable, or nothing resident
    memory_checked_at: float | None = None
    memory_last_run: float = field(default_factory=time.monotonic)  # the bind itself ran the memory step
    memory_reruns: int = 0
    memory_futile: int = 0  # reruns in a row that left the ratio below the threshold

    def to_json(self) -> dict[str, Any]:
        b = self.binding
        return {
            "pid": b.pid,
            "start_time": b.start_time,
            "npus": list(b.npus),
            "bound_at": self.bound_at,
            "topology_policy": self.policy,
            "outcome": "aligned" if alignment_of(b.plan)[0] else "unaligned",
            "plan": b.plan.to_json(),
            "original_cpus": sorted(b.original_cpus),
            "steps": [s.to_json() for s in b.steps],
            "drift": {"events": self.drift_events, "culprit": self.culprit, "left_alone": self.left_alone,
                      "irqs_left_alone": self.irqs_left_alone},
            "late_threads_pinned": self.late_threads,
            "memory_local_ratio": None if self.memory_local_ratio is None else round(self.memory_local_ratio, 4),
            "memory_reruns": self.memory_reruns,
        }
