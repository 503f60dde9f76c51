"""The fixture npu-smi (fixtures/bin/npu-smi) and the demo that runs on it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ascendbind.values.cpulist import parse_cpulist
from ascendbind.discovery.parse.npu_smi import parse_board, parse_chip_map, parse_process_table, parse_topo

ROOT = Path(__file__).resolve().parent.parent
NPU_SMI = ROOT / "fixtures" / "bin" / "npu-smi"


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ASCENDBIND_")}
    full_env.update(env)
    return subprocess.run([str(NPU_SMI), *args], capture_output=True, text=True, env=full_env, timeout=30)


def test_synthesised_host_parses_as_one_910b3_on_this_machines_cpus():
    with open("/sys/devices/system/cpu/online") as fh:
        online = parse_cpulist(fh.read())
    chips = parse_chip_map(run("info", "-m").stdout)
    assert [(c.card, c.chip, c.logic_id, c.name) for c in chips] == [(0, 0, 0, "Ascend 910B3")]
    topo = parse_topo(run("info", "-t", "topo").stdout)
    assert topo.has_affinity and [r.affinity for r in topo.rows] == [online]
    pci = parse_board(run("info", "-t", "board", "-i", "0").stdout)
    assert pci and not os.path.exists(f"/sys/bus/pci/devices/{pci}")
    assert parse_process_table(run("info").stdout) == ()
    rows = parse_process_table(run("info", ASCENDBIND_FAKE_NPU_PIDS=f"{os.getpid()},1").stdout)
    assert [(r.card, r.chip, r.pid) for r in rows] == [(0, 0, os.getpid()), (0, 0, 1)]


def test_unknown_arguments_and_cards_fail_like_a_tool_would():
    assert run("info", "-t", "board", "-i", "3").returncode != 0
    bad = run("set", "-t", "x")
    assert bad.returncode == 1 and "unsupported" in bad.stderr


def test_replay_mode_reads_the_snapshot_command_files(tmp_path):
    (tmp_path / "cmd").mkdir()
    (tmp_path / "cmd" / "npu-smi_info_-t_topo.txt").write_text("recorded topo\n")
    ok = run("info", "-t", "topo", ASCENDBIND_FIXTURE_HOST=str(tmp_path))
    assert ok.returncode == 0 and ok.stdout == "recorded topo\n"
    missing = run("info", "-m", ASCENDBIND_FIXTURE_HOST=str(tmp_path))
    assert missing.returncode == 1 and "npu-smi_info_-m.txt" in missing.stderr
