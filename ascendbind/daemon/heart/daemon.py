"""The daemon's one piece of state and the operations on it: bind, release, drop.

``Daemon.held`` maps pid -> Held (the applier's Binding plus reconcile
bookkeeping). Every change to it happens under ``Daemon.lock`` and is followed by
a state-file write, so what is on disk is what the daemon holds. The HTTP
server, the reconcile loop, the locality check, re-planning and auto-bind all
call in here (the table's keeping is ownership.py's half of the class); none of
them touches ``held`` or a held record on its own.

Identity: a request observes its target once (discovery's ``ProcessView``: pid,
start time, kernel thread flag, uids, status, cpuset, environ, threads) and
carries that one value through authorization, the worker's facts, binding and
the held record; a start time that changes on the way is a 409 ``pid_recycled``.
A bind's observation also pins the process (discovery/read/pin.py): the applier
binds through that pidfd and confirms its writes against it, undoing any that
reached a newcomer; a worker gone by then is never held (409 ``pid_recycled``,
404 ``pid_gone``). The held record keeps a copy, and wherever the worker is
recognised again its pidfd decides, whatever the start time says.

Ownership rules:
* one live worker per NPU unless ``allow_shared_npu``; a bind for an NPU whose
  owner is dead *replaces* the dead entry (its saved IRQ masks are carried
  over, since they are the host's originals) instead of answering 409;
* a live holder that ``npu-smi info``'s process table does not list on that NPU
  gives way to a newcomer that it does list: the holder is released (its
  affinity restored) and counted as ``evicted``. Anyone may bind their own idle
  process to an NPU; only the driver knows who really uses it, so squatting
  never blocks a real worker. A listed holder is never evicted;
* IRQ masks are restored only when no live worker owns that NPU any more; the
  IRQs ascendbind banned in irqbalance likewise go back to it only when no live
  worker pins them, and until then their ban passes to a worker that does;
* a worker bound again keeps its first ``original_cpus`` and first saved IRQ
  masks, so release always returns to the state before ascendbind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from ...applier import release_binding
from ...applier.bind import apply_observed, unproven_irqs
from ...applier.irq import with_planned_irqs
from ...discovery.gather.identity import recycled, refuse_non_worker, require_live
from ...values.config import Config
from ...values.cpulist import format_cpulist
from ...discovery.gather.process import ProcessView, observe_process, read_identity
from ...discovery.gather.worker import discover_worker, without_process_table
from ...errors import AscendbindError, ConfigError, DiscoveryError, NotPermitted, PlanImpossible, ProcessGone, UsageError
from ...values.frozen import frozen_map
from ...values.model import Binding, DeviceType, ProcessIdentity
from ...planner import make_plan, resolve_targets
from ...values.reasons import Outcome, Step
from ...values.targeting import TargetRequest
from ..api.auth import Peer, authorize
from ..isolate.keeper import Isolation
from ..watch.held import Held
from ..watch.bans import carried_bans
from ..api.requests import (PlanAsk, _int_field, alignment_of, outcome_of_error, parse_bind_request,
                           recycled_is_a_conflict, resolve_policy)
from ..host.hostcache import HostCache
from ..watch.lifecycle import claim
from ..watch.locality import MemoryLocality, ratios_by_npu
from ..watch.memmove import MemoryMover
from ..watch.npucheck import NpuChecker
from ..watch.proof import kept_on_rebind, proof_of
from ..api.contention import Contention
# imported here, not at the first request: Python 3.9 lets a second thread that imports a module
# while a first is still running it see it half made (ImportError "partially initialized module")
from ..api.status import workers_answer
from ..api.metrics import BindClock, Metrics
from ..watch.observe import role_cpus
from .ownership import Ownership
from ..state.state import StateFile

__all__ = ["Daemon"]

log = structlog.get_logger("ascendbind.daemon")

# plan errors that mean "refused by the topology policy": counted failed, plus an alignment failure
_POLICY_REFUSALS = ("topology_rejected", "too_many_numa_nodes")


# ------------------------------------------------------------------ the daemon


class Daemon(Ownership):
    def __init__(self, config: Config, *, metrics: Metrics | None = None, source=None,
                 before_writes: Callable[[int], None] | None = None, confine_self: bool = False) -> None:
        self.config = config
        # the applier's hooks right before a bind's first write (apply_observed): tests recycle the pid
        # there; and between its steps, naming the next (tests kill the daemon at these points)
        self.before_writes = before_writes
        self.among_writes: Callable[[int, Step], None] | None = None
        self.metrics = metrics or Metrics()
        self.hosts = HostCache(config, self.metrics, source=source)
        self.state = StateFile(config.state_dir, proc_root=config.proc_root)
        self.lock = threading.RLock()
        self.held: dict[int, Held] = {}
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
        self._saved_held: frozenset[int] = frozenset()
        # the memory step's moves, in the background (memmove.py), and the locality check
        # that measures where a worker's memory is and asks for reruns (locality.py)
        self.mover = MemoryMover(self)
        self.locality = MemoryLocality(self)
        # a bind that names its NPU, checked against npu-smi's process table after its answer
        self.npu_check = NpuChecker(self)
        # the rest of the host off the bound workers' CPUs; ``confine_self``: this process is the
        # daemon, whose own threads follow the housekeeping CPUs (never a test's in-process Daemon)
        self.isolation = Isolation(confine_self=confine_self)

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

    # ---------------------------------------------------------- state

    def save(self, timeout: float | None = None, *, later: list[Callable[[], None]] | None = None) -> bool:
        """Write the state file and sync the gauges from the held table; with ``timeout``, give
        up (False) when the lock is not had within it (a stop that cannot wait). ``later``: a
        bind's work for after its answer, where the reconcile loop's poke goes (its first look
        at the worker would otherwise compete with the answer for the interpreter)."""
        if not self.lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            records = [h.state_record() for h in self.held.values()]
            try:
                self.isolation.after_change(self, records)  # writes the state file before any mask
                self.state.save_encoded(records, isolation=self.isolation.state_json())
            except (OSError, ConfigError) as exc:
                # bindings stay in force; the next change retries the write
                log.error("could not write the state file", path=self.state.path,
                          error=exc.strerror if isinstance(exc, OSError) else str(exc))
            self.metrics.bound_workers.set(len(self.held))
            held = frozenset(map(id, self.held.values()))
            if held != self._saved_held:  # a worker bound, bound again or gone: the loop looks now
                self._saved_held = held
                if later is None:
                    self.held_changed()
                else:
                    later.append(self.held_changed)
            # a released or gone worker's locality series goes with it
            self.metrics.memory_local(ratios_by_npu(self.held.values()))
        finally:
            self.lock.release()
        return True

    # ---------------------------------------------------------- bind

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

    def _request_facts(self, target: ProcessIdentity | ProcessView, npus: tuple[int, ...] | None,
                       policy: PlanAsk | str | None):
        """(config, host, worker) for one bind or plan request: the policy resolved, the
        cached static facts (plus a fresh process table when the request names no NPU),
        and the worker's facts, built from the request's observation of it (``target``;
        an identity alone is observed now, and must name the process observed)."""
        return self._facts_of(self._view_of(target), TargetRequest.of(npus), policy)[:3]

    def _view_of(self, target: ProcessIdentity | ProcessView, *, pin: bool = False) -> ProcessView:
        """``target`` itself, or a new observation of the process the identity names (with
        ``pin``, holding it: the caller closes ``view.pin``)."""
        if isinstance(target, ProcessView):
            return target

        def same(seen: ProcessIdentity) -> None:
            if seen.start_time != target.start_time:
                raise recycled(target.pid, seen.start_time, target.start_time)

        with recycled_is_a_conflict():
            return observe_process(self.hosts.source, target.pid, pin=pin, vet=same)

    def _facts_of(self, view: ProcessView, request: TargetRequest, policy: PlanAsk | str | None):
        """(config, host, worker, the process table's failure or None). A request that names its
        NPU costs no npu-smi run: its process table is not read (the worker's evidence says so)."""
        config = resolve_policy(policy, self.config)
        host = self.hosts.get()
        unread = "not read: the request names its NPU" if request.names_npus else None
        failure = None
        if unread is None:
            try:
                host = dataclasses.replace(host, processes=self.hosts.processes())
            except DiscoveryError as exc:
                failure, unread = exc, f"unavailable: {exc}"
        with recycled_is_a_conflict():
            worker = discover_worker(self.hosts.source, view.pid, config,
                                     want_uvb=host.device_type is DeviceType.A950, view=view)
        if unread is not None:
            worker = without_process_table(worker, unread)
        return config, host, worker, failure

    @staticmethod
    def _targets(host, worker, request: TargetRequest, failure: DiscoveryError | None):
        """The rule's decision; without any evidence and with the process table failing, the
        table's failure (503: ask again) rather than "no target"."""
        try:
            return resolve_targets(host, worker, request)
        except PlanImpossible as exc:
            if failure is not None and exc.code == "no_target_npu":
                raise failure from None
            raise

    def _first_allowance(self, worker, prev: Held | None):
        """Without a readable cpuset, a bound worker's Cpus_allowed_list is the mask we
        set: plan from the allowance first seen, so re-planning gives the same plan. A
        worker the ``host`` isolation level narrowed before its bind (it started while
        others were bound) is planned, and later released, with its CPUs from before."""
        if worker.allowed_source != "status":
            return worker
        if prev is not None:
            return dataclasses.replace(worker, allowed_cpus=prev.binding.original_cpus)
        before = self.isolation.before_isolation(t.tid for t in worker.threads)
        if before and not before <= worker.allowed_cpus:
            allowed = worker.allowed_cpus | before
            note = (f"isolation had narrowed this process's threads to {format_cpulist(worker.allowed_cpus)}; "
                    f"planning from their CPUs before it, {format_cpulist(allowed)}")
            return dataclasses.replace(worker, allowed_cpus=allowed, warnings=(*worker.warnings, note))
        return worker

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
        view = self._view_of(target, pin=True)
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
        pid = view.pid
        config, host, worker, failure = self._facts_of(view, request, policy)
        clock.mark("worker")
        decision = self._targets(host, worker, request, failure)
        targets = decision.npus
        fresh = host.processes if not request.names_npus and failure is None else None
        listed = self._listed_if_contested(pid, targets, fresh)
        proof = proof_of(worker, decision, targets, root_uid=vouched[0], listed=listed or vouched[1])
        with self.lock:
            prev = self.held.get(pid)
            if prev is not None and not self.still_bound(prev, worker.start_time):
                self.held.pop(pid)
                self._undo_gone(prev, "recycled")
                prev = None
            worker = self._first_allowance(worker, prev)
            if prev is not None:
                proof = kept_on_rebind(proof, prev.proof, prev.binding.npus, targets)
            replaced, evicted = self._claim(pid, targets, listed, proof.proven)
            plan = dataclasses.replace(make_plan(host, worker, targets, config), targets=decision)
            aligned, reason = alignment_of(plan)
            if plan.errors:
                if any(e.code in _POLICY_REFUSALS for e in plan.errors):
                    self.metrics.alignment_failure(reason or "other")
                first = plan.errors[0]
                raise PlanImpossible(first.reason, code=first.code, plan=plan)
            clock.mark("plan")
            if proof.proven:  # an unproven binding isolates nothing, so cannot leave the host without CPUs
                self.isolation.refuse(self, host, plan, config, pid, *(h.binding.pid for h in (*replaced, *evicted)))
            # the bind is in the state file before its first write (ownership.py: write-ahead)
            with self.write_ahead(pid, view.pin) as record, recycled_is_a_conflict():
                applied = apply_observed(plan, worker, host, config, view=view, npu_irqs=self.hosts.npu_irqs,
                                         move_memory=False, before_writes=self.before_writes, record=record,
                                         among_writes=self.among_writes,
                                         irqs_skipped=None if proof.proven else unproven_irqs(targets))
                self.metrics.recycled_writes(applied.binding.step(Step.AFFINITY))
                if applied.gone is not None:
                    self._gone_while_binding(applied, prev)
            if any(b.status == "failed" for b in applied.binding.irqs):
                self.hosts.forget_irqs()
            clock.mark("apply")
            gone = {h.binding.pid for h in (*replaced, *evicted)}
            self._leave_npus(prev, targets, gone)  # NPUs a re-bind no longer drives: theirs goes back
            sharers = [h for other, h in self.held.items()
                       if other != pid and other not in gone and set(h.binding.npus) & set(targets)]
            binding = self._inherit(applied.binding, [h for h in (prev, *replaced, *evicted) if h is not None],
                                    sharers)
            for h in replaced:
                self.held.pop(h.binding.pid, None)
                self.mover.cancel(h.binding.pid, "replaced")
                h.close()
                self.metrics.dropped_worker("replaced")
                log.info("dead owner replaced", pid=h.binding.pid, npus=list(h.binding.npus), by=pid)
            for h in evicted:
                self._evict(h, by=pid)
            ask = PlanAsk.of(policy)
            held = Held(binding, time.time(), ask.topology_policy, pool_source=ask.pool_source,
                        facts=(host, worker, config),
                        pin=view.pin.keep() if view.pin is not None else None, proof=proof)
            held.remember_threads(applied.threads, role_cpus(plan), plan.thread_classes)
            self.held[pid] = held
            self.isolation.hand_over(t.tid for t in worker.threads)
            memory = binding.step(Step.MEMORY)
            if memory is not None and memory.outcome is Outcome.PENDING:
                self.move_memory(held, memory.data["target_node"], "bind")
            else:
                self.mover.cancel(pid, "bound again")  # an earlier binding's move, if any
            if prev is not None:
                prev.close()
            self.save(later=later)
        clock.mark("record")
        self.metrics.step_results(binding.steps)
        if request.names_npus or not proof.proven:
            # its npu-smi run (tens of ms of CPU) would otherwise compete with the answer
            later.append(functools.partial(self.npu_check.submit, pid, binding.start_time, binding.npus, request,
                                           host, worker))
        if not aligned:
            self.metrics.alignment_failure(reason)
        outcome = "aligned" if aligned else "unaligned"
        log.info("worker bound", pid=pid, npus=list(binding.npus), outcome=outcome, failed_step=binding.failed)
        for warning in decision.warnings:  # e.g. a stray context's row left out
            log.warning("target npu warning", pid=pid, warning=warning)
        return {
            "pid": pid,
            "npus": list(binding.npus),
            "outcome": outcome,
            "status": "partial" if binding.failed else "bound",
            "replaced": [h.binding.pid for h in (*replaced, *evicted)],
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
            contested = [h for other, h in self.held.items()
                         if other != pid and set(h.binding.npus) & set(targets) and self.is_alive(h)]
        if not contested:
            return None
        try:
            rows = fresh if fresh is not None else self.hosts.processes()
        except AscendbindError as exc:
            log.warning("npu-smi process table unreadable; a live holder keeps its NPU", error=str(exc))
            return None
        return frozenset((r.npu, r.pid) for r in rows)

    def _claim(self, pid: int, targets: tuple[int, ...], listed: frozenset | None,
               proven: bool = True) -> tuple[list[Held], list[Held]]:
        """(dead owners of ``targets`` to replace, live holders to evict); Conflict when a
        live holder keeps its NPU (lifecycle.claim; ``proven``: the newcomer's binding is)."""
        holders = [(other, h.binding.npus, self.is_alive(h), h.proof.proven) for other, h in self.held.items()
                   if other != pid and set(h.binding.npus) & set(targets)]
        replace, evict = claim(pid, targets, holders, listed, allow_shared=self.config.allow_shared_npu,
                               proven=proven)
        return [self.held[a.pid] for a in replace], [self.held[a.pid] for a in evict]

    def _evict(self, h: Held, *, by: int) -> None:
        """Release a live holder that gives its NPU up (unproven, or unlisted by npu-smi):
        its threads go back to their original CPUs; its saved IRQ masks now travel with the
        new owner's binding."""
        b = dataclasses.replace(h.binding, saved_irq_masks=frozen_map({}))
        steps = release_binding(b, self.config, restore_irqs=False, pin=h.pin)
        self.held.pop(b.pid, None)
        self.mover.cancel(b.pid, "evicted")
        h.close()
        self.metrics.dropped_worker("evicted")
        log.warning("unlisted holder evicted" if h.proof.proven else "unproven holder evicted", pid=b.pid,
                    npus=list(b.npus), by=by,
                    affinity=next((s.outcome.value for s in steps), None))

    @staticmethod
    def _inherit(binding: Binding, older: list[Held], sharers: list[Held] = ()) -> Binding:
        """Keep the oldest saved IRQ masks and original CPUs: those are the host's, not ours;
        and the older holders' irqbalance bans, which are still ours to lift. ``sharers``:
        live workers that keep an NPU of this binding (``allow_shared_npu``); the masks this
        bind read on that NPU's IRQs are theirs (or unchanged, so not saved at all), so the
        host's masks they saved are kept here too, for whichever of them leaves last."""
        masks = dict(binding.saved_irq_masks)
        original = binding.original_cpus
        for h in older:
            masks.update({irq: m for irq, m in h.binding.saved_irq_masks.items() if irq in masks})
            if h.binding.pid == binding.pid:
                original = h.binding.original_cpus
        written = {b.irq for b in binding.irqs}
        for h in sharers:
            masks.update({irq: m for irq, m in h.binding.saved_irq_masks.items() if irq in written})
        return dataclasses.replace(binding, saved_irq_masks=frozen_map(masks), original_cpus=original,
                                   irqbalance_bans=carried_bans(binding.irqbalance_bans,
                                                                [h.binding.irqbalance_bans for h in older]))

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
        with self.lock:
            held = self.held.get(pid)
        try:
            target = require_live(read_identity(pid, self.config.proc_root), pid)
            authorize(peer, target, daemon_pid=self.pid, proc_root=self.config.proc_root, binding=False)
        except ProcessGone:
            if held is None or not peer.is_root:
                raise
        if held is None:
            raise ProcessGone(f"process {pid} is not bound by this daemon", code="not_bound")
        return self.release_pid(pid)

    def npu_checked(self, pid: int, start_time: int, npus: tuple[int, ...], verdict: str, why: str) -> bool:
        """The process table's verdict on a named or unproven bind (watch/npucheck.py), for
        the binding it was made for only; a contradicted one is undone, a confirmed unproven
        one becomes proven (ownership.py ``prove_held``). True: still unproven, ask again later."""
        with self.lock:
            h = self.held.get(pid)
            if h is None or h.binding.start_time != start_time or tuple(h.binding.npus) != npus:
                return False  # released, re-bound or gone meanwhile: the verdict is about another binding
            h.npu_check = {"verdict": verdict, "detail": why}
            self.metrics.npu_check(verdict)
            if verdict == "contradicted":
                log.warning("named NPU contradicted by npu-smi; binding undone", pid=pid, npus=list(npus),
                            detail=why)
                self.release_pid(pid, reason="npu_mismatch")
                return False
            if verdict == "confirmed":
                self.prove_held(h, why)
            else:
                log.info("named NPU not confirmed by npu-smi", pid=pid, npus=list(npus), verdict=verdict,
                         detail=why)
            return self.held.get(pid) is h and not h.proof.proven

    # ---------------------------------------------------------- read-only

    def workers(self, query: str = "", peer: Peer | None = None) -> dict[str, Any]:
        """GET /v1/workers[?pid=P[&explain=1]] asked by ``peer`` (status.py)."""
        return workers_answer(self, query, peer)

    def plan_request(self, peer: Peer, pid: int | None, request: TargetRequest | tuple[int, ...] | None,
                     policy: PlanAsk | str | None) -> dict[str, Any]:
        request = TargetRequest.of(request)
        view = self.observe(peer, pid or peer.pid)
        pid = view.pid
        config, host, worker, failure = self._facts_of(view, request, policy)
        with self.lock:
            worker = self._first_allowance(worker, self.held.get(pid))
        decision = self._targets(host, worker, request, failure)
        plan = dataclasses.replace(make_plan(host, worker, decision.npus, config), targets=decision)
        if plan.errors:
            raise PlanImpossible(plan.errors[0].reason, code=plan.errors[0].code, plan=plan)
        self.isolation.refuse(self, host, plan, config, pid)
        # what the IRQ step would move, from the same cached lookup a bind uses
        plan = with_planned_irqs(plan, host, config, self.hosts.source, lookup=self.hosts.npu_irqs)
        return {"pid": pid, "plan": plan.to_json()}

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

