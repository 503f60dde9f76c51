"""The held table's rules as tables: (table, events) -> (table, effects).

``step`` is pure: plain values in, a new table and frozen effects out. No daemon,
no worker process, no clock. Each row names the rule it pins down; the real
effects (threads put back, IRQ masks restored on a real /proc) are the daemon
tests' (test_daemon_irq_ownership.py, test_write_ahead.py, test_isolation_proof.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from ascendbind.daemon.heart.effects import (BindIrqs, CancelMove, FollowIsolation, Forget, Metric, Note, Persist,
                                             QueueMove, Remember, RestoreAffinity, RestoreIrqs)
from ascendbind.daemon.heart.events import Bound, Gone, Looked, MemoryMoved, NpuChecked, Released, Replanned
from ascendbind.daemon.heart.step import claim, first_allowance, holders, inherit, step, with_originals
from ascendbind.daemon.heart.table import EMPTY, Holding, Reader, Table
from ascendbind.daemon.watch.blame import Blame
from ascendbind.daemon.watch.lifecycle import NoteLocality, PinThreads, Reassert
from ascendbind.daemon.watch.proof import Proof
from ascendbind.errors import Conflict
from ascendbind.values.frozen import frozen_map
from ascendbind.values.model import IrqbalanceBans, StepResult
from ascendbind.values.reasons import Outcome, Reason, Step
from tests.builders import irq_binding

PROVEN = Proof(True, "root", "root asked")
CLAIM = Proof(False, "claim", "the request names NPU 0")
BANS = IrqbalanceBans(77, 1, frozenset({120, 121}))


def held(*bindings, proof=PROVEN) -> Table:
    return Table.of(Holding(b, proof) for b in bindings)


def kinds(effects) -> list[str]:
    return [type(e).__name__ for e in effects]


def run(table: Table, *events):
    """Step ``table`` through ``events``: the last table, and every effect in order."""
    effects = []
    for e in events:
        table, more = step(table, e)
        effects += more
    return table, effects


# ------------------------------------------------------------------ the scan and the claim


def test_holders_is_the_one_scan_of_who_holds_some_npus():
    t = held(irq_binding(1, 0, 120, 121), irq_binding(2, 1, 130, 131)).with_(Holding(irq_binding(3, 0, 122, 123), CLAIM))
    assert [h.pid for h in holders(t, (0,))] == [1, 3]
    assert [h.pid for h in holders(t, (0, 1), but=(1,))] == [2, 3]
    assert [h.pid for h in holders(t, (0,), live={3})] == [3]
    assert [h.pid for h in holders(t, (0,), proven=False)] == [3]
    assert holders(t, (7,)) == ()


CLAIMS = [
    # name, holders (pid, npu, proof), live, listed, shared, newcomer proven, (replaced, evicted)
    ("a dead holder is replaced", [(2, 0, PROVEN)], set(), None, False, True, ((2,), ())),
    ("an unlisted live holder gives way to a listed newcomer", [(2, 0, PROVEN)], {2}, {(0, 9)}, False, True,
     ((), (2,))),
    ("an unproven live holder gives way to a proven newcomer", [(2, 0, CLAIM)], {2}, None, False, True, ((), (2,))),
    ("an unproven newcomer shares with an unproven holder", [(2, 0, CLAIM)], {2}, None, False, False, ((), ())),
    ("allow_shared_npu: every live holder stays", [(2, 0, PROVEN)], {2}, None, True, True, ((), ())),
    ("a holder of another NPU is nobody's business", [(2, 5, PROVEN)], {2}, None, False, True, ((), ())),
    ("dead and unlisted at once", [(2, 0, PROVEN), (3, 1, PROVEN)], {3}, {(0, 9), (1, 9)}, False, True,
     ((2,), (3,))),
]


@pytest.mark.parametrize("name,found,live,listed,shared,proven,want", CLAIMS, ids=[c[0] for c in CLAIMS])
def test_who_gives_way_when_an_npu_is_claimed(name, found, live, listed, shared, proven, want):
    t = Table.of(Holding(irq_binding(p, n, 100 + 2 * p, 101 + 2 * p), pr) for p, n, pr in found)
    assert claim(t, 9, (0, 1), live=live, listed=listed, proven=proven, allow_shared=shared) == want


@pytest.mark.parametrize("listed", [None, {(0, 2)}, {(0, 2), (0, 9)}, set()])
def test_a_live_holder_keeps_its_npu_unless_the_driver_lists_only_the_newcomer(listed):
    t = held(irq_binding(2, 0, 120, 121))
    with pytest.raises(Conflict) as exc:  # npu-smi unread (None): nobody is displaced on a guess
        claim(t, 9, (0,), live={2}, listed=listed)
    assert exc.value.code == "npu_busy"


# ------------------------------------------------------------------ inheritance


def test_a_binding_inherits_the_oldest_masks_original_cpus_and_bans():
    old = dataclasses.replace(irq_binding(9, 0, 120, 121, saved=("000000ff", "000000ff")),
                              original_cpus=frozenset({0, 1}), irqbalance_bans=BANS)
    new = irq_binding(9, 0, 120, 121, saved=("00000004", "00000008"))  # what it read was our own write
    got = inherit(new, [old])
    assert dict(got.saved_irq_masks) == {120: "000000ff", 121: "000000ff"}
    assert got.original_cpus == frozenset({0, 1}) and got.irqbalance_bans == BANS


def test_a_sharer_keeps_the_hosts_masks_for_whoever_leaves_last():
    sharer = irq_binding(2, 0, 120, 121, saved=("0000ffff", "0000ffff"))
    new = irq_binding(9, 0, 120, 121, saved=("00000004", "00000008"))
    assert dict(inherit(new, [], [sharer]).saved_irq_masks) == {120: "0000ffff", 121: "0000ffff"}
    other = irq_binding(3, 1, 130, 131)  # another NPU's IRQs are not this bind's
    assert dict(inherit(new, [], [other]).saved_irq_masks) == {120: "00000004", 121: "00000008"}


def test_a_write_ahead_record_carries_the_originals_the_table_knows():
    t = held(dataclasses.replace(irq_binding(9, 0, 120, 121, saved=("000000ff", "000000ff")),
                                 original_cpus=frozenset({0}), irqbalance_bans=BANS))
    intended = irq_binding(9, 0, 120, 121, saved=("00000004", "00000008"))
    got = with_originals(t, intended, live={9})
    assert got.original_cpus == frozenset({0}) and got.irqbalance_bans == BANS
    assert dict(got.saved_irq_masks) == {120: "000000ff", 121: "000000ff"}


def test_a_rebound_worker_plans_from_its_first_allowance():
    @dataclasses.dataclass(frozen=True)
    class W:
        allowed_source: str = "status"
        allowed_cpus: frozenset = frozenset({4})
    prev = dataclasses.replace(irq_binding(9, 0, 120, 121), original_cpus=frozenset(range(8)))
    assert first_allowance(W(), prev).allowed_cpus == frozenset(range(8))
    assert first_allowance(W(), None) is None
    assert first_allowance(W("cpuset"), prev) is None


# ------------------------------------------------------------------ sequences


def test_bound_then_released():
    t, fx = run(EMPTY, Bound(irq_binding(9, 0, 120, 121), PROVEN, live={9}, memory_node=1, threads=(9, 10)),
                Released(9, live={9}))
    assert t == EMPTY
    assert fx == [FollowIsolation(hand_over=(9, 10)), QueueMove(9, 1, "bind"), Persist(),
                  RestoreAffinity(irq_binding(9, 0, 120, 121), restore_irqs=True, restore_uvb=False),
                  CancelMove(9, "released"), Forget(9, "released"), Persist(), FollowIsolation(adopt=(9,))]


def test_bound_again_forgets_the_earlier_record_and_its_move():
    first = irq_binding(9, 0, 120, 121, saved=("000000ff", "000000ff"))
    t, fx = run(held(first), Bound(irq_binding(9, 0, 120, 121, saved=("00000004", "00000008")), PROVEN, live={9}))
    assert dict(t.get(9).binding.saved_irq_masks) == {120: "000000ff", 121: "000000ff"}
    assert kinds(fx) == ["FollowIsolation", "CancelMove", "Forget", "Persist"]
    assert fx[1] == CancelMove(9, "bound again") and fx[2] == Forget(9, None)


def test_a_rebind_to_another_npu_gives_the_left_npus_irqs_back():
    old = irq_binding(9, 0, 120, 121, saved=("000000ff", "000000ff"))
    t, fx = run(held(old), Bound(irq_binding(9, 1, 130, 131), PROVEN, live={9}))
    assert fx[0] == RestoreIrqs(dataclasses.replace(old, npus=(0,)), why="left")
    assert dict(t.get(9).binding.saved_irq_masks) == {130: "0000ffff", 131: "0000ffff"}


def test_a_dead_owner_is_replaced_and_its_masks_carried_over():
    dead = irq_binding(2, 0, 120, 121, saved=("000000ff", "000000ff"))
    t, fx = run(held(dead), Bound(irq_binding(9, 0, 120, 121, saved=("00000004", "00000008")), PROVEN, live={9},
                                  replaced=(2,)))
    assert list(t) == [9] and dict(t.get(9).binding.saved_irq_masks) == {120: "000000ff", 121: "000000ff"}
    assert [e for e in fx if not isinstance(e, Note)][:2] == [CancelMove(2, "replaced"), Forget(2, "replaced")]
    assert not any(isinstance(e, (RestoreAffinity, RestoreIrqs)) for e in fx)  # the masks went to the newcomer


def test_an_evicted_holder_gets_its_cpus_back_but_its_masks_go_to_the_newcomer():
    squatter = irq_binding(2, 0, 120, 121, saved=("000000ff", "000000ff"))
    t, fx = run(held(squatter, proof=CLAIM), Bound(irq_binding(9, 0, 120, 121), PROVEN, live={2, 9}, evicted=(2,)))
    restore = next(e for e in fx if isinstance(e, RestoreAffinity))
    assert restore.binding.pid == 2 and not restore.binding.saved_irq_masks and restore.restore_irqs is False
    assert Forget(2, "evicted") in fx and dict(t.get(9).binding.saved_irq_masks) == {120: "000000ff",
                                                                                  121: "000000ff"}


def test_a_claimed_holder_that_left_meanwhile_is_nobodys_business():
    t, fx = run(EMPTY, Bound(irq_binding(9, 0, 120, 121), PROVEN, live={9}, replaced=(2,), evicted=(3,)))
    assert list(t) == [9] and not any(isinstance(e, (Forget, RestoreAffinity)) for e in fx)


def test_a_gone_worker_gives_back_only_what_no_live_worker_needs():
    a, b = irq_binding(1, 0, 120, 121), irq_binding(2, 0, 120, 121)
    t, fx = run(held(a, b), Gone(1, live={2}))
    assert list(t) == [2] and not any(isinstance(e, RestoreIrqs) for e in fx)  # 2 still owns NPU 0's IRQs
    t, fx = run(t, Gone(2, live=set(), reason="recycled"))
    assert t == EMPTY
    assert fx[:2] == [CancelMove(2, "recycled"), RestoreIrqs(b)] and fx[-1] == Persist()
    assert Forget(2, "recycled") in fx


def test_a_gone_worker_passes_its_bans_to_a_live_one_that_pins_the_irqs():
    a = dataclasses.replace(irq_binding(1, 0, 120, 121), irqbalance_bans=BANS)
    t, fx = run(held(a, irq_binding(2, 0, 120, 121)), Gone(1, live={2}))
    assert t.get(2).binding.irqbalance_bans == BANS and not any(isinstance(e, RestoreIrqs) for e in fx)


def test_releasing_a_dead_worker_is_its_drop():
    t, fx = run(held(irq_binding(1, 0, 120, 121)), Released(1, live=set()))
    assert t == EMPTY and CancelMove(1, "exited") in fx and not any(isinstance(e, RestoreAffinity) for e in fx)


def test_an_event_for_a_record_no_longer_held_does_nothing():
    t = held(irq_binding(1, 0, 120, 121))
    for e in (Released(5), Gone(5), Looked(5), Replanned(5, irq_binding(5, 0, 1, 2)),
              MemoryMoved(5, StepResult(Step.MEMORY, Outcome.APPLIED, None, "moved")),
              NpuChecked(5, 1, (0,), "confirmed", "x")):
        assert step(t, e) == (t, ())


def test_a_verdict_about_an_earlier_binding_of_the_number_does_nothing():
    t = held(irq_binding(1, 0, 120, 121))
    assert step(t, NpuChecked(1, 1, (0,), "contradicted", "not listed", live={1})) == (t, ())  # START is 5000


def test_a_contradicted_npu_undoes_the_binding():
    b = irq_binding(1, 0, 120, 121)
    t, fx = run(held(b, proof=CLAIM), NpuChecked(1, b.start_time, (0,), "contradicted", "lists 7", live={1}))
    assert t == EMPTY and fx[0] == Metric("npu_check", "contradicted") and Forget(1, "npu_mismatch") in fx


def test_a_confirmed_claim_is_proven_evicts_unproven_sharers_and_binds_its_irqs():
    irqs_left = StepResult(Step.IRQ, Outcome.SKIPPED, Reason.UNPROVEN, "unproven")
    b = dataclasses.replace(irq_binding(1, 0, 120, 121), steps=(irqs_left,))
    t = held(b, irq_binding(3, 0, 122, 123), proof=CLAIM).with_(Holding(irq_binding(4, 0, 124, 125), PROVEN))
    t, fx = run(t, NpuChecked(1, b.start_time, (0,), "confirmed", "npu-smi lists it", live={1, 3, 4}))
    assert t.get(1).proof.proven and t.get(1).proof.by == "npu_check" and 3 not in t
    assert Forget(3, "evicted") in fx and fx[-2:] == [BindIrqs(1, (4,)), Persist()]


def test_a_confirmed_claim_stays_unproven_when_isolating_it_leaves_no_housekeeping_cpu():
    b = irq_binding(1, 0, 120, 121)
    t, fx = run(held(b, proof=CLAIM), NpuChecked(1, b.start_time, (0,), "confirmed", "listed", live={1},
                                                 refused="no CPU left"))
    assert not t.get(1).proof.proven and "no CPU left" in t.get(1).proof.detail and fx[-1] == Persist()


def test_a_replan_keeps_the_hosts_originals_and_queues_the_move():
    old = dataclasses.replace(irq_binding(1, 0, 120, 121, saved=("000000ff", "000000ff")),
                              original_cpus=frozenset({0}))
    t, fx = run(held(old), Replanned(1, irq_binding(1, 0, 120, 121, saved=("00000004", "00000008")), memory_node=0))
    assert t.get(1).binding.original_cpus == frozenset({0})
    assert dict(t.get(1).binding.saved_irq_masks) == {120: "000000ff", 121: "000000ff"}
    assert fx == [QueueMove(1, 0, "replan"), Persist()]


def test_a_finished_move_becomes_the_bindings_memory_step():
    b = dataclasses.replace(irq_binding(1, 0, 120, 121), steps=(StepResult(Step.MEMORY, Outcome.PENDING, None, "queued"),))
    done = StepResult(Step.MEMORY, Outcome.APPLIED, None, "moved", frozen_map({"pages": 3}))
    t, fx = run(held(b), MemoryMoved(1, done))
    assert t.get(1).binding.step(Step.MEMORY) == done and fx == [Persist()]


def test_a_look_persists_only_the_verdicts():
    pin = PinThreads(((10, "main"),))
    note = NoteLocality(0.5, 1.0, False)
    t = held(irq_binding(1, 0, 120, 121))
    assert step(t, Looked(1, (pin, note))) == (t, (Remember(1, pin), Remember(1, note)))
    again = Reassert("threads", Blame("external", "no evidence"), (1.0,), tids=(10,))
    assert step(t, Looked(1, (again,))) == (t, (Remember(1, again), Persist()))


# ------------------------------------------------------------------ the reader


def test_the_reader_hands_out_copies_taken_under_the_lock_never_the_lock():
    taken = []

    def locked(read):
        taken.append(True)
        return read()

    class Rec:
        def __init__(self, b):
            self.binding = b

    one, two = Rec(irq_binding(1, 0, 120, 121)), Rec(irq_binding(2, 1, 130, 131))
    records = {1: one}
    r = Reader(locked, lambda: records, lambda: held(one.binding))
    copy = r.records()
    records[2] = two
    assert list(copy) == [1] and r.holds(2) and r.get(2) is two and len(r) == 2
    assert r.current(two) and not r.current(Rec(two.binding))  # another record at the same pid is not current
    assert r.read(lambda now: sorted(now)) == [1, 2] and list(r.table()) == [1]
    assert len(taken) == 7  # every read but len() went through the lock
    assert not hasattr(r, "lock")
