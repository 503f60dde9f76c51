"""Isolation's one mask interface and its one "still ours?" rule.

* ``MaskKey``: a mask's name, parsed once and printed as the state file keys it (a table).
* ``holds``: what a recorded mask holds now, the one rule every kind and irqbalance's
  banned CPUs are judged by (a table).
* Each kind's read / apply / verify / restore, for real: the mask files on a fixture
  /proc + /sys tree of regular files (the real ones are host-wide: the QEMU guest
  changes those), a thread's affinity on a child process this test starts, and
  irqbalance's banned CPUs on a real irqbalance in a mount namespace of its own.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from ascendbind.daemon.isolate.banned import IrqbalanceBan
from ascendbind.daemon.isolate.kinds import TaskMask, mask_kinds
from ascendbind.daemon.isolate.rules.keys import MaskKey
from ascendbind.daemon.isolate.rules.records import (RECORD_TYPES, IrqSaved, IsolationRecord, SavedBan, TaskSaved,
                                                     WatchdogSaved)
from ascendbind.daemon.isolate.rules.verdicts import Holds, holds
from ascendbind.discovery.gather.process import stat_of
from ascendbind.values.config import Config
from ascendbind.values.cpulist import format_cpulist, parse_cpulist, parse_mask
from tests.daemon_harness import wait_for
from tests.irqbalance_harness import Irqbalance, fixture_proc_link
from tests.test_applier_irq import immutable, needs_chattr

# ---------------------------------------------------------------- the key


@pytest.mark.parametrize("text, kind, parts", [
    ("irq:24", "irq", (24,)),
    ("default", "default", ()),
    ("workqueues", "workqueues", ()),
    ("watchdog", "watchdog", ()),
    ("workqueue:dev0_sq_send_wq", "workqueue", ("dev0_sq_send_wq",)),
    ("workqueue:scsi_tmf_0:1", "workqueue", ("scsi_tmf_0:1",)),  # only the first colon is the kind's
    ("task:812:4711", "task", (812, 4711)),
    ("irqbalance:77", "irqbalance", (77,)),
])
def test_a_mask_key_is_parsed_once_and_printed_as_the_state_file_keys_it(text, kind, parts):
    key = MaskKey(text)
    assert (key.kind, key.parts) == (kind, parts)
    assert str(key) == text and key == text and hash(key) == hash(text) and {text: 1}[key] == 1
    made = MaskKey.of(kind, *parts)
    assert type(made) is MaskKey and made == key and made.parts == parts
    assert json.dumps({key: 1}) == json.dumps({text: 1})
    assert pickle.loads(pickle.dumps(key)).parts == parts and MaskKey(key) is key


@pytest.mark.parametrize("text", ["irq:x", "irq:", "irq:-1", "irq:12345678", "task:1", "task:1:2:3", "task:a:1",
                                  "workqueue:", "workqueue:../x", "workqueue:a/b", "default:1", "watchdog:0",
                                  "cpu:1", "", " irq:1", "irq:1\n", "irqbalance:x", "IRQ:1"])
def test_what_names_no_mask_is_refused(text):
    with pytest.raises(ValueError, match="not an isolation mask key"):
        MaskKey(text)


def test_a_keys_parts_are_read_by_name_and_only_for_its_kind():
    assert MaskKey("irq:24").irq == 24 and MaskKey("workqueue:a:b").name == "a:b"
    task = MaskKey.of("task", 812, 4711)
    assert (task.tid, task.start_time) == (812, 4711) and MaskKey("irqbalance:77").pid == 77
    with pytest.raises(AttributeError, match="is a irq key, not a task key"):
        MaskKey("irq:24").tid
    with pytest.raises(ValueError):
        MaskKey.of("cpu", 1)
    with pytest.raises(ValueError):
        MaskKey.of("workqueue", "x" * 65)


def test_an_older_state_files_record_loads_into_each_kinds_record_and_writes_back_the_same():
    # as written by the daemon before the record types had a kind each
    older = {"masks": {"default": {"original": "00000fff", "ours": ["000000ff"]},
                       "irq:30": {"original": "00000fff", "ours": ["000000ff"]},
                       "task:812:4711": {"original": "0-11", "ours": ["0-7"]},
                       "watchdog": {"original": "0-11", "ours": ["0-7"]},
                       "workqueue:dev4_sq_send_wq": {"original": "00000fff", "ours": ["000000c0"]},
                       "workqueues": {"original": "00000fff", "ours": ["000000ff"]}},
             "irqbalance": {"pid": 77, "start_time": 1234, "original": "00000001", "ours": ["0,8-11"]}}
    record = IsolationRecord.from_json(json.loads(json.dumps(older)))
    assert {k: type(v) for k, v in record.masks.items()} == {MaskKey(k): RECORD_TYPES[MaskKey(k).kind]
                                                             for k in older["masks"]}
    assert all(type(k) is MaskKey for k in record.masks)
    assert record.to_json() == older
    with pytest.raises(ValueError, match="not an isolation mask key"):
        IsolationRecord.from_json({"masks": {"irqbalance:77": {"original": "0", "ours": []}}})


# ---------------------------------------------------------------- the one rule

B = SavedBan(77, 1234, "00000001", ("0,8-11",))  # irqbalance: its own set as a hex mask, ours as cpu lists


@pytest.mark.parametrize("saved, now, verdict", [
    (TaskSaved("0-7", ("0-1",)), None, Holds.GONE),            # the thread exited, the IRQ was freed
    (TaskSaved("0-7", ("0-1",)), "0-7", Holds.ORIGINAL),       # a crash before the write landed, or put back
    (TaskSaved("0-7", ("0-1",)), "0-1", Holds.OURS),
    (TaskSaved("0-7", ("0-1", "0")), "0", Holds.OURS),         # a crash between two writes: either is ours
    (TaskSaved("0-7", ("0-1", "0")), "0-1", Holds.OURS),
    (TaskSaved("0-7", ("0-1",)), "2", Holds.OWNER),            # neither: its owner's now
    (TaskSaved("0-7", ()), "0-1", Holds.OWNER),
    (IrqSaved("00000fff", ("000000ff",)), "0-7", Holds.OURS),  # compared as CPUs, not texts
    (IrqSaved("fff", ("ff",)), "0-11", Holds.ORIGINAL),
    (IrqSaved("00000fff", ("000000ff",)), "8-9", Holds.OWNER),
    (WatchdogSaved("0-11", ("0-7",)), "0-7", Holds.OURS),
    (B, "0,8-11", Holds.OURS),
    (B, "0", Holds.ORIGINAL),
    (B, "5", Holds.OWNER),
    (B, None, Holds.GONE),
])
def test_still_ours(saved, now, verdict):
    assert holds(saved, None if now is None else parse_cpulist(now)) is verdict


# ---------------------------------------------------------------- the mask files


FILES = [
    # key, its file under the fixture root, the host's text, the CPUs wanted, the text written
    ("irq:30", "proc/irq/30/smp_affinity", "00000fff", "0-7", "000000ff"),
    ("default", "proc/irq/default_smp_affinity", "00000fff", "0-7", "000000ff"),
    ("workqueue:dev4_sq_send_wq", "sys/devices/virtual/workqueue/dev4_sq_send_wq/cpumask", "00000fff", "6-7",
     "000000c0"),
    ("workqueues", "sys/devices/virtual/workqueue/cpumask", "00000fff", "0-7", "000000ff"),
    ("watchdog", "proc/sys/kernel/watchdog_cpumask", "0-11", "0-7", "0-7"),
]


def _file_kind(tmp_path, rel, text):
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    cfg = Config(proc_root=str(tmp_path / "proc"), sys_root=str(tmp_path / "sys"))
    return path, cfg


@pytest.mark.parametrize("key, rel, host, wanted, written", FILES, ids=[f[0] for f in FILES])
def test_each_mask_file_is_read_applied_verified_and_restored_byte_for_byte(tmp_path, key, rel, host, wanted,
                                                                             written):
    path, cfg = _file_kind(tmp_path, rel, host)
    key = MaskKey(key)
    kind = mask_kinds(cfg)[key.kind]
    assert kind.read(key) == host
    text = kind.text(parse_cpulist(wanted), host)
    assert text == written
    saved = kind.record(host).with_ours(text)  # what the keeper saves before the write
    assert type(saved) is RECORD_TYPES[key.kind]
    w = kind.apply(key, text)
    assert (w.status, w.previous, w.now) == ("ok", host, written) and path.read_text() == written
    assert kind.verify(key, saved) is Holds.OURS
    other = kind.text(frozenset({8, 9}), host)
    path.write_text(other + "\n")  # its owner changes it
    assert kind.verify(key, saved) is Holds.OWNER
    path.write_text(written + "\n")
    w = kind.restore(key, saved)
    assert w.status == "ok" and path.read_text() == host  # the text read before, byte for byte
    assert kind.verify(key, saved) is Holds.ORIGINAL
    path.unlink()  # the IRQ freed, the workqueue gone, a kernel without the watchdog
    assert kind.read(key) is None and kind.verify(key, saved) is Holds.GONE
    assert kind.apply(key, text).status == "gone" and not path.exists()


@needs_chattr
def test_a_mask_the_kernel_refuses_is_unchangeable_with_its_kinds_reason(tmp_path):
    """chattr +i makes root's write fail with EPERM, as the kernel refuses a managed IRQ."""
    path, cfg = _file_kind(tmp_path, "proc/irq/30/smp_affinity", "00000fff")
    kinds = mask_kinds(cfg)
    with immutable(path):
        w = kinds["irq"].apply(MaskKey("irq:30"), "000000ff")
    assert w.status == "unchangeable" and path.read_text() == "00000fff\n"
    assert (kinds["irq"].unchangeable.value, kinds["workqueue"].unchangeable.value) == ("irq_unchangeable",
                                                                                         "mask_unchangeable")


# ---------------------------------------------------------------- a thread's affinity


def test_a_threads_mask_is_read_applied_verified_and_restored_and_a_reused_id_is_never_touched():
    cpus = frozenset(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    one, other = sorted(cpus)[:2]
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        kind = TaskMask(Config())
        key = MaskKey.of("task", child.pid, stat_of(child.pid)[1])
        host = kind.read(key)
        assert host == format_cpulist(cpus)
        saved = kind.record(host).with_ours(str(one))
        w = kind.apply(key, str(one))
        assert (w.status, w.now) == ("ok", str(one)) and os.sched_getaffinity(child.pid) == {one}
        assert kind.verify(key, saved) is Holds.OURS
        os.sched_setaffinity(child.pid, {other})  # as its owner would
        assert kind.verify(key, saved) is Holds.OWNER
        os.sched_setaffinity(child.pid, {one})
        assert kind.restore(key, saved).status == "ok" and os.sched_getaffinity(child.pid) == cpus
        assert kind.verify(key, saved) is Holds.ORIGINAL
        # the same id with another start time is another task: gone, and never written
        stale = MaskKey.of("task", child.pid, key.start_time + 1)
        assert kind.read(stale) is None and kind.verify(stale, saved) is Holds.GONE
        assert kind.apply(stale, str(one)).status == "gone" and os.sched_getaffinity(child.pid) == cpus
    finally:
        child.stdin.close()
        child.wait(10)
    assert kind.read(key) is None and kind.apply(key, str(one)).status == "gone"


# ---------------------------------------------------------------- irqbalance's banned CPUs


def test_irqbalances_banned_cpus_are_read_applied_verified_and_restored(tmp_path):
    """irqbalance 1.9 takes ``settings cpus <list>`` at its next pass (one second here);
    its own set is CPU 0, from IRQBALANCE_BANNED_CPULIST, so the restore sends ``NULL``."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "sys").mkdir()
    ib = Irqbalance(tmp_path, interval=1, env={"IRQBALANCE_BANNED_CPULIST": "0"}).start()
    try:
        fixture_proc_link(tmp_path / "proc", ib.pid)
        ban = IrqbalanceBan(Config(proc_root=str(tmp_path / "proc"), sys_root=str(tmp_path / "sys"),
                                   command_timeout_seconds=30))
        key = ban.key(ib.pid)
        assert wait_for(lambda: ban.read(key) == "00000001", 30), ban.read(key)
        saved = SavedBan(ib.pid, stat_of(ib.pid)[1], ban.read(key)).with_ours("0,8-11")
        assert ban.alive(saved) and ban.verify(key, saved) is Holds.ORIGINAL
        assert ban.apply(key, "0,8-11").status == "ok"
        assert wait_for(lambda: parse_mask(ban.read(key)) == {0, 8, 9, 10, 11}, 30), ban.read(key)
        assert ban.verify(key, saved) is Holds.OURS
        w = ban.restore(key, saved)
        assert (w.status, w.now) == ("ok", "settings cpus NULL")
        assert wait_for(lambda: ban.read(key) == "00000001", 30), ban.read(key)
        assert ban.verify(key, saved) is Holds.ORIGINAL
        # another irqbalance process (a restart) forgot our set: gone, nothing to give back
        assert ban.verify(key, SavedBan(ib.pid, saved.start_time + 1, "00000001", ("0,8-11",))) is Holds.GONE
    finally:
        ib.stop()
