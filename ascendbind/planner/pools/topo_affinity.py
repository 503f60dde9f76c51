"""``topo_affinity``: pools from each NPU's CPU affinity (``npu-smi info -t topo``).

1. Candidates are the target NPUs plus every other logical NPU whose affinity
   intersects the allowed CPUs. Hidden NPUs count so that two single-NPU
   workers whose NPUs share an affinity split it instead of both taking it.
2. A candidate's base pool is its affinity ∩ allowed (empty: that NPU fails).
3. A base pool on one NUMA node is extended with the allowed CPUs of another
   node (``numa_extension``: the next node, the closest, or none).
4. NPUs with identical extended pools split it evenly in logical-id order,
   the last taking the remainder.
5. Only target NPUs are kept.

Extended pools that intersect without being identical are not separated by
the even split; when that makes a target's final pool overlap another
NPU's, the plan carries a ``pools_overlap`` warning naming both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ...values.model import PlanIssue
from ..codes import issue
from .layout import Layout, cl, nodes_text

__all__ = ["AffinityPools", "affinity_pools", "candidate_npus", "base_pool"]


@dataclass
class AffinityPools:
    pools: dict[int, tuple[int, ...]] = field(default_factory=dict)  # every candidate's final pool
    extended: dict[int, frozenset[int]] = field(default_factory=dict)  # every candidate's extended pool
    candidates: tuple[int, ...] = ()
    errors: list[PlanIssue] = field(default_factory=list)
    warnings: list[PlanIssue] = field(default_factory=list)


def candidate_npus(layout: Layout, affinity: Mapping[int, frozenset[int]], targets: Sequence[int]) -> tuple[int, ...]:
    allowed = layout.allowed_set
    hidden = (npu for npu, aff in affinity.items() if not allowed.isdisjoint(aff))
    return tuple(sorted(set(targets).union(hidden)))


def base_pool(layout: Layout, affinity: Mapping[int, frozenset[int]], npu: int,
              errors: list[PlanIssue]) -> frozenset[int] | None:
    """A candidate's affinity ∩ allowed, or None after recording why there is none."""
    aff = affinity.get(npu)
    if aff is None:
        errors.append(issue(npu, "no_affinity", f"npu-smi info -t topo reports no CPU affinity for NPU {npu}"))
        return None
    base = aff & layout.allowed_set
    if not base:
        # only a target can get here: hidden candidates intersect by construction
        errors.append(issue(npu, "affinity_outside_cpuset",
                            f"NPU {npu}'s CPU affinity {cl(aff)} does not intersect the worker's "
                            f"allowed CPUs {cl(layout.allowed)}"))
        return None
    return base


def affinity_pools(layout: Layout, affinity: Mapping[int, frozenset[int]], targets: Sequence[int],
                   extension: str = "next") -> AffinityPools:
    out = AffinityPools()
    target_set = set(targets)
    out.candidates = candidate_npus(layout, affinity, targets)
    groups: dict[frozenset[int], list[int]] = {}
    for npu in out.candidates:
        base = base_pool(layout, affinity, npu, out.errors)
        if base is None:
            continue
        pool = base
        nodes = layout.nodes_of(base)
        if len(nodes) == 1:
            other = layout.extension_node(nodes[0], extension)
            if other is not None:
                pool = base.union(layout.allowed_on(other))
        out.extended[npu] = pool
        groups.setdefault(pool, []).append(npu)

    for pool, members in groups.items():
        parts = layout.split(sorted(pool), len(members))
        for npu, part in zip(members, parts):  # members are in logical-id order
            out.pools[npu] = part

    out.warnings.extend(_overlaps(layout, groups, out.pools, target_set))
    return out


def _overlaps(layout: Layout, groups: dict[frozenset[int], list[int]], pools: dict[int, tuple[int, ...]],
              targets: set[int]) -> list[PlanIssue]:
    """Warnings for a target whose final pool overlaps another candidate's.

    Only different extended pools can produce that, so only pairs of extended
    pools are compared (a min/max range test first, then one C-level
    ``isdisjoint``), and only those holding a target.
    """
    keys = list(groups)
    spans = [(min(k), max(k)) for k in keys]
    seen: set[tuple[int, int]] = set()
    warnings: list[PlanIssue] = []
    sets: dict[int, frozenset[int]] = {}
    ext_nodes: dict[frozenset[int], str] = {}

    def pool_set(npu: int) -> frozenset[int]:
        if npu not in sets:
            sets[npu] = frozenset(pools[npu])
        return sets[npu]

    def nodes_of_ext(ext: frozenset[int]) -> str:
        if ext not in ext_nodes:
            ext_nodes[ext] = nodes_text(layout.nodes_of(ext))
        return ext_nodes[ext]

    for ga, ka in enumerate(keys):
        if targets.isdisjoint(groups[ka]):
            continue
        lo_a, hi_a = spans[ga]
        for gb, kb in enumerate(keys):
            lo_b, hi_b = spans[gb]
            if gb == ga or hi_b < lo_a or hi_a < lo_b or ka.isdisjoint(kb):
                continue
            for a in groups[ka]:
                if a not in targets:
                    continue
                for b in groups[kb]:
                    pair = (min(a, b), max(a, b))
                    if pair in seen:
                        continue
                    shared = pool_set(a) & pool_set(b)
                    if not shared:
                        continue
                    seen.add(pair)
                    x, y = pair
                    ex, ey = (ka, kb) if x == a else (kb, ka)
                    warnings.append(issue(
                        x if x in targets else y, "pools_overlap",
                        f"NPU {x}'s pool {cl(pools[x])} overlaps NPU {y}'s pool {cl(pools[y])} on CPUs "
                        f"{cl(shared)}: their NUMA-extended affinity pools (NUMA {nodes_of_ext(ex)} "
                        f"and NUMA {nodes_of_ext(ey)}) intersect without being identical, and "
                        f"the even split only separates NPUs with identical pools"))
    return sorted(warnings, key=lambda w: (w.npu, w.reason))
