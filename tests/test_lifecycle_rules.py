"""The worker lifecycle's rules as tables: (record, observation, now) -> actions.

Plain values in, frozen actions out: no daemon, no worker process, no clock.
Each row names the rule it pins down; the real-effect side (threads pinned,
masks written back, IRQs restored on a real host) is in the daemon tests.
"""

from __future__ import annotations

import pytest

from ascendbind.daemon.watch.blame import Evidence
from ascendbind.daemon.watch.lifecycle import (CpusetNews, Drop, LeaveAlone, Limits, Looks, NoteLocality,
                                               Observation, PinThreads, Reassert, Record, Replan,
                                               RerunMemory, decide, left_behind,
                                               MEMORY_HYSTERESIS, memory_rerun_due, rerun_was_futile, restoration,
                                               wanted)
from ascendbind.values.decisions import IrqBinding
from ascendbind.discovery.parse.numa_maps import parse_numa_maps
from ascendbind.values.frozen import frozen_map
from ascendbind.values.model import Binding, DeviceType, IrqbalanceBans, Mode, NpuPlan, Plan, StepResult
from ascendbind.values.reasons import Outcome, Step

NOW = 1000.0
LIMITS = Limits(reassert_limit=3, window=60.0, memory_local_threshold=0.8, memory_rerun_seconds=600.0)
R = Record(pid=42)
TORCH = Evidence(torch_npu="1")
OPENMP = Evidence(openmp=("OMP_PROC_BIND=true",))
VLLM_X86 = Evidence(vllm="default", vllm_pid=7, arm=False)
IRQS = ((120, frozenset({2})), (121, frozenset({3})))


def _culprit(actions) -> str:
    (a,) = [a for a in actions if isinstance(a, (Reassert, LeaveAlone))]
    return a.blame.culprit


# ---------------------------------------------------------------- one look -> actions

DECIDE_TABLE = [
    # (name, record, observation, expected actions)
    ("nothing seen: nothing to do", R, Observation(), ()),
    ("exited: dropped, nothing else", R,
     Observation(gone="exited", to_pin=((7, "acl"),), drifted=(8,), moved_irqs=IRQS), (Drop("exited"),)),
    ("recycled: dropped as recycled", R, Observation(gone="recycled"), (Drop("recycled"),)),
    ("a gone worker left alone is dropped all the same",
     Record(42, left_alone=frozenset({"threads", "irqs"})), Observation(gone="exited"), (Drop("exited"),)),
    ("late or renamed threads are pinned", R, Observation(to_pin=((7, "acl"), (9, "release"))),
     (PinThreads(((7, "acl"), (9, "release"))),)),
    ("threads left alone: a late thread is not pinned either", Record(42, left_alone=frozenset({"threads"})),
     Observation(to_pin=((7, "acl"),), drifted=(8,)), ()),
    ("first drift: re-asserted, the window starts", R, Observation(drifted=(8, 9)),
     (Reassert("threads", decide(R, Observation(drifted=(8,)), NOW, LIMITS)[0].blame, (NOW,), tids=(8, 9)),)),
    ("second drift inside the window: re-asserted, both counted", Record(42, reasserts={"threads": (NOW - 30,)}),
     Observation(drifted=(8,)), "reassert:2"),
    ("third drift inside the window: the last re-assert", Record(42, reasserts={"threads": (NOW - 50, NOW - 10)}),
     Observation(drifted=(8,)), "reassert:3"),
    ("fourth inside the window: left alone", Record(42, reasserts={"threads": (NOW - 50, NOW - 30, NOW - 10)}),
     Observation(drifted=(8,)), "alone:3"),
    ("re-asserts older than the window do not count", Record(42, reasserts={"threads": (NOW - 300, NOW - 200, NOW - 61)}),
     Observation(drifted=(8,)), "reassert:1"),
    ("exactly the window's age still counts", Record(42, reasserts={"threads": (NOW - 60, NOW - 59, NOW - 1)}),
     Observation(drifted=(8,)), "alone:3"),
    ("old and recent mixed: only the recent ones count", Record(42, reasserts={"threads": (NOW - 120, NOW - 20, NOW - 5)}),
     Observation(drifted=(8,)), "reassert:3"),
    ("pin and drift in one look: pinned first, then re-asserted", R,
     Observation(to_pin=((7, "acl"),), drifted=(8,)), "pin+reassert:1"),
    ("IRQ masks moved: re-asserted", R, Observation(moved_irqs=IRQS), "irq-reassert:1"),
    ("IRQ masks left alone: nothing, even when they move", Record(42, left_alone=frozenset({"irqs"})),
     Observation(moved_irqs=IRQS), ()),
    ("IRQ masks past the limit: left alone", Record(42, reasserts={"irqs": (NOW - 3, NOW - 2, NOW - 1)}),
     Observation(moved_irqs=IRQS), "irq-alone:3"),
    ("thread and IRQ budgets are separate", Record(42, reasserts={"threads": (NOW - 3, NOW - 2, NOW - 1)}),
     Observation(drifted=(8,), moved_irqs=IRQS), "alone:3+irq-reassert:1"),
    ("threads left alone, IRQs still watched", Record(42, left_alone=frozenset({"threads"})),
     Observation(drifted=(8,), moved_irqs=IRQS), "irq-reassert:1"),
]


@pytest.mark.parametrize("name,record,obs,expected", DECIDE_TABLE, ids=[row[0] for row in DECIDE_TABLE])
def test_one_look_calls_for_these_actions(name, record, obs, expected):
    actions = decide(record, obs, NOW, LIMITS)
    if isinstance(expected, tuple):
        assert actions == expected
        return
    kinds = []
    for a in actions:
        if isinstance(a, PinThreads):
            kinds.append("pin")
        elif isinstance(a, Reassert):
            kinds.append(f"{'irq-' if a.what == 'irqs' else ''}reassert:{len(a.times)}")
            assert a.times[-1] == NOW and all(NOW - t <= LIMITS.window for t in a.times)
            assert (a.irqs == obs.moved_irqs) if a.what == "irqs" else (a.tids == obs.drifted)
        elif isinstance(a, LeaveAlone):
            kinds.append(f"{'irq-' if a.what == 'irqs' else ''}alone:{len(a.times)}")
            assert f"after {len(a.times)} re-asserts within 60 s" in a.why
            assert f"blamed {a.blame.culprit}" in a.why and "Fix:" in a.why
    assert "+".join(kinds) == expected


BLAME_TABLE = [
    # (evidence, irqbalance running, thread culprit, IRQ culprit)
    (None, False, "external", "external"),
    (TORCH, False, "self", "external"),
    (OPENMP, True, "env", "irqbalance"),
    (VLLM_X86, True, "external", "irqbalance"),  # vllm-ascend's binder runs only on ARM
    (Evidence(vllm="default", vllm_pid=7, arm=True), False, "self", "external"),
]


@pytest.mark.parametrize("evidence,irqbalance,threads,irqs", BLAME_TABLE)
def test_the_culprit_comes_from_the_evidence_and_never_changes_the_verdict(evidence, irqbalance, threads, irqs):
    obs = Observation(drifted=(8,), evidence=evidence, moved_irqs=IRQS, irqbalance_running=irqbalance)
    fresh = decide(R, obs, NOW, LIMITS)
    assert [type(a) for a in fresh] == [Reassert, Reassert]
    assert (fresh[0].blame.culprit, fresh[1].blame.culprit) == (threads, irqs)
    spent = Record(42, reasserts={"threads": (NOW - 3, NOW - 2, NOW - 1), "irqs": (NOW - 3, NOW - 2, NOW - 1)})
    tired = decide(spent, obs, NOW, LIMITS)
    assert [type(a) for a in tired] == [LeaveAlone, LeaveAlone]  # whoever did it
    assert (_culprit(tired[:1]), _culprit(tired[1:])) == (threads, irqs)


@pytest.mark.parametrize("record,looks", [
    (R, Looks(threads=True, irqs=True)),
    (Record(42, left_alone=frozenset({"threads"})), Looks(threads=False, irqs=True)),
    (Record(42, left_alone=frozenset({"irqs"})), Looks(threads=True, irqs=False)),
    (Record(42, left_alone=frozenset({"threads", "irqs"})), Looks(threads=False, irqs=False)),
])
def test_a_look_reads_nothing_that_is_left_alone(record, looks):
    assert wanted(record) == looks


@pytest.mark.parametrize("record", [
    R, Record(42, left_alone=frozenset({"threads", "irqs"})), Record(42, reasserts={"threads": (1.0, 2.0, 3.0)}),
    Record(42, memory_ratio=0.1, memory_last_run=0.0), Record(42, memory_futile=5, reasserts={"irqs": (9.0,)}),
])
def test_a_look_that_saw_nothing_calls_for_nothing(record):
    # the reconcile shell skips asking when a look saw nothing; this is what lets it
    assert decide(record, Observation(), 1e9, Limits(memory_local_threshold=0.9)) == ()


def test_a_limit_of_one_leaves_alone_at_the_second_drift():
    one = Limits(reassert_limit=1, window=10.0)
    first = decide(R, Observation(drifted=(8,)), NOW, one)
    assert isinstance(first[0], Reassert) and first[0].times == (NOW,)
    second = decide(Record(42, reasserts={"threads": first[0].times}), Observation(drifted=(8,)), NOW + 5, one)
    assert isinstance(second[0], LeaveAlone) and "after 1 re-asserts within 10 s" in second[0].why
    later = decide(Record(42, reasserts={"threads": first[0].times}), Observation(drifted=(8,)), NOW + 11, one)
    assert isinstance(later[0], Reassert) and later[0].times == (NOW + 11,)


# ---------------------------------------------------------------- a cpuset changed

MOVED = CpusetNews(frozenset({1}), frozenset({0}), "cpuset_changed", moved=True)


@pytest.mark.parametrize("record", [R, Record(42, left_alone=frozenset({"threads"})),
                                    Record(42, reasserts={"threads": (NOW - 50, NOW - 30, NOW - 10)})],
                         ids=["bound", "left alone", "budget spent"])
def test_a_changed_cpuset_is_replanned_never_reasserted_nor_blamed_on_a_tool(record):
    # the kernel moved the threads into the new cpuset: the look's drift is its move, not a
    # tool's, and a worker left alone (for that very drift, say) is looked at again
    actions = decide(record, Observation(drifted=(8, 9), to_pin=((7, "acl"),), cpuset=MOVED), NOW, LIMITS)
    assert [type(a) for a in actions] == [Replan]
    assert actions[0].news == MOVED and actions[0].blame.culprit == "cpuset"
    assert "from CPUs 1 to 0" in actions[0].blame.why and "external" not in actions[0].blame.why


def test_a_changed_checkpoint_asks_for_a_replan_beside_the_looks_own_actions():
    # only kubelet's checkpoint changed: no thread was moved, so the look's drift is still drift
    news = CpusetNews(frozenset({0}), frozenset({0}), "checkpoint_changed")
    actions = decide(R, Observation(drifted=(8,), cpuset=news), NOW, LIMITS)
    assert [type(a) for a in actions] == [Replan, Reassert]
    assert actions[0].blame is None and actions[1].blame.culprit == "external"


def test_a_changed_cpuset_leaves_the_irq_and_memory_rules_as_they_are():
    actions = decide(R, Observation(cpuset=MOVED, moved_irqs=IRQS, memory_measured=True, memory_ratio=0.95),
                     NOW, LIMITS)
    assert [type(a) for a in actions] == [Replan, Reassert, NoteLocality]
    assert actions[1].what == "irqs" and actions[1].blame.culprit == "external"


# ---------------------------------------------------------------- memory locality

MEMORY_TABLE = [
    # (name, record, ratio, expected)
    ("nothing resident: recorded as unknown, no rerun", R, None, (NoteLocality(None, NOW, False),)),
    ("good locality resets the futile count", Record(42, memory_futile=3), 0.95, (NoteLocality(0.95, NOW, True),)),
    ("exactly the threshold is no rerun, but no reset either", R, 0.8, (NoteLocality(0.8, NOW, False),)),
    ("the threshold plus the hysteresis band resets", R, 0.85, (NoteLocality(0.85, NOW, True),)),
    ("low, last run long ago: rerun", Record(42, memory_last_run=NOW - 600), 0.5,
     (NoteLocality(0.5, NOW, False), RerunMemory(0.5))),
    ("low, but a move is queued or running: no rerun", Record(42, memory_last_run=NOW - 6000, memory_moving=True),
     0.5, (NoteLocality(0.5, NOW, False),)),
    ("low, last run too recent: no rerun yet", Record(42, memory_last_run=NOW - 599), 0.5,
     (NoteLocality(0.5, NOW, False),)),
    ("low after two futile reruns: waits 4 intervals", Record(42, memory_last_run=NOW - 2399, memory_futile=2),
     0.5, (NoteLocality(0.5, NOW, False),)),
    ("... and reruns once they have passed", Record(42, memory_last_run=NOW - 2400, memory_futile=2), 0.5,
     (NoteLocality(0.5, NOW, False), RerunMemory(0.5))),
    ("the back-off is capped at 16 intervals", Record(42, memory_last_run=NOW - 9600, memory_futile=40), 0.1,
     (NoteLocality(0.1, NOW, False), RerunMemory(0.1))),
]


@pytest.mark.parametrize("name,record,ratio,expected", MEMORY_TABLE, ids=[row[0] for row in MEMORY_TABLE])
def test_a_locality_check_is_recorded_and_reruns_the_memory_step_at_a_falling_rate(name, record, ratio, expected):
    assert decide(record, Observation(memory_measured=True, memory_ratio=ratio), NOW, LIMITS) == expected


def test_the_residency_a_check_read_is_recorded_with_its_ratio():
    res = parse_numa_maps("7f00 default anon=3 N0=1 N1=2 kernelpagesize_kB=4\n")
    note = decide(R, Observation(memory_measured=True, memory_ratio=1 / 3, memory_residency=res), NOW, LIMITS)[0]
    assert note.residency is res


def test_the_rerun_rate_and_futility_rules():
    assert not memory_rerun_due(None, 0.8, 0.0, NOW, 600.0)
    assert not memory_rerun_due(0.9, 0.8, 0.0, NOW, 600.0)
    assert memory_rerun_due(0.1, 0.8, NOW - 600, NOW, 600.0, futile=0)
    assert not memory_rerun_due(0.1, 0.8, NOW - 600, NOW, 600.0, futile=0, moving=True)
    assert not memory_rerun_due(0.1, 0.8, NOW - 1199, NOW, 600.0, futile=1)


FUTILE_TABLE = [
    # (name, ratio before, ratio after, futile)
    ("nothing measured after", 0.5, None, True),
    ("still below the threshold", 0.5, 0.79, True),
    ("raised past the threshold", 0.5, 0.95, False),
    ("past the threshold, but by less than the band: it moved almost nothing", 0.78, 0.81, True),
    ("no ratio before (first check after a bind): judged by the threshold", None, 0.81, False),
]


@pytest.mark.parametrize("name,before,after,futile", FUTILE_TABLE, ids=[row[0] for row in FUTILE_TABLE])
def test_a_rerun_is_futile_when_it_did_not_raise_the_ratio(name, before, after, futile):
    assert rerun_was_futile(before, after, LIMITS) is futile
    assert MEMORY_HYSTERESIS == 0.05


# ---------------------------------------------------------------- leaving: what goes back

def _binding(pid: int, irqs_by_npu: dict[int, tuple[int, ...]], *, mode: Mode = Mode.TOPO_AFFINITY,
             bans: frozenset[int] | None = None) -> Binding:
    npus = tuple(sorted(irqs_by_npu))
    pool = (2, 3, 4, 5, 6)
    plan = Plan(mode, DeviceType.A2, None, pool,
                tuple(NpuPlan(n, pool, (2,), (3,), (4,), (5,), (0,)) for n in npus))
    writes = tuple(IrqBinding(n, i, frozenset({2}), "000000ff", "ok", "00000004")
                   for n, irqs in irqs_by_npu.items() for i in irqs)
    step = StepResult(Step.IRQ, Outcome.APPLIED, None, "bound")
    saved = frozen_map({w.irq: w.previous for w in writes})
    return Binding(pid, 5000, npus, plan, frozenset(range(8)), saved, (step,),
                   irqbalance_bans=None if bans is None else IrqbalanceBans(77, 1, bans), irqs=writes)


RESTORE_TABLE = [
    # (name, leaving, others alive, is_950, masks restored, bans lifted, bans passed, restore uvb)
    ("the only worker restores everything", _binding(1, {0: (120, 121)}, bans=frozenset({120})), {}, False,
     {120, 121}, {120}, {}, False),
    ("an NPU another live worker owns keeps its IRQs where they are",
     _binding(1, {0: (120,), 1: (130,)}, bans=frozenset({120, 130})), {2: _binding(2, {1: (130,)})}, False,
     {120}, {120}, {2: {130}}, False),
    ("a live worker on other NPUs changes nothing", _binding(1, {0: (120,)}), {2: _binding(2, {3: (140,)})},
     False, {120}, None, {}, False),
    ("the last 950 worker restores the UVB masks", _binding(1, {0: (120,)}, mode=Mode.ASCEND950_CLUSTER),
     {2: _binding(2, {3: (140,)})}, True, {120}, None, {}, True),
    ("a 950 worker with another 950 worker alive leaves them",
     _binding(1, {0: (120,)}, mode=Mode.ASCEND950_CLUSTER),
     {2: _binding(2, {3: (140,)}, mode=Mode.ASCEND950_CLUSTER)}, True, {120}, None, {}, False),
]


@pytest.mark.parametrize("name,leaving,others,is_950,masks,lifted,passed,uvb", RESTORE_TABLE,
                         ids=[row[0] for row in RESTORE_TABLE])
def test_a_leaving_worker_gives_back_only_what_no_live_worker_still_uses(name, leaving, others, is_950, masks,
                                                                          lifted, passed, uvb):
    r = restoration(leaving, others, is_950=is_950)
    assert set(r.binding.saved_irq_masks) == masks
    assert (None if r.binding.irqbalance_bans is None else set(r.binding.irqbalance_bans.irqs)) == lifted
    assert {pid: set(b.irqs) for pid, b in r.passed_bans.items()} == passed
    assert r.restore_uvb is uvb
    assert r.binding.pid == leaving.pid and r.binding.original_cpus == leaving.original_cpus


REBIND_TABLE = [
    # (name, old binding, new NPUs, others alive, masks back, bans lifted, bans passed, masks kept, bans kept)
    ("same NPUs: nothing goes back, everything is kept", _binding(1, {0: (120, 121)}, bans=frozenset({120})),
     (0,), {}, set(), None, {}, {120, 121}, {120}),
    ("another NPU: the left one's masks and bans go back", _binding(1, {0: (120, 121)}, bans=frozenset({120})),
     (1,), {}, {120, 121}, {120}, {}, set(), None),
    ("one of two NPUs left: only its IRQs go back",
     _binding(1, {0: (120,), 1: (130,)}, bans=frozenset({120, 130})), (1,), {}, {120}, {120}, {}, {130}, {130}),
    ("a live sharer of the left NPU keeps its masks and takes its bans",
     _binding(1, {0: (120, 121)}, bans=frozenset({120, 121})), (1,), {2: _binding(2, {0: (120, 121)})},
     set(), None, {2: {120, 121}}, set(), None),
    ("a live worker on other NPUs changes nothing", _binding(1, {0: (120,)}, bans=frozenset({120})), (1,),
     {2: _binding(2, {3: (140,)})}, {120}, {120}, {}, set(), None),
    ("a ban of an IRQ of no NPU of its own stays with the new binding",
     _binding(1, {0: (120,)}, bans=frozenset({120, 999})), (1,), {}, {120}, {120}, {}, set(), {999}),
]


@pytest.mark.parametrize("name,old,npus,others,back,lifted,passed,kept,kept_bans", REBIND_TABLE,
                         ids=[row[0] for row in REBIND_TABLE])
def test_a_rebound_worker_gives_back_what_it_saved_for_the_npus_it_left(name, old, npus, others, back, lifted,
                                                                         passed, kept, kept_bans):
    r, keeps = left_behind(old, npus, others)
    assert set(r.binding.saved_irq_masks) == back
    assert {i: r.binding.saved_irq_masks[i] for i in back} == {i: old.saved_irq_masks[i] for i in back}
    assert (None if r.binding.irqbalance_bans is None else set(r.binding.irqbalance_bans.irqs)) == lifted
    assert {pid: set(b.irqs) for pid, b in r.passed_bans.items()} == passed
    assert r.restore_uvb is False  # the worker is still held: the UVB masks stay
    assert set(keeps.saved_irq_masks) == kept
    assert (None if keeps.irqbalance_bans is None else set(keeps.irqbalance_bans.irqs)) == kept_bans
    assert keeps.npus == old.npus and keeps.original_cpus == old.original_cpus
