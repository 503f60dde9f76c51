"""irqbalance cooperation against the real irqbalance (Debian's package), run by
each test in the foreground (tests/irqbalance_harness.py: a policy script keeps
it off this host's IRQs, every IRQ mask is restored after it stops).

The IRQ numbers banned here need not exist: irqbalance keeps any number on its
ban list, and a fixture /proc + /sys tree (as in test_applier_irq) carries the
NPU's IRQ files, so the ban list is what is checked, read back with the test's
own socket code (``RawClient``), which also plays "someone else" banning IRQs.
"""

from __future__ import annotations

import dataclasses

import pytest

from ascendbind.applier import apply_plan, release_binding
from ascendbind.applier.irq import bind_irqs
from ascendbind.applier.irqbalance import IrqbalanceLink, ban_irqs, hand_back
from ascendbind.values.config import Config
from ascendbind.discovery.gather.process import read_identity
from ascendbind.daemon.watch.held import Held
from ascendbind.values.reasons import Outcome, Reason, Step
from ascendbind.daemon.heart.daemon import Daemon
from ascendbind.values.model import Binding, IrqbalanceBans
from tests.irqbalance_harness import ABSTRACT_NAME, Irqbalance, RawClient, fixture_proc_link, listening_names
from tests.test_applier_irq import host, immutable, make_tree, mask, needs_chattr, plan
from tests.builders import irq_binding, proc_config, proc_tree
from tests.workers import small_pool_plan, start_worker
from tests.test_applier_bind import CPUS, plan_for, worker_facts


@pytest.fixture
def irqbalance(tmp_path):
    made: list[Irqbalance] = []

    def start(**kw) -> Irqbalance:
        ib = Irqbalance(tmp_path / f"irqbalance{len(made)}", **kw)
        ib.tmp_path.mkdir()
        made.append(ib)
        return ib.start()

    yield start
    for ib in made:
        ib.stop()


def test_setup_of_the_real_irqbalance_lists_its_command_line_bans(irqbalance):
    ib = irqbalance(banirq=[7777])
    link = IrqbalanceLink(ib.pid, 30)
    setup = link.setup()
    assert setup.banned_irqs == {7777} and setup.sleep_seconds >= 1
    assert link.where == f"/run/irqbalance/irqbalance{ib.pid}.sock"  # its own /run, seen through /proc/<pid>/root


def test_ban_keeps_every_ban_it_finds_and_hand_back_lifts_only_ours(irqbalance):
    ib = irqbalance(banirq=[7777])
    raw = RawClient(ib.pid)
    raw.ban({7777, 9100})  # someone else, before us
    res = ban_irqs(ib.pid, {9001, 9002, 9100}, proc_root="/proc", timeout=30)
    assert res.status == "banned", res.sentence
    assert res.bans == IrqbalanceBans(ib.pid, read_identity(ib.pid).start_time, frozenset({9001, 9002}))
    assert raw.banned() == {7777, 9100, 9001, 9002}
    raw.ban(raw.banned() | {9200})  # someone else, after us

    status, sentence = hand_back(res.bans, proc_root="/proc", timeout=30)
    assert status == "handed back", sentence
    assert raw.banned() == {7777, 9100, 9200}


def test_bans_of_an_irqbalance_that_exited_are_never_lifted_from_its_successor(irqbalance):
    first = irqbalance()
    res = ban_irqs(first.pid, {9001}, proc_root="/proc", timeout=30)
    assert res.status == "banned", res.sentence
    first.stop()
    second = irqbalance(banirq=[9001])  # an operator bans the same IRQ on the new one
    status, sentence = hand_back(res.bans, proc_root="/proc", timeout=30)
    assert status == "gone" and f"pid {first.pid}" in sentence
    assert RawClient(second.pid).banned() == {9001}


def test_a_list_too_long_for_irqbalance_is_not_sent(irqbalance):
    ib = irqbalance(banirq=[7777])
    res = ban_irqs(ib.pid, set(range(10000, 10200)), proc_root="/proc", timeout=30)
    assert res.status == "unreachable" and "500" in res.sentence and res.bans is None
    assert RawClient(ib.pid).banned() == {7777}


def test_the_plain_foreground_irqbalance_on_its_fallback_socket(irqbalance):
    ib = irqbalance(own_run=False, banirq=[7777])
    link = IrqbalanceLink(ib.pid, 30)
    assert link.setup().banned_irqs == {7777}
    names = listening_names(ib.pid)
    assert link.where == ("its abstract socket" if names == [ABSTRACT_NAME] else names[0])
    res = ban_irqs(ib.pid, {9001}, proc_root="/proc", timeout=30)
    assert res.status == "banned" and RawClient(ib.pid).banned() == {7777, 9001}
    assert hand_back(res.bans, proc_root="/proc", timeout=30)[0] == "handed back"
    assert RawClient(ib.pid).banned() == {7777}


# ---------------------------------------------------------------- through the IRQ step


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "npu")


def _with_irqbalance(tree, ib) -> Config:
    fixture_proc_link(tree[0], ib.pid)
    return Config(proc_root=str(tree[0]), sys_root=str(tree[1]))


def test_the_irq_step_bans_exactly_the_pinned_irqs_and_release_lifts_them(tree, irqbalance):
    ib = irqbalance()
    raw = RawClient(ib.pid)
    raw.ban({421})  # the CQ was banned by someone else already
    config = _with_irqbalance(tree, ib)
    res = bind_irqs(plan(), host(), config)
    assert res.outcome is Outcome.APPLIED and res.reason is None, res.detail
    assert res.data["irqbalance"] == "banned"
    assert list(res.data["irqbalance_bans"]["irqs"]) == [423]
    assert raw.banned() == {421, 423}
    assert mask(tree, 423) == "00000004" and mask(tree, 421) == "00000008"

    bans = IrqbalanceBans.from_json(res.data["irqbalance_bans"])
    gone = Binding(999999, 1, (0,), plan(), frozenset({0}), res.data["previous"], (res,), bans)
    irq = {s.step: s for s in release_binding(gone, config)}[Step.IRQ]
    assert irq.outcome is Outcome.APPLIED, irq.detail
    assert irq.data["irqbalance_bans"]["status"] == "handed back"
    assert raw.banned() == {421}
    assert mask(tree, 423) == "f" and mask(tree, 421) == "f"


@needs_chattr
def test_an_irq_whose_write_fails_does_not_stay_banned(tree, irqbalance):
    ib = irqbalance()
    config = _with_irqbalance(tree, ib)
    with immutable(tree[0] / "irq" / "423" / "smp_affinity"):
        res = bind_irqs(plan(), host(), config)
    assert res.reason is Reason.IRQ_UNCHANGEABLE, res.detail
    assert list(res.data["irqbalance_bans"]["irqs"]) == [421]
    assert RawClient(ib.pid).banned() == {421}


def test_apply_and_release_of_a_real_worker_ban_and_lift(tree, irqbalance):
    ib = irqbalance(banirq=[7777])
    config = dataclasses.replace(_with_irqbalance(tree, ib), small_pool="share")
    with start_worker() as w:
        fixture_proc_link(tree[0], w.pid)
        binding = apply_plan(plan_for(small_pool_plan(CPUS)), worker_facts(w.pid, w.start_time),
                             host(), config)
        assert binding.irqbalance_bans is not None and binding.irqbalance_bans.irqs == {421, 423}
        assert RawClient(ib.pid).banned() == {7777, 421, 423}
        steps = {s.step: s for s in release_binding(binding, config)}
    assert steps[Step.AFFINITY].outcome is Outcome.APPLIED
    assert steps[Step.IRQ].outcome is Outcome.APPLIED, steps[Step.IRQ].detail
    assert RawClient(ib.pid).banned() == {7777}


def test_irqbalance_that_exits_before_release_fails_nothing(tree, irqbalance):
    ib = irqbalance()
    config = _with_irqbalance(tree, ib)
    res = bind_irqs(plan(), host(), config)
    ib.stop()
    bans = IrqbalanceBans.from_json(res.data["irqbalance_bans"])
    gone = Binding(999999, 1, (0,), plan(), frozenset({0}), res.data["previous"], (res,), bans)
    irq = {s.step: s for s in release_binding(gone, config)}[Step.IRQ]
    assert irq.outcome is Outcome.APPLIED and irq.data["irqbalance_bans"]["status"] == "gone", irq.detail


# ---------------------------------------------------------------- the daemon: restart, owner gone


def test_a_restarted_daemon_lifts_a_gone_workers_bans_once_no_live_worker_pins_them(tmp_path, irqbalance):
    ib = irqbalance()
    raw = RawClient(ib.pid)
    raw.ban({7777})
    irqs = {120: "00000004", 121: "00000008", 130: "00000010", 131: "00000020"}
    proc = proc_tree(tmp_path, irqs, live_pids=[100, 200])
    fixture_proc_link(proc, ib.pid)
    config = proc_config(tmp_path, proc)
    bans = ban_irqs(ib.pid, set(irqs), proc_root=str(proc), timeout=30).bans
    assert bans is not None and raw.banned() == {7777, *irqs}

    # worker 100 pinned NPUs 0 and 1 and banned all four IRQs; live worker 200 shares NPU 1
    first = Daemon(config)
    first.state.prepare()
    both = dataclasses.replace(irq_binding(100, 0, 120, 121), irqbalance_bans=bans)
    npu1 = irq_binding(100, 1, 130, 131)
    both = dataclasses.replace(both, npus=(0, 1), steps=(dataclasses.replace(
        both.steps[0], data={"npus": [*both.steps[0].data["npus"], *npu1.steps[0].data["npus"]]}),),
        irqs=(*both.irqs, *npu1.irqs))
    first.held = {100: Held(both, 0.0), 200: Held(irq_binding(200, 1, 130, 131, cpus=(4, 5)), 0.0)}
    first.commit()

    (proc / "100" / "stat").unlink()  # worker 100 exits while no daemon runs
    second = Daemon(config)
    second.state.prepare()
    assert second.restore()["gone"] == 1
    assert raw.banned() == {7777, 130, 131}  # NPU 0's IRQs lifted; NPU 1's still pinned by 200
    assert second.held[200].binding.irqbalance_bans.irqs == {130, 131}

    third = Daemon(config)  # the ban passed to 200 is in the state file too
    third.state.prepare()
    third.restore()
    assert third.held[200].binding.irqbalance_bans.irqs == {130, 131}
    (proc / "200" / "stat").unlink()
    third.drop(200, "exited")
    assert raw.banned() == {7777}
