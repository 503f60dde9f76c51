"""Assemble HostFacts / WorkerFacts from a HostSource.

Everything here goes through ``source.run`` / ``source.read`` /
``source.listdir``, so the same code runs on the live host, on a snapshot
directory, and under the snapshot recorder.

Cost (the daemon calls this per request): ``discover_host`` runs npu-smi
three times plus one ``-t board`` query per die (skip those with
``want_pci=False`` and ask ``pci_address_of`` for just the target NPU; an
Ascend 950 is never asked, since only the IRQ step needs the address and the
950 binds no NPU IRQs), and lscpu twice. Its facts are static between hot-plug
events, so a daemon should cache them. ``discover_worker`` only reads a handful of small /proc files per
worker plus one ``comm`` per thread; it runs ``ps -Te`` only when ``want_uvb``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ...values.config import Config
from ...errors import DiscoveryError, ToolMissing
from ...values.frozen import frozen_map
from ...values.model import CpuFacts, CpuInfo, DeviceType, HostFacts, NpuChip, NpuProcess
from ..parse.lscpu import LscpuSummary, parse_lscpu, parse_lscpu_e
from ..parse.npu_smi import SRC_INFO, TopoTable, board_source, parse_board, parse_chip_map, parse_process_table, parse_topo
from ..read.sources import HostSource
from ..parse.sysfs import parse_cpulist_file, parse_node_distance

__all__ = [
    "discover_host",
    "discover_cpu_topology",
    "discover_processes",
    "detect_device_type",
    "board_argv",
    "pci_address_of",
    "read_boot_id",
    "CpuTopology",
    "NPU_SMI_MISSING",
]

NPU_SMI_MISSING = (
    "npu-smi not found on this host (neither `npu-smi info -m` nor `npu-smi info` could run); "
    "planning needs the NPU map and topology it prints. Record a snapshot on the NPU host with "
    "`ascendbind snapshot DIR` and use `ascendbind plan --snapshot DIR`, "
    "or point config key npu_smi at the binary"
)
NODE_ROOT = "/sys/devices/system/node"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def read_boot_id(source: HostSource) -> str:
    """This boot's id (a random UUID the kernel draws at boot), or "unknown" when unreadable."""
    text = source.read(BOOT_ID, limit=64)
    return text.strip()[:64] if text and text.strip() else "unknown"


# ---------------------------------------------------------------- CPUs and NUMA


@dataclass(frozen=True)
class CpuTopology(CpuFacts):
    """The CPU half of HostFacts (what is left when npu-smi is missing), with what its
    discovery warned of and lscpu's summary."""

    warnings: tuple[str, ...]
    summary: LscpuSummary | None


def _read_cpulist(source: HostSource, path: str) -> frozenset[int] | None:
    text = source.read(path)
    return None if text is None else parse_cpulist_file(text, path)


def discover_cpu_topology(source: HostSource) -> CpuTopology:
    warnings: list[str] = []
    e_text = source.run(["lscpu", "-e"])
    s_text = source.run(["lscpu"])
    summary = parse_lscpu(s_text) if s_text is not None else None
    if e_text is not None:
        cpus = parse_lscpu_e(e_text)
    else:
        online = _read_cpulist(source, "/sys/devices/system/cpu/online")
        if online is None and summary is not None:
            online = summary.online_cpus
        if online is None:
            raise ToolMissing(
                "cannot list the CPUs: `lscpu -e` is unavailable and /sys/devices/system/cpu/online is unreadable"
            )
        warnings.append("lscpu -e unavailable; CPUs from /sys/devices/system/cpu/online")
        cpus = tuple(CpuInfo(cpu=c, node=None, socket=None, core=None, online=True) for c in sorted(online))

    online_cpus = frozenset(c.cpu for c in cpus if c.online)
    numa: dict[int, set[int]] = {}
    for c in cpus:
        if c.online and c.node is not None:
            numa.setdefault(c.node, set()).add(c.cpu)
    if not numa:
        # no NODE column: sysfs knows the nodes, lscpu's summary may too
        nodes = _read_cpulist(source, f"{NODE_ROOT}/online")
        for n in sorted(nodes or ()):
            node_cpus = _read_cpulist(source, f"{NODE_ROOT}/node{n}/cpulist")
            if node_cpus:
                numa[n] = set(node_cpus & online_cpus)
        if not numa and summary is not None and summary.numa_cpus:
            numa = {n: set(s & online_cpus) for n, s in summary.numa_cpus.items()}
        if not numa:
            warnings.append("no NUMA information (lscpu -e NODE, sysfs, lscpu); all CPUs taken as node 0")
            numa = {0: set(online_cpus)}
        node_of = {cpu: n for n, s in numa.items() for cpu in s}
        cpus = tuple(
            CpuInfo(c.cpu, node_of.get(c.cpu) if c.online else None, c.socket, c.core, c.online) for c in cpus
        )
    numa = {n: s for n, s in numa.items() if s}

    distances: dict[int, tuple[int, ...]] = {}
    for n in sorted(numa):
        path = f"{NODE_ROOT}/node{n}/distance"
        text = source.read(path)
        if text is not None:
            distances[n] = parse_node_distance(text, path)

    tpc = summary.threads_per_core if summary is not None else None
    if tpc is None:
        per_core = Counter((c.socket, c.core) for c in cpus if c.online and c.core is not None)
        tpc = max(per_core.values()) if per_core else None
    return CpuTopology(
        cpus=cpus,
        threads_per_core=tpc,
        numa_nodes=frozen_map({n: frozenset(numa[n]) for n in sorted(numa)}),
        numa_distances=frozen_map(distances),
        warnings=tuple(warnings),
        summary=summary,
    )


# ---------------------------------------------------------------- NPUs


def detect_device_type(chips: Sequence[NpuChip]) -> DeviceType:
    """By chip name: 950 -> 950; 310P -> 310P; 910B -> A2; Ascend910 with two dies per card -> A3."""
    if not chips:
        return DeviceType.UNKNOWN
    name = chips[0].name.replace(" ", "").upper()
    if "950" in name:
        return DeviceType.A950
    if "310P" in name:
        return DeviceType.P310
    if "910B" in name:
        return DeviceType.A2
    dies_per_card = Counter(c.card for c in chips)
    if "910" in name and max(dies_per_card.values()) >= 2:
        return DeviceType.A3
    return DeviceType.UNKNOWN


def board_argv(chips: Sequence[NpuChip], chip: NpuChip) -> list[str]:
    """``-c <chip>`` exactly when the card holds more than one compute die (a
    snapshot names its file after this argv)."""
    argv = ["npu-smi", "info", "-t", "board", "-i", str(chip.card)]
    if sum(1 for c in chips if c.card == chip.card) > 1:
        argv += ["-c", str(chip.chip)]
    return argv


def pci_address_of(source: HostSource, chips: Sequence[NpuChip], chip: NpuChip) -> str | None:
    """One die's PCI address, or None when the board query prints none.
    Raises CommandFailed / ParseError like any other command."""
    return _board_address(source, chips, chip)[0]


def _board_address(source: HostSource, chips: Sequence[NpuChip], chip: NpuChip) -> tuple[str | None, str]:
    """(address or None, why there is none). Raises like ``pci_address_of``."""
    argv = board_argv(chips, chip)
    name = board_source(chip.card, chip.chip if "-c" in argv else None)
    text = source.run(argv)
    if text is None:
        return None, f"`{name}` is unavailable on this host (no output)"
    addr = parse_board(text, name)
    return addr, "" if addr else f"`{name}` printed no PCIe Bus Info (absent or NA)"


def _pci_addresses(
    source: HostSource, chips: Sequence[NpuChip], device_type: DeviceType, warnings: list[str]
) -> tuple[dict[int, str], dict[int, str]]:
    """(logic id -> PCI address, logic id -> why it is unknown). Only the IRQ step
    needs an address, so a board query that fails costs that NPU its IRQ step (the
    step says why) and never the plan."""
    pci: dict[int, str] = {}
    unknown: dict[int, str] = {}
    if device_type is DeviceType.A950:
        # the 950 binds no NPU IRQs, and its npu-smi rejects the -c form of the query
        return pci, {c.logic_id: "not queried: Ascend 950 binds no NPU IRQs" for c in chips}
    for chip in chips:
        try:
            addr, why = _board_address(source, chips, chip)
        except DiscoveryError as exc:
            warnings.append(f"no PCI address for NPU {chip.logic_id}: {exc}")
            unknown[chip.logic_id] = f"the board query failed: {exc}"
            continue
        if addr is None:
            unknown[chip.logic_id] = why
        else:
            pci[chip.logic_id] = addr
    return pci, unknown


def pci_numa_node(source: HostSource, addr: str) -> int | None:
    """The NUMA node sysfs reports for a PCI device; None when absent or -1 (unknown),
    which is what single-node hosts and many VMs print."""
    text = source.read(f"/sys/bus/pci/devices/{addr}/numa_node")
    try:
        node = int(text.strip()) if text is not None else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def _topo_to_logic(table: TopoTable, chips: tuple[NpuChip, ...], warnings: list[str]) -> dict[int, frozenset[int]]:
    logic_ids = {c.logic_id for c in chips}
    by_phy = {c.phy_id: c.logic_id for c in chips if c.phy_id is not None}
    dies_on: dict[int, list[int]] = {}
    for c in chips:
        dies_on.setdefault(c.card, []).append(c.logic_id)
    # 310P prints one row per *card* (NPU32768 ...): fan a row out to the card's dies
    rows_are_cards = bool(dies_on) and len(table.rows) == len(dies_on)
    out: dict[int, frozenset[int]] = {}
    for row in table.rows:
        if row.affinity is None:
            continue
        if row.kind == "Phy-ID":
            if row.index not in by_phy:
                warnings.append(f"npu-smi info -t topo: Phy-ID{row.index} matches no chip in npu-smi info -m; ignored")
                continue
            targets = [by_phy[row.index]]
        elif rows_are_cards and row.index in dies_on and (len(dies_on[row.index]) > 1 or row.index not in logic_ids):
            targets = sorted(dies_on[row.index])
        elif chips and row.index not in logic_ids:
            warnings.append(f"npu-smi info -t topo: NPU{row.index} is not a logic id in npu-smi info -m; ignored")
            continue
        else:
            targets = [row.index]
        for logic in targets:
            out[logic] = row.affinity
    return {k: out[k] for k in sorted(out)}


def _map_processes(text: str, chips: tuple[NpuChip, ...], warnings: list[str]) -> tuple[NpuProcess, ...]:
    by_card_chip = {(c.card, c.chip): c.logic_id for c in chips}
    logic_ids = {c.logic_id for c in chips}
    out: list[NpuProcess] = []
    for row in parse_process_table(text, SRC_INFO):
        if row.chip is None:
            logic = row.card  # 950: NPU ID is the logic id
            if chips and logic not in logic_ids:
                warnings.append(f"npu-smi info: process {row.pid} on NPU ID {logic}, which npu-smi info -m lacks")
                continue
        else:
            found = by_card_chip.get((row.card, row.chip))
            if found is None:
                warnings.append(
                    f"npu-smi info: process {row.pid} on NPU {row.card} chip {row.chip}, "
                    "which npu-smi info -m does not map to a logic id"
                )
                continue
            logic = found
        out.append(NpuProcess(npu=logic, pid=row.pid, name=row.name, container_pid=row.container_pid))
    return tuple(out)


def discover_processes(
    source: HostSource, config: Config, *, chips: Sequence[NpuChip] | None = None
) -> tuple[NpuProcess, ...]:
    """Only the ``npu-smi info`` process table, mapped to logic ids: the cheap
    refresh for a daemon that caches HostFacts (pass ``chips`` from them to save
    the ``npu-smi info -m`` run). Rows that cannot be mapped are dropped."""
    text = source.run(["npu-smi", "info"])
    if text is None:
        raise ToolMissing(NPU_SMI_MISSING, code="npu_smi_missing")
    if chips is None:
        chip_text = source.run(["npu-smi", "info", "-m"])
        chips = parse_chip_map(chip_text) if chip_text is not None else ()
    return _map_processes(text, tuple(chips), [])


def discover_host(source: HostSource, config: Config, *, want_pci: bool = True) -> HostFacts:
    """Run/read every static input (npu-smi info/-m/-t topo/-t board, lscpu -e,
    lscpu, sysfs NUMA nodes and distances) through ``source``. A board query
    that fails is a warning and an entry in ``pci_unknown``, never an error.

    Raises ToolMissing when npu-smi is absent (the message says to use
    --snapshot), ParseError for malformed text (source + line), CommandFailed.
    ``config.device_type`` other than "auto" overrides detection.
    """
    chip_text = source.run(["npu-smi", "info", "-m"])
    info_text = source.run(["npu-smi", "info"])
    if chip_text is None and info_text is None:
        raise ToolMissing(NPU_SMI_MISSING, code="npu_smi_missing")
    warnings: list[str] = []
    chips: tuple[NpuChip, ...] = ()
    if chip_text is not None:
        chips = tuple(sorted(parse_chip_map(chip_text), key=lambda c: c.logic_id))
    else:
        warnings.append("npu-smi info -m printed nothing; no logic-id map")
    processes = _map_processes(info_text, chips, warnings) if info_text is not None else ()
    if info_text is None:
        warnings.append("npu-smi info printed nothing; no process table")

    topo_text = source.run(["npu-smi", "info", "-t", "topo"])
    topo = parse_topo(topo_text) if topo_text is not None else TopoTable(rows=(), has_affinity=False)
    topo_affinity = _topo_to_logic(topo, chips, warnings)

    if config.device_type != "auto":
        device_type = DeviceType(config.device_type)
    else:
        device_type = detect_device_type(chips)
    pci, pci_unknown = _pci_addresses(source, chips, device_type, warnings) if want_pci else ({}, {})
    pci_nodes = {npu: node for npu, addr in pci.items() if (node := pci_numa_node(source, addr)) is not None}

    cpu = discover_cpu_topology(source)
    return HostFacts(
        cpus=cpu.cpus,
        threads_per_core=cpu.threads_per_core,
        numa_nodes=cpu.numa_nodes,
        numa_distances=cpu.numa_distances,
        chips=chips,
        chip_name=chips[0].name if chips else None,
        device_type=device_type,
        topo_affinity=frozen_map(topo_affinity),
        topo_rows=len(topo.rows),
        processes=processes,
        pci_addresses=frozen_map(pci),
        pci_unknown=frozen_map(pci_unknown),
        pci_numa_nodes=frozen_map(pci_nodes),
        warnings=cpu.warnings + tuple(warnings),
    )
