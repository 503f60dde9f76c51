"""discover_host / discover_worker over every fixture host (SnapshotHost), over edited
copies of them (one variant each), and live on this machine against real child processes."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys

import pytest

from ascendbind.applier.irq import bind_irqs, with_planned_irqs
from ascendbind.values.config import Config
from ascendbind.discovery import LiveHost, SnapshotHost, discover_host, discover_processes, discover_worker
from ascendbind.discovery.gather.host import board_argv, detect_device_type
from ascendbind.errors import ParseError, ProcessGone, ToolMissing, UsageError
from ascendbind.values.model import DeviceType, NpuChip, NpuProcess
from ascendbind.planner import make_plan, resolve_targets
from ascendbind.values.reasons import Outcome, Reason
from ascendbind.values.targeting import TargetRequest
from tests.workers import start_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = os.path.join(ROOT, "fixtures", "hosts")
CFG = Config()
R = range


def host(name: str) -> SnapshotHost:
    return SnapshotHost(os.path.join(HOSTS, name))


def copy_host(tmp_path, name: str) -> str:
    dst = str(tmp_path / name)
    shutil.copytree(os.path.join(HOSTS, name), dst, ignore=shutil.ignore_patterns("expected"))
    return dst


def put(d: str, rel: str, text: str) -> None:
    path = os.path.join(d, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


def drop(d: str, *rels: str) -> None:
    for rel in rels:
        path = os.path.join(d, rel)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def fake_npu_smi(tmp_path, host_dir: str, fail: tuple[str, ...] = (), log: str | None = None) -> str:
    """A tiny npu-smi that replays a snapshot's cmd/ files (LiveHost passes no env through,
    so the directory is baked in). Argument strings in ``fail`` exit 1 like a broken query;
    with ``log``, every call appends its arguments there as one line."""
    path = tmp_path / "npu-smi"
    path.write_text(
        f"#!{sys.executable}\nimport sys\nargs = ' '.join(sys.argv[1:])\n"
        + (f"open({log!r}, 'a').write(args + '\\n')\n" if log else "")
        + f"if args in {list(fail)!r}:\n    sys.stderr.write('Error: card is resetting.\\n'); sys.exit(1)\n"
        f"name = '_'.join(['npu-smi'] + sys.argv[1:]) + '.txt'\n"
        f"try:\n    sys.stdout.write(open({host_dir!r} + '/cmd/' + name).read())\n"
        "except OSError:\n    sys.stderr.write('not supported\\n'); sys.exit(2)\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


class NpuSmiLive(SnapshotHost):
    """A snapshot's files, with npu-smi run for real (a fake binary): the board query
    then fails the way it does on a host, by exit status."""

    def __init__(self, directory: str, npu_smi: str) -> None:
        super().__init__(directory)
        self.live = LiveHost(npu_smi=npu_smi)

    def run(self, argv):
        return self.live.run(argv) if argv[0] == "npu-smi" else super().run(argv)


class Recording(SnapshotHost):
    """A snapshot that notes every command discovery asks it for."""

    def __init__(self, directory: str) -> None:
        super().__init__(directory)
        self.argvs: list[list[str]] = []

    def run(self, argv):
        self.argvs.append(list(argv))
        return super().run(argv)


# ---------------------------------------------------------------- fixture hosts


def test_a2_host():
    h = discover_host(host("a2-8x910b3"), CFG)
    assert h.device_type is DeviceType.A2 and h.chip_name == "Ascend 910B3"
    assert h.logic_ids == tuple(R(8)) and h.threads_per_core == 1 and len(h.cpus) == 192
    assert h.numa_nodes == {k: frozenset(R(24 * k, 24 * k + 24)) for k in R(8)}
    aff = {0: R(144, 168), 2: R(144, 168), 1: R(96, 120), 3: R(96, 120), 4: R(0, 24), 6: R(0, 24), 5: R(48, 72), 7: R(48, 72)}
    assert h.topo_affinity == {k: frozenset(v) for k, v in aff.items()} and h.topo_rows == 8
    assert h.processes == (NpuProcess(0, 4343, "python3"), NpuProcess(3, 4242, "python3"))
    assert h.pci_addresses[0] == "0000:c1:00.0" and h.pci_addresses[7] == "0000:42:00.0" and len(h.pci_addresses) == 8
    assert h.numa_distances[0] == (10, 12, 12, 12, 20, 20, 30, 30) and h.numa_distances[4][4] == 10
    assert h.warnings == ()


def test_a2_container_workers():
    src = host("a2-container")
    me = discover_worker(src, None, CFG)
    assert (me.pid, me.allowed_cpus, me.allowed_source) == (57, frozenset(R(144, 192)), "status")
    assert me.mems_allowed == frozenset({6, 7}) and me.env == {"ASCEND_RT_VISIBLE_DEVICES": "0"}  # from meta.json
    b = discover_worker(src, 7001, CFG)
    assert b.env["ASCEND_RT_VISIBLE_DEVICES"] == "2" and "HOME" in b.env  # from proc/7001/environ
    assert b.allowed_cpus == frozenset(R(144, 192)) and b.start_time is None and b.cpuset_path is None
    assert {t.comm for t in b.threads} >= {"python3", "acl_thread", "release_thread"} and len(b.threads) == 8
    assert [p.pid for p in discover_host(src, CFG).processes] == [27000, 27001]


def test_a3_host():
    src = host("a3-16die")
    h = discover_host(src, CFG)
    assert h.device_type is DeviceType.A3 and h.logic_ids == tuple(R(16)) and h.threads_per_core == 2
    assert h.topo_affinity == {} and h.topo_rows == 16
    assert h.chip(5).card == 2 and h.chip(5).chip == 1 and h.chip(5).phy_id == 5
    assert h.numa_nodes[2] == frozenset(R(160, 240))
    # 16 addresses, although only "-c" board files exist: the query carried -c for two-die cards
    assert len(h.pci_addresses) == 16 and h.pci_addresses[5] == "0000:b3:00.0"
    assert [(p.npu, p.pid) for p in h.processes] == [(1, 1002), (5, 1001)]
    assert discover_worker(src, 1001, CFG).allowed_cpus == frozenset(R(3, 201))
    assert discover_worker(src, 1002, CFG).allowed_cpus == frozenset(R(4, 132))
    assert discover_worker(src, None, CFG).allowed_cpus == frozenset(R(640))


def test_310p_card_rows_fan_out_to_dies():
    h = discover_host(host("310p-4card"), CFG)
    assert h.device_type is DeviceType.P310 and h.logic_ids == tuple(R(8)) and h.topo_rows == 4
    node0 = frozenset(R(0, 16)) | frozenset(R(32, 48))
    node1 = frozenset(R(16, 32)) | frozenset(R(48, 64))
    assert h.topo_affinity == {**{i: node0 for i in R(4)}, **{i: node1 for i in R(4, 8)}}
    assert h.numa_nodes == {0: node0, 1: node1} and h.threads_per_core == 2
    assert [(p.npu, p.pid) for p in h.processes] == [(3, 6100), (4, 6200)]
    assert h.pci_addresses[3] == "0000:04:00.0"


def test_950_host_and_uvb_threads():
    src = host("950-4numa")
    h = discover_host(src, CFG)
    assert h.device_type is DeviceType.A950 and h.logic_ids == tuple(R(8)) and h.threads_per_core == 1
    assert h.topo_affinity[3] == frozenset(R(40, 80)) and h.topo_affinity[6] == frozenset(R(120, 160))
    assert [(p.npu, p.pid, p.container_pid) for p in h.processes] == [(0, 5151, 118), (5, 5252, 131)]
    w = discover_worker(src, 5151, CFG, want_uvb=True)
    assert w.uvb_tids == (1890, 1891, 1892, 1893)  # not uvb_poll_ctl
    assert discover_worker(src, 5151, CFG).uvb_tids == ()  # only when asked


def test_950_discovery_never_runs_a_board_query(tmp_path):
    d = os.path.join(HOSTS, "950-4numa")
    log = str(tmp_path / "calls")
    # a 950's npu-smi refuses the board query (-c is unsupported there): make every one fail
    boards = tuple(f"info -t board -i {k}" + c for k in R(8) for c in ("", " -c 0"))
    live = NpuSmiLive(d, fake_npu_smi(tmp_path, d, fail=boards, log=log))
    h = discover_host(live, CFG)
    with open(log) as fh:
        calls = fh.read().splitlines()
    assert sorted(calls) == ["info", "info -m", "info -t topo"]
    assert h.device_type is DeviceType.A950 and h.logic_ids == tuple(R(8)) and h.pci_addresses == {}
    assert h.pci_unknown == {k: "not queried: Ascend 950 binds no NPU IRQs" for k in R(8)}
    assert not any("PCI" in w for w in h.warnings), h.warnings
    assert h == discover_host(host("950-4numa"), CFG)  # the snapshot, which holds no board listing


def test_device_type_950_from_config_skips_board_queries_too():
    rec = Recording(os.path.join(HOSTS, "a2-8x910b3"))
    h = discover_host(rec, CFG.replace(device_type="950"))
    assert not any("board" in argv for argv in rec.argvs) and h.pci_addresses == {}
    rec = Recording(os.path.join(HOSTS, "a2-8x910b3"))
    assert len(discover_host(rec, CFG).pci_addresses) == 8
    assert sum("board" in argv for argv in rec.argvs) == 8


def test_malformed_host_is_parseable_with_warnings():
    h = discover_host(host("malformed-a2"), CFG)
    assert h.logic_ids == tuple(R(7)) and 7 not in h.topo_affinity
    assert h.topo_affinity[0] == frozenset(R(144, 168))
    assert [c.cpu for c in h.cpus if not c.online] == [190, 191]
    assert h.numa_nodes[7] == frozenset(R(168, 190))  # from sysfs: lscpu -e has no NODE column
    assert [c.node for c in h.cpus][:25:24] == [0, 1]
    assert [(p.npu, p.pid) for p in h.processes] == [(1, 5001)]
    assert any("process 5002" in w and "chip 0" in w for w in h.warnings)
    assert sorted(h.pci_addresses) == [0, 1, 2, 4, 6]  # card 3 printed nothing, card 5 NA


# ---------------------------------------------------------------- variants (edited copies)


def test_a3_permuted_phy_ids_map_topo_rows(tmp_path):
    d = copy_host(tmp_path, "a3-16die")
    rows = ["\tNPU ID   Chip ID   Chip Logic ID   Chip Phy-ID   Chip Name"]
    rows += [f"\t{lg // 2}   {lg % 2}   {lg}   {15 - lg}   Ascend910" for lg in R(16)]
    put(d, "cmd/npu-smi_info_-m.txt", "\n".join(rows) + "\n")
    head = "\t   " + "".join(f"Phy-ID{i}".ljust(11) for i in R(16)) + "CPU Affinity"
    body = [f"Phy-ID{p}".ljust(11) + "".join(("X" if p == q else "HCCS").ljust(11) for q in R(16)) + f"{40 * p}-{40 * p + 39}" for p in R(16)]
    put(d, "cmd/npu-smi_info_-t_topo.txt", "\n".join([head, *body]) + "\n")
    h = discover_host(SnapshotHost(d), CFG)
    assert h.topo_affinity[0] == frozenset(R(600, 640))  # logic 0 is Phy-ID15
    assert h.topo_affinity[15] == frozenset(R(0, 40))


def test_a3_npu_labels_variant(tmp_path):
    d = copy_host(tmp_path, "a3-16die")
    head = "\t   " + "".join(f"NPU{i}".ljust(11) for i in R(16))
    body = [f"NPU{i}".ljust(11) + "".join(("X" if i == j else "HCCS").ljust(11) for j in R(16)) for i in R(16)]
    put(d, "cmd/npu-smi_info_-t_topo.txt", "\n".join([head, *body, "", "Legend:"]) + "\n")
    h = discover_host(SnapshotHost(d), CFG)
    assert h.topo_rows == 16 and h.topo_affinity == {} and h.device_type is DeviceType.A3


def test_topo_row_for_unknown_npu_is_a_warning(tmp_path):
    d = copy_host(tmp_path, "a2-8x910b3")
    put(d, "cmd/npu-smi_info_-t_topo.txt", "\t   NPU0       NPU9       CPU Affinity\nNPU0  X  HCCS  0-23\nNPU9  HCCS  X  24-47\n")
    h = discover_host(SnapshotHost(d), CFG)
    assert h.topo_affinity == {0: frozenset(R(24))}
    assert any("NPU9" in w for w in h.warnings)


def test_numa_fallbacks(tmp_path):
    d = copy_host(tmp_path, "malformed-a2")
    drop(d, "sys/devices/system/node")
    h = discover_host(SnapshotHost(d), CFG)  # no NODE column, no sysfs: lscpu's NUMA lines
    assert h.numa_nodes[7] == frozenset(R(168, 190)) and h.numa_distances == {}
    put(d, "cmd/lscpu.txt", "Architecture:  aarch64\nThread(s) per core:  1\n")
    h = discover_host(SnapshotHost(d), CFG)
    assert h.numa_nodes == {0: frozenset(R(190))} and any("node 0" in w for w in h.warnings)


def test_cpus_without_lscpu_e(tmp_path):
    d = copy_host(tmp_path, "a2-8x910b3")
    drop(d, "cmd/lscpu_-e.txt")
    put(d, "sys/devices/system/cpu/online", "0-191\n")
    put(d, "sys/devices/system/node/online", "0-1\n")
    put(d, "sys/devices/system/node/node0/cpulist", "0-95\n")
    put(d, "sys/devices/system/node/node1/cpulist", "96-191\n")
    h = discover_host(SnapshotHost(d), CFG)
    assert len(h.cpus) == 192 and h.numa_nodes == {0: frozenset(R(96)), 1: frozenset(R(96, 192))}
    assert h.cpus[100].node == 1 and h.threads_per_core == 1
    drop(d, "sys/devices/system/cpu/online", "cmd/lscpu.txt")
    with pytest.raises(ToolMissing, match="lscpu -e"):
        discover_host(SnapshotHost(d), CFG)


def test_npu_smi_missing(tmp_path):
    d = copy_host(tmp_path, "a2-8x910b3")
    drop(d, "cmd/npu-smi_info.txt", "cmd/npu-smi_info_-m.txt")
    with pytest.raises(ToolMissing, match="--snapshot") as info:
        discover_host(SnapshotHost(d), CFG)
    assert info.value.exit_status == 5 and info.value.code == "npu_smi_missing"
    with pytest.raises(ToolMissing):
        discover_processes(SnapshotHost(d), CFG)


def test_chip_map_missing_but_process_table_present(tmp_path):
    d = copy_host(tmp_path, "a2-8x910b3")
    drop(d, "cmd/npu-smi_info_-m.txt")
    h = discover_host(SnapshotHost(d), CFG)
    assert h.chips == () and h.device_type is DeviceType.UNKNOWN and h.processes == ()
    assert any("npu-smi info -m" in w for w in h.warnings) and any("process 4242" in w for w in h.warnings)
    assert len(h.topo_affinity) == 8  # without a map, NPU<n> rows are taken as logic ids


def test_malformed_npu_smi_is_a_parse_error(tmp_path):
    d = copy_host(tmp_path, "a2-8x910b3")
    put(d, "cmd/npu-smi_info_-m.txt", "\tNPU ID   Chip ID   Chip Logic ID   Chip Name\n\t0  0  0  Ascend 910B3\n\tx  0  1  Ascend 910B3\n")
    with pytest.raises(ParseError, match=r"npu-smi info -m line 3"):
        discover_host(SnapshotHost(d), CFG)


def test_device_type_rules_and_override():
    def chips(name, dies):
        return [NpuChip(card=i // dies, chip=i % dies, logic_id=i, name=name) for i in R(2 * dies)]

    assert detect_device_type(chips("Ascend 910B3", 1)) is DeviceType.A2
    assert detect_device_type(chips("Ascend910", 2)) is DeviceType.A3
    assert detect_device_type(chips("Ascend 910C", 2)) is DeviceType.A3
    assert detect_device_type(chips("Ascend910", 1)) is DeviceType.UNKNOWN
    assert detect_device_type(chips("Ascend 310P3", 2)) is DeviceType.P310
    assert detect_device_type(chips("Ascend 310", 1)) is DeviceType.UNKNOWN
    assert detect_device_type(chips("Ascend 950PR", 1)) is DeviceType.A950
    assert detect_device_type([]) is DeviceType.UNKNOWN
    h = discover_host(host("a2-8x910b3"), CFG.replace(device_type="A3"))
    assert h.device_type is DeviceType.A3


def test_board_query_carries_chip_only_for_multi_die_cards():
    a2 = discover_host(host("a2-8x910b3"), CFG, want_pci=False)
    assert a2.pci_addresses == {}
    assert board_argv(a2.chips, a2.chips[3]) == ["npu-smi", "info", "-t", "board", "-i", "3"]
    a3 = discover_host(host("a3-16die"), CFG, want_pci=False)
    assert board_argv(a3.chips, a3.chips[5]) == ["npu-smi", "info", "-t", "board", "-i", "2", "-c", "1"]


def test_failing_board_query_is_a_warning(tmp_path):
    d = os.path.join(HOSTS, "a2-8x910b3")
    live = LiveHost(npu_smi=fake_npu_smi(tmp_path, d, fail=("info -t board -i 3",)))
    h = discover_host(live, CFG)
    assert sorted(h.pci_addresses) == [0, 1, 2, 4, 5, 6, 7]
    assert any("NPU 3" in w and "exited 1" in w for w in h.warnings)
    assert h.chips == discover_host(host("a2-8x910b3"), CFG).chips


@pytest.mark.parametrize(
    "how, why",
    [
        ("exit status", "the board query failed: command npu-smi info -t board -i 3 exited 1"),
        ("no output", "`npu-smi info -t board -i 3` is unavailable on this host (no output)"),
        ("unparsable", "the board query failed: npu-smi info -t board -i 3 line 2: PCIe Bus Info '0000:ZZ:00.0'"),
        ("NA", "`npu-smi info -t board -i 3` printed no PCIe Bus Info (absent or NA)"),
    ],
)
def test_failed_board_query_costs_only_the_irq_step(tmp_path, how, why):
    d = copy_host(tmp_path, "a2-8x910b3")
    board = "cmd/npu-smi_info_-t_board_-i_3.txt"
    src: SnapshotHost = SnapshotHost(d)
    if how == "exit status":
        src = NpuSmiLive(d, fake_npu_smi(tmp_path, d, fail=("info -t board -i 3",)))
    elif how == "no output":
        drop(d, board)
    elif how == "unparsable":
        put(d, board, "\tNPU ID                         : 3\n\tPCIe Bus Info                  : 0000:ZZ:00.0\n")
    else:
        put(d, board, "\tNPU ID                         : 3\n\tPCIe Bus Info                  : NA\n")
    h = discover_host(src, CFG)
    assert sorted(h.pci_addresses) == [0, 1, 2, 4, 5, 6, 7] and h.pci_unknown[3].startswith(why)
    worker = discover_worker(src, None, CFG)
    plan = make_plan(h, worker, resolve_targets(h, worker, TargetRequest(npus=(3,))).npus, CFG)
    with open(os.path.join(HOSTS, "a2-8x910b3", "expected", "npu3.json")) as fh:
        golden = json.load(fh)["plan"]
    golden.pop("irqs")  # the IRQ lookup `plan` adds after planning: the placement does not need the address
    golden.pop("targets")  # the target rule's account, which `plan` adds to the plan it prints
    assert plan.to_json() == golden
    shown = with_planned_irqs(plan, h, CFG, src).irqs[3]
    assert (shown.reason, shown.sq) == (Reason.NO_PCI_ADDRESS, None) and shown.detail.startswith(f"NPU 3: {why}")
    proc, sys_ = tmp_path / "proc", tmp_path / "sys"
    (proc / "irq").mkdir(parents=True)
    sys_.mkdir()
    step = bind_irqs(plan, h, CFG.replace(proc_root=str(proc), sys_root=str(sys_)))
    assert (step.outcome, step.reason) == (Outcome.SKIPPED, Reason.NO_PCI_ADDRESS)
    assert step.detail.startswith(f"NPU 3: {why}"), step.detail


def test_discover_processes_alone():
    src = host("310p-4card")
    assert [(p.npu, p.pid) for p in discover_processes(src, CFG)] == [(3, 6100), (4, 6200)]
    chips = discover_host(src, CFG).chips
    assert discover_processes(src, CFG, chips=chips) == discover_host(src, CFG).processes


def test_worker_cgroup_v1_v2_and_fallbacks(tmp_path):
    d = copy_host(tmp_path, "a2-8x910b3")
    put(d, "proc/4242/cgroup", "12:cpuset:/kubepods/pod1/ctr\n0::/\n")
    put(d, "sys/fs/cgroup/cpuset/kubepods/pod1/ctr/cpuset.effective_cpus", "96-119\n")
    w = discover_worker(SnapshotHost(d), 4242, CFG)
    assert (w.allowed_cpus, w.allowed_source, w.cpuset_path) == (frozenset(R(96, 120)), "cgroup", "/kubepods/pod1/ctr")
    put(d, "proc/4343/cgroup", "0::/system.slice/vllm.service\n")
    put(d, "sys/fs/cgroup/system.slice/vllm.service/cpuset.cpus.effective", "0-23,48-71\n")
    w = discover_worker(SnapshotHost(d), 4343, CFG)
    assert w.allowed_cpus == frozenset(R(24)) | frozenset(R(48, 72)) and w.allowed_source == "cgroup"
    drop(d, "sys/fs/cgroup/system.slice")  # cgroup named, file absent: Cpus_allowed_list
    w = discover_worker(SnapshotHost(d), 4343, CFG)
    assert (w.allowed_cpus, w.allowed_source) == (frozenset(R(192)), "status")
    put(d, "sys/fs/cgroup/cpuset/kubepods/pod1/ctr/cpuset.effective_cpus", "96-x\n")
    w = discover_worker(SnapshotHost(d), 4242, CFG)
    assert w.allowed_source == "status" and "cpuset.effective_cpus" in w.warnings[0]


def test_worker_errors(tmp_path):
    with pytest.raises(ProcessGone):
        discover_worker(host("a2-8x910b3"), 31337, CFG)
    for bad in (0, -4, True, "12"):
        with pytest.raises(UsageError):
            discover_worker(host("a2-8x910b3"), bad, CFG)
    d = copy_host(tmp_path, "a2-8x910b3")
    put(d, "proc/4242/status", "Name:\tpython3\nTgid:\t4242\n")
    with pytest.raises(ParseError, match="Cpus_allowed_list"):
        discover_worker(SnapshotHost(d), 4242, CFG)


def test_uvb_from_proc_when_ps_is_absent(tmp_path):
    d = copy_host(tmp_path, "950-4numa")
    drop(d, "cmd/ps_-Te.txt")
    for tid, comm in ((1890, "uvb_poll_window"), (1891, "uvb_poll_window"), (1894, "uvb_poll_ctl")):
        put(d, f"proc/1888/task/{tid}/comm", comm + "\n")
    w = discover_worker(SnapshotHost(d), 5151, CFG, want_uvb=True)
    assert w.uvb_tids == (1890, 1891)


# ---------------------------------------------------------------- live, on this machine


def _cgroup_cpus_of(pid: int) -> frozenset[int]:
    """The CPUs of ``pid``'s cpuset as the kernel keeps them: cgroup v1's cpuset hierarchy, or
    on cgroup v2 its cgroup's ``cpuset.cpus.effective``, or where its parent does not enable the
    cpuset controller (no such file) its nearest ancestor's that has one: the root's at the top."""
    from ascendbind.values.cpulist import parse_cpulist

    for line in open(f"/proc/{pid}/cgroup"):
        hid, ctrls, path = line.rstrip("\n").split(":", 2)
        if "cpuset" in ctrls.split(","):
            return parse_cpulist(open(f"/sys/fs/cgroup/cpuset{path.rstrip('/')}/cpuset.effective_cpus").read())
    rel = path.rstrip("/")
    while not os.path.exists(f"/sys/fs/cgroup{rel}/cpuset.cpus.effective") and rel:
        rel = rel.rpartition("/")[0]
    return parse_cpulist(open(f"/sys/fs/cgroup{rel}/cpuset.cpus.effective").read())


def test_live_worker_facts(monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3")
    live = LiveHost()
    with start_worker(plain=2, acl=1, release=1) as w:
        facts = discover_worker(live, w.pid, CFG)
        assert facts.pid == w.pid and facts.start_time == w.start_time
        ticks_now = os.sysconf("SC_CLK_TCK") * float(open("/proc/uptime").read().split()[0])
        assert 0 < facts.start_time <= ticks_now + 1
        assert facts.allowed_source == "cgroup" and facts.allowed_cpus == _cgroup_cpus_of(w.pid)
        assert {t.tid: t.comm for t in facts.threads} == w.threads()
        assert {"acl_thread", "release_thread", "worker_0"} <= {t.comm for t in facts.threads}
        assert facts.env["ASCEND_RT_VISIBLE_DEVICES"] == "3" and facts.uvb_tids == ()
        later = w.spawn("late_thread")
        assert later in {t.tid for t in discover_worker(live, w.pid, CFG).threads}
    with pytest.raises(ProcessGone):
        discover_worker(live, w.pid, CFG)


def test_live_worker_status_fallback_sees_its_own_mask(tmp_path):
    # no readable cgroup (sys_root points at an empty tree): Cpus_allowed_list, as `taskset -a` sets it
    live = LiveHost(sys_root=str(tmp_path))
    last = max(os.sched_getaffinity(0))
    with start_worker(plain=1, acl=0, release=0) as w:
        for tid in w.threads():
            os.sched_setaffinity(tid, {last})
        facts = discover_worker(live, w.pid, CFG)
        assert (facts.allowed_cpus, facts.allowed_source) == (frozenset({last}), "status")


def test_a_main_thread_that_pinned_itself_does_not_narrow_the_allowed_cpus(tmp_path):
    # libgomp with OMP_PROC_BIND pins the calling thread (here the main one) before any binder runs
    cpus = frozenset(os.sched_getaffinity(0))
    with start_worker(plain=1, acl=0, release=0) as w:
        w.narrow_main({min(cpus)})
        facts = discover_worker(LiveHost(), w.pid, CFG)
        assert (facts.allowed_cpus, facts.allowed_source) == (cpus, "cgroup")  # the cpuset
        facts = discover_worker(LiveHost(sys_root=str(tmp_path)), w.pid, CFG)  # no cpuset to read
        assert (facts.allowed_cpus, facts.allowed_source) == (cpus, "status")  # its threads', united
        assert any("narrower than its threads'" in x for x in facts.warnings), facts.warnings


def test_a_cgroup_v2_without_the_cpuset_controller_runs_on_its_nearest_ancestors(tmp_path):
    d = tmp_path / "snap"
    (d / "proc" / "77").mkdir(parents=True)
    (d / "proc" / "77" / "status").write_text("Name:\tpython3\nTgid:\t77\nCpus_allowed_list:\t3\n")
    (d / "proc" / "77" / "cgroup").write_text("0::/kubepods.slice/pod1/cri-77\n")
    (d / "sys" / "fs" / "cgroup" / "kubepods.slice").mkdir(parents=True)
    (d / "sys" / "fs" / "cgroup" / "kubepods.slice" / "cpuset.cpus.effective").write_text("8-15\n")
    facts = discover_worker(SnapshotHost(str(d)), 77, CFG)
    assert (facts.allowed_cpus, facts.allowed_source) == (frozenset(range(8, 16)), "cgroup")


def test_live_self_and_uvb_threads():
    live = LiveHost()
    me = discover_worker(live, None, CFG)
    assert me.pid == os.getpid() and me.allowed_cpus

    class NoPs(LiveHost):
        def run(self, argv):
            return None if argv[0] == "ps" else super().run(argv)

    with start_worker(plain=1, acl=0, release=0, names=("uvb_poll_window_thread",)) as w:
        uvb = [tid for tid, comm in w.threads().items() if comm == "uvb_poll_window"]
        assert len(uvb) == 1
        assert set(uvb) <= set(discover_worker(live, w.pid, CFG, want_uvb=True).uvb_tids)
        assert set(uvb) <= set(discover_worker(NoPs(), w.pid, CFG, want_uvb=True).uvb_tids)


def test_pci_numa_node_from_sysfs_is_the_device_hint_without_affinity(tmp_path):
    """A3 prints no CPU Affinity; sysfs <addr>/numa_node is then the NPU's node (-1 = unknown)."""
    from ascendbind.settings import load_config
    from ascendbind.discovery import SnapshotHost, discover_host

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "hosts", "a3-16die")
    host_dir = tmp_path / "a3"
    shutil.copytree(src, host_dir)
    cfg = load_config(None, env={})
    facts = discover_host(SnapshotHost(str(host_dir)), cfg)
    addr0, addr1 = facts.pci_addresses[0], facts.pci_addresses[1]
    for addr, node in ((addr0, "3\n"), (addr1, "-1\n")):
        d = host_dir / "sys" / "bus" / "pci" / "devices" / addr
        d.mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(node)
    facts = discover_host(SnapshotHost(str(host_dir)), cfg)
    assert facts.pci_numa_nodes.get(0) == 3
    assert 1 not in facts.pci_numa_nodes
