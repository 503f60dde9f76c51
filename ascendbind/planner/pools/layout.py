"""The host's CPU layout as the planner needs it, computed once per plan.

HostFacts stores NUMA nodes as node -> CPUs; every rule asks the other way
round ("which node is this CPU on?") many times, so the lookups are built here
once (dicts and sorted tuples) and each rule stays linear in the CPU count.

Whole-core *units* serve ``cpu_bind_policy = full-pcpus``: a unit is the set of
SMT siblings (same ``CORE`` in ``lscpu -e``) that are in a given CPU list,
ordered by their lowest CPU. With the default policy every CPU is its own
unit, which makes unit arithmetic identical to plain CPU arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ...values.cpulist import format_cpulist
from ...values.model import HostFacts

__all__ = ["Layout", "cl", "nodes_text"]


def cl(cpus: Iterable[int]) -> str:
    """A cpulist for sentences; '(none)' rather than an empty string."""
    return format_cpulist(cpus) or "(none)"


def nodes_text(nodes: Iterable[int]) -> str:
    return format_cpulist(nodes) or "(none)"


@dataclass(frozen=True)
class Layout:
    allowed: tuple[int, ...]  # the worker's allowed CPUs, sorted
    allowed_set: frozenset[int]
    node_of: Mapping[int, int]  # cpu -> NUMA node, for every CPU the host reports a node for
    nodes: tuple[int, ...]  # NUMA nodes that have CPUs, ascending
    node_cpus: Mapping[int, frozenset[int]]  # node -> all its CPUs
    allowed_by_node: Mapping[int, tuple[int, ...]]  # node -> its allowed CPUs, sorted
    distances: Mapping[int, Mapping[int, int]]  # node -> node -> distance (may be empty)
    core_of: Mapping[int, int]  # cpu -> core id (lscpu -e CORE); empty without that column
    full_pcpus: bool

    @classmethod
    def build(cls, host: HostFacts, allowed: Iterable[int], *, full_pcpus: bool = False) -> Layout:
        node_of = {cpu: node for node, cpus in host.numa_nodes.items() for cpu in cpus}
        filled = len(node_of) < len(host.cpus)
        if filled:
            # hosts whose sysfs node map missed some CPUs: lscpu -e's NODE column fills in
            for info in host.cpus:
                if info.node is not None and info.cpu not in node_of:
                    node_of[info.cpu] = info.node
        # sibling lookups only matter for full-pcpus; skip the work otherwise
        core_of = {i.cpu: i.core for i in host.cpus if i.core is not None} if full_pcpus else {}
        allowed_sorted = tuple(sorted(set(allowed)))
        by_node: dict[int, list[int]] = {}
        get = node_of.get
        for cpu in allowed_sorted:
            node = get(cpu)
            if node is not None:
                by_node.setdefault(node, []).append(cpu)
        nodes = sorted(set(node_of.values()))
        if filled:
            lists: dict[int, list[int]] = {}
            for cpu, node in node_of.items():
                lists.setdefault(node, []).append(cpu)
            node_sets = {n: frozenset(c) for n, c in lists.items()}
        else:
            node_sets = {n: frozenset(host.numa_nodes[n]) for n in nodes}
        ordered = sorted(host.numa_distances)
        distances: dict[int, dict[int, int]] = {}
        for node, row in host.numa_distances.items():
            # sysfs node*/distance lists distances to nodes in ascending node order
            if len(row) == len(ordered):
                distances[node] = dict(zip(ordered, row))
        return cls(
            allowed=allowed_sorted,
            allowed_set=frozenset(allowed_sorted),
            node_of=node_of,
            nodes=tuple(nodes),
            node_cpus=node_sets,
            allowed_by_node={n: tuple(c) for n, c in by_node.items()},
            distances=distances,
            core_of=core_of,
            full_pcpus=full_pcpus,
        )

    # ------------------------------------------------------------ NUMA

    def nodes_of(self, cpus: Iterable[int]) -> tuple[int, ...]:
        """Sorted NUMA nodes of these CPUs (CPUs without a known node are ignored)."""
        node_of = self.node_of
        cpus = cpus if isinstance(cpus, (set, frozenset)) else frozenset(cpus)
        if cpus:
            # fast path, one subset test in C: the common pool lies on the node of its first CPU
            first = node_of.get(min(cpus))
            if first is not None and cpus <= self.node_cpus[first]:
                return (first,)
        return tuple(sorted({node_of[c] for c in cpus if c in node_of}))

    def allowed_on(self, node: int) -> tuple[int, ...]:
        return self.allowed_by_node.get(node, ())

    def distance(self, a: int, b: int) -> int | None:
        return self.distances.get(a, {}).get(b)

    def has_distances(self) -> bool:
        return bool(self.distances) and all(n in self.distances for n in self.nodes)

    def extension_node(self, node: int, how: str) -> int | None:
        """The node a one-node pool is extended to (``numa_extension``).

        ``next`` is ``(node + 1) % n_nodes`` over the nodes that have CPUs (the node
        map comes from the CPU list of ``lscpu -e``, so CPU-less nodes never
        count). ``closest`` is the nearest other node by sysfs
        distance, ties to the lower id; without distances it is ``next``.
        """
        if how == "none" or node not in self.nodes or len(self.nodes) < 2:
            return None
        if how == "closest" and self.has_distances():
            others = [n for n in self.nodes if n != node]
            return min(others, key=lambda n: (self.distance(node, n), n))
        i = self.nodes.index(node)
        return self.nodes[(i + 1) % len(self.nodes)]

    # ------------------------------------------------------------ whole cores

    def units(self, cpus: Sequence[int]) -> list[tuple[int, ...]]:
        """``cpus`` (sorted) grouped into units: SMT siblings with full-pcpus, else one CPU each.

        Units are ordered by their lowest CPU, so with siblings numbered far apart
        (x86 style: core k = CPUs k and k + n/2) a unit still sits where its first
        thread does.
        """
        if not self.full_pcpus or not self.core_of:
            return [(c,) for c in cpus]
        groups: dict[object, list[int]] = {}
        order: list[object] = []
        core_of = self.core_of
        for cpu in cpus:
            # a CPU without a CORE cell is a core of its own
            key = core_of.get(cpu, ("cpu", cpu))
            group = groups.get(key)
            if group is None:
                groups[key] = group = []
                order.append(key)
            group.append(cpu)
        return [tuple(groups[k]) for k in order]

    def split(self, pool: Sequence[int], parts: int) -> list[tuple[int, ...]]:
        """Split a sorted pool evenly into ``parts`` in order; the last takes the remainder.

        An even split: ``len // parts`` each, counted in units
        (whole cores with full-pcpus).
        """
        if not self.full_pcpus:
            size = len(pool) // parts
            return [tuple(pool[i * size:(i + 1) * size if i < parts - 1 else len(pool)]) for i in range(parts)]
        units = self.units(pool)
        size = len(units) // parts
        out = []
        for i in range(parts):
            end = (i + 1) * size if i < parts - 1 else len(units)
            chunk = units[i * size:end]
            out.append(tuple(sorted(c for u in chunk for c in u)))
        return out
