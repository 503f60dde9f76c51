"""Record this machine (real lscpu, /proc, /sys, a real child process; npu-smi replayed
from a fixture host), then discover from the recording: the same facts as live."""

from __future__ import annotations

import json
import os

import pytest

from ascendbind.values.config import Config
from ascendbind.discovery import LiveHost, SnapshotHost, discover_host, discover_worker
from ascendbind.discovery.gather.snapshot import record_snapshot
from ascendbind.discovery.gather.worker import read_numa_residency
from ascendbind.errors import ProcessGone, ToolMissing, UsageError
from tests.hanging_tool import HangingNpuSmi
from tests.test_discovery_host import HOSTS, fake_npu_smi, put
from tests.workers import start_worker

A2 = os.path.join(HOSTS, "a2-8x910b3")


def real_pci_device_with_msi() -> str | None:
    base = "/sys/bus/pci/devices"
    for addr in sorted(os.listdir(base)) if os.path.isdir(base) else ():
        if os.path.isdir(f"{base}/{addr}/msi_irqs") and os.listdir(f"{base}/{addr}/msi_irqs"):
            return addr
    return None


def host_dir_with_real_pci(tmp_path) -> tuple[str, str | None]:
    """The A2 fixture's npu-smi text, with NPU0's board pointing at a real PCI device of this
    machine, so the recorder has a real msi_irqs directory to copy."""
    addr = real_pci_device_with_msi()
    d = tmp_path / "npu-host"
    (d / "cmd").mkdir(parents=True)
    for name in os.listdir(os.path.join(A2, "cmd")):
        text = open(os.path.join(A2, "cmd", name)).read()
        if addr and name == "npu-smi_info_-t_board_-i_0.txt":
            text = text.replace("0000:C1:00.0", addr.upper())
        (d / "cmd" / name).write_text(text)
    return str(d), addr


def test_record_worker_then_discover_gives_the_same_facts(tmp_path, monkeypatch):
    npu_dir, addr = host_dir_with_real_pci(tmp_path)
    cfg = Config(npu_smi=fake_npu_smi(tmp_path, npu_dir))
    live = LiveHost.from_config(cfg)
    out = str(tmp_path / "snap")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("SECRET_TOKEN", "do-not-record")
    with start_worker(plain=2, acl=1, release=1, names=("uvb_poll_window_thread",)) as w:
        files = record_snapshot(out, w.pid, cfg)
        live_host = discover_host(live, cfg)
        live_worker = discover_worker(live, w.pid, cfg, want_uvb=True)

    snap = SnapshotHost(out)
    assert discover_host(snap, cfg) == live_host
    recorded = discover_worker(snap, w.pid, cfg, want_uvb=True)
    assert recorded.env == {"ASCEND_RT_VISIBLE_DEVICES": "3"}  # only that key: environ is never written
    for field in ("pid", "start_time", "allowed_cpus", "allowed_source", "mems_allowed", "threads", "cpuset_path"):
        assert getattr(recorded, field) == getattr(live_worker, field), field
    assert set(live_worker.uvb_tids) <= set(recorded.uvb_tids) and recorded.uvb_tids

    for rel in ("cmd/npu-smi_info.txt", "cmd/npu-smi_info_-m.txt", "cmd/npu-smi_info_-t_topo.txt",
                "cmd/npu-smi_info_-t_board_-i_7.txt", "cmd/lscpu.txt", "cmd/lscpu_-e.txt", "cmd/ps_-Te.txt",
                f"proc/{w.pid}/status", f"proc/{w.pid}/stat", f"proc/{w.pid}/cgroup", f"proc/{w.pid}/numa_maps",
                "proc/interrupts",
                "sys/devices/system/node/node0/distance", "meta.json"):
        assert rel in files and os.path.isfile(os.path.join(out, rel)), rel
    assert not any(f.endswith("environ") for f in files)
    # the locality check replays from the snapshot: the worker's memory per node, as recorded
    assert read_numa_residency(snap, w.pid, start_time=recorded.start_time).total_kib > 0
    assert "do-not-record" not in "".join(open(os.path.join(out, f), errors="replace").read() for f in files)
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert meta["arch"] == os.uname().machine and meta["pid"] == w.pid
    if addr:  # this host has a PCI device with MSI vectors: its IRQs are recorded as empty files
        got = sorted(os.listdir(os.path.join(out, "sys/bus/pci/devices", addr, "msi_irqs")))
        assert got == sorted(os.listdir(f"/sys/bus/pci/devices/{addr}/msi_irqs"))
        assert os.path.getsize(os.path.join(out, "sys/bus/pci/devices", addr, "msi_irqs", got[0])) == 0


def test_record_self_without_pid(tmp_path):
    cfg = Config(npu_smi=fake_npu_smi(tmp_path, A2))
    out = str(tmp_path / "snap")
    files = record_snapshot(out, None, cfg)
    assert "proc/self/status" in files and not any(f.startswith(f"proc/{os.getpid()}/") for f in files)
    me = discover_worker(SnapshotHost(out), None, cfg)
    assert me.pid == os.getpid() and me.allowed_cpus == discover_worker(LiveHost(), None, cfg).allowed_cpus
    assert json.load(open(os.path.join(out, "meta.json")))["pid"] is None
    assert discover_host(SnapshotHost(out), cfg).processes == discover_host(SnapshotHost(A2), cfg).processes


def test_missing_npu_smi_still_records_everything_else(tmp_path):
    cfg = Config(npu_smi=str(tmp_path / "no-such-npu-smi"))
    out = str(tmp_path / "snap")
    files = record_snapshot(out, None, cfg)
    assert any("npu-smi not found" in w for w in files.warnings)
    assert any("npu-smi not found" in w for w in json.load(open(os.path.join(out, "meta.json")))["warnings"])
    assert {"cmd/lscpu.txt", "cmd/lscpu_-e.txt", "proc/self/status", "proc/interrupts"} <= set(files)
    assert not any(f.startswith("cmd/npu-smi") for f in files)
    with pytest.raises(ToolMissing):
        discover_host(SnapshotHost(out), cfg)
    assert discover_worker(SnapshotHost(out), None, cfg).allowed_cpus


def test_unparsable_npu_smi_is_recorded_for_the_bug_report(tmp_path):
    bad = tmp_path / "bad"
    put(str(bad), "cmd/npu-smi_info.txt", open(os.path.join(A2, "cmd/npu-smi_info.txt")).read())
    put(str(bad), "cmd/npu-smi_info_-m.txt", "\tNPU ID   Chip ID   Chip Logic ID   Chip Name\n\tzero  0  0  Ascend 910B3\n")
    cfg = Config(npu_smi=fake_npu_smi(tmp_path, str(bad)))
    out = str(tmp_path / "snap")
    files = record_snapshot(out, None, cfg)
    assert any("npu-smi info -m line 2" in w for w in files.warnings)
    assert "zero" in open(os.path.join(out, "cmd/npu-smi_info_-m.txt")).read()
    assert "cmd/lscpu_-e.txt" in files


def test_refusals(tmp_path):
    cfg = Config(npu_smi=fake_npu_smi(tmp_path, A2))
    full = tmp_path / "full"
    full.mkdir()
    (full / "old.txt").write_text("x")
    with pytest.raises(UsageError, match="not empty"):
        record_snapshot(str(full), None, cfg)
    with start_worker(plain=0, acl=0, release=0) as w:
        gone = w.pid
    with pytest.raises(ProcessGone):
        record_snapshot(str(tmp_path / "gone"), gone, cfg)
    assert not (tmp_path / "gone").exists()


def test_a_hanging_npu_smi_costs_the_snapshot_one_timeout_and_leaves_nothing_running(tmp_path):
    fake = HangingNpuSmi(tmp_path, host_dir=A2)
    fake.hang("info -t board")  # the tables answer, every board query hangs
    cfg = Config(npu_smi=str(fake.path), command_timeout_seconds=2)  # the answering runs must fit in it
    out = str(tmp_path / "snap")
    files = record_snapshot(out, None, cfg)
    assert [c for c in fake.calls() if c.startswith("info -t board")] == ["info -t board -i 0"]
    assert sum("timed out" in w for w in files.warnings) == 8  # one per NPU, seven of them not even run
    assert {"cmd/npu-smi_info_-m.txt", "cmd/npu-smi_info_-t_topo.txt", "cmd/lscpu_-e.txt"} <= set(files)
    assert fake.wait_no_survivors() == []


@pytest.mark.parametrize("where", ["file", "proc", "sys", "dev"])
def test_refusals_of_impossible_places_create_nothing(tmp_path, where):
    cfg = Config(npu_smi=fake_npu_smi(tmp_path, A2))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = {"file": str(blocker / "deeper" / "snap"), "proc": "/proc/self/ascendbind-snap",
           "sys": "/sys/fs/cgroup/ascendbind-snap-test", "dev": "/dev/shm/../ascendbind-snap-test"}[where]
    with pytest.raises(UsageError, match="snapshot directory"):
        record_snapshot(out, None, cfg)
    assert not os.path.exists(out)
