"""The NPU evidence about a worker: its parsers, and the reads through a HostSource.

Parsers with plain text; the reader (discovery/gather/deviceset.py) on snapshot directories
and on the live host: a real /dev of mknod-made nodes under a scratch directory (a
symlinked one is not followed, a huge one not listed), real namespace links, and the
recorder writing what it read so that a SnapshotHost reads it back the same.
"""

from __future__ import annotations

import os
import stat

import pytest

from ascendbind.discovery.parse.devices import (allowed_minors, devdrv_major, format_char_devices, nested_pid_namespace,
                                          parse_char_devices, trs_core_udevids)
from ascendbind.discovery.read.devnodes import DEV_ENTRIES_LIMIT, scan_char_devices
from ascendbind.discovery.gather.deviceset import read_npu_evidence
from ascendbind.discovery.gather.process import observe_process
from ascendbind.discovery.gather.snapshot import RecordingHost
from ascendbind.discovery.read.sources import LiveHost, SnapshotHost
from ascendbind.errors import ParseError, ProcessGone
from ascendbind.planner.npus.ascend_env import is_virtual, parse_rt_visible_devices, parse_visible_devices
from ascendbind.values.targeting import DeviceNode, physical_of_udevid

from .containers import npu_major

PROC_DEVICES = "Character devices:\n  1 mem\n 10 misc\n236 devdrv-cdev\n237 hisi_hdc\n\nBlock devices:\n  7 loop\n"


# ------------------------------------------------------------ parsers

def test_the_driver_major_comes_from_the_character_section_only():
    assert devdrv_major(PROC_DEVICES) == 236
    assert devdrv_major("Character devices:\n  1 mem\n\nBlock devices:\n236 devdrv-cdev\n") is None
    assert devdrv_major("Character devices:\n  1 mem\n") is None
    with pytest.raises(ParseError, match="line 2"):
        devdrv_major("Character devices:\nnot a line\n")


@pytest.mark.parametrize("text, minors", [
    ("a *:* rwm\n", None),                              # a cgroup that allows everything
    ("c 1:3 rwm\nc 236:5 rw\nc 236:7 rwm\n", {5, 7}),
    ("c 236:* rwm\n", None),                            # every minor of the major
    ("c *:* rw\n", None),
    ("c 236:5 m\nc 236:6 r\n", set()),                  # mknod or read only: cannot be opened
    ("b 236:5 rwm\nc 10:236 rwm\n", set()),             # a block device, another major
])
def test_devices_list_whitelists(text, minors):
    got = allowed_minors(text, 236)
    assert got == (None if minors is None else frozenset(minors))


def test_a_malformed_devices_list_names_the_line():
    with pytest.raises(ParseError, match="line 2"):
        allowed_minors("c 1:3 rwm\nallow everything\n", 236)


def test_the_process_map_is_read_for_one_host_pid():
    names = ["4242-1-dev-3", "4242-2-dev-3", "4242-3-dev-180", "42421-1-dev-0", "summary", "77-1-dev-5"]
    assert trs_core_udevids(names, 4242) == (3, 180)
    assert trs_core_udevids(names, 99) == ()


def test_a_recorded_dev_listing_round_trips():
    nodes = (DeviceNode("davinci5", 236, 5), DeviceNode("vdavinci180", 236, 180))
    assert parse_char_devices(format_char_devices(reversed(nodes)), "x") == nodes
    with pytest.raises(ParseError):
        parse_char_devices("davinci5 236-5\n", "x")


def test_udevids_of_vnpus_belong_to_their_physical_device():
    assert [physical_of_udevid(u) for u in (0, 7, 99, 100, 115, 116, 180, 227)] == [0, 7, 99, 0, 0, 1, 5, 7]


@pytest.mark.parametrize("raw, ids", [
    ("5", (5,)), (" 1, 3 ", (1, 3)), ("0-3", (0, 1, 2, 3)), ("6,2-3", (2, 3, 6)), ("Ascend910-3", (3,)),
    ("Ascend910-1,Ascend910-4", (1, 4)), ("npu-2", (2,)), ("void", ()), ("180", (180,)),
])
def test_ascend_visible_devices_as_the_container_runtime_reads_it(raw, ids):
    assert parse_visible_devices(raw) == ids


@pytest.mark.parametrize("raw", ["5;6", "x", "3-1", "0-99999", "GPU-1"])
def test_a_malformed_ascend_visible_devices_is_refused_by_value(raw):
    with pytest.raises(ValueError, match="ASCEND_VISIBLE_DEVICES"):
        parse_visible_devices(raw)


def test_ascend_rt_visible_devices_keeps_its_order():
    assert parse_rt_visible_devices("1,0") == (1, 0) and parse_rt_visible_devices(" 4, 6 ") == (4, 6)
    for bad in ("1,1", "0,x", "", "-1"):
        with pytest.raises(ValueError):
            parse_rt_visible_devices(bad)
    assert is_virtual("NODRV,VIRTUAL") and is_virtual(" virtual") and not is_virtual("") and not is_virtual(None)


# ------------------------------------------------------------ the reader, on a snapshot

def _snapshot(tmp_path, *, ns="mnt:[4026532705]", dev="davinci5 236:5\n", devices_list="c 236:5 rw\n",
              trs=("4242-1-dev-5",), proc_devices=PROC_DEVICES):
    d = tmp_path / "snap"

    def put(rel, text):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)

    put("proc/4242/status", "Name:\tpython3\nTgid:\t4242\nCpus_allowed_list:\t0-7\n")
    put("proc/4242/stat", "4242 (python3) S 1 4242 4242 0 -1 4194560" + " 0" * 12 + " 5555" + " 0" * 30 + "\n")
    put("proc/4242/cgroup", "5:devices:/kubepods/pod1\n3:cpuset:/kubepods/pod1\n0::/\n")
    put("proc/1/ns/mnt", "mnt:[4026531841]\n")
    if ns is not None:
        put("proc/4242/ns/mnt", ns + "\n")
    if dev is not None:
        put("proc/4242/root/dev", dev)
    if devices_list is not None:
        put("sys/fs/cgroup/devices/kubepods/pod1/devices.list", devices_list)
    for name in trs:
        put(f"proc/trs_core/proc/{name}", "")
    if proc_devices is not None:
        put("proc/devices", proc_devices)
    return SnapshotHost(str(d))


def _evidence(source):
    return read_npu_evidence(source, observe_process(source, 4242))


def test_a_containers_evidence_from_a_snapshot(tmp_path):
    ev = _evidence(_snapshot(tmp_path))
    assert ev.major == 236 and ev.host_namespace is False
    assert ev.device_nodes == (DeviceNode("davinci5", 236, 5),)
    assert ev.cgroup_devices.minors == frozenset({5}) and ev.cgroup_devices.path.endswith("pod1/devices.list")
    assert ev.driver_udevids == (5,)


def test_a_worker_in_the_host_namespace_has_no_device_set_of_its_own(tmp_path):
    ev = _evidence(_snapshot(tmp_path, ns="mnt:[4026531841]"))
    assert ev.host_namespace is True and ev.device_nodes is None
    assert "host's mount namespace" in ev.unavailable["device_nodes"]


def test_without_the_driver_major_nothing_of_the_device_set_is_read(tmp_path):
    ev = _evidence(_snapshot(tmp_path, proc_devices="Character devices:\n  1 mem\n"))
    assert ev.major is None and ev.device_nodes is None and ev.cgroup_devices is None
    assert "no devdrv-cdev" in ev.unavailable["device_nodes"] and "no devdrv-cdev" in ev.unavailable["devices_cgroup"]
    ev = _evidence(_snapshot(tmp_path / "b", proc_devices=None))
    assert "unreadable" in ev.unavailable["device_nodes"]


def test_unreadable_and_malformed_pieces_are_recorded_as_unavailable(tmp_path):
    ev = _evidence(_snapshot(tmp_path, dev=None, devices_list="nonsense\n", trs=(), ns=None))
    assert ev.host_namespace is None and ev.device_nodes is None
    assert "/proc/4242/root/dev" in ev.unavailable["device_nodes"]
    assert "line 1" in ev.unavailable["devices_cgroup"]
    assert ev.driver_udevids is None and "trs_core" in ev.unavailable["driver"]
    ev = _evidence(_snapshot(tmp_path / "b", dev="davinci5 five\n"))
    assert ev.device_nodes is None and "NAME MAJOR:MINOR" in ev.unavailable["device_nodes"]


@pytest.mark.parametrize("nspid, host_ns", [
    ("NSpid:\t4242\t1\n", False),   # a pid namespace below the reader's: a container's process
    ("NSpid:\t4242\n", None),        # the reader's own pid namespace: nothing is concluded
    ("", None),                       # no NSpid line
    ("NSpid:\t4242\tx\n", None),    # malformed: nothing is concluded
])
def test_where_pid_1s_mount_namespace_is_unreadable_a_nested_pid_namespace_is_a_container(tmp_path, nspid, host_ns):
    source = _snapshot(tmp_path, proc_devices="Character devices:\n  1 mem\n")
    root = tmp_path / "snap" / "proc"
    (root / "1" / "ns" / "mnt").unlink()
    status = root / "4242" / "status"
    status.write_text(status.read_text() + nspid)
    assert _evidence(source).host_namespace is host_ns


def test_nspid_parser():
    assert nested_pid_namespace("Name:\tx\nNSpid:\t77\t5\t1\n") is True
    assert nested_pid_namespace("NSpid:\t77\n") is False
    assert nested_pid_namespace("Name:\tx\n") is None and nested_pid_namespace("NSpid:\n") is None


def test_a_live_contained_worker_is_not_taken_for_the_host():
    from .containers import contained_worker

    live = LiveHost()
    with contained_worker([("davinci0", 3)], allow=[3]) as w:
        assert read_npu_evidence(live, observe_process(live, w.pid)).host_namespace is False
    with contained_worker(bare=True) as w:
        assert read_npu_evidence(live, observe_process(live, w.pid)).host_namespace is not False


def test_a_pid_recycled_while_its_devices_were_read_is_refused(tmp_path):
    source = _snapshot(tmp_path)
    view = observe_process(source, 4242)
    stat_file = tmp_path / "snap" / "proc" / "4242" / "stat"
    stat_file.write_text(stat_file.read_text().replace(" 5555 ", " 6666 "))
    with pytest.raises(ProcessGone) as exc:
        read_npu_evidence(source, view)
    assert exc.value.code == "pid_recycled"


# ------------------------------------------------------------ the live host

def _mknod(path, minor, major):
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(major, minor))


def test_the_live_scan_lists_nodes_of_the_major_only_and_follows_no_link(tmp_path):
    major = npu_major()
    dev = tmp_path / "dev"
    dev.mkdir()
    _mknod(dev / "davinci5", 5, major)
    _mknod(dev / "vdavinci180", 180, major)
    _mknod(dev / "null-like", 3, 1)
    (dev / "davinci9").symlink_to(dev / "davinci5")   # a link to a node is no node of its own
    (dev / "davinci_manager").write_text("")
    assert scan_char_devices(str(dev), major) == [DeviceNode("davinci5", major, 5),
                                                  DeviceNode("vdavinci180", major, 180)]
    (tmp_path / "linked").symlink_to(dev)
    assert scan_char_devices(str(tmp_path / "linked"), major) is None  # /dev itself a link: not read
    assert scan_char_devices(str(tmp_path / "absent"), major) is None


def test_a_dev_too_large_to_list_is_not_listed(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(DEV_ENTRIES_LIMIT + 1):
        (dev / f"f{i}").touch()
    assert scan_char_devices(str(dev), npu_major()) is None


def test_live_namespace_links_and_the_recorder_round_trip(tmp_path):
    live = LiveHost()
    mine = live.readlink("/proc/self/ns/mnt")
    assert mine is not None and mine.startswith("mnt:[")
    major = npu_major()
    dev = tmp_path / "dev"
    dev.mkdir()
    _mknod(dev / "davinci2", 6, major)
    rec = RecordingHost(live, str(tmp_path / "snap"))
    assert rec.readlink("/proc/self/ns/mnt") == mine
    assert rec.char_devices(str(dev), major) == [DeviceNode("davinci2", major, 6)]
    snap = SnapshotHost(str(tmp_path / "snap"))
    assert snap.readlink("/proc/self/ns/mnt") == mine
    assert snap.char_devices(str(dev), major) == [DeviceNode("davinci2", major, 6)]
    assert snap.char_devices(str(dev), major + 1) == []
