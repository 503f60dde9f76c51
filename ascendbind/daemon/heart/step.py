"""The held table's rules: ``step(table, event) -> (table, effects)``. No I/O.

h11 keeps its protocol this way: events in, a new state and what to do out, and
the caller does the I/O. Here the caller is the ``Daemon``: it observes (a bind's
writes, pidfds, npu-smi), steps the table with what it saw, keeps the new table,
and runs the effects (run.py) under its lock. Everything about who holds what
lives here once:

* who else holds some NPUs (``holders``: the one scan of the table);
* who gives way to a bind (``claim``): a dead holder is replaced, an unproven or
  unlisted live one evicted, any other live holder keeps its NPU (409);
* what a binding inherits from the records it replaces (``inherit``): the oldest
  saved IRQ masks and original CPUs (the host's, not ours), the older holders'
  irqbalance bans (still ours to lift), and the host's masks live sharers saved;
* what a leaving worker gives back (watch/lifecycle.py's ``restoration``, over
  the *live* others only), and what a re-bound worker leaves behind;
* the lifecycle of a record: bound, bound again, released, gone, proven by
  npu-smi or contradicted, re-planned, its memory moved.

Liveness is an input: each event carries the pids observed alive just before
(``live``); a record not in it counts as dead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence

from ...values.frozen import frozen_map
from ...values.model import Binding, Mode
from ...values.reasons import Step
from ..api.requests import claim_npus
from ..watch.bans import carried_bans
from ..watch.lifecycle import LeaveAlone, Reassert, Restoration, irqs_unproven, left_behind, restoration
from ..watch.proof import prove
from .effects import (BindIrqs, CancelMove, Effect, FollowIsolation, Forget, Metric, Note, Persist, QueueMove,
                      Remember, RestoreAffinity, RestoreIrqs)
from .events import Bound, Event, Gone, Looked, MemoryMoved, NpuChecked, Released, Replanned
from .table import Holding, Table

__all__ = ["step", "holders", "claim", "inherit", "with_originals", "restoration_of", "last_950", "first_allowance",
           "leave", "pass_bans"]

Stepped = tuple[Table, tuple[Effect, ...]]


# ------------------------------------------------------------------ queries


def holders(table: Table, npus: Collection[int], *, but: Collection[int] = (), live: Collection[int] | None = None,
            proven: bool | None = None, irqs_bound: bool | None = None) -> tuple[Holding, ...]:
    """The records of ``table`` that hold any of ``npus``, by pid, but those in ``but``;
    ``live``: only those alive; ``proven``: only those (not) proven; ``irqs_bound``: only
    those whose IRQ step was (not) left out for want of proof."""
    out = []
    for pid in table:
        h = table.held[pid]
        if pid in but or not h.drives(npus) or (live is not None and pid not in live):
            continue
        if proven is not None and h.proof.proven is not proven:
            continue
        if irqs_bound is not None and irqs_unproven(h.binding) is irqs_bound:
            continue
        out.append(h)
    return tuple(out)


def _others(table: Table, pid: int, live: Collection[int], skip: Collection[int] = ()) -> dict[int, Binding]:
    """The live records but ``pid``'s and ``skip``'s, pid -> binding."""
    return {p: table.held[p].binding for p in table if p != pid and p not in skip and p in live}


def claim(table: Table, pid: int, targets: Iterable[int], *, live: Collection[int], listed, proven: bool = True,
          allow_shared: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dead holders of ``targets`` to replace, live holders to evict) when ``pid`` binds
    them; Conflict ``npu_busy`` when a live holder keeps its NPU (api/requests.claim_npus:
    ``listed`` is npu-smi's (npu, pid) pairs, ``proven`` the newcomer's proof)."""
    targets = tuple(targets)
    found = [(h.pid, h.binding.npus, h.pid in live, h.proof.proven) for h in holders(table, targets, but=(pid,))]
    dead, evict = claim_npus(pid, targets, found, listed, allow_shared=allow_shared, proven=proven)
    return tuple(dead), tuple(evict)


def inherit(binding: Binding, older: Sequence[Binding], sharers: Sequence[Binding] = ()) -> Binding:
    """Keep the oldest saved IRQ masks and original CPUs: those are the host's, not ours;
    and the older holders' irqbalance bans, which are still ours to lift. ``sharers``:
    workers that keep an NPU of this binding (``allow_shared_npu``); the masks this bind
    read on that NPU's IRQs are theirs (or unchanged, so not saved at all), so the host's
    masks they saved are kept here too, for whichever of them leaves last."""
    masks = dict(binding.saved_irq_masks)
    original = binding.original_cpus
    for b in older:
        masks.update({irq: m for irq, m in b.saved_irq_masks.items() if irq in masks})
        if b.pid == binding.pid:
            original = b.original_cpus
    written = {w.irq for w in binding.irqs}
    for b in sharers:
        masks.update({irq: m for irq, m in b.saved_irq_masks.items() if irq in written})
    return dataclasses.replace(binding, saved_irq_masks=frozen_map(masks), original_cpus=original,
                               irqbalance_bans=carried_bans(binding.irqbalance_bans,
                                                            [b.irqbalance_bans for b in older]))


def with_originals(table: Table, intended: Binding, live: Collection[int]) -> Binding:
    """``intended`` (a bind before its first write) with the host's originals the table
    holds: the worker's earlier binding's original CPUs, bans and UVB masks, and, for
    each IRQ the bind will write, the mask a holder of that NPU saved (what it read may
    be our own). A re-bind to other NPUs keeps the left NPUs' masks too until its writes
    are done: until then only this record holds them, so a restart's undo restores them."""
    masks = dict(intended.saved_irq_masks)
    original, bans, uvb = intended.original_cpus, None, intended.uvb_previous
    back: dict[int, str] = {}
    prev = table.get(intended.pid)
    older = [*([] if prev is None else [prev]), *holders(table, intended.npus, but=(intended.pid,))]
    for h in older:
        b = h.binding
        if h is prev:
            original, bans, uvb = b.original_cpus, b.irqbalance_bans, b.uvb_previous
            left = left_behind(b, intended.npus, _others(table, intended.pid, live))[0]
            back = dict(left.binding.saved_irq_masks)
        masks.update({irq: m for irq, m in b.saved_irq_masks.items() if irq in masks})
    masks.update({irq: m for irq, m in back.items() if irq not in masks})
    return dataclasses.replace(intended, saved_irq_masks=frozen_map(masks), original_cpus=original,
                               irqbalance_bans=bans, uvb_previous=uvb)


def restoration_of(table: Table, pid: int, live: Collection[int], binding: Binding | None = None) -> Restoration:
    """What ``pid``'s record (or ``binding``, one not in the table) may give back, over the
    other live records (lifecycle.restoration)."""
    b = binding if binding is not None else table.held[pid].binding
    return restoration(b, _others(table, pid, live), is_950=b.plan.mode is Mode.ASCEND950_CLUSTER)


def last_950(table: Table, binding: Binding, live: Collection[int]) -> bool:
    """Whether ``binding`` is the last live 950 cluster binding (it restores the UVB masks)."""
    mode = Mode.ASCEND950_CLUSTER
    return binding.plan.mode is mode and not any(
        b.plan.mode is mode for b in _others(table, binding.pid, live).values())


def first_allowance(worker, prev: Binding | None):
    """Without a readable cpuset, a bound worker's Cpus_allowed_list is the mask we set:
    plan it from the allowance first seen (its binding's original CPUs), so planning it
    again gives the same plan. None: not bound, or its cpuset is readable."""
    if worker.allowed_source != "status" or prev is None:
        return None
    return dataclasses.replace(worker, allowed_cpus=prev.original_cpus)


def pass_bans(table: Table, passed) -> Table:
    """The table with each live record taking over the banned IRQs a leaving one passes it."""
    return table.with_(*(dataclasses.replace(table.held[pid], binding=dataclasses.replace(
        table.held[pid].binding, irqbalance_bans=carried_bans(table.held[pid].binding.irqbalance_bans, [bans])))
        for pid, bans in passed.items()))


# ------------------------------------------------------------------ the step


def step(table: Table, event: Event) -> Stepped:
    """The table after ``event``, and what the daemon must do for it, in order."""
    kind = type(event)
    if kind is Bound:
        return _bound(table, event)
    if event.pid not in table:
        return table, ()  # released, replaced or gone meanwhile: the event is about no record now
    return _STEPS[kind](table, event)


def _left_npus(table: Table, prev: Holding | None, e: Bound, gone: Collection[int]) -> tuple[Table, list[Effect]]:
    """A worker bound again to other NPUs gives back what it saved for the NPUs it no
    longer drives, as a release of those NPUs would (the bans other live workers pin pass
    to them); its record keeps only what the new binding is to inherit."""
    if prev is None or not set(prev.binding.npus) - set(e.binding.npus):
        return table, []
    r, kept = left_behind(prev.binding, e.binding.npus, _others(table, prev.pid, e.live, gone))
    table = pass_bans(table, r.passed_bans).rebound(prev.pid, kept)
    b = r.binding
    if not b.saved_irq_masks and b.irqbalance_bans is None:
        return table, []
    return table, [RestoreIrqs(b, why="left")]


def _bound(table: Table, e: Bound) -> Stepped:
    pid = e.binding.pid
    if any(p not in table for p in (*e.replaced, *e.evicted)):
        # holders the claim named that left the table meanwhile have nothing left to give up
        e = dataclasses.replace(e, replaced=tuple(p for p in e.replaced if p in table),
                                evicted=tuple(p for p in e.evicted if p in table))
    gone = (*e.replaced, *e.evicted)
    table, effects = _left_npus(table, table.get(pid), e, gone)
    prev = table.get(pid)
    sharers = [h.binding for h in holders(table, e.binding.npus, but=(pid, *gone))]
    older = [h.binding for h in (prev, *(table.held[p] for p in gone)) if h is not None]
    binding = inherit(e.binding, older, sharers)
    for p in e.replaced:
        effects += [CancelMove(p, "replaced"), Forget(p, "replaced"),
                    Note("info", "dead owner replaced", frozen_map({"pid": p, "by": pid}))]
    for p in e.evicted:
        h = table.held[p]
        effects += [RestoreAffinity(dataclasses.replace(h.binding, saved_irq_masks=frozen_map({})),
                                    restore_irqs=False),
                    CancelMove(p, "evicted"), Forget(p, "evicted"),
                    Note("warning", "unlisted holder evicted" if h.proof.proven else "unproven holder evicted",
                         frozen_map({"pid": p, "npus": list(h.binding.npus), "by": pid}))]
    table = table.without(*gone).with_(Holding(binding, e.proof))
    effects.append(FollowIsolation(hand_over=e.threads))
    effects.append(QueueMove(pid, e.memory_node, "bind") if e.memory_node is not None
                   else CancelMove(pid, "bound again"))  # an earlier binding's move, if any
    if prev is not None:
        effects.append(Forget(pid, None))
    return table, (*effects, Persist())


def leave(table: Table, pid: int, live: Collection[int]) -> tuple[Table, Restoration]:
    """The table without ``pid``, the bans it passes given to the live records that pin
    their IRQs, and what it gives back."""
    r = restoration_of(table, pid, live)
    return pass_bans(table.without(pid), r.passed_bans), r


def _gone(table: Table, e: Gone) -> Stepped:
    table2, r = leave(table, e.pid, e.live)
    b = r.binding
    effects: list[Effect] = [CancelMove(e.pid, e.reason)]
    if b.saved_irq_masks or b.irqbalance_bans or r.restore_uvb:
        effects.append(RestoreIrqs(b, restore_uvb=r.restore_uvb))
    effects += [Forget(e.pid, e.reason), Note("info", "worker dropped", frozen_map({
        "pid": e.pid, "npus": list(b.npus), "reason": e.reason, "irqs_restored": sorted(b.saved_irq_masks)})),
        Persist()]
    return table2, tuple(effects)


def _released(table: Table, e: Released) -> Stepped:
    if e.pid not in e.live:
        return _gone(table, Gone(e.pid, e.live, "exited"))
    uvb = last_950(table, table.held[e.pid].binding, e.live)
    table2, r = leave(table, e.pid, e.live)
    return table2, (RestoreAffinity(r.binding, restore_irqs=True, restore_uvb=uvb), CancelMove(e.pid, e.reason),
                    Forget(e.pid, e.reason), Persist(), FollowIsolation(adopt=(e.pid,)))


def _looked(table: Table, e: Looked) -> Stepped:
    effects: list[Effect] = [Remember(e.pid, a) for a in e.actions]
    if any(isinstance(a, (Reassert, LeaveAlone)) for a in e.actions):
        effects.append(Persist())  # the verdicts and culprits are in the state file
    return table, tuple(effects)


def _memory_moved(table: Table, e: MemoryMoved) -> Stepped:
    b = table.held[e.pid].binding
    steps = tuple(e.result if s.step is Step.MEMORY else s for s in b.steps)
    return table.rebound(e.pid, dataclasses.replace(b, steps=steps)), (Persist(),)


def _replanned(table: Table, e: Replanned) -> Stepped:
    binding = inherit(e.binding, [table.held[e.pid].binding])
    effects: tuple[Effect, ...] = (Persist(),)
    if e.memory_node is not None:
        effects = (QueueMove(e.pid, e.memory_node, "replan"), *effects)
    return table.rebound(e.pid, binding), effects


def _npu_checked(table: Table, e: NpuChecked) -> Stepped:
    h = table.held[e.pid]
    if h.binding.start_time != e.start_time or tuple(h.binding.npus) != e.npus:
        return table, ()  # a verdict about an earlier binding of the number
    effects: tuple[Effect, ...] = (Metric("npu_check", e.verdict),)
    if e.verdict == "contradicted":
        table, more = _released(table, Released(e.pid, e.live, "npu_mismatch"))
        note = Note("warning", "named NPU contradicted by npu-smi; binding undone",
                    frozen_map({"pid": e.pid, "npus": list(e.npus), "detail": e.why}))
        return table, (*effects, note, *more)
    if e.verdict != "confirmed":
        return table, (*effects, Note("info", "named NPU not confirmed by npu-smi", frozen_map(
            {"pid": e.pid, "npus": list(e.npus), "verdict": e.verdict, "detail": e.why})))
    if h.proof.proven:
        return table, effects
    return _proven(table, e, effects)


def _proven(table: Table, e: NpuChecked, effects: tuple[Effect, ...]) -> Stepped:
    """npu-smi lists the unproven worker on its NPUs: proven from now on (isolation starts
    for it), and the unproven workers sharing its NPUs are released as a proven bind would
    have evicted them; kept unproven, with the reason, when isolating it too would leave
    the host no housekeeping CPU (``refused``)."""
    h = table.held[e.pid]
    if e.refused is not None:
        proof = dataclasses.replace(h.proof, detail=f"{e.why}, but isolating it too would leave no housekeeping "
                                                    f"CPU: {e.refused}")
        return table.with_(dataclasses.replace(h, proof=proof)), (*effects, Persist())
    table = table.with_(dataclasses.replace(h, proof=prove(h.proof, "confirmed", e.why)))
    effects += (Note("info", "binding proven by npu-smi; isolation applies to it",
                     frozen_map({"pid": e.pid, "npus": list(h.binding.npus)})),)
    squatters = () if e.allow_shared else holders(table, h.binding.npus, but=(e.pid,), live=e.live, proven=False)
    for o in squatters:
        effects += (Note("warning", "unproven holder evicted", frozen_map({"pid": o.pid, "by": e.pid})),)
        table, more = _released(table, Released(o.pid, e.live, "evicted"))
        effects += more
    if irqs_unproven(h.binding):
        sharers = holders(table, h.binding.npus, but=(e.pid,), live=e.live, irqs_bound=True)
        effects += (BindIrqs(e.pid, tuple(o.pid for o in sharers)),)
    return table, (*effects, Persist())


_STEPS = {Released: _released, Gone: _gone, Looked: _looked, MemoryMoved: _memory_moved, Replanned: _replanned,
          NpuChecked: _npu_checked}
