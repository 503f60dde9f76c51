"""Run every step for one worker (OWNER: applier helper — replace this stub)."""

from __future__ import annotations

from ..config import Config
from ..model import Binding, HostFacts, Plan, StepResult, WorkerFacts


def apply_plan(plan: Plan, worker: WorkerFacts, host: HostFacts, config: Config) -> Binding:
    """Steps affinity, irq, memory, uvb; each yields a StepResult; a failed step never stops
    the independent ones. Verifies pid + start time first (ProcessGone if gone/recycled).
    """
    raise NotImplementedError


def release_binding(binding: Binding, config: Config, *, restore_irqs: bool = True) -> tuple[StepResult, ...]:
    """Restore the worker's original affinity (all threads) and, if asked, the saved IRQ masks."""
    raise NotImplementedError
