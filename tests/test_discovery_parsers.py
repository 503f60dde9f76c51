"""Parsers over real-looking text: every variant real hosts print, and every malformed case
(each must be a ParseError naming the source and the line)."""

from __future__ import annotations

import os
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascendbind.discovery.parse.lscpu import parse_lscpu, parse_lscpu_e
from ascendbind.discovery.parse.npu_smi import (
    TopoRow,
    parse_board,
    parse_chip_map,
    parse_process_table,
    parse_topo,
)
from ascendbind.discovery.parse.procfs import (
    cpuset_cgroup,
    parse_cgroup,
    parse_environ,
    parse_ps_te,
    parse_stat_start_time,
    parse_status,
)
from ascendbind.discovery.parse.sysfs import parse_cpulist_file, parse_node_distance
from ascendbind.errors import ParseError
from tests import table_variants

HOSTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "hosts")


def fixture(host: str, rel: str) -> str:
    with open(os.path.join(HOSTS, host, rel), encoding="utf-8") as fh:
        return fh.read()


def cmd(host: str, name: str) -> str:
    return fixture(host, f"cmd/{name}.txt")


def parse_error(fn, *args, source: str, line: int | None):
    with pytest.raises(ParseError) as info:
        fn(*args)
    err = info.value
    assert err.source == source
    assert err.line == line
    assert source in str(err)
    if line is not None:
        assert f"line {line}" in str(err)
    return err


def line_of(text: str, needle: str) -> int:
    for n, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return n
    raise AssertionError(needle)


R = range


# ---------------------------------------------------------------- npu-smi info -m


def test_chip_map_a2_skips_mcu_rows_and_keeps_spaced_names():
    chips = parse_chip_map(cmd("a2-8x910b3", "npu-smi_info_-m"))
    assert [(c.card, c.chip, c.logic_id) for c in chips] == [(k, 0, k) for k in R(8)]
    assert {c.name for c in chips} == {"Ascend 910B3"}
    assert all(c.phy_id is None for c in chips)


def test_chip_map_a3_two_dies_with_phy_ids():
    chips = parse_chip_map(cmd("a3-16die", "npu-smi_info_-m"))
    assert len(chips) == 16
    assert chips[5].card == 2 and chips[5].chip == 1 and chips[5].logic_id == 5 and chips[5].phy_id == 5
    assert {c.name for c in chips} == {"Ascend910"}


def test_chip_map_950_without_logic_column_uses_npu_id():
    chips = parse_chip_map(cmd("950-4numa", "npu-smi_info_-m"))
    # Slot ID is a column this parser does not know: it must not shift Chip ID or the rest
    assert [(c.card, c.chip, c.logic_id, c.phy_id, c.name) for c in chips] == [
        (k, 0, k, k, "Ascend950PR") for k in R(8)
    ]


@pytest.mark.parametrize("name", ["Ascend950PR", "Ascend950DT"])
def test_chip_map_real_950_output(name):
    # as a real Ascend 950 prints it, tab and spacing included
    text = (
        "\tNPU ID    Slot ID    Chip ID    Chip Phy-ID    Chip Name\n"
        f"\t0         0          0          0              {name}\n"
        f"\t1         3          0          1              {name}\n"
    )
    chips = parse_chip_map(text)
    assert [(c.card, c.chip, c.logic_id, c.phy_id, c.name) for c in chips] == [(0, 0, 0, 0, name), (1, 0, 1, 1, name)]


def test_chip_map_single_space_never_separates_columns():
    # one space joins words into one name: "Chip Phy-ID Chip Name" is one (unknown) column,
    # so the header lacks "Chip Name"; guessing a split from known names is what broke 950
    text = "NPU ID  Chip ID  Chip Logic ID  Chip Phy-ID Chip Name\n0       0        0              4 Ascend\n"
    err = parse_error(parse_chip_map, text, source="npu-smi info -m", line=1)
    assert "'Chip Name'" in str(err)


def test_chip_map_spaced_name_in_a_middle_column_and_an_empty_unknown_cell():
    text = (
        "\tChip Name       Bus Width Mode    NPU ID    Chip ID    Chip Logic ID\n"
        "\tAscend 910B3    PCIe x16 Gen5     0         0          0\n"
        "\tAscend 910B3                      1         0          1\n"
        "\tMcu             -                 1         1          -\n"
    )
    chips = parse_chip_map(text)
    assert [(c.card, c.chip, c.logic_id, c.name) for c in chips] == [(0, 0, 0, "Ascend 910B3"), (1, 0, 1, "Ascend 910B3")]


def test_chip_map_310p_large_card_ids():
    chips = parse_chip_map(cmd("310p-4card", "npu-smi_info_-m"))
    assert [(c.card, c.chip, c.logic_id) for c in chips][:3] == [(32768, 0, 0), (32768, 1, 1), (32896, 0, 2)]


def test_chip_map_na_logic_ids_and_trailing_warning():
    chips = parse_chip_map(cmd("malformed-a2", "npu-smi_info_-m"))
    assert [c.logic_id for c in chips] == list(R(7))  # NPU 7 prints NA: not a usable die


@pytest.mark.parametrize(
    "text, line, what",
    [
        ("NPU ID  Chip ID  Chip Logic ID  Chip Name\nx0  0  0  Ascend 910B3\n", 2, "NPU ID 'x0'"),
        ("NPU ID  Chip ID  Chip Logic ID  Chip Name\n0  0  zero  Ascend 910B3\n", 2, "Chip Logic ID"),
        ("NPU ID  Chip ID  Chip Logic ID  Chip Name\n0       0        0              Ascend\n1       0\n", 3, "no 'Chip Name' cell"),
        ("NPU ID  Chip ID  Chip Logic ID  Chip Name\n0       0                       Ascend\n", 2, "no 'Chip Logic ID' cell"),
        ("NPU ID  Chip ID  Chip Logic ID  Chip Name\n0  0  0  A\n1  0  0  A\n", 3, "appears twice"),
        ("dcmi model initialized failed, because the device is used. ret is -8020\n", 1, "header"),
        ("NPU ID  Chip Logic ID\n0 0\n", 1, "Chip ID"),
    ],
)
def test_chip_map_malformed(text, line, what):
    err = parse_error(parse_chip_map, text, source="npu-smi info -m", line=line)
    assert what in str(err)


def test_chip_map_empty_output():
    parse_error(parse_chip_map, "\n", source="npu-smi info -m", line=None)


# ---------------------------------------------------------------- npu-smi info process table


def test_process_table_a2_card_chip_rows():
    rows = parse_process_table(cmd("a2-8x910b3", "npu-smi_info"))
    assert [(r.card, r.chip, r.pid, r.name, r.memory_mb) for r in rows] == [
        (0, 0, 4343, "python3", 56612),
        (3, 0, 4242, "python3", 56630),
    ]


def test_process_table_950_npu_id_and_container_pid():
    rows = parse_process_table(cmd("950-4numa", "npu-smi_info"))
    assert [(r.card, r.chip, r.pid, r.container_pid) for r in rows] == [(0, None, 5151, 118), (5, None, 5252, 131)]


def test_process_table_card_chip_with_container_column():
    text = (
        "| NPU     Chip | Process id | Process id in container | Process name | Process memory(MB) |\n"
        "+==============+============+=========================+==============+====================+\n"
        "| 7       1    | 1444275    | 12                      | sglang sched | 60970              |\n"
    )
    (row,) = parse_process_table(text)
    assert (row.card, row.chip, row.pid, row.container_pid, row.name) == (7, 1, 1444275, 12, "sglang sched")


def test_process_table_noise_rows_and_warnings():
    rows = parse_process_table(cmd("malformed-a2", "npu-smi_info"))
    assert [(r.card, r.pid) for r in rows] == [(1, 5001), (7, 5002)]


def test_process_table_no_processes_at_all():
    text = cmd("a2-8x910b3", "npu-smi_info").replace("| 0       0                 | 4343", "| 9       0                 | 4343")
    assert parse_process_table(text)[0].card == 9
    empty = "\n".join(ln for ln in cmd("a2-8x910b3", "npu-smi_info").splitlines() if "python3" not in ln)
    assert parse_process_table(empty) == ()


def test_process_table_truncated_row():
    full = cmd("a2-8x910b3", "npu-smi_info")
    cut = full[: full.index("4343") + 2]  # the output stops mid-row
    parse_error(parse_process_table, cut, source="npu-smi info", line=line_of(full, "4343"))


def test_process_table_missing_entirely():
    full = cmd("a2-8x910b3", "npu-smi_info")
    cut = full[: full.index("| NPU     Chip")]
    err = parse_error(parse_process_table, cut, source="npu-smi info", line=None)
    assert "no process table" in str(err)


@pytest.mark.parametrize(
    "row, what",
    [
        ("| 3       0   | 42x2     | python3   | 100 |", "Process id"),
        ("| 3           | 4242     | python3   | 100 |", "'<npu> <chip>'"),
        ("| three   0   | 4242     | python3   | 100 |", "NPU 'three'"),
        ("| 3       0   | 4242     | python3   | lots |", "Process memory"),
    ],
)
def test_process_table_bad_cells(row, what):
    text = "| NPU     Chip | Process id | Process name | Process memory(MB) |\n+===+\n" + row + "\n"
    err = parse_error(parse_process_table, text, source="npu-smi info", line=3)
    assert what in str(err)


def test_process_table_npu_id_form_rejects_two_numbers():
    text = "| NPU ID | Process id | Process name | Process memory(MB) |\n| 3 0 | 4242 | python3 | 100 |\n"
    parse_error(parse_process_table, text, source="npu-smi info", line=2)


def test_process_table_unknown_header():
    text = "| Device | Process id | Process name |\n"
    parse_error(parse_process_table, text, source="npu-smi info", line=1)


# ---------------------------------------------------------------- npu-smi info -t topo


def test_topo_a2_affinity_column():
    table = parse_topo(cmd("a2-8x910b3", "npu-smi_info_-t_topo"))
    assert table.has_affinity
    assert [(r.kind, r.index) for r in table.rows] == [("NPU", i) for i in R(8)]
    assert table.rows[0].affinity == frozenset(R(144, 168))
    assert table.rows[5].affinity == frozenset(R(48, 72))


def test_topo_a3_phy_id_rows_without_affinity():
    table = parse_topo(cmd("a3-16die", "npu-smi_info_-t_topo"))
    assert not table.has_affinity
    assert [(r.kind, r.index, r.affinity) for r in table.rows] == [("Phy-ID", i, None) for i in R(16)]


def test_topo_a3_npu_rows_without_affinity():
    # the other A3 variant: NPU<n> labels (logic ids), still no CPU Affinity column
    head = "\t   " + "".join(f"NPU{i}".ljust(11) for i in R(16))
    rows = [f"NPU{i}".ljust(11) + "".join(("X" if i == j else "HCCS").ljust(11) for j in R(16)) for i in R(16)]
    table = parse_topo("\n".join([head, *rows, "", "Legend:", "", "  X    = Self"]) + "\n")
    assert [(r.kind, r.index) for r in table.rows] == [("NPU", i) for i in R(16)]
    assert not table.has_affinity and all(r.affinity is None for r in table.rows)


def test_topo_310p_card_rows_with_spaces_after_commas():
    table = parse_topo(cmd("310p-4card", "npu-smi_info_-t_topo"))
    assert [r.index for r in table.rows] == [32768, 32896, 33024, 33152]
    assert table.rows[0].affinity == frozenset(R(0, 16)) | frozenset(R(32, 48))
    assert table.rows[3].affinity == frozenset(R(16, 32)) | frozenset(R(48, 64))


def test_topo_na_affinity_and_trailing_warning():
    table = parse_topo(cmd("malformed-a2", "npu-smi_info_-t_topo"))
    assert table.rows[7] == TopoRow("NPU", 7, None)
    assert table.rows[0].affinity == frozenset(R(144, 168))


def test_topo_single_npu_and_unsupported_device():
    table = parse_topo("\t   NPU0       CPU Affinity\nNPU0       X          0-1\n")
    assert table.rows == (TopoRow("NPU", 0, frozenset({0, 1})),) and table.has_affinity
    assert parse_topo("This device does not support querying topo.\n").rows == ()
    assert parse_topo("NPU0 NPU1 CPU Affinity\nNPU0 X HCCS -\nNPU1 HCCS X NA\n").rows[1].affinity is None


def test_topo_bad_cpulist():
    full = cmd("a2-8x910b3", "npu-smi_info_-t_topo").replace("96-119", "96-1x9", 1)
    err = parse_error(parse_topo, full, source="npu-smi info -t topo", line=3)
    assert "CPU Affinity" in str(err)


def test_topo_truncated_row():
    full = cmd("a2-8x910b3", "npu-smi_info_-t_topo")
    lines = full.splitlines()
    cut = "\n".join(lines[:4] + [lines[4][:40]]) + "\n"
    err = parse_error(parse_topo, cut, source="npu-smi info -t topo", line=5)
    assert "link cells" in str(err)


def test_topo_missing_affinity_cell_and_garbage_row():
    full = cmd("a2-8x910b3", "npu-smi_info_-t_topo")
    lines = full.splitlines()
    no_aff = "\n".join(lines[:2] + [lines[2].rsplit(None, 1)[0]]) + "\n"
    parse_error(parse_topo, no_aff, source="npu-smi info -t topo", line=3)
    garbage = "\n".join(lines[:3] + ["GPU2       HCCS       HCCS"]) + "\n"
    parse_error(parse_topo, garbage, source="npu-smi info -t topo", line=4)


def test_topo_header_only_and_row_before_header():
    full = cmd("a2-8x910b3", "npu-smi_info_-t_topo")
    parse_error(parse_topo, full.splitlines()[0] + "\n", source="npu-smi info -t topo", line=None)
    parse_error(parse_topo, "NPU0 X HCCS 0-3\n", source="npu-smi info -t topo", line=1)


# ---------------------------------------------------------------- npu-smi info -t board


def test_board_pci_address_variants():
    assert parse_board(cmd("a2-8x910b3", "npu-smi_info_-t_board_-i_0")) == "0000:c1:00.0"
    assert parse_board(cmd("a3-16die", "npu-smi_info_-t_board_-i_2_-c_1")) == "0000:b3:00.0"
    assert parse_board("Some Header\nPCIeBusInfo: 0000:01:00.0\n") == "0000:01:00.0"
    assert parse_board("\tPCIe Bus Info                  : C1:00.0\n") == "0000:c1:00.0"
    assert parse_board(cmd("malformed-a2", "npu-smi_info_-t_board_-i_5")) is None  # NA
    assert parse_board("\tNPU ID   : 0\n\tChip Count   : 1\n") is None


def test_board_bad_address():
    text = "\tNPU ID                         : 0\n\tPCIe Bus Info                  : 0000:ZZ:00.0\n"
    parse_error(parse_board, text, "npu-smi info -t board -i 0", source="npu-smi info -t board -i 0", line=2)


# ---------------------------------------------------------------- lscpu -e / lscpu


def test_lscpu_e_fixture_and_offline_rows_without_node_column():
    cpus = parse_lscpu_e(cmd("a2-8x910b3", "lscpu_-e"))
    assert len(cpus) == 192 and cpus[25].node == 1 and cpus[100].socket == 1 and all(c.online for c in cpus)
    ugly = parse_lscpu_e(cmd("malformed-a2", "lscpu_-e"))
    assert all(c.node is None for c in ugly)
    assert [(c.cpu, c.online, c.socket, c.core) for c in ugly[-2:]] == [(190, False, None, None), (191, False, None, None)]


def _online_cpus() -> frozenset[int]:
    """The kernel's online CPUs (what ``os.cpu_count()`` counts: sysconf's ONLN)."""
    with open("/sys/devices/system/cpu/online") as fh:
        return parse_cpulist_file(fh.read(), "/sys/devices/system/cpu/online")


def test_lscpu_e_x86_with_mhz_column_and_this_machine():
    cpus = parse_lscpu_e(cmd("310p-4card", "lscpu_-e"))
    assert cpus[32].core == 0 and cpus[32].node == 0 and cpus[16].node == 1
    real = subprocess.run(["lscpu", "-e"], capture_output=True, text=True, env={"LC_ALL": "C", "PATH": os.environ["PATH"]})
    mine = parse_lscpu_e(real.stdout)
    assert os.sched_getaffinity(0) <= {c.cpu for c in mine if c.online}
    # a row per CPU the machine has: the online ones exactly, and any offline one as "no"
    # (a machine may have CPUs offline, which os.cpu_count() leaves out)
    assert {c.cpu for c in mine if c.online} == _online_cpus() and len(_online_cpus()) == os.cpu_count()
    assert len(mine) >= os.cpu_count()


@pytest.mark.parametrize(
    "text, line",
    [
        ("CPU NODE SOCKET CORE ONLINE\n  0    0      0    0    yes\n  x    0      0    1    yes\n", 3),
        ("CPU NODE SOCKET CORE ONLINE\n  0    0      0    0    yes  extra\n", 2),
        ("CPU NODE SOCKET CORE ONLINE\n  0    0      0\n", 2),  # truncated row
        ("CPU NODE SOCKET CORE ONLINE\n  0    0      0    0    maybe\n", 2),
        ("CPU NODE SOCKET CORE ONLINE\n  0    0      0    0    yes\n  0    0      0    0    yes\n", 3),
        ("CPU NODE SOCKET CORE ONLINE\n  0   -1      0    0    yes\n", 2),
        ("lscpu: failed to determine number of CPUs\n", 1),
    ],
)
def test_lscpu_e_malformed(text, line):
    parse_error(parse_lscpu_e, text, source="lscpu -e", line=line)


def test_lscpu_e_header_only():
    parse_error(parse_lscpu_e, "CPU NODE SOCKET CORE ONLINE\n", source="lscpu -e", line=None)


def test_lscpu_summary_fixture_and_this_machine():
    s = parse_lscpu(cmd("a3-16die", "lscpu"))
    assert (s.architecture, s.threads_per_core, s.numa_node_count, s.cpu_count) == ("aarch64", 2, 8, 640)
    assert s.numa_cpus[7] == frozenset(R(560, 640))
    ugly = parse_lscpu(cmd("malformed-a2", "lscpu"))
    assert ugly.online_cpus == frozenset(R(190)) and ugly.numa_cpus[7] == frozenset(R(168, 190))
    real = parse_lscpu(subprocess.run(["lscpu"], capture_output=True, text=True, env={"LC_ALL": "C"}).stdout)
    # "CPU(s)" counts offline CPUs too; os.cpu_count() only the online ones, which lscpu lists
    assert real.online_cpus == _online_cpus() and real.cpu_count >= os.cpu_count() == len(real.online_cpus)
    assert real.threads_per_core >= 1


def _arm64_guest(name: str) -> str:
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "arm64-guest",
                           f"{name}.txt")) as fh:
        return fh.read()


def test_lscpu_of_a_real_arm64_kernel_with_four_nodes_and_a_cluster_column():
    # what Debian's arm64 kernel prints in the arm64 guest (tests/arm64_guest.py): a CLUSTER
    # column and no SOCKET one in lscpu -e; "Socket(s): -" and "Cluster(s)" in lscpu
    cpus = parse_lscpu_e(_arm64_guest("lscpu_-e"))
    assert [(c.cpu, c.node, c.core, c.online) for c in cpus] == [(k, k // 2, k, True) for k in R(8)]
    assert all(c.socket is None for c in cpus)
    s = parse_lscpu(_arm64_guest("lscpu"))
    assert (s.architecture, s.cpu_count, s.threads_per_core, s.numa_node_count) == ("aarch64", 8, 1, 4)
    assert s.online_cpus == frozenset(R(8))
    assert dict(s.numa_cpus) == {n: frozenset({2 * n, 2 * n + 1}) for n in R(4)}


def test_lscpu_summary_malformed():
    text = "Architecture:        aarch64\nThread(s) per core:  two\n"
    parse_error(parse_lscpu, text, source="lscpu", line=2)
    parse_error(parse_lscpu, "NUMA node0 CPU(s):   0-x\n", source="lscpu", line=1)
    parse_error(parse_lscpu, "\n\n", source="lscpu", line=None)


# ---------------------------------------------------------------- every table: unknown and reordered columns

TABLE_PARSERS = {
    "npu-smi_info_-m": parse_chip_map,
    "npu-smi_info": parse_process_table,
    "npu-smi_info_-t_topo": parse_topo,
    "lscpu_-e": parse_lscpu_e,
}
TABLE_CASES = [
    (h, t)
    for h in sorted(os.listdir(HOSTS))
    if os.path.isdir(os.path.join(HOSTS, h))
    for t in TABLE_PARSERS
    if os.path.exists(os.path.join(HOSTS, h, "cmd", f"{t}.txt"))
]


@pytest.mark.parametrize("variant", table_variants.VARIANTS)
@pytest.mark.parametrize("host, table", TABLE_CASES, ids=[f"{h}/{t}" for h, t in TABLE_CASES])
def test_unknown_multi_word_and_reordered_columns_read_the_same(host, table, variant):
    text = cmd(host, table)
    edited = table_variants.TABLES[table](text, variant)
    assert edited != text
    assert ("extra" in variant) == (table_variants.EXTRA_NAME in edited)
    assert TABLE_PARSERS[table](edited) == TABLE_PARSERS[table](text)


MANGLES = ["\t", " ", "  ", "|", "-", "x", "\n", "NA", "9", ", ", "NPU3 ", "Chip Name", "CPU"]


@settings(max_examples=300)
@given(
    case=st.sampled_from(TABLE_CASES),
    edits=st.lists(st.tuples(st.floats(0, 1), st.sampled_from(MANGLES + [""]), st.integers(0, 6)), max_size=4),
)
def test_mangled_tables_are_parse_errors_never_tracebacks(case, edits):
    host, table = case
    lines = cmd(host, table).splitlines()
    # the header and the first rows, where the layout is read (the process table follows the status table)
    at = next(i for i, ln in enumerate(lines) if "Process id" in ln) - 1 if table == "npu-smi_info" else 0
    text = "\n".join(lines[at : at + 8])
    for where, insert, cut in edits:
        k = int(where * len(text))
        text = text[:k] + insert + text[k + (0 if insert else cut) :]
    try:
        TABLE_PARSERS[table](text)
    except ParseError as err:
        assert str(err).startswith(err.source)


def test_every_table_of_every_host_has_variants():
    # the 950 host's tables included: all four exist on every fixture host
    assert {t for _, t in TABLE_CASES} == set(TABLE_PARSERS)
    assert {h for h, _ in TABLE_CASES} >= {"950-4numa", "a2-8x910b3", "a3-16die", "310p-4card", "malformed-a2"}


# ---------------------------------------------------------------- /proc


def test_status_fixture_and_this_process():
    st = parse_status(fixture("a2-container", "proc/7001/status"), "/proc/7001/status")
    assert (st.name, st.tgid, st.cpus_allowed, st.mems_allowed) == ("python3", 7001, frozenset(R(144, 192)), frozenset({6, 7}))
    with open("/proc/self/status") as fh:
        me = parse_status(fh.read())
    assert me.tgid == os.getpid() and me.cpus_allowed == frozenset(os.sched_getaffinity(0))


def test_status_malformed():
    parse_error(parse_status, "Name:\tx\nCpus_allowed_list:\t0-3,x\n", "/proc/9/status", source="/proc/9/status", line=2)
    parse_error(parse_status, "Name:\tx\ngarbage line\n", "/proc/9/status", source="/proc/9/status", line=2)
    parse_error(parse_status, "Tgid:\tabc\n", "/proc/9/status", source="/proc/9/status", line=1)
    parse_error(parse_status, "", "/proc/9/status", source="/proc/9/status", line=None)


def test_stat_start_time_with_hostile_comm_and_this_process():
    fields = " ".join(str(i) for i in range(3, 53))
    assert parse_stat_start_time(f"1234 (evil) name (x)) S {fields[2:]}") == 22
    with open("/proc/self/stat") as fh:
        text = fh.read()
    assert parse_stat_start_time(text) == int(text.rpartition(")")[2].split()[19])


def test_stat_malformed():
    parse_error(parse_stat_start_time, "1234 (x) S 1 2 3\n", "/proc/1234/stat", source="/proc/1234/stat", line=1)
    parse_error(parse_stat_start_time, "1234 no parens\n", "/proc/1234/stat", source="/proc/1234/stat", line=1)
    bad = "1 (x) S " + " ".join(["7"] * 18) + " soon 9 9\n"
    parse_error(parse_stat_start_time, bad, "/proc/1/stat", source="/proc/1/stat", line=1)


def test_environ_nul_separated():
    env = parse_environ(fixture("a2-container", "proc/7001/environ"))
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "2" and env["HOME"] == "/root"
    assert parse_environ("A=1=2\0junk\0\0B=\0") == {"A": "1=2", "B": ""}


def test_cgroup_v1_v2_and_hybrid():
    v1 = parse_cgroup("11:cpuset:/docker/abc\n10:cpu,cpuacct:/docker/abc\n")
    assert cpuset_cgroup(v1) == ("v1", "/docker/abc")
    v2 = parse_cgroup("0::/kubepods.slice/pod1/cri-containerd-2.scope\n")
    assert cpuset_cgroup(v2) == ("v2", "/kubepods.slice/pod1/cri-containerd-2.scope")
    hybrid = parse_cgroup("3:cpuset:/\n1:name=systemd:/user.slice\n0::/user.slice\n")
    assert cpuset_cgroup(hybrid) == ("v1", "/")
    assert cpuset_cgroup(parse_cgroup("4:memory:/x\n")) is None
    with open("/proc/self/cgroup") as fh:
        assert parse_cgroup(fh.read())


def test_cgroup_malformed():
    parse_error(parse_cgroup, "3:cpuset:/\nnot a cgroup line\n", "/proc/1/cgroup", source="/proc/1/cgroup", line=2)
    parse_error(parse_cgroup, "x:cpuset:/\n", "/proc/1/cgroup", source="/proc/1/cgroup", line=1)


def test_ps_te_fixture_real_and_spaces_in_comm():
    rows = parse_ps_te(cmd("950-4numa", "ps_-Te"))
    assert [r.tid for r in rows if r.comm.startswith("uvb_poll_window")] == [1890, 1891, 1892, 1893]
    real = subprocess.run(["ps", "-Te"], capture_output=True, text=True, env={"LC_ALL": "C", "PATH": os.environ["PATH"]})
    mine = parse_ps_te(real.stdout)
    assert any(r.pid == os.getpid() and r.tid == os.getpid() for r in mine)
    spaced = parse_ps_te("  PID  SPID TTY          TIME CMD\n   12    13 ?        00:00:00 kworker/0:1 H\n")
    assert spaced[0].comm == "kworker/0:1 H"


def test_ps_te_malformed():
    parse_error(parse_ps_te, "  PID  SPID TTY TIME CMD\n   1  x ? 00:00:00 init\n", source="ps -Te", line=2)
    parse_error(parse_ps_te, "error: unsupported option\n", source="ps -Te", line=1)
    parse_error(parse_ps_te, "", source="ps -Te", line=None)


# ---------------------------------------------------------------- sysfs


def test_node_distance_and_cpulist_files():
    assert parse_node_distance(fixture("a2-8x910b3", "sys/devices/system/node/node0/distance")) == (
        10, 12, 12, 12, 20, 20, 30, 30,
    )
    assert parse_cpulist_file("0-23\n", "/sys/devices/system/node/node0/cpulist") == frozenset(R(24))
    assert parse_cpulist_file("\n", "/sys/fs/cgroup/cpuset.cpus.effective") == frozenset()


def test_sysfs_malformed():
    src = "/sys/devices/system/node/node1/distance"
    parse_error(parse_node_distance, "10 x 20\n", src, source=src, line=1)
    parse_error(parse_node_distance, "10 0\n", src, source=src, line=1)
    parse_error(parse_node_distance, "10 20\n20 10\n", src, source=src, line=None)
    cl = "/sys/fs/cgroup/cpuset/x/cpuset.effective_cpus"
    parse_error(parse_cpulist_file, "0-3,y\n", cl, source=cl, line=1)
    parse_error(parse_cpulist_file, "0-3\n4\n", cl, source=cl, line=2)
