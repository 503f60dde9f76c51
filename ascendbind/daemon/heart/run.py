"""The effect runner: what ``step`` decided, done on the host (under the daemon's lock).

The ``Daemon`` steps its table, keeps the new one, and hands the effects here
with the records that just left the table (``leaving``: their pidfds decide
whether a write still reaches the worker, and are closed here). Its
collaborators are explicit: the config, the metrics, the mover, isolation, the
host cache, the state file, and the records still held (``records``).

``commit`` is the one place the daemon writes its state file and the one place it
reaches isolation's mutating side: isolation follows the table after every change
(and records each mask in the state file before writing it), a bound worker's
threads are handed over, a released one is adopted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import structlog

from ...applier import release_binding
from ...applier.affinity import bind_threads
from ...applier.bind import merge_npu_plans
from ...applier.irq import hand_back_bans, restore_irq_masks, set_irq_affinity
from ...discovery.read.bounded import task_affinity
from ...errors import AscendbindError, ConfigError
from ..watch.held import Held, SeenThread, accepted
from ..watch.lifecycle import MASK_LABELS, LeaveAlone, NoteLocality, PinThreads, Reassert
from ..watch.locality import ratios_by_npu
from ..watch.observe import role_cpus
from .effects import (BindIrqs, CancelMove, Effect, FollowIsolation, Forget, Metric, Note, Persist, QueueMove,
                      Remember, RestoreAffinity, RestoreIrqs)

__all__ = ["EffectRunner", "Ran"]

log = structlog.get_logger("ascendbind.daemon")


@dataclass
class Ran:
    """What a run did: each released worker's steps (pid -> results), whether the state
    file is due (``persist``), and what isolation is to be told."""

    steps: dict[int, tuple] = field(default_factory=dict)
    restored: dict[int, list[int]] = field(default_factory=dict)  # pid -> the IRQs whose masks went back
    persist: bool = False
    adopt: tuple[int, ...] = ()
    hand_over: tuple[int, ...] = ()


class EffectRunner:
    def __init__(self, *, config, metrics, mover, isolation, hosts, state, records: Callable[[], Mapping[int, Held]],
                 bind_irqs: Callable[[Held, list[Held]], None], poke: Callable[[], None]) -> None:
        self.config, self.metrics, self.mover, self.isolation = config, metrics, mover, isolation
        self.hosts, self.state, self.records = hosts, state, records
        self.bind_irqs, self.poke = bind_irqs, poke
        self._window = 0.0  # the re-assert window of the look being run, for the log
        self._saved_held: frozenset[int] = frozenset()

    # ---------------------------------------------------------- the run

    def run(self, effects: Iterable[Effect], leaving: Mapping[int, Held] = {}, *, window: float = 0.0) -> Ran:
        """Do ``effects`` in order; ``Persist`` and ``FollowIsolation`` are gathered for
        ``commit`` (the caller's, once the run is over). ``window``: a look's re-assert
        window, for the log."""
        ran = Ran()
        self._window = window
        for e in effects:
            kind = type(e)
            if kind is Persist:
                ran.persist = True
            elif kind is FollowIsolation:
                ran.adopt += e.adopt
                ran.hand_over += e.hand_over
            else:
                self._DO[kind](self, e, leaving, ran)
        return ran

    def _restore_affinity(self, e: RestoreAffinity, leaving, ran: Ran) -> None:
        h = leaving.get(e.binding.pid)
        steps = release_binding(e.binding, self.config, restore_irqs=e.restore_irqs, restore_uvb=e.restore_uvb,
                                pin=h.pin if h is not None else None)
        self.metrics.recycled_writes(steps[0] if steps else None)
        ran.steps[e.binding.pid] = steps
        ran.restored[e.binding.pid] = sorted(e.binding.saved_irq_masks) if e.restore_irqs else []

    def _restore_irqs(self, e: RestoreIrqs, leaving, ran: Ran) -> None:
        b = e.binding
        try:
            if e.why == "left":  # the worker keeps its threads where they are: only the IRQs go back
                step = restore_irq_masks(b.saved_irq_masks, proc_root=self.config.proc_root)
                if b.irqbalance_bans is not None:
                    step = hand_back_bans(step, b.irqbalance_bans, self.config)
                log.info("re-bound worker's left NPUs given back", pid=b.pid, npus=list(b.npus),
                         irqs_restored=sorted(b.saved_irq_masks), outcome=step.outcome.value, detail=step.detail)
                return
            h = leaving.get(b.pid)
            release_binding(b, self.config, restore_irqs=True, restore_uvb=e.restore_uvb,
                            pin=h.pin if h is not None else None)
        except AscendbindError as exc:
            log.warning("giving back the IRQs of NPUs a re-bound worker left failed" if e.why == "left" else
                        "restoring IRQ masks of a gone worker failed", pid=b.pid, error=str(exc))

    def _queue_move(self, e: QueueMove, leaving, ran: Ran) -> None:
        h = self.records().get(e.pid)
        if h is not None:
            self.queue_move(h, e.node, e.why)

    def queue_move(self, h: Held, node: int, why: str, *, ratio_before: float | None = None):
        """Mark ``h`` as moving its pages to ``node`` and queue the move; the job, or None
        once the mover is closed."""
        job = self.mover.submit(h, node, why, ratio_before=ratio_before)
        if job is not None:
            h.memory_move = (node, why)
        return job

    def _cancel_move(self, e: CancelMove, leaving, ran: Ran) -> None:
        self.mover.cancel(e.pid, e.why)

    def _forget(self, e: Forget, leaving, ran: Ran) -> None:
        h = leaving.get(e.pid)
        if h is not None:
            h.close()
        if e.why is not None:
            self.metrics.dropped_worker(e.why)

    def _metric(self, e: Metric, leaving, ran: Ran) -> None:
        getattr(self.metrics, e.name)(e.label)

    def _note(self, e: Note, leaving, ran: Ran) -> None:
        getattr(log, e.level)(e.event, **e.fields)

    def _bind_irqs(self, e: BindIrqs, leaving, ran: Ran) -> None:
        records = self.records()
        self.bind_irqs(records[e.pid], [records[p] for p in e.sharers if p in records])

    # ---------------------------------------------------------- a look's actions

    def _remember(self, e: Remember, leaving, ran: Ran) -> None:
        h = self.records().get(e.pid)
        if h is None:
            return
        a = e.action
        if isinstance(a, PinThreads):
            self._pin_late(h, a)
        elif isinstance(a, Reassert):
            self._reassert(h, a)
        elif isinstance(a, LeaveAlone):
            h.count_drift(a.what, a.blame, a.times)
            self.metrics.drifted(a.blame.culprit)
            h.leave_alone(a.what, a.why)
            log.warning("masks keep moving; no longer re-asserting them", pid=h.binding.pid,
                        what=MASK_LABELS[a.what], culprit=a.blame.culprit,
                        reasserts=len(a.times), window_seconds=self._window, why=a.why)
        elif isinstance(a, NoteLocality):
            h.note_locality(a.ratio, a.at, a.residency, reset_futile=a.reset_futile)
            self.metrics.memory_local(ratios_by_npu(self.records().values()))

    def _bind_threads(self, h: Held, tids: list[int]) -> None:
        b = h.binding
        self.metrics.recycled_writes(bind_threads(b.pid, merge_npu_plans(b.plan.npus), b.plan.mode,
                                                  proc_root=self.config.proc_root, only_tids=tids, pin=h.pin,
                                                  classes=b.plan.thread_classes))

    def _pin_late(self, h: Held, a: PinThreads) -> None:
        tids = [tid for tid, _ in a.threads]
        self._bind_threads(h, tids)
        remember(h, a.threads)
        h.late_threads += len(tids)
        self.metrics.late_threads.inc(len(tids))
        log.info("late threads pinned", pid=h.binding.pid, tids=tids[:20], count=len(tids))

    def _reassert(self, h: Held, a: Reassert) -> None:
        h.count_drift(a.what, a.blame, a.times)
        self.metrics.drifted(a.blame.culprit)
        if a.irqs:
            for irq, cpus in a.irqs:
                set_irq_affinity(irq, cpus, proc_root=self.config.proc_root)
        if a.tids:
            self._bind_threads(h, list(a.tids))
            remember(h, [(tid, h.threads[tid].role) for tid in a.tids if tid in h.threads])
        what = f"IRQ masks {[irq for irq, _ in a.irqs]}" if a.irqs else f"{len(a.tids)} thread masks of {h.binding.pid}"
        self.metrics.reasserts.inc()
        log.info("drift re-asserted", pid=h.binding.pid, what=what, culprit=a.blame.culprit)

    _DO: dict[type, Callable] = {RestoreAffinity: _restore_affinity, RestoreIrqs: _restore_irqs,
                                 QueueMove: _queue_move, CancelMove: _cancel_move, Forget: _forget,
                                 Metric: _metric, Note: _note, BindIrqs: _bind_irqs, Remember: _remember}

    # ---------------------------------------------------------- the commit

    def commit(self, *, adopt: tuple[int, ...] = (), hand_over: Iterable[int] = (),
               later: list[Callable[[], None]] | None = None) -> None:
        """Follow the table (under the daemon's lock): isolation first (it records each mask
        in the state file before writing it), then the state file with every held record,
        the gauges, and the reconcile loop's poke when the set of records changed
        (``later``: a bind's work for after its answer, where the poke goes). ``hand_over``:
        threads of a worker just bound, isolation's no longer; ``adopt``: released workers,
        other tasks now, off the protected CPUs like any task just started."""
        held = self.records()
        if hand_over:
            self.isolation.hand_over(hand_over)
        persist = self._writer(held)
        try:
            # isolation follows the table; it writes the state file (persist) before any mask
            self.isolation.commit(self.hosts.known(), [h.binding for h in held.values()], self.config, persist,
                                  isolating=frozenset(pid for pid, h in held.items() if h.proof.proven))
            persist()
        except (OSError, ConfigError) as exc:
            # bindings stay in force; the next change retries the write
            log.error("could not write the state file", path=self.state.path,
                      error=exc.strerror if isinstance(exc, OSError) else str(exc))
        self.metrics.bound_workers.set(len(held))
        ids = frozenset(map(id, held.values()))
        if ids != self._saved_held:  # a worker bound, bound again or gone: the loop looks now
            self._saved_held = ids
            if later is None:
                self.poke()
            else:
                later.append(self.poke)
        # a released or gone worker's locality series goes with it
        self.metrics.memory_local(ratios_by_npu(held.values()))
        if adopt:
            self.adopt(adopt)

    def adopt(self, pids: Iterable[int]) -> dict[str, int]:
        """At ``host``: the tasks of ``pids`` (just started, just released) leave the protected
        CPUs, each mask in the state file before it is written (under the daemon's lock)."""
        held = self.records()
        return self.isolation.adopt(list(pids), [h.binding for h in held.values()], self.config,
                                    self._writer(held))

    def stop_isolation(self) -> None:
        """The daemon stops: every mask isolation changed goes back (bindings stay)."""
        held = self.records()
        self.isolation.stop(self.config, self._writer(held))

    def _writer(self, held: Mapping[int, Held]) -> Callable[[], None]:
        """Isolation's ``persist``: the state file with ``held``'s records, encoded once however
        often isolation writes it, beside isolation's record as it is at each write."""
        records = [h.state_record() for h in held.values()]
        return lambda: self.state.save_encoded(records, isolation=self.isolation.state_json())


def remember(h: Held, threads) -> None:
    """Record the masks the kernel kept after we set them (read back: a cpuset may narrow them)."""
    cpus = role_cpus(h.binding.plan)
    for tid, role in threads:
        try:
            mask = accepted(task_affinity(tid), cpus[role])
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


