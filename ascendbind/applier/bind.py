"""Run every step for one worker, and undo them on release.

Steps, in order: affinity (every thread by role), irq (the NPUs' SQ/CQ
interrupts), memory (the worker's private pages, now or, for the daemon, in the
background: ``pending``), uvb (Ascend 950 host poll threads). Each
yields a StepResult (applied | skipped | failed, a reason code from
``model.Reason``, a sentence). The steps are independent: a failed one never
stops the next, and whatever a step did change is in its ``data`` (IRQ masks
saved before writing, counts of threads bound) so nothing is half-applied
without being reported. The binding keeps what release and the reconcile loop
need as typed values: the IRQ writes (``Binding.irqs``), the masks to write
back, the irqbalance bans and the UVB threads' previous masks.

Identity: the worker is held by a pidfd (discovery/read/pin.py: the request's
observation took it, or it is opened here before the identity is read) and its
pid and start time are verified before anything is touched (ProcessGone:
``pid_gone`` / ``pid_recycled``). Each thread's mask is read before it is
written; after the writes, every one is confirmed to have reached the worker,
and one that reached another process (the pid, or a thread id, recycled
meanwhile) is undone (applier/confirm.py). A worker that exited by then is not
acted for any further: the IRQ, memory and UVB steps are skipped with its
reason, and ``Applied.gone`` says so, so that nobody holds the newcomer as the
worker. Without a pidfd (another ``proc_root``, an old kernel) the start time
is read again after the affinity step instead. Whoever calls, pid 1, a kernel
thread or the binding process itself is refused first (NotPermitted
``not_a_worker``).

Write-ahead: with ``record``, the caller is handed the binding as it stands
before any write, with everything undoing it needs (the worker's identity and
original CPUs, the plan, the masks of the IRQs the step will write, read first),
right before the first write; the daemon keeps it in its state file, so a kill
among the writes leaves a record.

A worker driving several NPUs gets, per role, the union of those NPUs' role
CPUs (the role split is defined per NPU; the union keeps multi-NPU workers on their
NPUs' pools instead of picking one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..values.config import Config
from ..discovery.gather.identity import (GONE_STATES, check_may_bind, recycled, refuse_non_worker, require_live,
                                  require_worker, verify_identity)
from ..discovery.gather.irqhost import NpuIrqLookup
from ..discovery.read.pin import LIVE_PROC, ProcessPin, open_pin
from ..discovery.gather.process import ProcessView, stat_of
from ..errors import PlanImpossible, ProcessGone
from ..values.frozen import frozen_map
from ..values.model import (
    Binding,
    HostFacts,
    NpuPlan,
    Plan,
    StepResult,
    WorkerFacts,
)
from ..values.reasons import Outcome, Reason, Step
from .affinity import AffinityResult, ThreadMask, bind_tasks, set_all_threads
from .irq import IrqPrep, IrqStep, bind_npu_irqs, hand_back_bans, prepare_npu_irqs, restore_irq_masks
from .memory import memory_target, migrate_memory, pending_memory
from .uvb import UvbStep, bind_uvb, restore_uvb_threads

__all__ = ["apply_plan", "apply_observed", "Applied", "release_binding", "merge_npu_plans", "bind_irqs_of",
           "unproven_irqs"]


def merge_npu_plans(npus: tuple[NpuPlan, ...]) -> NpuPlan:
    """One NpuPlan whose every role (and share class) is the union of that role over ``npus``."""
    if len(npus) == 1:
        return npus[0]

    def union(attr: str) -> tuple[int, ...]:
        return tuple(sorted({c for p in npus for c in getattr(p, attr)}))

    return NpuPlan(
        npu=npus[0].npu,
        pool=union("pool"),
        irq=union("irq"),
        main=union("main"),
        acl=union("acl"),
        release=union("release"),
        numa_nodes=union("numa_nodes"),
        classes=tuple((name, tuple(sorted({c for p in npus for c in p.class_cpus(name)})))
                      for name, _ in npus[0].classes),
    )


def _guard(step: Step, run: Callable[[], StepResult]) -> StepResult:
    # Each step handles the errors it expects; this keeps an unexpected OS error
    # in one step from stopping the independent ones.
    try:
        return run()
    except OSError as exc:
        return _unexpected(step, exc)


def _unexpected(step: Step, exc: OSError) -> StepResult:
    return StepResult(step, Outcome.FAILED, Reason.OS_ERROR, f"{step.value}: unexpected error: {exc}")


def _guard_irq(run: Callable[[], IrqStep]) -> IrqStep:
    try:
        return run()
    except OSError as exc:
        return IrqStep(_unexpected(Step.IRQ, exc))


def _guard_uvb(run: Callable[[], UvbStep]) -> UvbStep:
    try:
        return run()
    except OSError as exc:
        return UvbStep(_unexpected(Step.UVB, exc))


@dataclass(frozen=True)
class Applied:
    """A binding and the per-thread masks its affinity step read back (tid -> ThreadMask).
    ``gone``: ``pid_gone`` / ``pid_recycled`` when the worker had exited by the end of the
    affinity step (the later steps were skipped; the binding is no worker's to hold)."""

    binding: Binding
    threads: Mapping[int, ThreadMask]
    gone: str | None = None


def _guard_affinity(run: Callable[[], AffinityResult]) -> AffinityResult:
    try:
        return run()
    except OSError as exc:
        failed = StepResult(Step.AFFINITY, Outcome.FAILED, Reason.OS_ERROR, f"affinity: unexpected error: {exc}")
        return AffinityResult(failed, frozen_map({}))


def apply_plan(plan: Plan, worker: WorkerFacts, host: HostFacts, config: Config, *,
               view: ProcessView | None = None, move_memory: bool = True, pin: ProcessPin | None = None) -> Binding:
    """Steps affinity, irq, memory, uvb; each yields a StepResult; a failed step never stops
    the independent ones. Verifies pid + start time first (ProcessGone if gone/recycled)
    and refuses what is never a worker (NotPermitted ``not_a_worker``). ``move_memory``
    and ``pin``: see ``apply_observed``.
    """
    return apply_observed(plan, worker, host, config, view=view, move_memory=move_memory, pin=pin).binding


def apply_observed(plan: Plan, worker: WorkerFacts, host: HostFacts, config: Config, *,
                   view: ProcessView | None = None, npu_irqs: NpuIrqLookup | None = None,
                   move_memory: bool = True, pin: ProcessPin | None = None,
                   before_writes: Callable[[int], None] | None = None,
                   record: Callable[[Binding], None] | None = None,
                   among_writes: Callable[[int, Step], None] | None = None,
                   irqs_skipped: StepResult | None = None) -> Applied:
    """``apply_plan``, also returning the masks the affinity step read back.

    With ``view`` (the request's one observation of the worker), the identity checks
    are decided on it and the affinity step's first pass binds its threads as listed
    and named there; only threads born since are listed and named again. Without
    one, the identity is read here and the affinity step lists the threads itself.
    ``pin``: the worker held by its pidfd (a held record's); else the view's, else
    one is opened here, before the identity is read. ``npu_irqs`` answers which IRQs
    each NPU owns (the daemon's cache); without it the
    IRQ step looks them up on the host. ``move_memory`` False leaves the pages to the
    caller: the memory step is then ``pending`` with its target node (the daemon moves
    them in the background), or skipped when there is nowhere to move them.
    ``record(intended)`` runs once every check has passed, right before the first write:
    ``intended`` is the binding as it stands before any write, with everything undoing
    it needs (the worker's identity and original allowed CPUs, the plan, and each IRQ
    the step will write with its mask read now; no step results yet). The daemon writes
    it to its state file there, so that a kill among the writes leaves a record. Then
    ``before_writes(pid)`` runs (tests recycle the pid there). ``among_writes(pid, step)``
    runs between steps, naming the next: after the task masks (``Step.IRQ``) and after
    the IRQ masks (``Step.MEMORY``); tests stop the daemon at these points to kill it there.
    ``irqs_skipped``: the IRQ step's result when the caller rules it out (``unproven_irqs``):
    no IRQ mask is read, recorded, written or banned.
    """
    if not plan.npus:
        raise PlanImpossible("nothing to bind: the plan holds no NPU", code="no_target_npu", plan=plan)
    pid, proc_root = worker.pid, config.proc_root
    if pin is None and view is not None:
        pin = view.pin
    own = open_pin(pid) if pin is None and view is None and proc_root == LIVE_PROC else None
    pin = pin or own
    try:
        return _apply(plan, worker, host, config, view, pin, npu_irqs, move_memory,
                      (record, before_writes, among_writes), irqs_skipped)
    finally:
        if own is not None:
            own.close()


def _apply(plan: Plan, worker: WorkerFacts, host: HostFacts, config: Config, view: ProcessView | None,
           pin: ProcessPin | None, npu_irqs: NpuIrqLookup | None, move_memory: bool,
           hooks: tuple, irqs_skipped: StepResult | None = None) -> Applied:
    pid, proc_root = worker.pid, config.proc_root
    start, tasks = _checked(worker, view, proc_root, pin)
    merged = merge_npu_plans(plan.npus)
    record, before_writes, among_writes = hooks
    irq_prep = IrqPrep(irqs_skipped) if irqs_skipped is not None else None
    if record is not None:
        # the IRQ masks are read before the first write of any kind, so the record has them
        irq_prep = irq_prep or _guard_prep(lambda: prepare_npu_irqs(plan, host, config, lookup=npu_irqs))
        record(_intended(plan, worker, start, irq_prep, pin))
    if before_writes is not None:
        before_writes(pid)

    steps: list[StepResult] = []
    bound = _guard_affinity(lambda: bind_tasks(pid, merged, plan.mode, proc_root=proc_root, tasks=tasks, pin=pin,
                                                     classes=plan.thread_classes))
    affinity = bound.result
    gone = _gone(pid, start, proc_root, pin)
    if gone is not None and affinity.reason not in (Reason.PID_GONE, Reason.PID_RECYCLED):
        affinity = StepResult(Step.AFFINITY, Outcome.FAILED, Reason(gone),
                              f"process {pid} exited while it was being bound ({gone})", affinity.data)
    steps.append(affinity)
    if gone is None and among_writes is not None:
        among_writes(pid, Step.IRQ)
    if gone is None:
        irq = _guard_irq(lambda: bind_npu_irqs(plan, host, config, lookup=npu_irqs, prepared=irq_prep))
    else:
        irq = IrqStep(_not_for_a_stranger(Step.IRQ, pid, gone))
    steps.append(irq.result)
    if gone is None and among_writes is not None:
        among_writes(pid, Step.MEMORY)
    if gone is None and not move_memory:
        target = memory_target(plan, host)
        steps.append(target if isinstance(target, StepResult) else pending_memory(target))
    elif gone is None:
        steps.append(_guard(Step.MEMORY, lambda: migrate_memory(plan, pid, host, config, start_time=start)))
    else:
        steps.append(_not_for_a_stranger(Step.MEMORY, pid, gone))
    gone = gone or _gone(pid, start, proc_root, pin)
    uvb = _guard_uvb(lambda: bind_uvb(plan)) if gone is None else UvbStep(_not_for_a_stranger(Step.UVB, pid, gone))
    steps.append(uvb.result)

    binding = Binding(
        pid=pid,
        start_time=worker.start_time if worker.start_time is not None else start,
        npus=tuple(p.npu for p in plan.npus),
        plan=plan,
        original_cpus=frozenset(worker.allowed_cpus),
        saved_irq_masks=irq.saved,
        steps=tuple(steps),
        irqbalance_bans=irq.bans,
        irqs=irq.bindings,
        uvb_previous=uvb.previous,
        pidfd_ino=pin.ino if pin is not None else None,
    )
    return Applied(binding, bound.threads, gone)


def _checked(worker: WorkerFacts, view: ProcessView | None, proc_root: str, pin: ProcessPin | None):
    """(start time, the view's tasks or None) once ``worker`` is proven the process observed,
    a worker, one the daemon may bind, and still there; ProcessGone / NotPermitted else."""
    pid = worker.pid
    if view is not None:
        identity = require_live(view.identity, pid)
        refuse_non_worker(identity)
        tasks = view.tasks  # (tid, comm, ...) tuples: the affinity step reads the first two
    else:
        identity = require_worker(pid, proc_root)
        tasks = None
    if identity.pid != pid:
        raise ProcessGone(f"the observation is of process {identity.pid}, not {pid}", code="pid_recycled")
    if worker.start_time is not None and identity.start_time != worker.start_time:
        raise recycled(pid, identity.start_time, worker.start_time)
    check_may_bind(identity if view is not None else pid, proc_root)
    gone = _gone(pid, identity.start_time, proc_root, pin)
    if gone is not None:
        raise ProcessGone(f"process {pid} exited before it was bound; nothing was written", code=gone)
    return identity.start_time, tasks


def _guard_prep(run: Callable[[], IrqPrep]) -> IrqPrep:
    try:
        return run()
    except OSError as exc:  # the IRQ step then reports it, and writes nothing
        return IrqPrep(_unexpected(Step.IRQ, exc))


def _intended(plan: Plan, worker: WorkerFacts, start: int, irq: IrqPrep, pin: ProcessPin | None) -> Binding:
    """The binding before its first write: what the record of a bind in flight keeps."""
    return Binding(
        pid=worker.pid,
        start_time=worker.start_time if worker.start_time is not None else start,
        npus=tuple(p.npu for p in plan.npus),
        plan=plan,
        original_cpus=frozenset(worker.allowed_cpus),
        saved_irq_masks=irq.originals,
        steps=(),
        pidfd_ino=pin.ino if pin is not None else None,
    )


def unproven_irqs(npus) -> StepResult:
    """The IRQ step of a binding nothing proves (its caller's own claim): the NPU's SQ/CQ
    IRQs are host-wide, and moving them, or banning them in irqbalance, for a worker that
    may not drive that NPU would let any local user steer another tenant's interrupts."""
    return StepResult(Step.IRQ, Outcome.SKIPPED, Reason.UNPROVEN,
                      f"nothing proves the worker drives NPU(s) {', '.join(map(str, npus))}: their SQ/CQ IRQs "
                      f"are left as they are until npu-smi lists it there")


def bind_irqs_of(binding: Binding, host: HostFacts, config: Config, *, npu_irqs: NpuIrqLookup | None = None,
                 record: Callable[[Binding], None] | None = None) -> Binding:
    """The IRQ step alone, for a held ``binding`` whose step was left out (``unproven_irqs``)
    and is now due: ``binding`` with the step's result, the masks it saved, its IRQ writes
    and its irqbalance bans (those of ``binding`` are the caller's to carry). ``record``
    gets the binding with the masks the step will change, read first, before its first
    write (write-ahead, as ``apply_observed``)."""
    prep = _guard_prep(lambda: prepare_npu_irqs(binding.plan, host, config, lookup=npu_irqs))
    if record is not None:
        record(dataclasses.replace(binding, saved_irq_masks=prep.originals))
    irq = _guard_irq(lambda: bind_npu_irqs(binding.plan, host, config, lookup=npu_irqs, prepared=prep))
    steps = tuple(irq.result if s.step is Step.IRQ else s for s in binding.steps)
    if not any(s.step is Step.IRQ for s in steps):
        steps = (*steps, irq.result)
    return dataclasses.replace(binding, saved_irq_masks=irq.saved, irqs=irq.bindings, irqbalance_bans=irq.bans,
                               steps=steps)


def _gone(pid: int, start: int, proc_root: str, pin: ProcessPin | None) -> str | None:
    """None while ``pid`` is still the worker (by its pidfd, else by its start time), else
    ``pid_gone`` (no process has the number) or ``pid_recycled`` (another one has)."""
    if pin is not None:
        if not pin.exited():
            return None
        st = stat_of(pid, proc_root)  # the worker's zombie, not reaped yet, or nobody: gone
        return "pid_gone" if st is None or st[0] in GONE_STATES else "pid_recycled"
    try:
        verify_identity(pid, start, proc_root)
    except ProcessGone as exc:
        return exc.code
    return None


def _not_for_a_stranger(step: Step, pid: int, gone: str) -> StepResult:
    return StepResult(step, Outcome.SKIPPED, Reason(gone),
                      f"process {pid} exited while it was being bound: nothing done for whoever has its pid now")


def release_binding(
    binding: Binding, config: Config, *, restore_irqs: bool = True, restore_uvb: bool = False,
    pin: ProcessPin | None = None,
) -> tuple[StepResult, ...]:
    """Restore the worker's original affinity (all threads) and, if asked, the saved IRQ
    masks, taking the IRQs it banned in irqbalance off that ban list again.

    ``restore_uvb`` puts the Ascend 950 UVB poll threads back on their old masks;
    the daemon asks for it only when the last 950 worker is released, since the
    threads serve every worker. A worker that has exited (or whose pid now names
    another process) is skipped, never touched. ``pin``: the worker held by its pidfd
    (the held record's), which decides that, and confirms the writes (see ``apply_observed``).
    """
    proc_root = config.proc_root
    steps: list[StepResult] = []
    try:
        verify_identity(binding.pid, binding.start_time, proc_root, pin=pin)
    except ProcessGone as exc:
        steps.append(StepResult(Step.AFFINITY, Outcome.SKIPPED, Reason(exc.code), f"{exc}: nothing to restore"))
    else:
        res = _guard(Step.AFFINITY, lambda: set_all_threads(binding.pid, binding.original_cpus, proc_root=proc_root,
                                                            pin=pin))
        if res.outcome is Outcome.FAILED and res.reason is Reason.PID_GONE:
            res = StepResult(Step.AFFINITY, Outcome.SKIPPED, Reason.PID_GONE, res.detail, res.data)
        steps.append(res)

    if restore_irqs:
        irq = _guard(Step.IRQ, lambda: restore_irq_masks(binding.saved_irq_masks, proc_root=proc_root))
        bans = binding.irqbalance_bans
        if bans is not None:
            irq = _guard(Step.IRQ, lambda: hand_back_bans(irq, bans, config))
        steps.append(irq)
    else:
        steps.append(
            StepResult(Step.IRQ, Outcome.SKIPPED, Reason.NOT_APPLICABLE, "IRQ masks left as bound (restore_irqs=False)")
        )

    if restore_uvb:
        steps.append(_guard(Step.UVB, lambda: restore_uvb_threads(binding.uvb_previous)))
    return tuple(steps)
