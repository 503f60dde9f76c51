"""`plan` shows which IRQs each NPU's IRQ step would move, from a snapshot and from
this host, and a snapshot replays exactly what the live lookup read."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from ascendbind.values.config import Config
from ascendbind.discovery import SnapshotHost, discover_host
from ascendbind.discovery.gather.irqhost import discover_npu_irqs
from ascendbind.values.reasons import Reason
from tests.golden import HOSTS
from tests.test_cli_plan import ROOT, ascendbind

A2 = os.path.join(HOSTS, "a2-8x910b3")
FAKE_BIN = os.path.join(ROOT, "fixtures", "bin")


def _plan(*argv: str, env=None) -> dict:
    r = ascendbind("plan", *argv, "--format", "json", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _fixture_sq_cq(host_dir: str, pci: str) -> tuple[int, int]:
    """The fixture's own facts, read here without ascendbind: the NPU's MSI vectors, and
    the first SQ and CQ names among them in /proc/interrupts order."""
    msi = {int(n) for n in os.listdir(os.path.join(host_dir, "sys/bus/pci/devices", pci, "msi_irqs"))}
    named: dict[str, int] = {}
    with open(os.path.join(host_dir, "proc/interrupts")) as fh:
        for line in fh:
            m = re.match(r"\s*(\d+):.*\s(sq_send_trigger_irq|cq_update_irq)\s*$", line)
            if m and int(m.group(1)) in msi:
                named.setdefault(m.group(2), int(m.group(1)))
    return named["sq_send_trigger_irq"], named["cq_update_irq"]


def test_plan_from_a_snapshot_names_each_npus_sq_and_cq_and_their_cpus():
    plan = _plan("--snapshot", A2, "--npu", "3", "--npu", "5")
    assert sorted(plan["irqs"]) == ["3", "5"]
    for npu, shown in plan["irqs"].items():
        sq, cq = _fixture_sq_cq(A2, shown["pci"])
        irq_cpus = plan["npus"][npu]["irq"]
        assert (shown["sq"], shown["cq"], shown["cq_guessed"], shown["skipped"]) == (sq, cq, False, None)
        assert shown["cpus"] == {str(sq): irq_cpus[:1], str(cq): irq_cpus[1:2]}
    # the two NPUs sit on different devices, so their IRQs differ
    assert plan["irqs"]["3"]["sq"] != plan["irqs"]["5"]["sq"]


def test_plan_shows_why_nothing_moves():
    off = _plan("--snapshot", A2, "--npu", "5", "--irq-binding", "false")["irqs"]["5"]
    assert (off["skipped"], off["sq"], off["cpus"]) == ("irq_binding_disabled", None, {})
    a950 = _plan("--snapshot", os.path.join(HOSTS, "950-4numa"), "--npu", "0")["irqs"]["0"]
    assert a950["skipped"] == "not_applicable" and a950["pci"] is None
    no_board = _plan("--snapshot", os.path.join(HOSTS, "malformed-a2"), "--npu", "3")["irqs"]["3"]
    assert no_board["skipped"] == "no_pci_address" and "npu-smi info -t board -i 3" in no_board["detail"]


def test_the_table_lists_the_moves():
    r = ascendbind("plan", "--snapshot", A2, "--npu", "3")
    assert r.returncode == 0, r.stderr
    sq, cq = _fixture_sq_cq(A2, "0000:82:00.0")
    assert f"irq: NPU3 (0000:82:00.0): IRQ {sq} -> CPU 120, IRQ {cq} -> CPU 121" in r.stdout


def test_a_missing_interrupt_table_is_a_reason_not_a_crash(tmp_path):
    host_dir = str(tmp_path / "a2")
    shutil.copytree(A2, host_dir)
    os.unlink(os.path.join(host_dir, "proc", "interrupts"))
    src = SnapshotHost(host_dir)
    facts = discover_host(src, Config())
    found = discover_npu_irqs(src, facts, [3])[3]
    assert found.reason is Reason.INTERRUPTS_UNREADABLE and found.sq is None
    with open(os.path.join(host_dir, "proc", "interrupts"), "w") as fh:
        fh.write("           CPU0\n 42:\n")
    found = discover_npu_irqs(src, facts, [3])[3]
    assert found.reason is Reason.INTERRUPTS_UNREADABLE and "/proc/interrupts line 2" in found.detail


def _real_msi_device() -> tuple[str, int] | None:
    base = "/sys/bus/pci/devices"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return None
    for addr in names:
        try:
            vectors = [n for n in os.listdir(os.path.join(base, addr, "msi_irqs")) if n.isdigit()]
        except OSError:
            continue
        if vectors:
            return addr, len(vectors)
    return None


@pytest.mark.skipif(_real_msi_device() is None, reason="no PCI device with MSI vectors on this machine")
def test_live_plan_reads_this_hosts_msi_vectors_and_a_snapshot_replays_them(tmp_path):
    """The fixture npu-smi, with its NPU moved onto a real PCI device of this machine:
    the live lookup lists that device's vectors and reads this /proc/interrupts; a
    snapshot records them, and planning from it shows the same answer."""
    addr, vectors = _real_msi_device()
    npu_host = tmp_path / "npu-host"
    (npu_host / "cmd").mkdir(parents=True)
    env = {"PATH": f"{FAKE_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    for argv in (["info"], ["info", "-m"], ["info", "-t", "topo"], ["info", "-t", "board", "-i", "0"]):
        out = subprocess.run([os.path.join(FAKE_BIN, "npu-smi"), *argv], capture_output=True, text=True,
                             check=True, env={**os.environ, **env}).stdout
        if "board" in argv:
            out = re.sub(r"(PCIe Bus Info\s*:\s*)\S+", lambda m: m.group(1) + addr.upper(), out)
        (npu_host / "cmd" / ("npu-smi_" + "_".join(argv) + ".txt")).write_text(out)
    env["ASCENDBIND_FIXTURE_HOST"] = str(npu_host)

    live = _plan("--npu", "0", "--small-pool", "share", env=env)["irqs"]["0"]
    assert live["pci"] == addr
    # no NPU driver here: the device's vectors carry other names
    assert live["skipped"] == "no_sq_irq", live
    assert f"none of its {vectors} MSI IRQs is named sq_send_trigger_irq" in live["detail"]

    snap = str(tmp_path / "snap")
    r = ascendbind("snapshot", snap, env=env)
    assert r.returncode == 0, r.stderr
    recorded = sorted(os.listdir(os.path.join(snap, "sys/bus/pci/devices", addr, "msi_irqs")))
    assert recorded == sorted(os.listdir(f"/sys/bus/pci/devices/{addr}/msi_irqs"))
    assert os.path.getsize(os.path.join(snap, "proc", "interrupts")) > 0
    replayed = _plan("--snapshot", snap, "--npu", "0", "--small-pool", "share")["irqs"]["0"]
    assert replayed == live
