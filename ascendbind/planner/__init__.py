"""Planner: (host facts, worker facts, target NPUs, config) -> Plan. Pure: no I/O."""

from .plan import make_plan
from .targets import select_targets

__all__ = ["make_plan", "select_targets"]
