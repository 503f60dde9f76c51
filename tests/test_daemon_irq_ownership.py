"""IRQ masks in the daemon: drift re-asserted with a culprit, and restored on
drop only for NPUs no live worker owns. Runs on a fixture proc tree
(``proc_root``): plain ``irq/<n>/smp_affinity`` files, ``<pid>/stat`` for the
workers' identities and ``<pid>/comm`` for an irqbalance process; the daemon
code reads and writes them exactly as it does /proc."""

from __future__ import annotations

import dataclasses
import shutil

from ascendbind.daemon.watch.held import Held
from ascendbind.values.reasons import Outcome, Reason, Step
from ascendbind.values.frozen import frozen_map
from ascendbind.daemon.heart.step import inherit
from ascendbind.daemon.watch.reconcile import Reconciler
from ascendbind.values.model import Binding, StepResult
from tests.builders import START, irq_binding, proc_daemon, proc_tree



def test_moved_irq_mask_is_set_back_and_blamed_on_irqbalance_when_it_runs(tmp_path):
    proc = proc_tree(tmp_path, {120: "00000004", 121: "00000008"}, live_pids=[4242])
    d = proc_daemon(tmp_path, proc)
    h = Held(irq_binding(4242, 0, 120, 121), 0.0)
    d.held = {4242: h}  # the daemon acts only on what it holds
    rec = Reconciler(d, reassert_limit=2)
    assert rec._irqs(h) is False  # as we left them

    (proc / "irq/120/smp_affinity").write_text("0000ffff\n")
    assert rec._irqs(h) is True
    assert (proc / "irq/120/smp_affinity").read_text().strip() == "00000004"
    assert h.drift["irqs"].culprit == "external" and h.drift["threads"].culprit is None  # no irqbalance: no evidence

    (proc / "777").mkdir()
    (proc / "777" / "comm").write_text("irqbalance\n")
    (proc / "irq/121/smp_affinity").write_text("0000ffff\n")
    assert rec._irqs(h) is True and h.drift["irqs"].culprit == "irqbalance"
    assert (proc / "irq/121/smp_affinity").read_text().strip() == "00000008"

    # past the per-window limit the IRQs are left to irqbalance, the threads are not
    (proc / "irq/121/smp_affinity").write_text("0000ffff\n")
    rec._irqs(h)
    irqs, threads = h.drift["irqs"], h.drift["threads"]
    assert irqs.left_alone and not threads.left_alone and irqs.culprit == "irqbalance"
    assert "IRQ masks moved again after 2 re-asserts" in irqs.why
    assert "blamed irqbalance" in irqs.why and threads.why is None
    assert (proc / "irq/121/smp_affinity").read_text().strip() == "0000ffff"
    text = d.metrics.render().decode()
    assert 'ascendbind_drift_total{culprit="irqbalance"} 2.0' in text
    assert 'ascendbind_drift_total{culprit="external"} 1.0' in text


def test_dropping_a_gone_worker_restores_irqs_only_of_npus_nobody_live_owns(tmp_path):
    # pid 100 (gone) had NPUs 0 and 1 bound; pid 200 (live) shares NPU 1
    proc = proc_tree(tmp_path, {120: "00000004", 121: "00000008", 130: "00000010", 131: "00000020"},
                      live_pids=[200])
    d = proc_daemon(tmp_path, proc)
    gone = irq_binding(100, 0, 120, 121, saved=("000000ff", "000000ff"))
    irq_step = StepResult(Step.IRQ, Outcome.APPLIED, None, "bound", frozen_map({"npus": [
        {"npu": 0, "writes": [{"irq": 120, "cpus": [2], "status": "ok"}, {"irq": 121, "cpus": [3], "status": "ok"}]},
        {"npu": 1, "writes": [{"irq": 130, "cpus": [4], "status": "ok"}, {"irq": 131, "cpus": [5], "status": "ok"}]},
    ]}))
    gone = Binding(100, START, (0, 1), gone.plan, gone.original_cpus,
                   frozen_map({120: "000000ff", 121: "000000ff", 130: "000000ff", 131: "000000ff"}), (irq_step,),
                   irqs=(*gone.irqs, *irq_binding(100, 1, 130, 131, cpus=(4, 5), saved=("000000ff", "000000ff")).irqs))
    live = irq_binding(200, 1, 130, 131, cpus=(4, 5))
    d.held = {100: Held(gone, 0.0), 200: Held(live, 0.0)}

    Reconciler(d).pass_once()

    assert sorted(d.held) == [200]
    assert (proc / "irq/120/smp_affinity").read_text().strip() == "000000ff"  # NPU 0: restored
    assert (proc / "irq/121/smp_affinity").read_text().strip() == "000000ff"
    assert (proc / "irq/130/smp_affinity").read_text().strip() == "00000010"  # NPU 1: the live owner's
    assert (proc / "irq/131/smp_affinity").read_text().strip() == "00000020"
    assert 'ascendbind_workers_dropped_total{reason="exited"} 1.0' in d.metrics.render().decode()


def test_workers_sharing_an_npu_give_the_host_its_irq_masks_back_whichever_leaves_last(tmp_path):
    # allow_shared_npu: pid 300 binds NPU 2 first and saves the host's masks; pid 400 binds
    # the same NPU later and reads 300's masks, or finds them already right and saves none
    for first_gone, read_by_second in ((300, ("00000004", "00000008")), (400, ("00000004", "00000008")),
                                       (300, None), (400, None)):
        case = tmp_path / f"{first_gone}-{bool(read_by_second)}"
        proc = proc_tree(case, {140: "00000004", 141: "00000008"}, live_pids=[300, 400])
        d = proc_daemon(case, proc)
        first = irq_binding(300, 2, 140, 141, saved=("000000ff", "0000ff00"))
        second = irq_binding(400, 2, 140, 141, saved=read_by_second or (None, None))
        if read_by_second is None:
            second = Binding(400, START, second.npus, second.plan, second.original_cpus, frozen_map({}),
                             second.steps, irqs=second.irqs)
        second = inherit(second, [], [first])
        assert dict(second.saved_irq_masks) == {140: "000000ff", 141: "0000ff00"}
        d.held = {300: Held(first, 0.0), 400: Held(second, 0.0)}

        last = 400 if first_gone == 300 else 300
        shutil.rmtree(proc / str(first_gone))
        Reconciler(d).pass_once()
        assert sorted(d.held) == [last]
        assert (proc / "irq/140/smp_affinity").read_text().strip() == "00000004"  # the live sharer's
        shutil.rmtree(proc / str(last))
        Reconciler(d).pass_once()
        assert d.held == {}
        assert (proc / "irq/140/smp_affinity").read_text().strip() == "000000ff"  # the host's, again
        assert (proc / "irq/141/smp_affinity").read_text().strip() == "0000ff00"


def test_an_unproven_sharer_owns_no_irq_mask_so_a_gone_proven_holder_gives_them_back(tmp_path):
    # pid 500 (proven, gone) moved NPU 3's IRQs and saved the host's masks; pid 600 (live) shares
    # NPU 3 unproven: its IRQ step was skipped, it saved and wrote nothing, and keeps nothing back
    proc = proc_tree(tmp_path, {150: "00000004", 151: "00000008"}, live_pids=[600])
    d = proc_daemon(tmp_path, proc)
    proven = irq_binding(500, 3, 150, 151, saved=("000000ff", "0000ff00"))
    skipped = StepResult(Step.IRQ, Outcome.SKIPPED, Reason.UNPROVEN, "nothing proves it")
    unproven = dataclasses.replace(irq_binding(600, 3, 150, 151), saved_irq_masks=frozen_map({}), irqs=(),
                                   steps=(skipped,))
    d.held = {500: Held(proven, 0.0), 600: Held(unproven, 0.0)}

    Reconciler(d).pass_once()

    assert sorted(d.held) == [600]
    assert (proc / "irq/150/smp_affinity").read_text().strip() == "000000ff"
    assert (proc / "irq/151/smp_affinity").read_text().strip() == "0000ff00"
