"""Topology and CPU-bind policies as small objects behind one protocol, after kubelet.

The kubelet Topology Manager gives each policy its own type behind one
interface (merge the providers' hints, then admit or refuse); the rest of the
planner asks the policy, never compares its name. Here:

none              keeps the seed pool and only reports whether it is aligned;
                  admits every NPU, even when alignment cannot be evaluated
best-effort       builds the pool inside a preferred merged hint; admits every
                  NPU it can evaluate
restricted        admits only a preferred merged hint (pool built inside it)
single-numa-node  merges single-node preferred hints only; admits only a merged
                  hint of exactly one node

A policy is looked up once per plan from the config value (``topology_policy``),
which config.py has already checked against the same four names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from ...values.config import CHOICES
from .hints import Hint, Merged, filter_single_numa, merge, width

__all__ = ["TopologyPolicy", "topology_policy", "TOPOLOGY_POLICIES", "CpuBindPolicy", "cpu_bind_policy",
           "CPU_BIND_POLICIES"]


class TopologyPolicy(Protocol):
    name: str
    # acts on alignment at all: builds pools inside the merged mask, and refuses an
    # NPU whose alignment cannot be evaluated (too many NUMA nodes, none reported)
    aligns: bool
    # refuses an NPU it cannot align (kubelet's "admit" answers no)
    strict: bool
    # keeps only single-node preferred hints before merging
    prefers_single_node: bool
    # why the seed pool stays when the NPU is admitted unaligned; None for a strict policy
    kept_note: str | None

    def merge(self, providers: Sequence[Sequence[Hint]], machine: int, *, prefer_closest: bool,
              distances: Mapping[int, Mapping[int, int]]) -> tuple[Merged, bool]:
        """The merged hint over every provider's hints, and whether any combination shares a node."""
        ...

    def fits(self, merged: Merged, viable: bool) -> bool:
        """Whether the merged hint is one this policy would build a pool inside."""
        ...

    def admit(self, fits: bool) -> bool:
        """Whether the NPU is planned, given whether its pool fits the merged hint."""
        ...


class _BestEffort:
    __slots__ = ()
    name = "best-effort"
    aligns = True
    strict = False
    prefers_single_node = False
    kept_note: str | None = "best-effort keeps the seed pool"

    def merge(self, providers, machine, *, prefer_closest, distances):
        return merge(providers, machine, prefer_closest=prefer_closest, distances=distances)

    def fits(self, merged: Merged, viable: bool) -> bool:
        return viable and merged.preferred

    def admit(self, fits: bool) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<topology policy {self.name}>"


class _None(_BestEffort):
    __slots__ = ()
    name = "none"
    aligns = False
    kept_note = "topology_policy none keeps the seed pool"


class _Restricted(_BestEffort):
    __slots__ = ()
    name = "restricted"
    strict = True
    kept_note = None

    def admit(self, fits: bool) -> bool:
        return fits


class _SingleNumaNode(_Restricted):
    __slots__ = ()
    name = "single-numa-node"
    prefers_single_node = True

    def merge(self, providers, machine, *, prefer_closest, distances):
        # every candidate is one node, so distance cannot break a tie (kubelet ignores it too)
        return merge(filter_single_numa(providers), machine)

    def fits(self, merged: Merged, viable: bool) -> bool:
        return viable and merged.preferred and width(merged.mask) == 1


TOPOLOGY_POLICIES: dict[str, TopologyPolicy] = {
    p.name: p for p in (_None(), _BestEffort(), _Restricted(), _SingleNumaNode())}
assert tuple(TOPOLOGY_POLICIES) == CHOICES["topology_policy"], "a policy name without its object, or the reverse"


def topology_policy(name: str) -> TopologyPolicy:
    """The policy object for a checked ``topology_policy`` value (KeyError for any other)."""
    return TOPOLOGY_POLICIES[name]


class CpuBindPolicy:
    """``cpu_bind_policy``: whether pools and roles are cut in whole physical cores."""

    __slots__ = ("name", "whole_cores")

    def __init__(self, name: str, whole_cores: bool) -> None:
        self.name, self.whole_cores = name, whole_cores

    def __repr__(self) -> str:
        return f"<cpu bind policy {self.name}>"


CPU_BIND_POLICIES: dict[str, CpuBindPolicy] = {
    p.name: p for p in (CpuBindPolicy("default", False), CpuBindPolicy("full-pcpus", True))}
assert tuple(CPU_BIND_POLICIES) == CHOICES["cpu_bind_policy"], "a cpu bind policy without its object, or the reverse"


def cpu_bind_policy(name: str) -> CpuBindPolicy:
    """The object for a checked ``cpu_bind_policy`` value (KeyError for any other)."""
    return CPU_BIND_POLICIES[name]
