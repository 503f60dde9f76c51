"""The fixed set of planner issue codes (documented in the package docstring).

Every ``PlanIssue`` the planner emits goes through :func:`issue`, which refuses
a code outside these tuples: operators and golden files rely on the set being
closed.
"""

from __future__ import annotations

from ..values.model import PlanIssue

__all__ = ["ERROR_CODES", "WARNING_CODES", "issue"]

ERROR_CODES: tuple[str, ...] = (
    "unknown_npu",
    "npu_out_of_range",
    "slice_too_small",
    "pool_too_small",
    "no_affinity",
    "affinity_outside_cpuset",
    "spans_numa_nodes",
    "bad_threads_per_core",
    "too_few_clusters",
    "topology_rejected",
    "too_many_numa_nodes",
)

WARNING_CODES: tuple[str, ...] = (
    "pools_overlap",
    "extension_fallback",
)


def issue(npu: int | None, code: str, reason: str) -> PlanIssue:
    if code not in ERROR_CODES and code not in WARNING_CODES:
        raise ValueError(f"planner issue code {code!r} is not in the documented set")
    return PlanIssue(npu=npu, code=code, reason=reason)
