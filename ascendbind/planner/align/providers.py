"""The three hint providers of NUMA alignment, each NUMA-bitmask hints for one NPU.

device  the NPU's node(s) from its topo affinity, else its PCI device's sysfs
        ``numa_node``, else no opinion (A3: HCCS makes every node equally far,
        which is also why A3 plans with global_slice; A3 never has one). One preferred
        hint per node.
cpu     the single nodes on which a pool meeting the role minimum can be built
        *inside that node* for this NPU and the NPUs that share the node
        (preferred; score = the share of the node's allowed CPUs, or of the
        slice, this NPU would get, in percent, at least 1), plus the
        seed pool's own nodes when it spans several (not preferred), so a merge
        that cannot align still describes the pool the placement rules gave.
memory  one preferred hint per node in the worker's ``Mems_allowed``, plus
        their union (not preferred); no opinion when Mems_allowed is unknown.

``build_in_mask`` is the matching pool rule used when a policy aligns:
topo_affinity — the candidates whose device node lies in the mask split the
mask's allowed CPUs in logical-id order (no extension); global_slice — the
NPU's own slice ∩ the mask; 950 — the cluster, already on one node. Both keep
pools of different NPUs disjoint, because every worker computes the same
member list for a mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ...values.config import Config
from ...values.model import DeviceType, HostFacts, Mode, WorkerFacts
from .hints import Hint, mask_of, nodes_in, width
from ..pools.layout import Layout, cl, nodes_text
from .policy import cpu_bind_policy
from ..pools.roles import RoleSplitError, role_minimum, split_roles

__all__ = ["HintContext", "device_hints", "cpu_hints", "memory_hints", "build_in_mask", "cpu_shortfall",
           "and_join"]


def and_join(parts: Sequence[str]) -> str:
    parts = list(parts)
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


@dataclass
class HintContext:
    """What every provider needs about this request, computed once."""

    host: HostFacts
    worker: WorkerFacts
    layout: Layout
    config: Config
    mode: Mode
    device_type: DeviceType
    pools: dict[int, tuple[int, ...]]  # seed pools (targets; hidden candidates too in topo modes)
    candidates: Sequence[int]  # topo_affinity: NPUs that take part in the split
    # the pools are the worker's own cpuset (pool_source): kept, or cut to a mask, like a slice
    own_cpuset: bool = False
    device_nodes: dict[int, tuple[int, ...] | None] = field(default_factory=dict)
    members: dict[int, list[int]] = field(default_factory=dict)  # node -> candidates with a device node there
    _groups: dict = field(default_factory=dict)  # nodes -> (members, allowed CPUs), built once per plan
    _table: list | None = None
    _memory: list | None = None

    def __post_init__(self) -> None:
        if self.mode is Mode.TOPO_AFFINITY:
            for npu in self.candidates:
                for node in self.device_node_list(npu) or ():
                    self.members.setdefault(node, []).append(npu)

    @property
    def minimum(self) -> int:
        return role_minimum(self.config, ascend950=self.mode is Mode.ASCEND950_CLUSTER)

    def device_node_list(self, npu: int) -> tuple[int, ...] | None:
        if npu not in self.device_nodes:
            nodes: tuple[int, ...] | None = None
            aff = self.host.topo_affinity.get(npu)
            if aff:
                nodes = self.layout.nodes_of(aff) or None
            if nodes is None and self.device_type is not DeviceType.A3:
                node = self.host.pci_numa_nodes.get(npu)
                if node is not None and node >= 0:
                    nodes = (node,)
            self.device_nodes[npu] = nodes
        return self.device_nodes[npu]

    def valid(self, pool: Sequence[int]) -> bool:
        try:
            split_roles(pool, self.config, self.layout, ascend950=self.mode is Mode.ASCEND950_CLUSTER)
        except RoleSplitError:
            return False
        return True

    def _node_group(self, nodes: tuple[int, ...]) -> tuple[list[int], list[int]]:
        group = self._groups.get(nodes)
        if group is None:
            members = sorted({m for n in nodes for m in self.members.get(n, ())})
            cpus = sorted(c for n in nodes for c in self.layout.allowed_on(n))
            self._groups[nodes] = group = (members, cpus)
        return group

    def node_table(self) -> list[tuple[int, list[int], frozenset[int], int]]:
        """(node, members, members as a set, allowed CPU count) for every node with allowed CPUs."""
        if self._table is None:
            self._table = []
            for node in self.layout.nodes:
                members, cpus = self._node_group((node,))
                if cpus:
                    self._table.append((node, members, frozenset(members), len(cpus)))
        return self._table

    def share(self, npu: int, nodes: Sequence[int]) -> tuple[tuple[int, ...], list[int], int]:
        """topo_affinity: (this NPU's share, the members, the CPU count) for a set of nodes."""
        members, cpus = self._node_group(tuple(nodes))
        if npu not in members:
            members = sorted([*members, npu])
        if not cpus:
            return (), members, 0
        return self.layout.split(cpus, len(members))[members.index(npu)], members, len(cpus)


# ---------------------------------------------------------------- providers


def device_hints(ctx: HintContext, npu: int) -> list[Hint]:
    nodes = ctx.device_node_list(npu)
    if not nodes:
        why = "A3 NPUs are equally far from every node (HCCS)" if ctx.device_type is DeviceType.A3 \
            else "no CPU affinity and no PCI numa_node"
        return [Hint(None, True, 0, why)]
    source = "topo affinity" if ctx.host.topo_affinity.get(npu) else "PCI numa_node"
    return [Hint(1 << n, True, 0, f"{source} on NUMA {n}") for n in nodes]


def cpu_hints(ctx: HintContext, npu: int) -> list[Hint]:
    layout = ctx.layout
    seed = ctx.pools.get(npu)
    hints: list[Hint] = []
    if ctx.mode is Mode.ASCEND950_CLUSTER and not ctx.own_cpuset:
        if seed:
            node = layout.nodes_of(seed)[0]
            hints.append(Hint(1 << node, True, 100, f"cluster {cl(seed)}"))
        return hints
    if ctx.mode is Mode.GLOBAL_SLICE or ctx.own_cpuset:
        if not seed:
            return hints
        what = "cpuset" if ctx.own_cpuset else "slice"
        for node in layout.nodes_of(seed):
            part = tuple(c for c in seed if layout.node_of.get(c) == node)
            if ctx.valid(part):
                hints.append(Hint(1 << node, True, max(1, len(part) * 100 // len(seed)),
                                  f"{len(part)} of {what} {cl(seed)}"))
    else:
        minimum = ctx.minimum
        for node, members, member_set, total in ctx.node_table():
            # this NPU's share of the node, by arithmetic (the placement rules' even split)
            if npu in member_set:
                k, last = len(members), members[-1] == npu
            else:
                k, last = len(members) + 1, not members or npu > members[-1]
            each = total // k
            size = total - (k - 1) * each if last else each
            if layout.full_pcpus:
                mine = ctx.share(npu, (node,))[0]
                size = len(mine) if ctx.valid(mine) else 0
            if not size or size < minimum:
                continue
            hints.append(Hint(1 << node, True, max(1, size * 100 // total),
                              f"{size} of {total} allowed CPUs" + (f", split {k} ways" if k > 1 else "")))
    if seed:
        m = mask_of(layout.nodes_of(seed))
        if m and not any(h.mask == m for h in hints):
            hints.append(Hint(m, False, 0, f"the seed pool {cl(seed)}"))
    return hints


def memory_hints(ctx: HintContext, npu: int) -> list[Hint]:
    # the same for every NPU of the worker: built once per plan
    if ctx._memory is None:
        ctx._memory = _memory_hints(ctx)
    return ctx._memory


def _memory_hints(ctx: HintContext) -> list[Hint]:
    machine = set(ctx.host.numa_nodes) | set(ctx.layout.nodes)
    mems = sorted(n for n in ctx.worker.mems_allowed if n in machine)
    if not mems:
        return [Hint(None, True, 0, "Mems_allowed unknown")]
    hints = [Hint(1 << n, True, 0, "in Mems_allowed") for n in mems]
    if len(mems) > 1:
        hints.append(Hint(mask_of(mems), False, 0, "all of Mems_allowed"))
    return hints


# ---------------------------------------------------------------- pools inside a mask


def build_in_mask(ctx: HintContext, npu: int, mask: int) -> tuple[int, ...]:
    nodes = nodes_in(mask)
    seed = ctx.pools.get(npu, ())
    if ctx.mode is Mode.TOPO_AFFINITY and not ctx.own_cpuset:
        return ctx.share(npu, nodes)[0]
    if ctx.mode is Mode.GLOBAL_SLICE or ctx.own_cpuset:
        keep = set(nodes)
        return tuple(c for c in seed if ctx.layout.node_of.get(c) in keep)
    return seed


# ---------------------------------------------------------------- why not


def cpu_shortfall(ctx: HintContext, npu: int, nodes: Sequence[int] | None = None) -> str:
    """Why the cpu provider cannot offer these nodes (all of them when None), as a sentence."""
    layout = ctx.layout
    need = f"a pool needs {ctx.minimum}"
    if cpu_bind_policy(ctx.config.cpu_bind_policy).whole_cores:
        need += " CPUs in whole cores"
    seed = ctx.pools.get(npu, ())
    if ctx.mode is Mode.GLOBAL_SLICE or ctx.own_cpuset:
        counts = {}
        for c in seed:
            n = layout.node_of.get(c)
            counts[n] = counts.get(n, 0) + 1
        ordered = sorted(counts.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
        shown = [f"{k} on NUMA {n}" if n is not None else f"{k} on no known node" for n, k in ordered]
        if nodes is not None:
            shown += [f"none on NUMA {n}" for n in nodes if n not in counts]
        # "4 CPUs on NUMA 0 and 4 on NUMA 1": the unit once, on the first count
        first = ordered[0][1] if ordered else 0
        shown[0] = shown[0].replace(" on ", f" CPU{'s' if first != 1 else ''} on ", 1)
        return f"cpu: {'cpuset' if ctx.own_cpuset else 'slice'} {cl(seed)} has {and_join(shown)}, {need}"
    if ctx.mode is Mode.ASCEND950_CLUSTER:
        return f"cpu: cluster {cl(seed)} is on NUMA {nodes_text(layout.nodes_of(seed))}"
    parts = []
    for node in (nodes if nodes is not None else layout.nodes):
        mine, members, total = ctx.share(npu, (node,))
        if not total:
            parts.append(f"NUMA {node} has no allowed CPUs")
        elif len(members) == 1:
            parts.append(f"NUMA {node} has {total} allowed CPU{'s' if total != 1 else ''}")
        else:
            parts.append(f"NUMA {node}'s {total} allowed CPUs are shared by NPUs {', '.join(map(str, members))} "
                         f"and give NPU {npu} {len(mine)}")
    return f"cpu: {and_join(parts) if parts else 'the host reports no NUMA nodes'}, {need}"


def single_node_masks(hints: Sequence[Hint]) -> set[int] | None:
    """Preferred single-node masks of a provider; None when it has no opinion."""
    if any(h.mask is None and h.preferred for h in hints):
        return None
    return {h.mask for h in hints if h.preferred and h.mask is not None and width(h.mask) == 1}
