"""The held table's keeper: every change to ``Daemon.held`` and to a held record
outside a bind happens here, under ``Daemon.lock``.

``Daemon`` (core.py) is built from this class and the request handlers. The
reconcile loop, the locality check, re-planning and auto-bind observe on their
own, ask the pure rules (lifecycle.py) what to do, and call in here to do it;
none of them assigns to a held record or to the table.

What lives here: loading the table from the state file at start, liveness
("is this record's process still the one we bound?": its pidfd says, where the
record holds one; a restarted daemon pins each worker again, proven by the
start time and, with pidfs, the pidfd inode the state file kept), what goes back to the
host when a worker leaves (lifecycle.restoration: IRQ masks of NPUs nobody
live owns, bans nobody live pins, the UVB masks with the last 950 worker),
dropping a gone worker, executing a look's actions, and the locality and
re-plan bookkeeping (a worker whose cpuset changed is planned again here:
``replan_cpuset``).

Write-ahead: a bind is in the state file before its first write. Once every
check has passed, the applier hands over the binding as it stands before any
write (``record``); ``write_ahead`` gives it the host's originals the held table
already knows (an earlier binding's original CPUs and bans, the saved IRQ masks
of the NPU's holders) and writes it as an *in-flight* record, in place of the
worker's earlier record if any. The bind's own save at its end replaces it with
the held record. A daemon killed in between leaves the in-flight record, and
the next daemon undoes it at start (``restore``): the worker's threads go back
to its original CPUs, the IRQ masks it recorded back to what they were (those of
NPUs no other live worker owns), its bans back to irqbalance. Undone, not
completed: whatever subset of the writes landed, undoing needs only what the
record holds, no discovery, no planning and no guess at how far the bind got;
and the caller's request died with the daemon unanswered, so "not bound" is
what it was told (``ascendbind run`` runs its command unbound, a client asks
again). A bind that fails after its record is undone the same way at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from typing import Any

import structlog

from ...applier import release_binding
from ...applier.affinity import bind_threads
from ...applier.bind import bind_irqs_of, merge_npu_plans
from ...discovery.gather.identity import pin_identity, verify_identity
from ...applier.irq import hand_back_bans, restore_irq_masks, set_irq_affinity
from ...discovery.gather.process import read_identity
from ...errors import AscendbindError, ConfigError, ProcessGone
from ...values.cpulist import format_cpulist
from ...values.frozen import frozen_map
from ...values.model import Binding, Mode, StepResult
from ...values.reasons import Outcome, Reason, Step
from ..watch.bans import carried_bans
from ..watch.blame import FIX
from ..watch.held import Held, SeenThread, accepted
from ..host.replan import Replanned, replan_worker
from ..watch.lifecycle import (Drop, LeaveAlone, NoteLocality, PinThreads, Reassert, Replan, Restoration,
                              irqs_unproven, left_behind, restoration)
from ..watch.locality import ratios_by_npu
from ..watch.memmove import STOPPING
from ..watch.proof import prove
from ..watch.observe import role_cpus
from ..state.state import encode_record
from ..state.staterecord import IN_FLIGHT, binding_from_json, binding_to_json

__all__ = ["Ownership"]

log = structlog.get_logger("ascendbind.daemon")


class Ownership:
    """The held-table half of ``Daemon`` (needs ``config``, ``held``, ``lock``, ``metrics``,
    ``state``, ``isolation``, ``hosts``, ``pid`` and ``save``)."""

    # ---------------------------------------------------------- start-up

    def restore(self) -> dict[str, int]:
        """Load the state file: keep live workers, drop gone ones (a bad file is never a crash loop)."""
        tidied: dict[str, Any] = {}
        try:
            tidied = self.state.clean()
        except (OSError, ConfigError) as exc:
            log.error("state directory not tidied", error=str(exc))
        loaded = self.state.load()
        self.isolation.load(loaded.isolation)  # what an earlier daemon changed on the host, to follow or put back
        kept = gone = bad = 0
        with self.lock:
            candidates: list[Held] = []
            alive: list[bool] = []
            flying: set[int] = set()
            for raw in loaded.workers:
                try:
                    b = binding_from_json(raw)
                except (KeyError, ValueError, TypeError) as exc:
                    bad += 1
                    log.error("state entry skipped", error=f"{type(exc).__name__}: {exc}")
                    continue
                h = Held.from_state(b, raw, time.time())
                if raw.get(IN_FLIGHT) is True:
                    flying.add(b.pid)
                try:  # the pidfd first, then the start time and the pidfd inode the file kept
                    h.pin = pin_identity(b.pid, b.start_time, b.pidfd_ino, self.config.proc_root)
                    alive.append(True)
                    if b.pidfd_ino is None and h.pin is not None and h.pin.ino is not None:
                        h.binding = dataclasses.replace(b, pidfd_ino=h.pin.ino)  # an older record: kept from now on
                except ProcessGone:
                    alive.append(False)
                candidates.append(h)
            self.held = {h.binding.pid: h for h, ok in zip(candidates, alive) if ok}
            for h, ok in zip(candidates, alive):
                if not ok:
                    gone += 1
                    self._undo_gone(h, "exited")
            self._undo_interrupted(flying)
            for pid, h in list(self.held.items()):
                ident = read_identity(pid, self.config.proc_root)
                why = ident.not_a_worker(self.pid) if ident is not None else None
                if why:  # bound by a daemon that did not refuse it: undo it, never keep it
                    self.held.pop(pid)
                    release_binding(self._restorable(h), self.config, restore_irqs=True, pin=h.pin)
                    h.close()
                    self.metrics.dropped_worker("released")
                    log.warning("state entry is no worker; released", pid=pid, reason=why)
            kept = len(self.held)
            for h in self.held.values():
                if h.memory_move is not None:  # stopped before its pages moved: move them now
                    self.move_memory(h, h.memory_move[0], "restart")
                if not h.proof.proven:  # npu-smi may list it by now (watch/proof.py)
                    self.npu_check.submit(h.binding.pid, h.binding.start_time, h.binding.npus, None, None, None)
            self.save()
        for _ in range(loaded.other_boot):
            self.metrics.dropped_worker("other_boot")
        log.info("state restored", kept=kept, dropped_gone=gone, dropped_other_boot=loaded.other_boot,
                 skipped_malformed=bad, moved_aside=loaded.moved_aside or tidied.get("moved_aside"))
        return {"kept": kept, "gone": gone, "other_boot": loaded.other_boot, "malformed": bad}

    def _undo_interrupted(self, flying: set[int]) -> None:
        """Undo the binds a killed daemon left in flight (their workers still live)."""
        for pid in sorted(flying & set(self.held)):
            h = self.held.pop(pid)
            self._roll_back(h, "restart")
            h.close()
            self.metrics.dropped_worker("interrupted")

    # ---------------------------------------------------------- write-ahead

    @contextlib.contextmanager
    def write_ahead(self, pid: int, pin) -> Iterator[Callable[[Binding], None]]:
        """The applier's ``record`` for a bind of ``pid`` (under the lock): writes the bind as
        in flight before its first write. A bind that fails after that is undone here, unless
        an earlier binding of the worker is still held (its record, written again, covers
        it); either way the in-flight record leaves the file."""
        recorded: list[Binding] = []

        def record(intended: Binding) -> None:
            b = self._with_originals(intended)
            self._save_in_flight(b)
            recorded.append(b)

        try:
            yield record
        except BaseException:
            if recorded:
                if pid not in self.held:
                    self._roll_back(Held(recorded[0], time.time(), pin=pin), "failed")
                self.save()
            raise

    def _with_originals(self, intended: Binding) -> Binding:
        """``intended`` with the host's originals that records of the table hold: the worker's
        earlier binding's original CPUs, bans and UVB masks, and, for each IRQ the bind will
        write, the mask a holder of that NPU saved (what it read may be our own)."""
        masks = dict(intended.saved_irq_masks)
        original, bans, uvb = intended.original_cpus, None, intended.uvb_previous
        back: dict[int, str] = {}
        for pid, h in self.held.items():
            b = h.binding
            if pid == intended.pid:
                original, bans, uvb = b.original_cpus, b.irqbalance_bans, b.uvb_previous
                # a re-bind to other NPUs gives the left NPUs' masks back after its writes:
                # until then only this record holds them, so a restart's undo restores them
                back = dict(left_behind(b, intended.npus, self._live_others(pid))[0].binding.saved_irq_masks)
            elif not set(b.npus) & set(intended.npus):
                continue
            masks.update({irq: m for irq, m in b.saved_irq_masks.items() if irq in masks})
        masks.update({irq: m for irq, m in back.items() if irq not in masks})
        return dataclasses.replace(intended, saved_irq_masks=frozen_map(masks), original_cpus=original,
                                   irqbalance_bans=bans, uvb_previous=uvb)

    def _save_in_flight(self, b: Binding) -> None:
        """The state file with ``b`` as an in-flight record beside the other held workers'. A
        failed write is logged and the bind goes on, as after any failed save: the daemon's
        bindings never wait on its disk."""
        records = [h.state_record() for pid, h in self.held.items() if pid != b.pid]
        records.append(encode_record(binding_to_json(b, **{IN_FLIGHT: True})))
        try:
            self.state.save_encoded(records, isolation=self.isolation.state_json())
        except (OSError, ConfigError) as exc:
            log.error("could not record the bind before its writes", pid=b.pid, path=self.state.path,
                      error=exc.strerror if isinstance(exc, OSError) else str(exc))

    def _roll_back(self, h: Held, why: str) -> None:
        """Undo a bind that was in flight (``h`` is out of the table): its threads back on its
        original CPUs, and what it recorded of the IRQs back as ``release`` would put it."""
        b = self._restorable(h)
        steps = release_binding(b, self.config, restore_irqs=True, restore_uvb=self._last_950(h), pin=h.pin)
        log.warning("bind in flight undone", pid=b.pid, why=why, irqs_restored=sorted(b.saved_irq_masks),
                    steps={s.step.value: s.outcome.value for s in steps})

    # ---------------------------------------------------------- liveness

    def is_alive(self, h: Held) -> bool:
        try:
            verify_identity(h.binding.pid, h.binding.start_time, self.config.proc_root, pin=h.pin)
        except ProcessGone:
            return False
        return True

    @staticmethod
    def still_bound(h: Held, start_time: int | None) -> bool:
        """Whether a process just observed at ``h``'s pid, started at ``start_time``, is the one
        ``h`` holds: same start time, and ``h``'s pidfd (where it has one) not exited; then
        the number never left that process, so the observation is of it."""
        return h.binding.start_time == start_time and (h.pin is None or not h.pin.exited())

    def _gone_while_binding(self, applied, prev: Held | None) -> None:
        """The worker exited before the bind was done (``applied.gone``): its number may
        name a newcomer, which is never held or acted for. An earlier binding of the same
        process leaves the table too. Raises ProcessGone with that code."""
        pid = applied.binding.pid
        if prev is not None and self.held.get(pid) is prev:
            self.held.pop(pid)
            self._undo_gone(prev, "exited")
            self.save()
        self.metrics.step_results(applied.binding.steps)
        affinity = applied.binding.step(Step.AFFINITY)
        detail = affinity.detail if affinity is not None else f"process {pid} exited while it was being bound"
        log.warning("worker gone while being bound; not held", pid=pid, reason=applied.gone, detail=detail)
        raise ProcessGone(f"{detail}; not bound", code=applied.gone)

    def live_owner_of(self, npus, *, except_pid: int) -> int | None:
        for pid, h in self.held.items():
            if pid != except_pid and set(h.binding.npus) & set(npus) and self.is_alive(h):
                return pid
        return None

    def holds(self, pid: int) -> bool:
        with self.lock:
            return pid in self.held

    # ---------------------------------------------------------- leaving

    def _restoration(self, h: Held) -> Restoration:
        """What ``h`` may give back (lifecycle.restoration over the other live workers); the
        irqbalance bans other live workers still pin pass to them here."""
        b = h.binding
        others = {pid: o.binding for pid, o in self.held.items() if o is not h and pid != b.pid and self.is_alive(o)}
        r = restoration(b, others, is_950=b.plan.mode is Mode.ASCEND950_CLUSTER)
        for pid, bans in r.passed_bans.items():
            o = self.held[pid]
            o.binding = dataclasses.replace(o.binding, irqbalance_bans=carried_bans(o.binding.irqbalance_bans, [bans]))
        return r

    def _live_others(self, pid: int, skip: Collection[int] = ()) -> dict[int, Binding]:
        return {p: o.binding for p, o in self.held.items() if p != pid and p not in skip and self.is_alive(o)}

    def _leave_npus(self, prev: Held | None, npus: tuple[int, ...], skip: Collection[int] = ()) -> None:
        """``prev``'s worker was just bound again to ``npus`` (under the lock, after the
        bind's writes, before its save): what ``prev`` saved for the NPUs it no longer drives
        goes back as a release of those NPUs would put it (lifecycle.left_behind; the bans
        other live workers pin pass to them), and ``prev`` keeps only what belongs to the
        NPUs it still drives, for the new binding to inherit. ``skip``: holders this bind
        replaces or evicts."""
        if prev is None or not set(prev.binding.npus) - set(npus):
            return
        r, kept = left_behind(prev.binding, npus, self._live_others(prev.binding.pid, skip))
        for pid, bans in r.passed_bans.items():
            o = self.held[pid]
            o.binding = dataclasses.replace(o.binding, irqbalance_bans=carried_bans(o.binding.irqbalance_bans, [bans]))
        b = r.binding
        prev.binding = kept
        if not b.saved_irq_masks and b.irqbalance_bans is None:
            return
        try:
            step = restore_irq_masks(b.saved_irq_masks, proc_root=self.config.proc_root)
            if b.irqbalance_bans is not None:
                step = hand_back_bans(step, b.irqbalance_bans, self.config)
        except AscendbindError as exc:
            log.warning("giving back the IRQs of NPUs a re-bound worker left failed", pid=b.pid, error=str(exc))
            return
        log.info("re-bound worker's left NPUs given back", pid=b.pid, npus=list(b.npus),
                 irqs_restored=sorted(b.saved_irq_masks), outcome=step.outcome.value, detail=step.detail)

    def _restorable(self, h: Held) -> Binding:
        """``h.binding`` keeping only the saved IRQ masks of NPUs no other live worker owns,
        and only the irqbalance bans of IRQs no other live worker pins (those pass to it)."""
        return self._restoration(h).binding

    def _last_950(self, h: Held) -> bool:
        if h.binding.plan.mode is not Mode.ASCEND950_CLUSTER:
            return False
        return not any(o is not h and o.binding.plan.mode is Mode.ASCEND950_CLUSTER and self.is_alive(o)
                       for o in self.held.values())

    def _undo_gone(self, h: Held, reason: str) -> None:
        """Forget a worker that no longer exists; restore IRQ masks of NPUs nobody live owns."""
        self.mover.cancel(h.binding.pid, reason)
        r = self._restoration(h)
        b = r.binding
        if b.saved_irq_masks or b.irqbalance_bans or r.restore_uvb:
            try:
                release_binding(b, self.config, restore_irqs=True, restore_uvb=r.restore_uvb, pin=h.pin)
            except AscendbindError as exc:
                log.warning("restoring IRQ masks of a gone worker failed", pid=b.pid, error=str(exc))
        h.close()
        self.metrics.dropped_worker(reason)
        log.info("worker dropped", pid=b.pid, npus=list(b.npus), reason=reason,
                 irqs_restored=sorted(b.saved_irq_masks))

    def release_pid(self, pid: int, reason: str = "released") -> dict[str, Any]:
        """Give a held worker back to the host: its threads' original CPUs (through its pidfd),
        and the IRQ masks, bans and UVB masks no other live worker still needs. ``reason``
        labels the drop (a release, or a named NPU that npu-smi contradicts)."""
        with self.lock:
            h = self.held.get(pid)
            if h is None:
                raise ProcessGone(f"process {pid} is not bound by this daemon", code="not_bound")
            if not self.is_alive(h):
                self.held.pop(pid)
                self._undo_gone(h, "exited")
                self.save()
                return {"pid": pid, "steps": [], "note": "the process had exited; only IRQ masks were considered"}
            b = self._restorable(h)
            steps = release_binding(b, self.config, restore_irqs=True, restore_uvb=self._last_950(h), pin=h.pin)
            self.metrics.recycled_writes(steps[0] if steps else None)
            self.held.pop(pid)
            self.mover.cancel(pid, reason)
            h.close()
            self.metrics.dropped_worker(reason)
            self.save()
            # a released worker is another task now: at ``host`` it leaves the protected CPUs
            # like one just started, not at the next full sweep
            self.isolation.adopt(self, [pid])
        log.info("worker released", pid=pid, irqs_restored=sorted(b.saved_irq_masks), reason=reason)
        return {"pid": pid, "irqs_restored": sorted(b.saved_irq_masks), "steps": [s.to_json() for s in steps]}

    def drop(self, pid: int, reason: str) -> None:
        with self.lock:
            h = self.held.pop(pid, None)
            if h is None:
                return
            self._undo_gone(h, reason)
            self.save()

    # ---------------------------------------------------------- proof

    def prove_held(self, h: Held, why: str) -> None:
        """npu-smi now lists ``h``'s worker on its NPUs: an unproven binding becomes proven
        (watch/proof.py), so isolation starts for it, and the unproven workers sharing its
        NPUs are released as a proven bind would have evicted them (not with
        ``allow_shared_npu``). Kept unproven, with the reason, when isolating it would leave
        the host no housekeeping CPU. Under the lock; writes the state file."""
        with self.lock:
            if h.proof.proven or self.held.get(h.binding.pid) is not h:
                return
            host = self.hosts.known()
            if host is not None:
                plans = [o.binding.plan for o in self.held.values() if o is not h and o.proof.proven]
                refused = self.isolation.refusal(host, [*plans, h.binding.plan], self.config)
                if refused is not None:
                    h.proof = dataclasses.replace(h.proof, detail=f"{why}, but isolating it too would leave no "
                                                                  f"housekeeping CPU: {refused.reason}")
                    self.save()
                    return
            h.proof = prove(h.proof, "confirmed", why)
            log.info("binding proven by npu-smi; isolation applies to it", pid=h.binding.pid,
                     npus=list(h.binding.npus))
            sharers = [] if self.config.allow_shared_npu else [
                pid for pid, o in self.held.items() if o is not h and not o.proof.proven
                and set(o.binding.npus) & set(h.binding.npus) and self.is_alive(o)]
            for pid in sharers:
                log.warning("unproven holder evicted", pid=pid, by=h.binding.pid)
                self.release_pid(pid, reason="evicted")
            if irqs_unproven(h.binding):
                self._bind_irqs_now(h, host)
            self.save()

    def _bind_irqs_now(self, h: Held, host) -> None:
        """The IRQ step a binding left out while nothing proved it, run now that it is proven
        (under the lock): written ahead like a bind (its in-flight record holds the masks it
        will change, read first, or a holder's saved ones for them), and its result, masks,
        IRQ writes and bans become the held binding's, so a release puts them back."""
        if host is None:
            log.warning("binding proven, host facts not known yet; its IRQs stay as they are",
                        pid=h.binding.pid)
            return
        config = h.facts[2] if h.facts is not None else self.config
        sharers = [o for pid, o in self.held.items() if o is not h and set(o.binding.npus) & set(h.binding.npus)
                   and not irqs_unproven(o.binding) and self.is_alive(o)]
        with self.write_ahead(h.binding.pid, h.pin) as record:
            bound = bind_irqs_of(h.binding, host, config, npu_irqs=self.hosts.npu_irqs, record=record)
        h.binding = self._inherit(bound, [h], sharers)
        irq = bound.step(Step.IRQ)
        if any(b.status == "failed" for b in bound.irqs):
            self.hosts.forget_irqs()
        if irq is not None:
            self.metrics.step_results([irq])
        log.info("binding proven; its NPU's IRQs bound", pid=h.binding.pid, npus=list(h.binding.npus),
                 outcome=irq.outcome.value if irq else None, irqs=[b.irq for b in bound.irqs])

    # ---------------------------------------------------------- a look's actions

    def act(self, h: Held, actions, *, window: float = 0.0) -> bool:
        """Execute what lifecycle.decide asked for ``h`` (under the lock); True when the
        state file must be written. ``window``: the re-assert window, for the log."""
        with self.lock:
            if self.held.get(h.binding.pid) is not h:
                return False  # released or replaced since the look
            dirty = False
            for a in actions:
                if isinstance(a, Drop):
                    self.held.pop(h.binding.pid, None)
                    self._undo_gone(h, a.reason)
                    return True
                if isinstance(a, PinThreads):
                    self._pin_late(h, a)
                elif isinstance(a, Reassert):
                    self._reassert(h, a)
                    dirty = True
                elif isinstance(a, LeaveAlone):
                    self._leave_alone(h, a, window)
                    dirty = True
                elif isinstance(a, NoteLocality):
                    self._note_locality(h, a)
            return dirty

    def _pin_late(self, h: Held, a: PinThreads) -> None:
        b = h.binding
        tids = [tid for tid, _ in a.threads]
        self.metrics.recycled_writes(bind_threads(b.pid, merge_npu_plans(b.plan.npus), b.plan.mode,
                                                  proc_root=self.config.proc_root, only_tids=tids, pin=h.pin,
                                                  classes=b.plan.thread_classes))
        self._remember(h, a.threads)
        h.late_threads += len(tids)
        self.metrics.late_threads.inc(len(tids))
        log.info("late threads pinned", pid=b.pid, tids=tids[:20], count=len(tids))

    def _count_drift(self, h: Held, a: Reassert | LeaveAlone) -> None:
        h.drift_events += 1
        self.metrics.drifted(a.blame.culprit)
        if a.what == "irqs":
            h.irq_culprit = a.blame.culprit
            h.irq_reasserts = deque(a.times)
        else:
            h.culprit, h.blame = a.blame.culprit, a.blame.why
            h.reasserts = deque(a.times)

    def _reassert(self, h: Held, a: Reassert) -> None:
        self._count_drift(h, a)
        b = h.binding
        if a.what == "irqs":
            for irq, cpus in a.irqs:
                set_irq_affinity(irq, cpus, proc_root=self.config.proc_root)
            what = f"IRQ masks {[irq for irq, _ in a.irqs]}"
        else:
            self.metrics.recycled_writes(bind_threads(b.pid, merge_npu_plans(b.plan.npus), b.plan.mode,
                                                      proc_root=self.config.proc_root, only_tids=list(a.tids),
                                                      pin=h.pin, classes=b.plan.thread_classes))
            self._remember(h, [(tid, h.threads[tid].role) for tid in a.tids if tid in h.threads])
            what = f"{len(a.tids)} thread masks of {b.pid}"
        self.metrics.reasserts.inc()
        log.info("drift re-asserted", pid=b.pid, what=what, culprit=a.blame.culprit)

    def _leave_alone(self, h: Held, a: LeaveAlone, window: float) -> None:
        self._count_drift(h, a)
        if a.what == "irqs":
            h.irqs_left_alone, h.irqs_left_alone_why = True, a.why
        else:
            h.left_alone, h.left_alone_why = True, a.why
        log.warning("masks keep moving; no longer re-asserting them", pid=h.binding.pid,
                    what="IRQ masks" if a.what == "irqs" else "thread masks", culprit=a.blame.culprit,
                    reasserts=len(a.times), window_seconds=window, why=a.why)

    def _remember(self, h: Held, threads) -> None:
        """Record the masks the kernel kept after we set them (read back: a cpuset may narrow them)."""
        cpus = role_cpus(h.binding.plan)
        for tid, role in threads:
            try:
                mask = accepted(os.sched_getaffinity(tid), cpus[role])
            except OSError:
                h.threads.pop(tid, None)  # exited meanwhile
                continue
            # the role we pinned for: if the thread renamed itself meanwhile, its next
            # (young) look sees a role that differs and moves it again
            prev = h.threads.get(tid)
            if prev is not None:
                prev.mask, prev.role = mask, role
            else:
                h.threads[tid] = SeenThread(mask, role)

    # ---------------------------------------------------------- locality

    def _note_locality(self, h: Held, a: NoteLocality) -> None:
        h.memory_checked_at = a.at
        h.memory_local_ratio = a.ratio
        h.memory_residency = a.residency
        if a.reset_futile:
            h.memory_futile = 0
        self.metrics.memory_local(ratios_by_npu(self.held.values()))

    # ---------------------------------------------------------- memory moves

    def move_memory(self, h: Held, node: int, why: str, *, ratio_before: float | None = None):
        """Mark ``h`` as moving its pages to ``node`` and queue the move (under the lock, so a
        release cannot slip between the two); the job, or None once the mover is closed."""
        with self.lock:
            if self.held.get(h.binding.pid) is not h:
                return None
            job = self.mover.submit(h, node, why, ratio_before=ratio_before)
            if job is not None:
                h.memory_move = (node, why)
            return job

    def rerun_memory(self, h: Held, node: int, now: float, due):
        """Queue a rerun of ``h``'s memory step when ``due(record)`` still says so (never
        twice at once); the move job, or None."""
        with self.lock:
            if self.held.get(h.binding.pid) is not h or not due(h.record()):
                return None
            h.memory_last_run = now
            return self.move_memory(h, node, "rerun", ratio_before=h.memory_local_ratio)

    def memory_moved(self, job, result: StepResult | None, *, seconds: float = 0.0) -> None:
        """A move ended (``result`` None: cancelled before it started): count it, and record
        it on the worker it was for, unless that worker is no longer held as it was, or the
        daemon is stopping (the mark stays in the state file; the next daemon moves on)."""
        cancelled = result is None or result.reason is Reason.MOVE_CANCELLED
        self.metrics.memory_move("cancelled" if cancelled else result.outcome.value,
                                 job.progress.bytes_moved if job.progress else 0, seconds if result else None)
        if result is not None:
            log.info("memory moved" if result.outcome is Outcome.APPLIED else "memory not moved", pid=job.pid,
                     why=job.why, node=job.node, outcome=result.outcome.value,
                     reason=result.reason.value if result.reason else None, detail=result.detail,
                     seconds=round(seconds, 3))
        if cancelled and job.cancel.why == STOPPING:
            return
        with self.lock:
            h = self.held.get(job.pid)
            newer = self.mover.job(job.pid)
            if h is not job.held or (newer is not None and newer is not job):
                return  # released, replaced, or this move was superseded by another (a re-plan)
            h.memory_move = None
            if result is not None:
                b = h.binding
                result = dataclasses.replace(result, data=frozen_map({
                    **result.data, "why": job.why, "started_at": None if job.started_at is None else
                    round(job.started_at, 3), "finished_at": round(time.time(), 3)}))
                h.binding = dataclasses.replace(b, steps=tuple(result if s.step is Step.MEMORY else s
                                                               for s in b.steps))
                self.metrics.step_results([result])
            self.save()
        if job.why == "rerun" and result is not None:
            self.metrics.memory_rerun(result.outcome.value)
        if result is None or self.config.memory_check_seconds <= 0:
            return
        # the locality right after the move: what status shows, and whether a rerun helped
        after = self.locality.measure(h, time.monotonic())
        if job.why == "rerun":
            futile = self.locality.futile(job.ratio_before, after)
            with self.lock:
                if self.held.get(job.pid) is h:
                    h.memory_reruns += 1
                    if futile:
                        h.memory_futile += 1

    def forget_locality(self) -> None:
        """The check is switched off: no stale ratios."""
        with self.lock:
            if any(h.memory_local_ratio is not None for h in self.held.values()):
                for h in self.held.values():
                    h.memory_local_ratio = None
                    h.memory_checked_at = None
                self.metrics.memory_local({})

    # ---------------------------------------------------------- re-plan

    def rebound(self, h: Held, binding: Binding, facts: tuple, masks) -> None:
        """``h`` bound again by a re-plan (under the lock): the new binding keeps the host's
        originals of the old one (``_inherit``), and the thread cache starts over. The state
        file is written at once: it replaces the re-plan's in-flight record (write-ahead)."""
        with self.lock:
            h.binding = self._inherit(binding, [h])
            h.bound_at = time.time()
            h.remember_threads(masks, role_cpus(binding.plan), binding.plan.thread_classes)
            h.facts = facts
            self.save()

    def replan_cpuset(self, h: Held, a: Replan) -> Replanned:
        """Plan ``h`` again because its cpuset, or kubelet's checkpoint, changed (lifecycle's
        ``Replan``; called outside the lock: the worker's facts are read). The kernel's move
        of its threads is blamed ``cpuset``, never a tool; the re-plan starts the binding's
        drift verdicts over, and a cpuset no plan fits leaves the threads alone until the
        cpuset changes again. A checkpoint change re-plans only a worker the new proof moves
        onto its own cpuset (planned by the placement rules, or stuck): a lost proof with an
        unchanged cpuset is kubelet writing its checkpoint before the container's cgroup,
        whose change re-plans the worker."""
        news = a.news
        try:
            host = self.hosts.get()
        except AscendbindError as exc:
            log.warning("cpuset changed, host facts unavailable; binding kept", pid=h.binding.pid, error=str(exc))
            return Replanned("failed", None, str(exc))
        wanted = None
        if news.why == "checkpoint_changed":
            stuck, old = h.cpuset_stuck is not None, h.binding.plan.pool_source
            wanted = lambda plan, _worker: plan.pool_source is not None and (old is None or stuck)  # noqa: E731
        done = replan_worker(self, h, host, reason=news.why, wanted=wanted)
        if done.outcome in ("gone", "skipped") or (news.why == "checkpoint_changed" and done.outcome == "failed"):
            return done
        with self.lock:
            if self.held.get(h.binding.pid) is not h:
                return done
            self._cpuset_verdict(h, a, done)
            self.save()
        return done

    def _cpuset_verdict(self, h: Held, a: Replan, done: Replanned) -> None:
        """Record what a re-plan for a changed cpuset came to on ``h`` (under the lock)."""
        news = a.news
        h.cpuset_seen = done.allowed if done.allowed is not None else news.after
        if a.blame is not None:  # the kernel moved the threads
            if news.moved:
                h.drift_events += 1
                self.metrics.drifted(a.blame.culprit)
            h.culprit, h.blame = a.blame.culprit, a.blame.why
        h.reasserts.clear()
        if done.outcome == "failed":
            h.cpuset_stuck = done.error or "no plan"
            h.left_alone = True
            h.left_alone_why = (f"the worker's cpuset is now CPUs {format_cpulist(h.cpuset_seen)} and no plan fits it "
                                f"({h.cpuset_stuck}); its threads stay where the kernel put them until the cpuset or "
                                f"kubelet's checkpoint changes again. Fix: {FIX['cpuset']}")
            log.warning("cpuset changed; no plan fits it, threads left where the kernel put them",
                        pid=h.binding.pid, cpuset=format_cpulist(h.cpuset_seen), why=news.why, error=done.error)
            return
        h.cpuset_stuck = None
        h.left_alone, h.left_alone_why = False, None
        log.info("cpuset changed; worker planned again" if done.outcome == "rebound" else
                 "cpuset changed; the plan stands", pid=h.binding.pid, why=news.why,
                 before=format_cpulist(news.before), after=format_cpulist(h.cpuset_seen), outcome=done.outcome)
