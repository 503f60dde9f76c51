"""Applier: Plan + pid -> StepResults. The only code that changes the host."""

from .bind import apply_plan, release_binding

__all__ = ["apply_plan", "release_binding"]
