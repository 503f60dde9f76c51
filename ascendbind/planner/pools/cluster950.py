"""``ascend950_cluster``: one full CPU cluster per NPU on its affinity node.

* Candidates as in topo_affinity (targets + hidden NPUs whose affinity meets
  the allowed CPUs); each one's affinity ∩ allowed must lie on one NUMA node.
* Cluster size is 8 × ``Thread(s) per core`` (1 or 2; anything else fails).
* Each node's allowed CPUs are cut into consecutive *full* clusters, handed
  out in logical-id order to the node's candidates (hidden ones included, so
  two workers on one node never take the same cluster). Too few: that NPU fails.
* UVB pool: allowed CPUs of NUMA node 0 minus CPU 0 minus every handed-out
  cluster; if that is empty, allowed CPUs of node 0 minus CPU 0.

A hidden candidate whose affinity spans nodes cannot take a cluster and is
left out of the hand-out rather than given a cluster on a node it only partly uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ...values.model import PlanIssue
from ..codes import issue
from .layout import Layout, cl, nodes_text
from .topo_affinity import base_pool, candidate_npus

__all__ = ["ClusterPools", "cluster_pools", "cluster_size"]


@dataclass
class ClusterPools:
    pools: dict[int, tuple[int, ...]] = field(default_factory=dict)  # every placed candidate
    node_of_npu: dict[int, int] = field(default_factory=dict)
    uvb_cpus: tuple[int, ...] = ()
    errors: list[PlanIssue] = field(default_factory=list)


def cluster_size(threads_per_core: int | None) -> int | None:
    if threads_per_core in (1, 2):
        return 8 * threads_per_core
    return None


def _ordinal(i: int) -> str:
    suffix = "th" if 10 <= i % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(i % 10, "th")
    return f"{i}{suffix}"


def cluster_pools(layout: Layout, affinity: Mapping[int, frozenset[int]], targets: Sequence[int],
                  threads_per_core: int | None) -> ClusterPools:
    out = ClusterPools()
    size = cluster_size(threads_per_core)
    if size is None:
        said = "does not report Thread(s) per core" if threads_per_core is None else \
            f"reports {threads_per_core} threads per core"
        for npu in targets:
            out.errors.append(issue(npu, "bad_threads_per_core",
                                    f"lscpu {said}; Ascend 950 clusters are 8 CPUs at 1 thread per core "
                                    f"or 16 at 2"))
        return out
    if not affinity:
        for npu in targets:
            out.errors.append(issue(npu, "no_affinity",
                                    "Ascend 950 cluster mode needs each NPU's CPU affinity from npu-smi info "
                                    "-t topo, which this host does not report"))
        return out

    target_set = set(targets)
    by_node: dict[int, list[int]] = {}
    for npu in candidate_npus(layout, affinity, targets):
        base = base_pool(layout, affinity, npu, out.errors)
        if base is None:
            continue
        nodes = layout.nodes_of(base)
        if len(nodes) != 1:
            if npu in target_set:
                out.errors.append(issue(npu, "spans_numa_nodes",
                                        f"NPU {npu}'s affinity within the allowed CPUs, {cl(base)}, lies on "
                                        f"NUMA nodes {nodes_text(nodes)}; an Ascend 950 cluster must come from "
                                        f"one node"))
            continue
        by_node.setdefault(nodes[0], []).append(npu)

    handed: set[int] = set()
    for node, members in sorted(by_node.items()):
        cpus = layout.allowed_on(node)
        ordered = [c for u in layout.units(cpus) for c in u]  # whole cores together with full-pcpus
        clusters = [tuple(sorted(ordered[i:i + size])) for i in range(0, len(ordered) - size + 1, size)]
        for i, npu in enumerate(members):  # members are in logical-id order
            if i < len(clusters):
                out.pools[npu] = clusters[i]
                out.node_of_npu[npu] = node
                handed.update(clusters[i])
            elif npu in target_set:
                out.errors.append(issue(npu, "too_few_clusters",
                                        f"NUMA node {node} has {len(cpus)} allowed CPUs, {len(clusters)} full "
                                        f"{size}-CPU cluster{'s' if len(clusters) != 1 else ''}, but NPU {npu} is "
                                        f"the {_ordinal(i + 1)} NPU on that node (NPUs "
                                        f"{', '.join(map(str, members))})"))

    node0 = [c for c in layout.allowed_on(0) if c != 0]
    uvb = [c for c in node0 if c not in handed]
    out.uvb_cpus = tuple(uvb or node0)
    return out
