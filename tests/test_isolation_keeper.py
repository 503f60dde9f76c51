"""The isolation keeper in-process: on a fixture /proc + /sys tree of regular files (the
IRQs, the default mask and the NPU driver's workqueue of a 12-CPU host that this
machine does not have), against a real irqbalance (its banned CPUs over its socket),
and the one-task mask primitive on a real process.

The host: two NPUs on one node, NPU 1 (physical id 4) near CPUs 6-11. Bound on NPU 1
its plan is irq 6-7, main 8-9, acl 10, release 11: the protected CPUs are 8-11.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from ascendbind.applier.taskmask import set_task_cpus, task_cpus
from ascendbind.values.config import Config
from ascendbind.values.cpulist import parse_mask
from ascendbind.daemon.isolate.keeper import Isolation
from ascendbind.daemon.isolate.rules.records import IsolationRecord
from ascendbind.values.decisions import IrqBinding
from ascendbind.discovery.gather.hostwork import kernel_threads
from ascendbind.values.model import Binding, DeviceType
from ascendbind.planner import make_plan
from ascendbind.planner.isolate.isolation import plan_isolation
from ascendbind.planner.isolate.driverwork import sq_task_device
from tests.irqbalance_harness import Irqbalance, RawClient, fixture_proc_link
from tests.test_applier_irq import immutable, needs_chattr
from tests.daemon_harness import wait_for
from tests.planner_hosts import host, worker

IRQS = {30: "virtio3-rx", 31: "trs-mbox-4-0", 32: "trs-mbox-5-0", 40: "sq_send_trigger_irq", 41: "nvme0q1"}
ALL12 = "00000fff"


def two_npu_host():
    h = host(12, 1, device_type=DeviceType.A2, chips=[(0, 0, 0), (1, 0, 1)],
             affinity={0: frozenset(range(6)), 1: frozenset(range(6, 12))})
    return dataclasses.replace(h, chips=tuple(dataclasses.replace(c, phy_id=p) for c, p in zip(h.chips, (5, 4))))


@pytest.fixture
def tree(tmp_path):
    proc, sys_ = tmp_path / "proc", tmp_path / "sys"
    for irq in IRQS:
        (proc / "irq" / str(irq)).mkdir(parents=True)
        (proc / "irq" / str(irq) / "smp_affinity").write_text(ALL12 + "\n")
    (proc / "irq" / "default_smp_affinity").write_text(ALL12 + "\n")
    header = "           " + "".join(f"CPU{i:<7}" for i in range(12)) + "\n"
    (proc / "interrupts").write_text(header + "".join(
        f" {irq}:{'          0' * 12}   ITS-MSI {irq} Edge      {name}\n" for irq, name in IRQS.items()))
    wq = sys_ / "devices" / "virtual" / "workqueue"
    for name in ("dev4_sq_send_wq", "dev5_sq_send_wq"):
        (wq / name).mkdir(parents=True)
        (wq / name / "cpumask").write_text(ALL12 + "\n")
    return proc, sys_


def config(tree, **kw) -> Config:
    return Config(isolation="irqs", numa_extension="none", irqbalance="warn", proc_root=str(tree[0]),
                  sys_root=str(tree[1]), **kw)


def binding(cfg: Config, *, pinned=(40,)) -> Binding:
    plan = make_plan(two_npu_host(), worker(range(12)), [1], cfg)
    assert (plan.npus[0].irq, plan.npus[0].main, plan.npus[0].acl) == ((6, 7), (8, 9), (10,))
    return Binding(pid=4242, start_time=1, npus=(1,), plan=plan, original_cpus=frozenset(range(12)),
                   saved_irq_masks={}, steps=(),
                   irqs=tuple(IrqBinding(1, irq, frozenset({6}), ALL12, "ok") for irq in pinned))


def masks(tree) -> dict[str, str]:
    proc, sys_ = tree
    out = {f"irq:{irq}": (proc / "irq" / str(irq) / "smp_affinity").read_text().strip() for irq in IRQS}
    out["default"] = (proc / "irq" / "default_smp_affinity").read_text().strip()
    for name in ("dev4_sq_send_wq", "dev5_sq_send_wq"):
        out[name] = (sys_ / "devices" / "virtual" / "workqueue" / name / "cpumask").read_text().strip()
    return out


class Disk:
    """``persist``: what the state file would hold, with the masks as they were when it was written."""

    def __init__(self, iso: Isolation, tree) -> None:
        self.iso, self.tree, self.writes = iso, tree, []

    def __call__(self) -> None:
        self.writes.append((IsolationRecord.from_json(self.iso.state_json()), masks(self.tree)))


def test_irqs_narrows_every_other_irq_sends_driver_work_home_and_puts_all_back(tree):
    cfg = config(tree)
    iso = Isolation()
    disk = Disk(iso, tree)
    before = masks(tree)
    iso.commit(two_npu_host(), [binding(cfg)], cfg, disk)
    after = masks(tree)
    assert after == {
        "irq:30": "000000ff",    # less the protected CPUs 8-11
        "irq:31": "000000c0",    # NPU 1's mailbox (device 4): its IRQ CPUs 6-7
        "irq:32": "000000ff",    # NPU 0's (device 5, not bound): like any other IRQ
        "irq:40": ALL12,         # the SQ the IRQ step pinned: the bind's, untouched
        "irq:41": "000000ff",
        "default": "000000ff",
        "dev4_sq_send_wq": "000000c0",  # NPU 1's workqueue: its IRQ CPUs
        "dev5_sq_send_wq": ALL12,       # NPU 0 is not bound
    }
    # recorded before written: the one write of the state file saw every change and no changed mask
    (record, seen), = disk.writes
    assert seen == before
    assert {k: v.original for k, v in record.masks.items()} == {
        "irq:30": ALL12, "irq:31": ALL12, "irq:32": ALL12, "irq:41": ALL12, "default": ALL12,
        "workqueue:dev4_sq_send_wq": ALL12}
    assert record.masks["irq:31"].ours == ("000000c0",)
    # a follow that changes nothing writes nothing
    iso.commit(two_npu_host(), [binding(cfg)], cfg, disk)
    assert len(disk.writes) == 1 and masks(tree) == after
    # nothing bound: every mask back, byte for byte, and the record empty
    iso.commit(two_npu_host(), [], cfg, disk)
    assert masks(tree) == before and iso.state_json() == {}


def test_a_second_worker_narrows_further_and_its_release_gives_back_only_its_cpus(tree):
    cfg = config(tree)
    iso = Isolation()
    first = binding(cfg)
    plan0 = make_plan(two_npu_host(), worker(range(12)), [0], cfg)
    second = dataclasses.replace(first, pid=4343, npus=(0,), plan=plan0, irqs=())
    iso.commit(two_npu_host(), [first], cfg, lambda: None)
    iso.commit(two_npu_host(), [first, second], cfg, lambda: None)
    assert masks(tree)["irq:30"] == "000000c3"  # 0-1 and 6-7: the two pools' IRQ CPUs
    iso.commit(two_npu_host(), [first], cfg, lambda: None)
    assert masks(tree)["irq:30"] == "000000ff"  # from the host's own mask, not from ours
    assert iso.record.masks["irq:30"].original == ALL12


def test_the_whole_host_plan_is_made_once_per_host_and_config_and_plans_the_same(tree):
    # every save follows the held table, and planning every NPU of a 640-CPU host costs ~2 ms:
    # the host's own plan is kept until a rediscovery (new facts) or a reload (new config)
    cfg = config(tree)
    iso = Isolation()
    h = two_npu_host()
    first = binding(cfg)
    second = dataclasses.replace(first, pid=4343, npus=(0,), plan=make_plan(h, worker(range(12)), [0], cfg), irqs=())
    iso.commit(h, [first], cfg, lambda: None)
    whole = iso._whole[2]
    assert iso.plan == plan_isolation(h, [first.plan], cfg)  # the same plan as made from scratch
    iso.commit(h, [first, second], cfg, lambda: None)
    assert iso._whole[2] is whole and iso.plan == plan_isolation(h, [first.plan, second.plan], cfg)
    rediscovered = dataclasses.replace(h)
    iso.commit(rediscovered, [first], cfg, lambda: None)
    assert iso._whole[2] is not whole and iso._whole[0] is rediscovered
    whole = iso._whole[2]
    reloaded = dataclasses.replace(cfg, housekeeping_cpus="0-1")
    iso.commit(rediscovered, [first], reloaded, lambda: None)
    assert iso._whole[2] is not whole and iso.plan == plan_isolation(rediscovered, [first.plan], reloaded)
    iso.commit(rediscovered, [], cfg, lambda: None)


def test_a_commit_that_changes_nothing_reads_nothing_until_a_full_follow_is_due(tree):
    """Every save commits; one whose bindings, level and plan are as before skips the host.
    The task watcher's periodic ``sweep_due`` makes the next commit look at everything."""
    cfg = config(tree)
    iso = Isolation()
    iso.commit(two_npu_host(), [binding(cfg)], cfg, lambda: None)
    new = tree[0] / "irq" / "42" / "smp_affinity"
    new.parent.mkdir()
    new.write_text(ALL12 + "\n")  # an IRQ requested since
    iso.commit(two_npu_host(), [binding(cfg)], cfg, lambda: None)
    assert new.read_text().strip() == ALL12
    iso.sweep_due()
    iso.commit(two_npu_host(), [binding(cfg)], cfg, lambda: None)
    assert new.read_text().strip() == "000000ff" and iso.record.masks["irq:42"].original == ALL12
    iso.commit(two_npu_host(), [], cfg, lambda: None)
    assert new.read_text() == ALL12 and iso.record.empty


def test_a_mask_changed_by_its_owner_is_left_and_listed(tree):
    cfg = config(tree)
    iso = Isolation()
    iso.commit(two_npu_host(), [binding(cfg)], cfg, lambda: None)
    (tree[0] / "irq" / "41" / "smp_affinity").write_text("00000300\n")  # an operator moves it
    iso.commit(two_npu_host(), [], cfg, lambda: None)
    assert masks(tree)["irq:41"] == "00000300" and masks(tree)["irq:30"] == ALL12
    left = iso.to_json(cfg)["left_to_owner"]
    assert [e["what"] for e in left] == ["irq:41"] and left[0]["reason"] == "changed_by_owner"
    assert "00000300" in left[0]["detail"] and "irq:41" not in iso.record.masks


def test_an_irq_the_bind_pins_later_keeps_its_host_mask_for_both_to_give_back(tree):
    """Narrowed while unbound, then pinned by an NPU's IRQ step (which saves our mask as
    its previous): isolation keeps its record until the bind has let go, so the host's
    own mask comes back in the end."""
    cfg = config(tree)
    iso = Isolation()
    iso.commit(two_npu_host(), [binding(cfg, pinned=())], cfg, lambda: None)
    assert masks(tree)["irq:40"] == "000000ff"
    (tree[0] / "irq" / "40" / "smp_affinity").write_text("00000040\n")  # the IRQ step pins it to CPU 6
    iso.commit(two_npu_host(), [binding(cfg)], cfg, lambda: None)
    assert iso.record.masks["irq:40"].original == ALL12
    (tree[0] / "irq" / "40" / "smp_affinity").write_text("000000ff\n")  # its release writes back what it saved
    iso.commit(two_npu_host(), [], cfg, lambda: None)
    assert masks(tree)["irq:40"] == ALL12


def test_off_and_a_restart_without_facts_put_back_what_an_earlier_daemon_changed(tree):
    cfg = config(tree)
    first = Isolation()
    disk = Disk(first, tree)
    first.commit(two_npu_host(), [binding(cfg)], cfg, disk)
    saved = first.state_json()
    # a new daemon loads the record; with nobody bound it needs no host facts to put it all back
    second = Isolation()
    second.load(saved)
    second.commit(None, [], cfg, lambda: None)
    assert masks(tree)["irq:30"] == ALL12 and second.state_json() == {}
    # with a worker bound and no facts yet it changes nothing until the host is known
    third = Isolation()
    third.commit(None, [binding(cfg)], cfg, lambda: None)
    assert masks(tree)["irq:30"] == ALL12 and third.to_json(cfg)["waiting"]
    # SIGHUP to off: everything back
    third.commit(two_npu_host(), [binding(cfg)], cfg, lambda: None)
    assert masks(tree)["irq:30"] == "000000ff"
    third.commit(two_npu_host(), [binding(cfg)], cfg.replace(isolation="off"), lambda: None)
    assert set(masks(tree).values()) == {ALL12} and third.state_json() == {}


def test_an_unwritable_state_file_stops_isolation_before_any_mask(tree):
    cfg = config(tree)
    iso = Isolation()
    before = masks(tree)

    def refuse() -> None:
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        iso.commit(two_npu_host(), [binding(cfg)], cfg, refuse)
    assert masks(tree) == before


@needs_chattr
def test_a_value_the_kernel_refuses_is_skipped_with_its_reason_and_not_tried_again(tree):
    """chattr +i makes root's write fail with EPERM, as the kernel refuses a managed IRQ."""
    cfg = config(tree)
    iso = Isolation()
    with immutable(tree[0] / "irq" / "41" / "smp_affinity"):
        iso.commit(two_npu_host(), [binding(cfg)], cfg, lambda: None)
    assert masks(tree)["irq:41"] == ALL12 and "irq:41" not in iso.record.masks
    assert [(s["what"], s["reason"]) for s in iso.to_json(cfg)["skipped"]] == [("irq:41", "irq_unchangeable")]
    # released and bound again: still listed, never written
    iso.commit(two_npu_host(), [], cfg, lambda: None)
    iso.commit(two_npu_host(), [binding(cfg), dataclasses.replace(binding(cfg), pid=5)], cfg, lambda: None)
    assert masks(tree)["irq:41"] == ALL12 and "irq:41" in {s["what"] for s in iso.to_json(cfg)["skipped"]}


@needs_chattr
def test_a_read_only_proc_irq_changes_nothing_and_says_so(tree):
    cfg = config(tree)
    iso = Isolation()
    before = masks(tree)
    with immutable(tree[0] / "irq"):
        iso.commit(two_npu_host(), [binding(cfg)], cfg, lambda: None)
    assert masks(tree) == before
    assert [s["reason"] for s in iso.to_json(cfg)["skipped"]] == ["irq_not_writable"]


def test_driver_threads_are_found_by_name_and_kernel_flag(tmp_path):
    proc = tmp_path / "proc"
    for pid, comm, flags in ((900, "dev4_sq_task", 0x00200040), (901, "dev4_sq_task", 0x400100),
                             (902, "kworker/0:1", 0x04208060)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) S 2 0 0 0 -1 {flags} 0 0 0 0 0 0 0 0 20 0 1 0 "
                                              f"{pid * 10} 0 0\n")
    found = kernel_threads(lambda c: sq_task_device(c) is not None, str(proc))
    assert [(t.pid, t.comm, t.start_time) for t in found] == [(900, "dev4_sq_task", 9000)]  # 901 is no kthread


def test_one_tasks_mask_is_set_and_read_back_on_a_real_process():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    cpu = min(os.sched_getaffinity(0))
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        w = set_task_cpus("task:x", child.pid, {cpu})
        assert (w.status, w.now) == ("ok", str(cpu)) and task_cpus(child.pid) == {cpu}
        refused = set_task_cpus("task:x", child.pid, {4095})  # no such CPU: EINVAL, never retried
        assert refused.status == "unchangeable" and task_cpus(child.pid) == {cpu}
    finally:
        child.stdin.close()
        child.wait(10)
    assert set_task_cpus("task:x", child.pid, {cpu}).status == "gone"


# ---------------------------------------------------------------- a real irqbalance


def _banned(client: RawClient) -> str:
    return client.send("setup").split("BANNED")[1].split()[0]


def test_irqbalance_is_told_the_protected_cpus_beside_its_own_and_given_back_its_set(tmp_path, tree):
    """irqbalance 1.9 takes ``settings cpus <list>`` for its banned CPUs and applies it at its
    next pass (one second here, ``--interval=1``); ``settings cpus NULL`` returns to the set
    it chose at start, here CPU 0 from IRQBALANCE_BANNED_CPULIST, the operator's own."""
    ib = Irqbalance(tmp_path, interval=1, env={"IRQBALANCE_BANNED_CPULIST": "0"}).start()
    try:
        fixture_proc_link(tree[0], ib.pid)
        client = RawClient(ib.pid)
        assert wait_for(lambda: _banned(client) == "00000001", 30), client.send("setup")
        cfg = config(tree, command_timeout_seconds=30).replace(irqbalance="ban")
        iso = Isolation()
        disk = Disk(iso, tree)
        iso.commit(two_npu_host(), [binding(cfg)], cfg, disk)
        assert iso.record.irqbalance is not None and iso.record.irqbalance.original == "00000001"
        # on disk before irqbalance was told
        told = [r.irqbalance for r, _ in disk.writes if r.irqbalance is not None]
        assert told and told[-1].ours == ("0,8-11",) and told[-1].pid == ib.pid
        assert "told" in iso.to_json(cfg)["irqbalance"]
        assert wait_for(lambda: parse_mask(_banned(client)) == {0, 8, 9, 10, 11}, 30), client.send("setup")
        iso.commit(two_npu_host(), [], cfg, disk)
        assert iso.record.irqbalance is None
        assert wait_for(lambda: _banned(client) == "00000001", 30), client.send("setup")
    finally:
        ib.stop()


def test_irqbalance_warn_only_reports_it(tmp_path, tree):
    ib = Irqbalance(tmp_path).start()
    try:
        fixture_proc_link(tree[0], ib.pid)
        cfg = config(tree)
        iso = Isolation()
        iso.commit(two_npu_host(), [binding(cfg)], cfg, lambda: None)
        assert iso.record.irqbalance is None and iso.to_json(cfg)["irqbalance"].startswith("irqbalance_active")
        assert _banned(RawClient(ib.pid)) == "00000000"
    finally:
        ib.stop()


def test_status_json_shape(tree):
    cfg = config(tree)
    iso = Isolation()
    iso.commit(two_npu_host(), [binding(cfg)], cfg, lambda: None)
    out = iso.to_json(cfg)
    assert out["protected"] == "8-11" and out["housekeeping"] == "0-1,6-7"
    assert out["changed"] == {"irq": 4, "default": 1, "workqueue": 1, "workqueues": 0, "watchdog": 0, "task": 0}
    assert out["tasks"] is None and out["skipped_total"] == 0  # the host level's report: only at host
    assert {g["class"] for g in out["cpus"]} == {"housekeeping", "protected", "other"}
    assert out["last_change"]["written"] == 6 and out["skipped"] == [] and out["daemon_threads"] is None


def test_host_takes_the_protected_cpus_out_of_the_watchdog_mask_and_puts_the_text_back(tree):
    # the soft-lockup detector's CPUs, a cpu list in the fixture tree (the real file is host-wide:
    # tests/numa/test_isolation_host_guest.py changes it in the guest only)
    watchdog = tree[0] / "sys" / "kernel" / "watchdog_cpumask"
    watchdog.parent.mkdir(parents=True)
    watchdog.write_text("0-11\n")
    cfg = config(tree).replace(isolation="host")
    iso = Isolation()
    on_disk = []
    iso.commit(two_npu_host(), [binding(cfg)], cfg, lambda: on_disk.append(iso.state_json()))
    assert watchdog.read_text().strip() == "0-7"  # the protected 8-11 are gone
    assert on_disk and on_disk[0]["masks"]["watchdog"] == {"original": "0-11", "ours": ["0-7"]}
    assert iso.to_json(cfg)["changed"]["watchdog"] == 1
    iso.commit(two_npu_host(), [], cfg, lambda: None)
    assert watchdog.read_text() == "0-11" and iso.record.empty  # the text read before, byte for byte
    # at irqs it is left as it is
    iso.commit(two_npu_host(), [binding(cfg.replace(isolation="irqs"))], cfg.replace(isolation="irqs"), lambda: None)
    assert watchdog.read_text() == "0-11" and "watchdog" not in iso.record.masks
    iso.commit(two_npu_host(), [], cfg, lambda: None)
    # an operator who changes it while it is narrowed keeps the change: nothing is written back
    iso.commit(two_npu_host(), [binding(cfg)], cfg, lambda: None)
    watchdog.write_text("0-3\n")
    iso.commit(two_npu_host(), [], cfg, lambda: None)
    assert watchdog.read_text() == "0-3\n" and iso.record.empty


def test_host_narrows_the_unbound_workqueues_mask_records_it_first_and_puts_it_back(tree):
    # the shared mask of the kernel's unbound workqueues, in the fixture tree (the real one is
    # host-wide: tests/numa/test_isolation_host_guest.py changes it in the guest only)
    shared = tree[1] / "devices" / "virtual" / "workqueue" / "cpumask"
    shared.write_text(ALL12 + "\n")
    cfg = config(tree).replace(isolation="host")
    iso = Isolation()
    on_disk = []
    iso.commit(two_npu_host(), [binding(cfg)], cfg, lambda: on_disk.append(iso.state_json()))
    assert shared.read_text().strip() == "000000ff"  # 0-7: the protected 8-11 are gone
    assert on_disk and on_disk[0]["masks"]["workqueues"] == {"original": ALL12, "ours": ["000000ff"]}
    out = iso.to_json(cfg)
    assert out["changed"]["workqueues"] == 1 and out["tasks"]["never_moved"]["pid 1"] == 0
    iso.commit(two_npu_host(), [], cfg, lambda: None)
    assert shared.read_text() == ALL12 and iso.record.empty  # byte for byte
