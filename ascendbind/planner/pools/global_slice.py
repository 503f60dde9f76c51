"""``global_slice``: cut the sorted allowed CPUs by *global* logical NPU id.

Why global ids: two workers with the same cpuset but different visible NPUs
must not overlap, so both slice the same id space and each keeps its own
slice. With ``total`` NPUs and ``n`` allowed CPUs::

    base = n // total, extra = n % total
    NPU i gets base + 1 CPUs if i < extra else base, consecutively

``total`` is the number of logical ids from ``npu-smi info -m``, else the
number of topo rows, else the number of target NPUs. An id >= total has no
slice. ``base`` below the role minimum fails every NPU, naming the CPUs needed.
With ``full-pcpus`` the same arithmetic runs over whole cores instead of CPUs.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...values.model import HostFacts, PlanIssue
from ..codes import issue
from .layout import Layout, cl

__all__ = ["total_npus", "slice_pools"]


def total_npus(host: HostFacts, targets: Sequence[int]) -> tuple[int, str]:
    """How many logical NPUs share the cpuset, and where that number came from."""
    if host.chips:
        return len(set(host.logic_ids)), "logical NPUs in npu-smi info -m"
    if host.topo_rows:
        return host.topo_rows, "rows of npu-smi info -t topo"
    return len(set(targets)), "target NPUs"


def slice_pools(layout: Layout, targets: Sequence[int], total: int, minimum: int,
                source: str = "logical NPUs") -> tuple[dict[int, tuple[int, ...]], list[PlanIssue]]:
    """Each target's slice of the allowed CPUs, and per-NPU issues."""
    pools: dict[int, tuple[int, ...]] = {}
    issues: list[PlanIssue] = []
    units = layout.units(layout.allowed)
    n_units = len(units)
    n_cpus = len(layout.allowed)
    total = max(total, 1)
    base, extra = divmod(n_units, total)

    def bounds(i: int) -> tuple[int, int]:
        start = i * base + min(i, extra)
        return start, start + base + (1 if i < extra else 0)

    if layout.full_pcpus and units and len(units) != n_cpus:
        smallest = min(sum(len(u) for u in units[slice(*bounds(i))]) for i in range(total))
        too_small = smallest < minimum
        per = f"{smallest} CPUs in {base} whole cores"
    else:
        too_small = base < minimum
        per = f"{base} CPUs"
    for npu in targets:
        if npu < 0 or npu >= total:
            issues.append(issue(npu, "npu_out_of_range",
                                f"NPU {npu} is out of range: global_slice cuts the cpuset for {total} "
                                f"NPUs (ids 0-{total - 1}, from the {source})"))
            continue
        if too_small:
            issues.append(issue(npu, "slice_too_small",
                                f"global_slice gives each of {total} NPUs {per} of the {n_cpus}-CPU cpuset "
                                f"{cl(layout.allowed)}, below the role minimum of {minimum}: need "
                                f"{minimum * total} CPUs for {total} NPUs, cpuset has {n_cpus}"))
            continue
        lo, hi = bounds(npu)
        pools[npu] = tuple(sorted(c for u in units[lo:hi] for c in u))
    return pools, issues
