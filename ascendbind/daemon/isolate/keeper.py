"""Isolation, kept in step with the held table.

The ``Daemon`` reaches it through a few entry points, each with the values it
needs spelled out (no entry point takes the daemon itself):

* ``commit(host, bindings, config, persist, isolating=...)``: the one way the
  daemon's commit of a change to the held table reaches the host. From the
  host's facts and the bound workers' plans it plans the level
  (planner/isolate/isolation.py), records each mask in the state file
  (``persist``) before writing it, writes it, and puts back what is no longer
  needed, unless its owner changed it meanwhile. The caller holds the daemon's
  lock, as for everything that writes the state file;
* ``adopt(pids, bindings, config, persist)``: the same for the processes the
  task watcher (taskwatch.py) names as they start, at ``host``;
* ``stop(config, persist)``: the daemon stops: every mask goes back;
* ``hand_over(tids)``: a bind took those threads: isolation forgets them.

and asks it two queries: ``refuse``/``refusal`` (would a plan leave the host
no housekeeping CPU?) and ``before_isolation`` (the CPUs threads had before
the host level narrowed them).

What follows from a commit:

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
  workqueues' shared mask and the soft-lockup watchdog's CPUs. A thread that
  inherited a mask isolation wrote is recorded with its parent's original, so
  it goes back too.

Every mask, whatever its kind, goes through the same interface (kinds.py:
read / apply / verify / restore) and the same verdict (rules/verdicts.py).
Every change is added to the record and the state file written *before* the
first write; what is no longer wanted is put back and read back byte for
byte, unless its owner changed it meanwhile (left as it is, logged, and listed
in status). An IRQ the IRQ step pins is the bind's while it is pinned:
isolation neither writes nor forgets it, so its original comes back once both
have let go. A value the kernel refuses (``irq_unchangeable``,
``mask_unchangeable``) is not tried again.

Without host facts (before the first discovery) nothing new is changed, but
with nothing bound everything recorded is put back: that needs no facts.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, NamedTuple

import structlog

from ...values.config import Config
from ...values.cpulist import format_cpulist
from ...values.decisions import MaskWrite
from ...discovery.gather.irqhost import irq_masks_writable
from ...errors import ConfigError, PlanImpossible
from ...values.model import Binding, HostFacts, Plan, PlanIssue
from ...planner.isolate.isolation import IsolationPlan, host_plan, plan_isolation
from ...values.reasons import Reason
from .banned import follow_irqbalance
from .hosttasks import HostTasks, before_isolation, task_keys_of
from .kinds import MaskKind, mask_kinds
from .rules.keys import KINDS, MaskKey
from .rules.records import IsolationRecord, SavedBan, SavedMask
from .rules.verdicts import Act, mask_act
from .selfmask import DaemonThreads
from .wanted import Wanted, host_wide_wanted, irq_wanted

__all__ = ["Isolation"]

log = structlog.get_logger("ascendbind.isolation")

MAX_LISTED = 256  # skipped masks listed in status (all are counted)
ADOPT_ROUNDS = 4
Changes = dict[MaskKey, "SavedMask | None"]  # applied to the record in one copy per batch


class _Weighed(NamedTuple):
    key: MaskKey
    act: Act
    kind: MaskKind
    current: str | None


class Isolation:
    """The isolation record and what follows from it (see the module docstring)."""

    def __init__(self, *, confine_self: bool = False, tasks_gauge: Any = None) -> None:
        self.record = IsolationRecord()
        self.threads = DaemonThreads() if confine_self else None
        self.gauge = tasks_gauge  # ascendbind_isolation_tasks{state}, set after each commit and adopt
        self.plan: IsolationPlan | None = None
        self.level = "off"
        self.waiting: str | None = None
        self.irqbalance: str | None = None
        self.skipped: dict[str, dict[str, str]] = {}  # key -> reason and sentence, from the latest follow
        self.left: deque[dict[str, str]] = deque(maxlen=32)  # masks left to their owner, newest last
        self.last: dict[str, Any] = {}
        self._refused: dict[MaskKey, dict[str, str]] = {}  # key -> its skip: the kernel refuses it, never tried again
        self._planned: tuple | None = None  # (host, plans, config) -> plan, for a save that changed nothing
        self._whole: tuple | None = None  # (host, config, host_plan of them): every bind's save needs it
        self._applied: tuple | None = None
        self._full = threading.Event()  # the watcher asks for a full follow at the next commit
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

    # ---------------------------------------------------------- queries

    def refusal(self, host: HostFacts, plans: Sequence[Plan], config: Config) -> PlanIssue | None:
        """Why a bind giving these plans is refused at this level (None: it is not)."""
        if config.isolation == "off":
            return None
        return plan_isolation(host, plans, config, whole=self._host_plan(host, config)).error

    def refuse(self, host: HostFacts, plan: Plan, config: Config, others: Iterable[Plan]) -> None:
        """PlanImpossible ``no_housekeeping_cpus`` when, with ``plan`` bound beside ``others``
        (the plans of the proven workers that stay: not the one binding, nor those it
        replaces), the level would leave no CPU for the rest of the host."""
        if config.isolation == "off":
            return
        refused = self.refusal(host, [*others, plan], config)
        if refused is not None:
            raise PlanImpossible(refused.reason, code=refused.code, plan=plan)

    def before_isolation(self, tids: Iterable[int]) -> frozenset[int]:
        """What the host level narrowed of threads ``tids``: their CPUs before it (empty: none)."""
        return before_isolation(self.record.masks, tids)

    @property
    def moving_tasks(self) -> bool:
        """Whether the host level moves other tasks now (the watcher follows new ones)."""
        return self._moving and not self.stopped

    # ---------------------------------------------------------- the entry points

    def commit(self, host: HostFacts | None, bindings: Sequence[Binding], config: Config,
               persist: Callable[[], None], *, isolating: Collection[int] | None = None) -> None:
        """Bring the host in line with ``bindings`` at ``config.isolation`` (the daemon's
        commit, under its lock). ``persist`` writes the state file (with ``state_json``)
        and is called before any write; one that fails stops it there (its OSError or
        ConfigError is the caller's to report). ``isolating``: the pids of the bindings
        whose CPUs are protected (the proven ones, daemon/watch/proof.py; None: all). The
        others are still the bind's: their threads and the IRQs their IRQ step pinned are
        never moved, but nothing moves for them."""
        try:
            self._follow(host, bindings, config, persist, isolating)
        except (OSError, ConfigError):
            raise
        except Exception:  # a bug here must not cost the state file of the bindings
            log.exception("isolation could not follow the bound workers")
        finally:
            self._gauge()

    def sweep_due(self) -> None:
        """A full follow at the next commit, whatever changed (the watcher's periodic sweep:
        threads made while their process was being moved, events lost, pids reused)."""
        self._full.set()

    def adopt(self, pids: Iterable[int], bindings: Sequence[Binding], config: Config,
              persist: Callable[[], None]) -> dict[str, int]:
        """Move the tasks of ``pids`` (just started, or just exec'd) at ``host``, with the
        same record-before-write as ``commit``; under the daemon's lock, like ``commit``."""
        iso = self.plan
        if not self.moving_tasks or iso is None or not iso.moves_tasks:
            return {}
        bound = {b.pid: b.start_time for b in bindings}
        total: dict[str, int] = {}
        # a thread started while its process was being moved has the old mask, or ours unrecorded:
        # the same processes again until a round finds nothing new (bounded: threads are not
        # created in a loop faster than a round, and the full sweep catches the rest)
        for _ in range(ADOPT_ROUNDS):
            wanted, swept, heirs = self.tasks.wanted(iso, config, bound, self.record.masks, self._refused, pids)
            self.record = self.record.with_masks(heirs)
            counts = self._masks(wanted, config, frozenset(), persist, scope=swept)
            for k, v in counts.items():
                total[k] = total.get(k, 0) + v
            if not counts["written"] and not heirs:
                break
        self.tasks.moved += total.get("written", 0)
        self._gauge()
        return total

    def hand_over(self, tids: Iterable[int]) -> None:
        """Threads ``tids`` are a bound worker's now: their records go (the binding keeps their
        original CPUs), so isolation never puts its original back over the bind's masks."""
        self.record = self.record.with_masks(dict.fromkeys(task_keys_of(self.record.masks, tids)))

    def stop(self, config: Config, persist: Callable[[], None]) -> None:
        """The daemon stops: every mask isolation changed goes back, and irqbalance's banned
        CPUs (bindings stay; the daemon's threads too, as the process ends anyway). Under
        the daemon's lock; from here on ``commit`` changes nothing."""
        self.stopped = True
        try:
            self.record = self.record.with_masks(self.tasks.heirs(config, self.record.masks))
            counts = self._masks({}, config, frozenset(), persist)
            self._irqbalance(None, config, persist)
            log.info("isolation put the host back", **counts)
        except Exception:
            log.exception("isolation could not put the host back")
        self._applied = None
        if self._moving:
            self._moving = False
            self.woken.set()

    # ---------------------------------------------------------- following the held table

    def _follow(self, host: HostFacts | None, bindings: Sequence[Binding], config: Config,
                persist: Callable[[], None], isolating: Collection[int] | None) -> None:
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
        iso = self.plan = self._plan(host, plans, config) if host is not None else None
        if self._full.is_set():
            self._full.clear()
            self._applied = None
        key = (config, iso, pinned, self.record.empty)
        if key == self._applied:
            return
        t0 = time.monotonic()
        self._confine_self(iso)
        on = self._irqs_writable(config, iso is not None and config.isolation != "off" and iso.moves_irqs)
        host_on = iso is not None and iso.moves_tasks
        if not host_on:
            # before the tasks go back: those that inherited a mask isolation wrote go back with them
            self.record = self.record.with_masks(self.tasks.heirs(config, self.record.masks))
        bound = {b.pid: b.start_time for b in bindings}
        wanted = self._wanted(iso, host, config, pinned, on, host_on, bound) if iso is not None and host else {}
        counts = self._masks(wanted, config, pinned, persist)
        self._irqbalance(iso if on else None, config, persist)
        self._applied = (config, iso, pinned, self.record.empty)  # as the record is now
        if host_on != self._moving:
            self._moving = host_on
            self.woken.set()
        self._note(config, iso, time.monotonic() - t0, counts)

    def _confine_self(self, iso: IsolationPlan | None) -> None:
        """The daemon's own threads on the housekeeping CPUs while anything is protected."""
        if self.threads is None:
            return
        if iso is not None and iso.protected and iso.housekeeping:
            self.threads.keep_on(iso.housekeeping, f"on the housekeeping CPUs {format_cpulist(iso.housekeeping)}"
                                                   ": workers are bound")
        else:
            self.threads.keep_on(None, "")
            if iso is not None and iso.protected:
                self.threads.note = "where they started: no housekeeping CPU is left"

    def _irqs_writable(self, config: Config, on: bool) -> bool:
        """``on`` unless ``/proc/irq`` cannot be written (then said in status)."""
        writable, where = irq_masks_writable(config.proc_root)
        if not on or writable:
            self.skipped.pop("irq", None)
            return on
        # a read-only /proc/irq (systemd's ProtectKernelTunables=yes): every write would fail
        self.skipped = {"irq": {"reason": Reason.IRQ_NOT_WRITABLE.value,
                                "detail": f"{where} is not writable (a read-only mount?): no mask is changed"}}
        return False

    def _note(self, config: Config, iso: IsolationPlan | None, seconds: float, counts: dict[str, int]) -> None:
        self.last = {"at": round(time.time(), 3), "seconds": round(seconds, 6), **counts}
        if any(counts.values()):
            log.info("isolation followed the bound workers", isolation=config.isolation,
                     protected=format_cpulist(iso.protected) if iso else "", housekeeping=format_cpulist(
                         iso.housekeeping) if iso else "", seconds=round(seconds, 4), **counts)

    def _irqbalance(self, iso: IsolationPlan | None, config: Config, persist: Callable[[], None]) -> None:
        def record(ban: SavedBan) -> None:
            self.record = self.record.with_ban(ban)
            persist()

        out = follow_irqbalance(self.record.irqbalance, iso, config, record)
        self.record = self.record.with_ban(out.ban)
        self.irqbalance = out.status
        if out.left is not None:
            self.left.append(out.left)

    def _gauge(self) -> None:
        if self.gauge is None:
            return
        recorded = sum(1 for k in self.record.masks if k.kind == "task")
        for state, value in (("recorded", recorded), ("left_to_owner", len(self.tasks.hands_off)),
                             ("pinned_inside", len(self.tasks.pinned)), ("record_full", self.tasks.over_limit)):
            self.gauge.labels(state=state).set(value)

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
                tasks: bool, bound: dict[int, int | None]) -> Wanted:
        """key -> (current text, wanted CPUs) of every mask the level sets: with ``irqs``
        the IRQ level's, with ``tasks`` the host level's."""
        out: Wanted = {}
        if tasks:
            out, swept, heirs = self.tasks.wanted(iso, config, bound, self.record.masks, self._refused)
            self.record = self.record.with_masks(heirs)
            self.tasks.swept_at = round(time.time(), 3)
            # a task refused for good that exited is forgotten with it
            self._refused = {k: v for k, v in self._refused.items() if k.kind != "task" or k in swept
                             or k in self.record.masks}
            out.update(host_wide_wanted(iso, config, self.record.masks, self._refused))
        if irqs:
            out.update(irq_wanted(iso, host, config, pinned, self.record.masks, self._refused))
        return out

    def _masks(self, wanted: Wanted, config: Config, pinned: frozenset[int], persist: Callable[[], None],
               scope: set[MaskKey] | None = None) -> dict[str, int]:
        """Weigh and carry out every mask in ``wanted`` or the record (with ``scope``: only
        the record's keys in it; the rest is left for a full follow)."""
        weighed = self._weigh(wanted, config, pinned, scope)
        # a skip is listed until the mask is tried again; a refused one whenever the level is on
        if scope is None:
            self.skipped = {k: v for k, v in self.skipped.items() if k in wanted or k in self.record.masks or k == "irq"}
            if wanted:
                self.skipped.update(self._refused)
        counts = {"written": 0, "restored": 0, "left_to_owner": 0, "skipped": 0}
        writes = self._settle(weighed, wanted, counts)
        if writes:
            persist()  # what is about to change is on disk before it changes
        changes: Changes = {}
        for w, before in writes:
            self._applied_one(w, before, changes, counts)
        for key, act, kind, _current in weighed:
            if act is Act.RESTORE:
                self._restore_one(key, kind, changes, counts)
        self.record = self.record.with_masks(changes)
        return counts

    def _weigh(self, wanted: Wanted, config: Config, pinned: frozenset[int],
               scope: set[MaskKey] | None) -> list[_Weighed]:
        """The verdict for every mask wanted or recorded (not those the IRQ step holds)."""
        kinds = mask_kinds(config)
        held = {MaskKey.of("irq", i) for i in pinned}  # the IRQ step's while pinned
        recorded = set(self.record.masks) if scope is None else set(self.record.masks) & scope
        out = []
        for key in sorted((set(wanted) | recorded) - held, key=str):  # plain text sorts fast
            kind = kinds[key.kind]
            current = wanted[key][0] if key in wanted else kind.read(key)
            target = wanted[key][1] if key in wanted else None
            act = mask_act(self.record.masks.get(key), kind.cpus(current), target)
            out.append(_Weighed(key, act, kind, current))
        return out

    def _settle(self, weighed: list[_Weighed], wanted: Wanted,
                counts: dict[str, int]) -> list[tuple[tuple[MaskKey, MaskKind, str], SavedMask | None]]:
        """The record as it must be before any write (each write's text added to its ``ours``);
        the writes to make, each with the record before it."""
        changes: Changes = {}
        writes = []
        for key, act, kind, current in weighed:
            saved = self.record.masks.get(key)
            if act is Act.WRITE:
                text = kind.text(wanted[key][1], current)
                changes[key] = (saved or kind.record(current)).with_ours(text)
                writes.append(((key, kind, text), saved))
            elif act is Act.KEEP:
                changes[key] = saved.settled(current)
            elif act in (Act.SETTLED, Act.GONE):
                changes[key] = None
            elif act is Act.OWNER:
                changes[key] = None
                self._left(key, saved, current)
                counts["left_to_owner"] += 1
        self.record = self.record.with_masks(changes)
        return writes

    def _applied_one(self, write: tuple[MaskKey, MaskKind, str], before: SavedMask | None, changes: Changes,
                     counts: dict[str, int]) -> None:
        key, kind, text = write
        w = kind.apply(key, text)
        if w.status == "ok":
            changes[key] = self.record.masks[key].settled(w.now or text)
            self.skipped.pop(key, None)
            counts["written"] += 1
        else:
            changes[key] = self._failed(key, kind, w, before, self.record.masks.get(key))
            counts["skipped"] += 1

    def _restore_one(self, key: MaskKey, kind: MaskKind, changes: Changes, counts: dict[str, int]) -> None:
        saved = self.record.masks[key]
        w = kind.restore(key, saved)
        if w.status in ("ok", "gone"):
            changes[key] = None
            counts["restored"] += 1 if w.status == "ok" else 0
        else:
            # refused now (it can never go back: forgotten, and listed) or failed (tried again)
            changes[key] = self._failed(key, kind, w, None if w.status == "unchangeable" else saved, saved)
            counts["skipped"] += 1

    def _failed(self, key: MaskKey, kind: MaskKind, w: MaskWrite, before: SavedMask | None,
                now: SavedMask | None) -> SavedMask | None:
        """Note a write that failed; the record's value for ``key`` afterwards."""
        reason = kind.unchangeable if w.status == "unchangeable" else kind.failed
        self.skipped[key] = {"reason": reason.value, "detail": f"{key}: {w.error or w.status}"}
        if w.status == "unchangeable":
            self._refused[key] = self.skipped[key]
        if w.status == "failed":
            log.warning("isolation could not write a mask", key=key, error=w.error, now=w.now)
        # nothing changed: the record is as before this write (or gone with a value never ours)
        return before if w.status in ("unchangeable", "gone") else now

    def _left(self, key: MaskKey, saved: SavedMask, current: str | None) -> None:
        why = (f"{key} holds {current}, neither its original {saved.original} nor what isolation wrote "
               f"({', '.join(saved.ours) or '-'}): its owner changed it, so it is left as it is")
        self.left.append({"what": str(key), "reason": Reason.CHANGED_BY_OWNER.value, "detail": why})
        self.tasks.left_to_owner(key)
        log.warning("mask changed by its owner meanwhile; left as it is", key=str(key), now=current,
                    original=saved.original, ours=list(saved.ours))

    # ---------------------------------------------------------- status

    def to_json(self, config: Config) -> dict[str, Any]:
        """The ``isolation`` object of ``GET /v1/workers``."""
        out: dict[str, Any] = self.plan.to_json() if self.plan is not None else {
            "level": config.isolation, "housekeeping_cpus": "auto" if config.housekeeping_cpus == "auto" else "config",
            "housekeeping": None, "protected": None, "cpus": [], "warnings": [], "error": None}
        kinds: dict[str, int] = {}
        for key in self.record.masks:
            kinds[key.kind] = kinds.get(key.kind, 0) + 1
        out.update(
            waiting=self.waiting,
            daemon_threads=None if self.threads is None else self.threads.to_json(),
            changed={k: kinds.get(k, 0) for k in KINDS},
            # bounded: at host thousands of tasks may be refused (a cpuset without a housekeeping CPU)
            skipped=[{"what": str(k), **v} for k, v in sorted(self.skipped.items())[:MAX_LISTED]],
            skipped_total=len(self.skipped),
            tasks=self.tasks.to_json() if config.isolation == "host" or self.tasks.swept_at else None,
            left_to_owner=list(self.left),
            irqbalance=self.irqbalance,
            last_change=self.last or None,
        )
        return out
