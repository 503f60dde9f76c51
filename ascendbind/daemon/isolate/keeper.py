"""Isolation, kept in step with the held table.

``Isolation.follow`` runs after every change to what the daemon holds (the
``Daemon`` calls it from ``save``, under its lock). From the host's facts and
the bound workers' plans it plans the level (planner/isolate/isolation.py), then:

* every level: the daemon's threads go to the housekeeping CPUs while anything
  is bound, and back where they started when nothing is (selfmask.py);
* ``irqs``: every IRQ in ``/proc/irq`` but the SQ/CQ IRQs a bound NPU's IRQ step
  pinned gets ``narrowed`` (the NPU driver's mailbox IRQ of a bound NPU: that
  NPU's IRQ CPUs), and so does ``/proc/irq/default_smp_affinity``; the driver's
  ``devN_sq_task`` threads and ``devN_sq_send_wq`` workqueues of bound NPUs go
  to their NPU's IRQ CPUs; a running irqbalance is told to keep IRQs off the
  protected CPUs as well as those it bans already (``irqbalance = ban`` or
  ``stop``; ``warn`` only reports it: banned.py); what each wants is wanted.py's;
* ``host``: also every other userspace thread (hosttasks.py: which are never
  moved, and the mask less the protected CPUs for the rest), the unbound
  workqueues' shared mask and the soft-lockup watchdog's CPUs. ``adopt`` does
  the same for the processes the watcher (taskwatch.py) names as they start; a thread that inherited a mask
  isolation wrote is recorded with its parent's original, so it goes back too.

Each mask is weighed by rules.py. Every change is added to the record and the
state file written *before* the first write; what is no longer wanted is put
back and read back byte for byte, unless its owner changed it meanwhile (left
as it is, logged, and listed in status). An IRQ the IRQ step pins is the
bind's while it is pinned: isolation neither writes nor forgets it, so its
original comes back once both have let go. A value the kernel refuses
(``irq_unchangeable``, ``mask_unchangeable``) is not tried again.

``put_back`` gives the host everything back (daemon stop); the daemon's threads
stay where they are, as the process ends anyway. Without host facts (before
the first discovery) nothing new is changed, but with nothing bound everything
recorded is put back: that needs no facts.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import structlog

from ...values.config import Config
from ...values.cpulist import format_cpulist
from ...values.decisions import MaskWrite
from ...discovery.gather.irqhost import irq_masks_writable
from ...errors import ConfigError, PlanImpossible
from ...values.model import Binding, HostFacts, Plan, PlanIssue
from ...planner.isolate.isolation import IsolationPlan, host_plan, plan_isolation
from ...values.reasons import Reason
from ..state.isolationrecord import KINDS, IsolationRecord, SavedMask, key_kind, mask_key
from .banned import follow_irqbalance
from .hosttasks import HostTasks, before_isolation, task_keys_of
from .masks import SKIP_REASONS, Mask, mask_of
from .rules import Act, mask_act
from .selfmask import DaemonThreads
from .wanted import host_wide_wanted, irq_wanted

__all__ = ["Isolation"]

log = structlog.get_logger("ascendbind.isolation")

MAX_LISTED = 256  # skipped masks listed in status (all are counted)
ADOPT_ROUNDS = 4


class Isolation:
    """The isolation record and what follows from it (see the module docstring)."""

    def __init__(self, *, confine_self: bool = False) -> None:
        self.record = IsolationRecord()
        self.threads = DaemonThreads() if confine_self else None
        self.plan: IsolationPlan | None = None
        self.level = "off"
        self.waiting: str | None = None
        self.irqbalance: str | None = None
        self.skipped: dict[str, dict[str, str]] = {}  # key -> reason and sentence, from the latest follow
        self.left: deque[dict[str, str]] = deque(maxlen=32)  # masks left to their owner, newest last
        self.last: dict[str, Any] = {}
        self._refused: dict[str, dict[str, str]] = {}  # key -> its skip: the kernel refuses it, never tried again
        self._planned: tuple | None = None  # (host, plans, config) -> plan, for a save that changed nothing
        self._whole: tuple | None = None  # (host, config, host_plan of them): every bind's save needs it
        self._applied: tuple | None = None
        self.stopped = False  # put back for good: the daemon is stopping
        self._moving = False
        self.tasks = HostTasks()  # the host level's other tasks
        self.woken = threading.Event()  # set when the host level starts or stops moving tasks (taskwatch.py)

    # ---------------------------------------------------------- state

    def load(self, raw: Any) -> None:
        try:
            self.record = IsolationRecord.from_json(raw)
        except ValueError as exc:
            log.error("isolation record in the state file not used; its masks are left as they are", error=str(exc))
            self.record = IsolationRecord()

    def state_json(self) -> dict[str, Any]:
        return self.record.to_json()

    def refusal(self, host: HostFacts, plans: Sequence, config: Config) -> PlanIssue | None:
        """Why a bind giving these plans is refused at this level (None: it is not)."""
        if config.isolation == "off":
            return None
        return plan_isolation(host, plans, config, whole=self._host_plan(host, config)).error

    # ---------------------------------------------------------- the Daemon's calls

    def refuse(self, daemon, host: HostFacts, plan, config: Config, *pids: int) -> None:
        """PlanImpossible ``no_housekeeping_cpus`` when, with ``plan`` bound beside the daemon's
        workers other than ``pids`` (the one binding, those it replaces), the level would
        leave no CPU for the rest of the host."""
        if config.isolation == "off":
            return
        with daemon.lock:
            plans = [h.binding.plan for other, h in daemon.held.items() if other not in pids and h.proof.proven]
            plans.append(plan)
        refused = self.refusal(host, plans, config)
        if refused is not None:
            raise PlanImpossible(refused.reason, code=refused.code, plan=plan)

    def after_change(self, daemon, records: list[str]) -> None:
        """``follow`` for the ``Daemon``'s save (under its lock): the state file, with the
        workers' ``records``, is written before any mask. A state file that cannot be
        written stops it there (the error is the save's to report)."""
        def persist() -> None:
            daemon.state.save_encoded(records, isolation=self.state_json())

        try:
            self.follow(daemon.hosts.known(), [h.binding for h in daemon.held.values()], daemon.config, persist,
                        isolating=frozenset(pid for pid, h in daemon.held.items() if h.proof.proven))
        except (OSError, ConfigError):
            raise
        except Exception:  # a bug here must not cost the state file of the bindings
            log.exception("isolation could not follow the bound workers")
        self._gauge(daemon)

    def _gauge(self, daemon) -> None:
        recorded = sum(1 for k in self.record.masks if key_kind(k) == "task")
        for state, value in (("recorded", recorded), ("left_to_owner", len(self.tasks.hands_off)),
                             ("pinned_inside", len(self.tasks.pinned)), ("record_full", self.tasks.over_limit)):
            daemon.metrics.isolation_tasks.labels(state=state).set(value)

    def stop(self, daemon) -> None:
        """The daemon stops: every mask isolation changed goes back (bindings stay)."""
        with daemon.lock:
            self.stopped = True
            records = [h.state_record() for h in daemon.held.values()]
            try:
                self.put_back(daemon.config, lambda: daemon.state.save_encoded(records, isolation=self.state_json()))
            except Exception:
                log.exception("isolation could not put the host back")

    # ---------------------------------------------------------- following the held table

    def follow(self, host: HostFacts | None, bindings: Sequence[Binding], config: Config,
               persist: Callable[[], None], *, isolating: Collection[int] | None = None) -> None:
        """Bring the host in line with ``bindings`` at ``config.isolation``; ``persist``
        writes the state file (with ``state_json``) and is called before any write.
        ``isolating``: the pids of the bindings whose CPUs are protected (the proven ones,
        daemon/watch/proof.py; None: all). The others are still the bind's: their threads
        and the IRQs their IRQ step pinned are never moved, but nothing moves for them."""
        self.level = config.isolation
        if self.stopped:
            return
        if self.threads is None and config.isolation == "off" and self.record.empty:
            self.plan = None
            return
        plans = tuple(b.plan for b in bindings if isolating is None or b.pid in isolating)
        if host is None and plans:
            self.waiting = "the host is not discovered yet: nothing is changed until it is"
            return
        self.waiting = None
        pinned = frozenset(w.irq for b in bindings for w in b.irqs if w.pinned)
        iso = self._plan(host, plans, config) if host is not None else None
        self.plan = iso
        key = (config, iso, pinned, self.record.empty)
        if key == self._applied:
            return
        t0 = time.monotonic()
        if self.threads is not None:
            if iso is not None and iso.protected and iso.housekeeping:
                self.threads.keep_on(iso.housekeeping, f"on the housekeeping CPUs {format_cpulist(iso.housekeeping)}"
                                                       ": workers are bound")
            else:
                self.threads.keep_on(None, "")
                if iso is not None and iso.protected:
                    self.threads.note = "where they started: no housekeeping CPU is left"
        on = iso is not None and config.isolation != "off" and iso.moves_irqs
        writable, where = irq_masks_writable(config.proc_root)
        if on and not writable:
            # a read-only /proc/irq (systemd's ProtectKernelTunables=yes): every write would fail
            self.skipped = {"irq": {"reason": Reason.IRQ_NOT_WRITABLE.value,
                                    "detail": f"{where} is not writable (a read-only mount?): no mask is changed"}}
            on = False
        else:
            self.skipped.pop("irq", None)
        host_on = iso is not None and iso.moves_tasks
        bound = {b.pid: b.start_time for b in bindings}
        if not host_on:
            # before the tasks go back: those that inherited a mask isolation wrote go back with them
            self.record = self.record.with_masks(self.tasks.heirs(config, self.record.masks))
        wanted = self._wanted(iso, host, config, pinned, on, host_on, bound) if iso is not None and host else {}
        counts = self._masks(wanted, config, pinned, persist)
        follow_irqbalance(self, iso if on else None, config, persist)
        self._applied = (config, iso, pinned, self.record.empty)
        if host_on != self._moving:
            self._moving = host_on
            self.woken.set()
        seconds = time.monotonic() - t0
        self.last = {"at": round(time.time(), 3), "seconds": round(seconds, 6), **counts}
        if any(counts.values()):
            log.info("isolation followed the bound workers", isolation=config.isolation,
                     protected=format_cpulist(iso.protected) if iso else "", housekeeping=format_cpulist(
                         iso.housekeeping) if iso else "", seconds=round(seconds, 4), **counts)

    @property
    def moving_tasks(self) -> bool:
        """Whether the host level moves other tasks now (the watcher follows new ones)."""
        return self._moving and not self.stopped

    def adopt(self, daemon, pids: Iterable[int]) -> dict[str, int]:
        """Move the tasks of ``pids`` (just started, or just exec'd) at ``host``, with the
        same record-before-write as ``follow``; under the daemon's lock, like ``follow``."""
        with daemon.lock:
            iso = self.plan
            if not self.moving_tasks or iso is None or not iso.moves_tasks:
                return {}
            bound = {h.binding.pid: h.binding.start_time for h in daemon.held.values()}
            total: dict[str, int] = {}
            # a thread started while its process was being moved has the old mask, or ours unrecorded:
            # the same processes again until a round finds nothing new (bounded: threads are not
            # created in a loop faster than a round, and the full sweep catches the rest)
            for _ in range(ADOPT_ROUNDS):
                wanted, swept, heirs = self.tasks.wanted(iso, daemon.config, bound, self.record.masks,
                                                         self._refused, pids)
                self.record = self.record.with_masks(heirs)
                counts = self._masks(wanted, daemon.config, frozenset(), lambda: self._persist(daemon), scope=swept)
                for k, v in counts.items():
                    total[k] = total.get(k, 0) + v
                if not counts["written"] and not heirs:
                    break
            self.tasks.moved += total.get("written", 0)
            self._gauge(daemon)
            return total

    def before_isolation(self, tids: Iterable[int]) -> frozenset[int]:
        """What the host level narrowed of threads ``tids``: their CPUs before it (empty: none)."""
        return before_isolation(self.record.masks, tids)

    def hand_over(self, tids: Iterable[int]) -> None:
        """Threads ``tids`` are a bound worker's now: their records go (the binding keeps their
        original CPUs), so isolation never puts its original back over the bind's masks."""
        self.record = self.record.with_masks(dict.fromkeys(task_keys_of(self.record.masks, tids)))

    def resweep(self, daemon) -> None:
        """A full follow at the next save, and that save now (the watcher's periodic sweep:
        threads made while their process was being moved, events lost, pids reused)."""
        with daemon.lock:
            self._applied = None
        daemon.save()

    def _persist(self, daemon) -> None:
        daemon.state.save_encoded([h.state_record() for h in daemon.held.values()], isolation=self.state_json())

    def put_back(self, config: Config, persist: Callable[[], None]) -> None:
        """Give the host back every mask and irqbalance's banned CPUs (the daemon stops)."""
        self.record = self.record.with_masks(self.tasks.heirs(config, self.record.masks))
        counts = self._masks({}, config, frozenset(), persist)
        follow_irqbalance(self, None, config, persist)
        self._applied = None
        if self._moving:
            self._moving = False
            self.woken.set()
        log.info("isolation put the host back", **counts)

    def _plan(self, host: HostFacts, plans: tuple, config: Config) -> IsolationPlan:
        key = (host, tuple(id(p) for p in plans), config)
        if self._planned is not None and self._planned[0] == key:
            return self._planned[1]
        iso = plan_isolation(host, plans, config, whole=self._host_plan(host, config))
        self._planned = (key, iso)
        return iso

    def _host_plan(self, host: HostFacts, config: Config) -> Plan:
        """``host_plan`` of ``host`` and ``config``, kept until either changes (a rediscovery,
        a reload): the planner's work over every NPU of the host, once, not at each save."""
        kept = self._whole
        if kept is not None and kept[0] is host and kept[1] == config:
            return kept[2]
        whole = host_plan(host, config)
        self._whole = (host, config, whole)
        return whole

    # ---------------------------------------------------------- masks

    def _wanted(self, iso: IsolationPlan, host: HostFacts, config: Config, pinned: frozenset[int], irqs: bool,
                tasks: bool, bound: dict[int, int | None]) -> dict[str, tuple[str, frozenset[int]]]:
        """key -> (current text, wanted CPUs) of every mask the level sets: with ``irqs``
        the IRQ level's, with ``tasks`` the host level's."""
        out: dict[str, tuple[str, frozenset[int]]] = {}
        if tasks:
            out, _swept, heirs = self.tasks.wanted(iso, config, bound, self.record.masks, self._refused)
            self.record = self.record.with_masks(heirs)
            self.tasks.swept_at = round(time.time(), 3)
            # a task refused for good that exited is forgotten with it
            self._refused = {k: v for k, v in self._refused.items() if key_kind(k) != "task" or k in _swept
                             or k in self.record.masks}
            out.update(host_wide_wanted(iso, config, self.record.masks, self._refused))
        if irqs:
            out.update(irq_wanted(iso, host, config, pinned, self.record.masks, self._refused))
        return out

    def _masks(self, wanted: dict[str, tuple[str, frozenset[int]]], config: Config, pinned: frozenset[int],
               persist: Callable[[], None], scope: set[str] | None = None) -> dict[str, int]:
        """Weigh and carry out every mask in ``wanted`` or the record (with ``scope``: only
        the record's keys in it; the rest is left for a full follow)."""
        held = {mask_key("irq", i) for i in pinned}  # the IRQ step's while pinned
        plan: list[tuple[str, Act, Mask, str | None]] = []
        recorded = set(self.record.masks) if scope is None else set(self.record.masks) & scope
        for key in sorted((set(wanted) | recorded) - held):
            m = mask_of(key, config)
            current = wanted[key][0] if key in wanted else m.read()
            target = wanted[key][1] if key in wanted else None
            act = mask_act(self.record.masks.get(key), None if current is None else m.parse(current), target, m.parse)
            plan.append((key, act, m, current))
        # a skip is listed until the mask is tried again; a refused one whenever the level is on
        if scope is None:
            self.skipped = {k: v for k, v in self.skipped.items() if k in wanted or k in self.record.masks or k == "irq"}
            if wanted:
                self.skipped.update(self._refused)
        counts = {"written": 0, "restored": 0, "left_to_owner": 0, "skipped": 0}
        writes = []
        changes: dict[str, SavedMask | None] = {}  # applied to the record in one copy per batch

        def saved_of(key: str) -> SavedMask | None:
            return changes[key] if key in changes else self.record.masks.get(key)

        for key, act, m, current in plan:
            saved = saved_of(key)
            if act is Act.WRITE:
                text = m.text(wanted[key][1], current)
                changes[key] = (saved or SavedMask(current)).with_ours(text)
                writes.append((key, m, text, saved))
            elif act is Act.KEEP:
                changes[key] = saved.settled(current)
            elif act in (Act.SETTLED, Act.GONE):
                changes[key] = None
            elif act is Act.OWNER:
                changes[key] = None
                self._left(key, saved, current)
                counts["left_to_owner"] += 1
        self.record = self.record.with_masks(changes)
        changes = {}
        if writes:
            persist()  # what is about to change is on disk before it changes
        for key, m, text, before in writes:
            w = m.write(text, False)
            if w.status == "ok":
                changes[key] = saved_of(key).settled(w.now or text)
                self.skipped.pop(key, None)
                counts["written"] += 1
            else:
                changes[key] = self._failed(key, w, before, saved_of(key))
                counts["skipped"] += 1
        for key, act, m, _current in plan:
            if act is Act.RESTORE:
                saved = saved_of(key)
                w = m.write(saved.original, True)
                if w.status in ("ok", "gone"):
                    changes[key] = None
                    counts["restored"] += 1 if w.status == "ok" else 0
                else:
                    # refused now (it can never go back: forgotten, and listed) or failed (tried again)
                    changes[key] = self._failed(key, w, None if w.status == "unchangeable" else saved, saved)
                    counts["skipped"] += 1
        self.record = self.record.with_masks(changes)
        return counts

    def _failed(self, key: str, w: MaskWrite, before: SavedMask | None, now: SavedMask | None) -> SavedMask | None:
        """Note a write that failed; the record's value for ``key`` afterwards."""
        unchangeable, failed = SKIP_REASONS[key_kind(key)]
        reason = unchangeable if w.status == "unchangeable" else failed
        self.skipped[key] = {"reason": reason.value, "detail": f"{key}: {w.error or w.status}"}
        if w.status == "unchangeable":
            self._refused[key] = self.skipped[key]
        if w.status == "failed":
            log.warning("isolation could not write a mask", key=key, error=w.error, now=w.now)
        # nothing changed: the record is as before this write (or gone with a value never ours)
        return before if w.status in ("unchangeable", "gone") else now

    def _left(self, key: str, saved: SavedMask, current: str | None) -> None:
        why = (f"{key} holds {current}, neither its original {saved.original} nor what isolation wrote "
               f"({', '.join(saved.ours) or '-'}): its owner changed it, so it is left as it is")
        self.left.append({"what": key, "reason": Reason.CHANGED_BY_OWNER.value, "detail": why})
        self.tasks.left_to_owner(key)
        log.warning("mask changed by its owner meanwhile; left as it is", key=key, now=current,
                    original=saved.original, ours=list(saved.ours))

    # ---------------------------------------------------------- status

    def to_json(self, config: Config) -> dict[str, Any]:
        """The ``isolation`` object of ``GET /v1/workers``."""
        out: dict[str, Any] = self.plan.to_json() if self.plan is not None else {
            "level": config.isolation, "housekeeping_cpus": "auto" if config.housekeeping_cpus == "auto" else "config",
            "housekeeping": None, "protected": None, "cpus": [], "warnings": [], "error": None}
        kinds: dict[str, int] = {}
        for key in self.record.masks:
            kinds[key_kind(key)] = kinds.get(key_kind(key), 0) + 1
        out.update(
            waiting=self.waiting,
            daemon_threads=None if self.threads is None else self.threads.to_json(),
            changed={k: kinds.get(k, 0) for k in KINDS},
            # bounded: at host thousands of tasks may be refused (a cpuset without a housekeeping CPU)
            skipped=[{"what": k, **v} for k, v in sorted(self.skipped.items())[:MAX_LISTED]],
            skipped_total=len(self.skipped),
            tasks=self.tasks.to_json() if config.isolation == "host" or self.tasks.swept_at else None,
            left_to_owner=list(self.left),
            irqbalance=self.irqbalance,
            last_change=self.last or None,
        )
        return out
