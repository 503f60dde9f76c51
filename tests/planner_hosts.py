"""HostFacts / WorkerFacts for planner tests, built directly (the planner is pure).

The shapes follow real hosts: an 8x910B3 A2 (192 CPUs,
8 NUMA nodes of 24, NPU pairs on nodes 6, 4, 0, 2), a 16-die A3 (640 CPUs,
8 nodes of 80, no affinity column), and an Ascend 950 (4 nodes, SMT-2).
"""

from __future__ import annotations

import dataclasses

from ascendbind.values.frozen import frozen_map
from ascendbind.values.model import CpuInfo, DeviceType, HostFacts, NpuChip, NpuProcess, WorkerFacts


def distances(n: int, near: int = 20, far: int = 30, socket: int | None = None) -> dict[int, tuple[int, ...]]:
    """A sysfs-style distance table: 10 to itself, ``near`` within a socket, ``far`` across."""
    socket = socket or max(1, n // 2)
    return {a: tuple(10 if a == b else (near if a // socket == b // socket else far) for b in range(n))
            for a in range(n)}


def host(
    n_cpus: int,
    n_nodes: int,
    *,
    device_type: DeviceType,
    chips: list[tuple[int, int, int]] | None = None,
    affinity: dict[int, frozenset[int]] | None = None,
    threads_per_core: int | None = 1,
    smt_stride: int | None = None,
    topo_rows: int | None = None,
    processes: tuple[NpuProcess, ...] = (),
    chip_name: str = "Ascend",
    with_distances: bool = True,
    nodes: dict[int, frozenset[int]] | None = None,
) -> HostFacts:
    """``n_cpus`` CPUs in ``n_nodes`` nodes of consecutive CPUs (unless ``nodes`` given).

    ``smt_stride``: SMT-2 siblings numbered x86 style (CPU c and c + stride share a core);
    without it and with threads_per_core 2, siblings are adjacent (2k, 2k+1).
    """
    if nodes is None:
        per = n_cpus // n_nodes
        nodes = {n: frozenset(range(n * per, (n + 1) * per)) for n in range(n_nodes)}
    node_of = {c: n for n, cs in nodes.items() for c in cs}
    cpus = []
    for c in range(n_cpus):
        if threads_per_core == 2:
            core = (c % smt_stride) if smt_stride else c // 2
        else:
            core = c
        cpus.append(CpuInfo(cpu=c, node=node_of.get(c), socket=0, core=core, online=True))
    chips = chips or []
    aff = affinity or {}
    return HostFacts(
        cpus=tuple(cpus),
        threads_per_core=threads_per_core,
        numa_nodes=frozen_map(nodes),
        numa_distances=frozen_map(distances(len(nodes)) if with_distances else {}),
        chips=tuple(NpuChip(card=c, chip=ch, logic_id=l, name=chip_name) for c, ch, l in chips),
        chip_name=chip_name,
        device_type=device_type,
        topo_affinity=frozen_map(aff),
        topo_rows=len(aff) if topo_rows is None else topo_rows,
        processes=processes,
    )


def one_npu_host(nodes: dict[int, frozenset[int]], *, affinity: dict[int, frozenset[int]] | None = None,
                 pci: dict[int, str] | None = None) -> HostFacts:
    """A one-NPU A2 host (910B3, logic id 0) over the given NUMA map: what the applier tests need."""
    n_cpus = max((c for cs in nodes.values() for c in cs), default=-1) + 1
    h = host(n_cpus, len(nodes), device_type=DeviceType.A2, chips=[(0, 0, 0)], affinity=affinity, topo_rows=1,
             chip_name="Ascend 910B3", nodes=nodes)
    return dataclasses.replace(h, pci_addresses=frozen_map(pci or {}))


def worker(allowed, *, pid: int = 4242, env: dict | None = None, mems=None, uvb=()) -> WorkerFacts:
    allowed = frozenset(allowed)
    return WorkerFacts(
        pid=pid,
        start_time=1,
        allowed_cpus=allowed,
        allowed_source="status",
        mems_allowed=frozenset(mems if mems is not None else ()),
        env=frozen_map(env or {}),
        uvb_tids=tuple(uvb),
    )


# ---------------------------------------------------------------- the real hosts

A2_AFFINITY = {
    0: frozenset(range(144, 168)), 2: frozenset(range(144, 168)),
    1: frozenset(range(96, 120)), 3: frozenset(range(96, 120)),
    4: frozenset(range(0, 24)), 6: frozenset(range(0, 24)),
    5: frozenset(range(48, 72)), 7: frozenset(range(48, 72)),
}


def a2_host(**kw) -> HostFacts:
    """8x910B3: 192 CPUs, 8 nodes of 24; NPU0,2 -> 144-167, NPU1,3 -> 96-119, NPU4,6 -> 0-23, NPU5,7 -> 48-71."""
    kw.setdefault("affinity", A2_AFFINITY)
    return host(192, 8, device_type=DeviceType.A2, chips=[(i, 0, i) for i in range(8)],
                chip_name="Ascend 910B3", **kw)


def a3_host(**kw) -> HostFacts:
    """16 dies on 8 cards: 640 CPUs, 8 nodes of 80, no CPU affinity column."""
    return host(640, 8, device_type=DeviceType.A3, chips=[(i // 2, i % 2, i) for i in range(16)],
                chip_name="Ascend910", topo_rows=16, **kw)


A950_AFFINITY = {npu: frozenset(range(64 * (npu // 2), 64 * (npu // 2) + 64)) for npu in range(8)}


def a950_host(**kw) -> HostFacts:
    """Ascend 950: 256 CPUs, 4 nodes of 64, SMT-2 (adjacent siblings); NPU 2k, 2k+1 on node k."""
    kw.setdefault("affinity", A950_AFFINITY)
    kw.setdefault("threads_per_core", 2)
    return host(256, 4, device_type=DeviceType.A950, chips=[(i, 0, i) for i in range(8)],
                chip_name="Ascend950", **kw)
