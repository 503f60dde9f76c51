"""The ``Daemon``: the held table, the requests that change it, and its keeping.

``Daemon.held`` maps pid -> ``Held`` (watch/held.py): the binding and its proof,
which the table's rules weigh, plus the reconcile loop's memory of the worker.
Every change to it is a step of the table (step.py): a request entry point
observes (reads the worker, writes its masks through the applier), says what it
saw as an event, keeps the table ``step`` returns, and ``run``s the effects,
all under ``Daemon.lock``; the state file is written before the lock is let go,
so what is on disk is what the daemon holds. The HTTP server, the reconcile loop,
the locality check, re-planning and auto-bind call in here; they read the table
through ``reader`` (table.py) and never take the lock or touch a record's binding.

Identity: a request observes its target once (discovery's ``ProcessView``: pid,
start time, kernel thread flag, uids, status, cpuset, environ, threads) and
carries that one value through authorization, the worker's facts, binding and
the held record; a start time that changes on the way is a 409 ``pid_recycled``.
A bind's observation also pins the process (discovery/read/pin.py): the applier
binds through that pidfd and confirms its writes against it, undoing any that
reached a newcomer; a worker gone by then is never held (409 ``pid_recycled``,
404 ``pid_gone``). The held record keeps a copy, and wherever the worker is
recognised again its pidfd decides, whatever the start time says. A restarted
daemon pins each worker again, proven by the start time and, with pidfs, the
pidfd inode the state file kept.

Ownership (step.py's rules): one live worker per NPU unless
``allow_shared_npu``; a dead owner is replaced (its saved IRQ masks carried
over); an unproven holder, or one npu-smi does not list while it lists the
newcomer, is evicted; IRQ masks and irqbalance bans go back only when no live
worker needs them; a worker bound again keeps its first ``original_cpus`` and
first saved IRQ masks, so release always returns to the state before ascendbind.

Write-ahead: a bind is in the state file before its first write. Once every
check has passed, the applier hands over the binding as it stands before any
write (``record``); ``write_ahead`` gives it the host's originals the table
already knows (step.with_originals) and writes it as an *in-flight* record, in
place of the worker's earlier record if any. The bind's own commit at its end
replaces it with the held record. A daemon killed in between leaves the
in-flight record, and the next daemon undoes it at start (``restore``): the
worker's threads go back to its original CPUs, the IRQ masks it recorded back to
what they were (those of NPUs no other live worker owns), its bans back to
irqbalance. Undone, not completed: whatever subset of the writes landed,
undoing needs only what the record holds; and the caller's request died with
the daemon unanswered, so "not bound" is what it was told. A bind that fails
after its record is undone the same way at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import structlog

from ...applier.bind import apply_observed, bind_irqs_of, unproven_irqs
from ...applier.irq import with_planned_irqs
from ...discovery.gather.identity import refuse_non_worker, require_live, verify_identity
from ...discovery.gather.process import ProcessView, observe_process, read_identity, thread_masks
from ...errors import AscendbindError, ConfigError, NotPermitted, PlanImpossible, ProcessGone, UsageError
from ...planner import make_plan
from ...values.config import Config
from ...values.cpulist import format_cpulist
from ...values.frozen import frozen_map
from ...values.model import Binding, ProcessIdentity, StepResult
from ...values.reasons import Outcome, Reason, Step
from ...values.targeting import TargetRequest
from ..api.auth import Peer, authorize
from ..api.contention import Contention
from ..api.metrics import BindClock, Metrics
from ..api.requests import (PlanAsk, _int_field, alignment_of, outcome_of_error, parse_bind_request,
                            recycled_is_a_conflict)
# imported here, not at the first request: Python 3.9 lets a second thread that imports a module
# while a first is still running it see it half made (ImportError "partially initialized module")
from ..api.status import workers_answer
from ..host.hostcache import HostCache
from ..host.replan import Replanned as ReplanOutcome, replan_worker
from ..isolate.keeper import Isolation
from ..state.state import StateFile, encode_record
from ..state.staterecord import IN_FLIGHT, binding_to_json
from ..watch.blame import FIX
from ..watch.held import Held
from ..watch.lifecycle import Drop, LeaveAlone, NoteLocality, PinThreads, Reassert, Replan
from ..watch.locality import MemoryLocality
from ..watch.memmove import STOPPING, MemoryMover
from ..watch.npucheck import NpuChecker
from ..watch.observe import role_cpus
from ..watch.proof import kept_on_rebind, proof_of
from .effects import Effect, Forget, Note, RestoreAffinity
from .events import Bound, Event, Gone, Looked, MemoryMoved, NpuChecked, Released, Replanned
from .facts import facts_of, targets_of, view_of
from .run import EffectRunner, Ran
from .startup import load_records
from .step import (claim, first_allowance, holders, inherit, last_950, leave, pass_bans, restoration_of, step,
                   with_originals)
from .table import Holding, Reader, Table

__all__ = ["Daemon"]

log = structlog.get_logger("ascendbind.daemon")

# plan errors that mean "refused by the topology policy": counted failed, plus an alignment failure
_POLICY_REFUSALS = ("topology_rejected", "too_many_numa_nodes")
# a look's actions that are the table's ``Looked`` (a drop is ``Gone``; re-plans and reruns run elsewhere)
_LOOKED = (PinThreads, Reassert, LeaveAlone, NoteLocality)
_TID = operator.attrgetter("tid")


class Daemon:
    def __init__(self, config: Config, *, metrics: Metrics | None = None, source=None,
                 before_writes: Callable[[int], None] | None = None, confine_self: bool = False) -> None:
        self._config = config
        # the applier's hooks right before a bind's first write (apply_observed): tests recycle the pid
        # there; and between its steps, naming the next (tests kill the daemon at these points)
        self.before_writes = before_writes
        self.among_writes: Callable[[int, Step], None] | None = None
        self.metrics = metrics or Metrics()
        self.hosts = HostCache(config, self.metrics, source=source)
        self.state = StateFile(config.state_dir, proc_root=config.proc_root)
        self.lock = threading.RLock()
        self.held: dict[int, Held] = {}
        # what the rooms read the table through: copies made under the lock, never the lock
        self.reader = Reader(self._locked, lambda: self.held, self._table)
        self.contention = Contention(self)  # what the held workers get of their CPUs, read at scrape time
        self.metrics.attach(self.contention)
        self.started = time.time()
        self.hotplug_status = "off"
        # set by the service to its hot-plug debouncer: a burst of uevents not yet acted upon
        self.rediscovery_pending: Callable[[], bool] = lambda: False
        # set by the service to its reconcile loop's thread-events source: how the loop learns of threads
        self.reconcile_mode: Callable[[], dict[str, str | None]] = lambda: {"mode": "listing", "reason": "not_started"}
        # and how it learns of one worker's threads (its event budget): for /v1/workers
        self.thread_events_of: Callable[[int], dict[str, Any] | None] = lambda pid: None
        self.pid = os.getpid()
        # set by the service to its reconcile loop's poke: the held table changed
        self.held_changed: Callable[[], None] = lambda: None
        # the memory step's moves, in the background (memmove.py), and the locality check
        # that measures where a worker's memory is and asks for reruns (locality.py)
        self.mover = MemoryMover(self)
        self.locality = MemoryLocality(self)
        # a bind that names its NPU, checked against npu-smi's process table after its answer
        self.npu_check = NpuChecker(self)
        # the rest of the host off the bound workers' CPUs; ``confine_self``: this process is the
        # daemon, whose own threads follow the housekeeping CPUs (never a test's in-process Daemon)
        self.isolation = Isolation(confine_self=confine_self, tasks_gauge=self.metrics.isolation_tasks)
        self.runner = EffectRunner(config=config, metrics=self.metrics, mover=self.mover, isolation=self.isolation,
                                   hosts=self.hosts, state=self.state, records=lambda: self.held,
                                   bind_irqs=self._bind_irqs_now, poke=lambda: self.held_changed())

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        """A reloaded config (SIGHUP) reaches the effect runner too: the next commit follows
        its isolation level, the next restore its IRQ settings."""
        self._config = config
        self.runner.config = config

    def adopt_tasks(self, pids: Iterable[int]) -> dict[str, int]:
        """At ``host``: the tasks of ``pids`` (just started) leave the protected CPUs."""
        with self.lock:
            return self.runner.adopt(pids)

    def stop_isolation(self) -> None:
        """The daemon stops: every mask isolation changed goes back (bindings stay)."""
        with self.lock:
            self.runner.stop_isolation()

    def close(self) -> None:
        """Stop the background parts: moving pages stop before their next chunk (their marks
        stay in the state file), the locality thread ends after its round; then let go of
        the workers' pidfds (the daemon is ending: the state file remembers them)."""
        self.mover.close()
        self.locality.close()
        self.npu_check.close()
        with self.lock:
            for h in self.held.values():
                h.close()

    # ---------------------------------------------------------- the table

    def _locked(self, read: Callable[[], Any]) -> Any:
        with self.lock:
            return read()

    def _table(self) -> Table:
        return Table.of(Holding(h.binding, h.proof) for h in self.held.values())

    def _live(self) -> frozenset[int]:
        """The held pids whose process is still the one bound (their pidfds, or start times, say so)."""
        return frozenset(pid for pid, h in self.held.items() if self.is_alive(h))

    def _submit(self, event: Event, *, fresh: dict[int, Held] | None = None,
                later: list[Callable[[], None]] | None = None, commit: bool = True) -> Ran:
        """Step the table with ``event``, keep the table it returns, and run its effects
        (under the lock). ``fresh``: the new records the event brings (a bind's).
        ``commit`` False: the caller writes the state file later (a pass of looks)."""
        with self.lock:
            table, effects = step(self._table(), event)
            return self.run(effects, self._keep(table, fresh or {}), later=later, commit=commit)

    def _keep(self, table: Table, fresh: dict[int, Held]) -> dict[int, Held]:
        """Make the records follow ``table``: each keeps its binding and proof, the ones
        not in it leave, ``fresh`` ones come in (in place of an earlier record at their
        pid). Returns the records that left, pid -> record, for the effects to close."""
        leaving: dict[int, Held] = {}
        for pid in list(self.held):
            now = table.get(pid)
            if now is None or pid in fresh:
                leaving[pid] = self.held.pop(pid)
                continue
            h = self.held[pid]
            h.binding, h.proof = now.binding, now.proof
        for pid, h in fresh.items():
            now = table.held[pid]
            h.binding, h.proof = now.binding, now.proof
            self.held[pid] = h
        return leaving

    def run(self, effects: tuple[Effect, ...] | list[Effect], leaving: dict[int, Held] | None = None, *,
            later: list[Callable[[], None]] | None = None, commit: bool = True, window: float = 0.0) -> Ran:
        """Do what ``step`` asked, under the one lock; then, unless ``commit`` is False, the
        state file and isolation follow (``EffectRunner.commit``). ``leaving``: the records
        that just left the table."""
        with self.lock:
            ran = self.runner.run(effects, leaving or {}, window=window)
            if ran.adopt or ran.hand_over or (commit and ran.persist):
                self.runner.commit(adopt=ran.adopt, hand_over=ran.hand_over, later=later)
        return ran

    def commit(self, timeout: float | None = None, *, later: list[Callable[[], None]] | None = None) -> bool:
        """Commit the held table as it stands: isolation follows it, then the state file and the
        gauges (``EffectRunner.commit``, the one place either is reached); with ``timeout``,
        give up (False) when the lock is not had within it (a stop that cannot wait).
        ``later``: a bind's work for after its answer, where the reconcile loop's poke goes."""
        if not self.lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            self.runner.commit(later=later)
        finally:
            self.lock.release()
        return True

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
        with self.lock:
            records, live, flying, bad = load_records(loaded.workers, self.config.proc_root)
            self.held = {h.binding.pid: h for h in records}
            for pid in sorted(set(self.held) - live):
                self._submit(Gone(pid, live, "exited"), commit=False)
            gone = len(records) - len(self.held)
            self._undo_interrupted(flying)
            self._release_non_workers()
            kept = len(self.held)
            self._resume()
            self.commit()
        for _ in range(loaded.other_boot):
            self.metrics.dropped_worker("other_boot")
        log.info("state restored", kept=kept, dropped_gone=gone, dropped_other_boot=loaded.other_boot,
                 skipped_malformed=bad, moved_aside=loaded.moved_aside or tidied.get("moved_aside"))
        return {"kept": kept, "gone": gone, "other_boot": loaded.other_boot, "malformed": bad}

    def _undo_interrupted(self, flying: set[int]) -> None:
        """Undo the binds a killed daemon left in flight (their workers still live)."""
        for pid in sorted(flying & set(self.held)):
            h = self.held[pid]
            leaving = self._keep(self._table().without(pid), {})
            self._roll_back(h, "restart")
            self.run([Forget(pid, "interrupted")], leaving, commit=False)

    def _release_non_workers(self) -> None:
        """A record whose process is no worker (bound by a daemon that did not refuse it):
        undone, never kept."""
        for pid in list(self.held):
            ident = read_identity(pid, self.config.proc_root)
            why = ident.not_a_worker(self.pid) if ident is not None else None
            if not why:
                continue
            table, r = leave(self._table(), pid, self._live())
            self.run([RestoreAffinity(r.binding, restore_irqs=True), Forget(pid, "released"),
                      Note("warning", "state entry is no worker; released", frozen_map({"pid": pid, "reason": why}))],
                     self._keep(table, {}), commit=False)

    def _resume(self) -> None:
        """What a restarted daemon takes up again for the records it keeps."""
        for h in self.held.values():
            if h.memory_move is not None:  # stopped before its pages moved: move them now
                self.move_memory(h, h.memory_move[0], "restart")
            if not h.proof.proven:  # npu-smi may list it by now (watch/proof.py)
                self.npu_check.submit(h.binding.pid, h.binding.start_time, h.binding.npus, None, None, None)

    # ---------------------------------------------------------- write-ahead

    @contextlib.contextmanager
    def write_ahead(self, pid: int, pin) -> Iterator[Callable[[Binding], None]]:
        """The applier's ``record`` for a bind of ``pid`` (under the lock): writes the bind as
        in flight before its first write. A bind that fails after that is undone here, unless
        an earlier binding of the worker is still held (its record, written again, covers
        it); either way the in-flight record leaves the file."""
        recorded: list[Binding] = []

        def record(intended: Binding) -> None:
            b = with_originals(self._table(), intended, self._live())
            self._save_in_flight(b)
            recorded.append(b)

        try:
            yield record
        except BaseException:
            if recorded:
                if pid not in self.held:
                    self._roll_back(Held(recorded[0], time.time(), pin=pin), "failed")
                self.commit()
            raise

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
        original CPUs, and what it recorded of the IRQs back as a release would put it."""
        table, live = self._table(), self._live()
        r = restoration_of(table, h.binding.pid, live, binding=h.binding)
        self._keep(pass_bans(table, r.passed_bans), {})
        b = r.binding
        ran = self.run([RestoreAffinity(b, restore_irqs=True, restore_uvb=last_950(table, h.binding, live))],
                       {b.pid: h}, commit=False)
        log.warning("bind in flight undone", pid=b.pid, why=why, irqs_restored=sorted(b.saved_irq_masks),
                    steps={s.step.value: s.outcome.value for s in ran.steps.get(b.pid, ())})

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

    def holds(self, pid: int) -> bool:
        return self.reader.holds(pid)

    # ---------------------------------------------------------- observing a worker

    def observe(self, peer: Peer, pid: int, *, pin: bool = False, clock: BindClock | None = None) -> ProcessView:
        """The request's one observation of ``pid``, authorized for ``peer`` as soon as its
        identity is read (a refused caller has the daemon read nothing more of it); with
        ``pin``, holding it (``view.pin``, the caller's to close). ProcessGone ``pid_gone``
        when it is absent, a zombie, or has no readable stat. ``clock``: a bind's, marked
        ``identity`` once the caller is authorized and ``worker`` once the rest is read."""
        def vet(identity: ProcessIdentity) -> None:
            require_live(identity, pid)
            authorize(peer, identity, daemon_pid=self.pid, proc_root=self.config.proc_root)
            if clock is not None:
                clock.mark("identity")

        view = observe_process(self.hosts.source, pid, vet=vet, pin=pin)
        if clock is not None:
            clock.mark("worker")
        return view

    def planning_facts(self, h: Held, target: ProcessIdentity) -> tuple:
        """(config, host, worker) to explain ``h``'s plan with, read now from ``target`` (the
        worker observed again), its allowance the one its binding was planned from."""
        config, host, worker, _ = facts_of(self.hosts, self.config, view_of(self.hosts.source, target),
                                       TargetRequest.of(h.binding.npus), h.ask)
        return config, host, self.allowance(worker, h)

    def allowance(self, worker, prev: Held | None):
        """The CPUs to plan ``worker`` from (step.first_allowance: a bound worker's first
        allowance); a worker the ``host`` isolation level narrowed before its bind (it
        started while others were bound) is planned, and later released, with its CPUs
        from before."""
        first = first_allowance(worker, prev.binding if prev is not None else None)
        if first is not None or worker.allowed_source != "status":
            return first or worker
        before = self.isolation.before_isolation(t.tid for t in worker.threads)
        if before and not before <= worker.allowed_cpus:
            allowed = worker.allowed_cpus | before
            note = (f"isolation had narrowed this process's threads to {format_cpulist(worker.allowed_cpus)}; "
                    f"planning from their CPUs before it, {format_cpulist(allowed)}")
            return dataclasses.replace(worker, allowed_cpus=allowed, warnings=(*worker.warnings, note))
        return worker

    # ---------------------------------------------------------- bind

    def bind_request(self, peer: Peer, body: Any, *, clock: BindClock | None = None,
                     later: list[Callable[[], None]] | None = None) -> dict[str, Any]:
        """POST /v1/bind: validate, authorize, bind; counts every outcome in ascendbind_bind_requests_total.
        ``clock``: marked at each phase of the bind (the caller adds it to the metrics once it
        has answered). ``later``: see ``bind_process``."""
        t0 = time.monotonic()
        try:
            pid, request, policy = parse_bind_request(body)
            view = self.observe(peer, pid or peer.pid, pin=True, clock=clock)
            with view.pin or contextlib.nullcontext():
                result = self.bind_process(view, request, policy, clock=clock, later=later, caller_uid=peer.uid)
        except AscendbindError as exc:
            self.metrics.bind_outcome(outcome_of_error(exc))
            raise
        finally:
            self.metrics.bind_duration.observe(time.monotonic() - t0)
        self.metrics.bind_outcome(result["outcome"])
        return result

    def bind_process(self, target: ProcessIdentity | ProcessView, request: TargetRequest | tuple[int, ...] | None,
                     policy: PlanAsk | str | None, *, clock: BindClock | None = None,
                     later: list[Callable[[], None]] | None = None, caller_uid: int | None = None,
                     listed: frozenset | None = None) -> dict[str, Any]:
        """Bind the process ``target`` names (authorized by the caller) to the NPUs the rule
        picks for ``request`` (NPU ids, a device index, or nothing: the evidence decides).
        Auto-bind enters here too. ``target`` is the request's observation of the process,
        or an identity to observe it by. ``later``: where the work that waits for the answer
        goes (the named NPU's check against npu-smi, the reconcile loop's poke), for the caller
        to run once it has answered, or failed to; without it, that work runs before this returns.
        ``caller_uid`` (the request's SO_PEERCRED uid) and ``listed`` (npu-smi's (npu, pid) pairs the
        caller read, as auto-bind does) weigh in what proves the binding (watch/proof.py)."""
        identity = target.identity if isinstance(target, ProcessView) else target
        if identity is None:
            raise ProcessGone(f"process {target.pid} has no readable stat", code="pid_gone")
        refuse_non_worker(identity, self.pid)
        view = view_of(self.hosts.source, target, pin=True)
        deferred: list[Callable[[], None]] = [] if later is None else later
        try:
            with (view.pin if view is not target else None) or contextlib.nullcontext():
                return self._bind_view(view, TargetRequest.of(request), policy, clock or BindClock(), deferred,
                                       (caller_uid, listed))
        finally:
            if later is None:  # whatever the bind came to, what it queued runs
                for work in deferred:
                    work()

    def _bind_view(self, view: ProcessView, request: TargetRequest, policy: PlanAsk | str | None,
                   clock: BindClock, later: list[Callable[[], None]], vouched: tuple = (None, None)) -> dict[str, Any]:
        """One bind, step by step: the worker's facts and its NPUs (outside the lock), then,
        under it, the claim, the plan, the writes and the record; the answer."""
        config, host, worker, failure = facts_of(self.hosts, self.config, view, request, policy)
        clock.mark("worker")
        decision = targets_of(host, worker, request, failure)
        fresh = host.processes if not request.names_npus and failure is None else None
        listed = self._listed_if_contested(view.pid, decision.npus, fresh)
        proof = proof_of(worker, decision, decision.npus, root_uid=vouched[0], listed=listed or vouched[1])
        with self.lock:
            prev = self._earlier_record(view.pid, worker.start_time)
            worker = self.allowance(worker, prev)
            if prev is not None:
                proof = kept_on_rebind(proof, prev.proof, prev.binding.npus, decision.npus)
            gone = claim(self._table(), view.pid, decision.npus, live=self._live(), listed=listed,
                         proven=proof.proven, allow_shared=self.config.allow_shared_npu)
            plan = self._plan(host, worker, decision, config)
            clock.mark("plan")
            if proof.proven:  # an unproven binding isolates nothing, so cannot leave the host without CPUs
                self.isolation.refuse(host, plan, config, self._proven_plans({view.pid, *gone[0], *gone[1]}))
            applied = self._apply(plan, worker, host, config, view, proof, prev)
            clock.mark("apply")
            binding = self._record_bind(view, applied, plan, proof, policy, (host, worker, config), gone, later)
        clock.mark("record")
        self._after_bind(binding, plan, proof, request, (host, worker), decision, later)
        return self._answer(binding, plan, proof, worker, decision, (*gone[0], *gone[1]))

    def _earlier_record(self, pid: int, start_time: int) -> Held | None:
        """The record held at ``pid`` if it is of the process being bound; one of an earlier
        process at that number is dropped as recycled (under the lock)."""
        prev = self.held.get(pid)
        if prev is not None and not self.still_bound(prev, start_time):
            self._submit(Gone(pid, self._live(), "recycled"), commit=False)
            return None
        return prev

    def _plan(self, host, worker, decision, config):
        """The plan for ``decision``'s NPUs; PlanImpossible (and, for the topology policy's
        refusals, an alignment failure) when none fits."""
        plan = dataclasses.replace(make_plan(host, worker, decision.npus, config), targets=decision)
        if plan.errors:
            if any(e.code in _POLICY_REFUSALS for e in plan.errors):
                self.metrics.alignment_failure(alignment_of(plan)[1] or "other")
            first = plan.errors[0]
            raise PlanImpossible(first.reason, code=first.code, plan=plan)
        return plan

    def _apply(self, plan, worker, host, config, view: ProcessView, proof, prev: Held | None):
        """The applier's writes, recorded in the state file before the first (write-ahead);
        a worker gone meanwhile is never held (``_gone_while_binding``)."""
        with self.write_ahead(view.pid, view.pin) as record, recycled_is_a_conflict():
            applied = apply_observed(plan, worker, host, config, view=view, npu_irqs=self.hosts.npu_irqs,
                                     move_memory=False, before_writes=self.before_writes, record=record,
                                     among_writes=self.among_writes,
                                     irqs_skipped=None if proof.proven else unproven_irqs(plan.targets.npus))
            self.metrics.recycled_writes(applied.binding.step(Step.AFFINITY))
            if applied.gone is not None:
                self._gone_while_binding(applied, prev)
        if any(b.status == "failed" for b in applied.binding.irqs):
            self.hosts.forget_irqs()
        return applied

    def _gone_while_binding(self, applied, prev: Held | None) -> None:
        """The worker exited before the bind was done (``applied.gone``): its number may
        name a newcomer, which is never held or acted for. An earlier binding of the same
        process leaves the table too. Raises ProcessGone with that code."""
        pid = applied.binding.pid
        if prev is not None and self.held.get(pid) is prev:
            self._submit(Gone(pid, self._live(), "exited"))
        self.metrics.step_results(applied.binding.steps)
        affinity = applied.binding.step(Step.AFFINITY)
        detail = affinity.detail if affinity is not None else f"process {pid} exited while it was being bound"
        log.warning("worker gone while being bound; not held", pid=pid, reason=applied.gone, detail=detail)
        raise ProcessGone(f"{detail}; not bound", code=applied.gone)

    def _record_bind(self, view: ProcessView, applied, plan, proof, policy, facts: tuple, gone: tuple,
                     later: list[Callable[[], None]]) -> Binding:
        """The bind, as the table's ``Bound`` event: its record, the dead owners it replaces
        and the holders it evicts, its memory move; the state file written (under the lock)."""
        ask = PlanAsk.of(policy)
        held = Held(applied.binding, time.time(), ask.topology_policy, pool_source=ask.pool_source, facts=facts,
                    pin=view.pin.keep() if view.pin is not None else None, proof=proof)
        held.remember_threads(applied.threads, role_cpus(plan), plan.thread_classes)
        memory = applied.binding.step(Step.MEMORY)
        node = memory.data["target_node"] if memory is not None and memory.outcome is Outcome.PENDING else None
        self._submit(Bound(applied.binding, proof, self._live(), gone[0], gone[1], node,
                           tuple(map(_TID, facts[1].threads))), fresh={view.pid: held}, later=later)
        return held.binding

    def _after_bind(self, binding: Binding, plan, proof, request: TargetRequest, facts: tuple, decision,
                    later: list[Callable[[], None]]) -> None:
        """A bind's metrics and log lines, and its check against npu-smi queued for after the answer."""
        self.metrics.step_results(binding.steps)
        if request.names_npus or not proof.proven:
            # its npu-smi run (tens of ms of CPU) would otherwise compete with the answer
            later.append(functools.partial(self.npu_check.submit, binding.pid, binding.start_time, binding.npus,
                                           request, *facts))
        aligned, reason = alignment_of(plan)
        if not aligned:
            self.metrics.alignment_failure(reason)
        log.info("worker bound", pid=binding.pid, npus=list(binding.npus),
                 outcome="aligned" if aligned else "unaligned", failed_step=binding.failed)
        for warning in decision.warnings:  # e.g. a stray context's row left out
            log.warning("target npu warning", pid=binding.pid, warning=warning)

    @staticmethod
    def _answer(binding: Binding, plan, proof, worker, decision, gone: tuple) -> dict[str, Any]:
        return {
            "pid": binding.pid,
            "npus": list(binding.npus),
            "outcome": "aligned" if alignment_of(plan)[0] else "unaligned",
            "status": "partial" if binding.failed else "bound",
            "replaced": list(gone),
            "proof": proof.to_json(),
            "warnings": list(worker.warnings) + list(decision.warnings),
            "plan": plan.to_json(),
            "steps": [s.to_json() for s in binding.steps],
        }

    def _listed_if_contested(self, pid: int, targets: tuple[int, ...], fresh) -> frozenset | None:
        """(npu, pid) pairs of npu-smi's process table when another live worker holds one of
        ``targets`` (read outside the lock: npu-smi may be slow), else None. ``fresh``: a
        table this request already read. None too when the table cannot be read."""
        if self.config.allow_shared_npu:
            return None
        with self.lock:
            contested = holders(self._table(), targets, but=(pid,), live=self._live())
        if not contested:
            return None
        try:
            rows = fresh if fresh is not None else self.hosts.processes()
        except AscendbindError as exc:
            log.warning("npu-smi process table unreadable; a live holder keeps its NPU", error=str(exc))
            return None
        return frozenset((r.npu, r.pid) for r in rows)

    # ---------------------------------------------------------- release

    def release_request(self, peer: Peer, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise UsageError("the body must be a JSON object", code="bad_request")
        unknown = sorted(set(body) - {"pid", "all"})
        if unknown:
            raise UsageError(f"unknown field(s): {', '.join(map(str, unknown))}", code="bad_request")
        if body.get("all") is True:
            if not peer.is_root:
                raise NotPermitted("only root may release every worker")
            # one step under the lock: a worker another path drops meanwhile (the loop finding it
            # exited, a named NPU contradicted) would otherwise turn the whole request into a 404
            with self.lock:
                return {"released": [self.release_pid(p)["pid"] for p in sorted(self.held)]}
        if "all" in body and body["all"] is not False:
            raise UsageError(f"field 'all' must be true or false, got {body['all']!r}", code="bad_request")
        pid = _int_field(body, "pid", minimum=1) or peer.pid
        held = self.reader.get(pid)
        try:
            target = require_live(read_identity(pid, self.config.proc_root), pid)
            authorize(peer, target, daemon_pid=self.pid, proc_root=self.config.proc_root, binding=False)
        except ProcessGone:
            if held is None or not peer.is_root:
                raise
        if held is None:
            raise ProcessGone(f"process {pid} is not bound by this daemon", code="not_bound")
        return self.release_pid(pid)

    def release_pid(self, pid: int, reason: str = "released") -> dict[str, Any]:
        """Give a held worker back to the host: its threads' original CPUs (through its pidfd),
        and the IRQ masks, bans and UVB masks no other live worker still needs. ``reason``
        labels the drop (a release, or a named NPU that npu-smi contradicts)."""
        with self.lock:
            if pid not in self.held:
                raise ProcessGone(f"process {pid} is not bound by this daemon", code="not_bound")
            ran = self._submit(Released(pid, self._live(), reason))
        steps = ran.steps.get(pid)
        if steps is None:
            return {"pid": pid, "steps": [], "note": "the process had exited; only IRQ masks were considered"}
        restored = ran.restored.get(pid, [])
        log.info("worker released", pid=pid, irqs_restored=restored, reason=reason)
        return {"pid": pid, "irqs_restored": restored, "steps": [s.to_json() for s in steps]}

    def drop(self, pid: int, reason: str) -> None:
        with self.lock:
            if pid in self.held:
                self._submit(Gone(pid, self._live(), reason))

    # ---------------------------------------------------------- npu-smi's verdict

    def npu_checked(self, pid: int, start_time: int, npus: tuple[int, ...], verdict: str, why: str) -> bool:
        """The process table's verdict on a named or unproven bind (watch/npucheck.py), for
        the binding it was made for only: a contradicted one is undone, a confirmed unproven
        one becomes proven (step.py). True: still unproven, ask again later."""
        with self.lock:
            h = self.held.get(pid)
            if h is None or h.binding.start_time != start_time or tuple(h.binding.npus) != npus:
                return False  # released, re-bound or gone meanwhile: the verdict is about another binding
            h.npu_check = {"verdict": verdict, "detail": why}
            refused = self._refused(h) if verdict == "confirmed" and not h.proof.proven else None
            self._submit(NpuChecked(pid, start_time, npus, verdict, why, self._live(), refused,
                                    self.config.allow_shared_npu))
            return self.held.get(pid) is h and not h.proof.proven

    def _refused(self, h: Held) -> str | None:
        """Why isolating ``h`` too would leave the host no housekeeping CPU; None: it would not
        (or the host's facts are not known yet)."""
        host = self.hosts.known()
        if host is None:
            return None
        plans = [o.binding.plan for o in self.held.values() if o is not h and o.proof.proven]
        refused = self.isolation.refusal(host, [*plans, h.binding.plan], self.config)
        return refused.reason if refused is not None else None

    def _bind_irqs_now(self, h: Held, sharers: list[Held]) -> None:
        """The IRQ step a binding left out while nothing proved it, run now that it is proven
        (under the lock): written ahead like a bind (its in-flight record holds the masks it
        will change, read first, or a holder's saved ones for them), and its result, masks,
        IRQ writes and bans become the held binding's, so a release puts them back."""
        host = self.hosts.known()
        if host is None:
            log.warning("binding proven, host facts not known yet; its IRQs stay as they are",
                        pid=h.binding.pid)
            return
        config = h.facts[2] if h.facts is not None else self.config
        with self.write_ahead(h.binding.pid, h.pin) as record:
            bound = bind_irqs_of(h.binding, host, config, npu_irqs=self.hosts.npu_irqs, record=record)
        binding = inherit(bound, [h.binding], [o.binding for o in sharers])
        self._keep(self._table().rebound(h.binding.pid, binding), {})
        irq = bound.step(Step.IRQ)
        if any(b.status == "failed" for b in bound.irqs):
            self.hosts.forget_irqs()
        if irq is not None:
            self.metrics.step_results([irq])
        log.info("binding proven; its NPU's IRQs bound", pid=h.binding.pid, npus=list(h.binding.npus),
                 outcome=irq.outcome.value if irq else None, irqs=[b.irq for b in bound.irqs])

    # ---------------------------------------------------------- a look's actions

    def act(self, h: Held, actions, *, window: float = 0.0) -> bool:
        """Carry out what lifecycle.decide asked for ``h`` (a ``Drop`` is the worker gone, the
        rest a ``Looked``); True when the state file must be written (the caller writes it,
        once per pass). ``window``: the re-assert window, for the log."""
        with self.lock:
            if self.held.get(h.binding.pid) is not h:
                return False  # released or replaced since the look
            drop = next((a for a in actions if isinstance(a, Drop)), None)
            if drop is not None:
                return self._submit(Gone(h.binding.pid, self._live(), drop.reason), commit=False).persist
            looked = Looked(h.binding.pid, tuple(a for a in actions if isinstance(a, _LOOKED)))
            table, effects = step(self._table(), looked)
            return self.run(effects, self._keep(table, {}), commit=False, window=window).persist

    @contextlib.contextmanager
    def looking_at(self, h: Held) -> Iterator[bool]:
        """Hold the table still while a look at ``h`` reads its threads and keeps their cache
        current; yields whether ``h`` is still the record held at its pid."""
        with self.lock:
            yield self.held.get(h.binding.pid) is h

    # ---------------------------------------------------------- memory moves

    def move_memory(self, h: Held, node: int, why: str, *, ratio_before: float | None = None):
        """Mark ``h`` as moving its pages to ``node`` and queue the move (under the lock, so a
        release cannot slip between the two); the job, or None once the mover is closed."""
        with self.lock:
            if self.held.get(h.binding.pid) is not h:
                return None
            return self.runner.queue_move(h, node, why, ratio_before=ratio_before)

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
        h = self._record_move(job, result)
        if h is None:
            return
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

    def _record_move(self, job, result: StepResult | None) -> Held | None:
        """The move's end on its record (the binding's memory step from now on); None when
        the record is no longer held as it was, or a newer move (a re-plan's) superseded it."""
        with self.lock:
            h = self.held.get(job.pid)
            newer = self.mover.job(job.pid)
            if h is not job.held or (newer is not None and newer is not job):
                return None
            h.memory_move = None
            if result is None:
                self.commit()
                return h
            result = dataclasses.replace(result, data=frozen_map({
                **result.data, "why": job.why, "started_at": None if job.started_at is None else
                round(job.started_at, 3), "finished_at": round(time.time(), 3)}))
            self._submit(MemoryMoved(job.pid, result))
            self.metrics.step_results([result])
            return h

    def forget_locality(self) -> None:
        """The check is switched off: no stale ratios."""
        with self.lock:
            if any(h.memory_local_ratio is not None for h in self.held.values()):
                for h in self.held.values():
                    h.memory_local_ratio = None
                    h.memory_checked_at = None
                self.metrics.memory_local({})

    # ---------------------------------------------------------- re-plan

    def rebind(self, h: Held, plan, worker, host, config) -> Binding | None:
        """Bind ``h``'s worker by a new ``plan`` (a re-plan, under the lock): written ahead
        like a bind, the new binding keeps the host's originals of the old one (step.py's
        ``Replanned``), the thread cache starts over, its pages move afterwards on the
        mover. None when ``h`` was released or bound again meanwhile."""
        pid = h.binding.pid
        with self.lock:
            if self.held.get(pid) is not h:
                return None
            skipped = None if h.proof.proven else unproven_irqs(h.binding.npus)
            with self.write_ahead(pid, h.pin) as record:
                binding = apply_observed(plan, worker, host, config, move_memory=False, pin=h.pin, record=record,
                                         among_writes=self.among_writes, irqs_skipped=skipped).binding
            self.rebound(h, binding, (host, worker, config), thread_masks(pid, proc_root=config.proc_root))
            return h.binding

    def rebound(self, h: Held, binding: Binding, facts: tuple, masks) -> None:
        """``h`` bound again by a re-plan (under the lock): the table's ``Replanned`` (the
        host's originals kept, its move queued), the thread cache started over. The state
        file is written at once: it replaces the re-plan's in-flight record (write-ahead)."""
        with self.lock:
            h.bound_at = time.time()
            h.remember_threads(masks, role_cpus(binding.plan), binding.plan.thread_classes)
            h.facts = facts
            memory = binding.step(Step.MEMORY)
            node = memory.data["target_node"] if memory is not None and memory.outcome is Outcome.PENDING else None
            self._submit(Replanned(h.binding.pid, binding, node))

    def replan_cpuset(self, h: Held, a: Replan) -> ReplanOutcome:
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
            return ReplanOutcome("failed", None, str(exc))
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
            self.commit()
        return done

    def _cpuset_verdict(self, h: Held, a: Replan, done: ReplanOutcome) -> None:
        """Record what a re-plan for a changed cpuset came to on ``h`` (under the lock)."""
        news = a.news
        h.cpuset_seen = done.allowed if done.allowed is not None else news.after
        threads = h.drift["threads"]
        if a.blame is not None:  # the kernel moved the threads
            if news.moved:
                h.drift_events += 1
                self.metrics.drifted(a.blame.culprit)
            threads.culprit, threads.blame = a.blame.culprit, a.blame.why
        threads.reasserts.clear()
        if done.outcome == "failed":
            h.cpuset_stuck = done.error or "no plan"
            threads.left_alone = True
            threads.why = (f"the worker's cpuset is now CPUs {format_cpulist(h.cpuset_seen)} and no plan fits it "
                           f"({h.cpuset_stuck}); its threads stay where the kernel put them until the cpuset or "
                           f"kubelet's checkpoint changes again. Fix: {FIX['cpuset']}")
            log.warning("cpuset changed; no plan fits it, threads left where the kernel put them",
                        pid=h.binding.pid, cpuset=format_cpulist(h.cpuset_seen), why=news.why, error=done.error)
            return
        h.cpuset_stuck = None
        threads.left_alone, threads.why = False, None
        log.info("cpuset changed; worker planned again" if done.outcome == "rebound" else
                 "cpuset changed; the plan stands", pid=h.binding.pid, why=news.why,
                 before=format_cpulist(news.before), after=format_cpulist(h.cpuset_seen), outcome=done.outcome)

    # ---------------------------------------------------------- read-only

    def workers(self, query: str = "", peer: Peer | None = None) -> dict[str, Any]:
        """GET /v1/workers[?pid=P[&explain=1]] asked by ``peer`` (status.py)."""
        return workers_answer(self, query, peer)

    def plan_request(self, peer: Peer, pid: int | None, request: TargetRequest | tuple[int, ...] | None,
                     policy: PlanAsk | str | None) -> dict[str, Any]:
        request = TargetRequest.of(request)
        view = self.observe(peer, pid or peer.pid)
        pid = view.pid
        config, host, worker, failure = facts_of(self.hosts, self.config, view, request, policy)
        worker = self.allowance(worker, self.reader.get(pid))
        decision = targets_of(host, worker, request, failure)
        plan = dataclasses.replace(make_plan(host, worker, decision.npus, config), targets=decision)
        if plan.errors:
            raise PlanImpossible(plan.errors[0].reason, code=plan.errors[0].code, plan=plan)
        with self.lock:
            others = self._proven_plans({pid})
        self.isolation.refuse(host, plan, config, others)
        # what the IRQ step would move, from the same cached lookup a bind uses
        plan = with_planned_irqs(plan, host, config, self.hosts.source, lookup=self.hosts.npu_irqs)
        return {"pid": pid, "plan": plan.to_json()}

    def _proven_plans(self, leaving) -> list:
        """The plans of the proven records but ``leaving``'s: the bindings that keep their CPUs
        protected beside a new one (under the lock)."""
        return [h.binding.plan for pid, h in self.held.items() if pid not in leaving and h.proof.proven]

    def health(self) -> dict[str, Any]:
        # never waits on the lock: a liveness probe must answer whatever a bind is doing
        n = len(self.held)
        return {
            **self.hosts.health(),
            "workers": n,
            "hotplug": self.hotplug_status,
            "rediscovery_pending": self.rediscovery_pending(),
            "reconcile": self.reconcile_mode(),
            "uptime_seconds": round(time.time() - self.started, 3),
        }
