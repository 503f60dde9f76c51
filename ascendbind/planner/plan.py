"""Entry point of the planner (OWNER: planner helper — replace this stub)."""

from __future__ import annotations

from collections.abc import Sequence

from ..config import Config
from ..model import HostFacts, Plan, WorkerFacts


def make_plan(host: HostFacts, worker: WorkerFacts, targets: Sequence[int], config: Config) -> Plan:
    """SPEC §2. Never raises for a per-NPU problem: it goes into ``plan.errors``
    (code + sentence with the numbers) and the NPU is absent from ``plan.npus``.
    Planning uses ``worker.allowed_cpus`` only (never a mask ascendbind set).
    """
    raise NotImplementedError
