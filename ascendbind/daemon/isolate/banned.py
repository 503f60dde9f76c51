"""irqbalance under isolation: told which CPUs to keep IRQs off, and given its own
banned CPUs back.

While ``irqs`` or ``host`` protects CPUs, a running irqbalance is told (over
its socket) to ban them as well as those it bans already (``irqbalance = ban``
or ``stop``; ``warn`` only reports it). The set lives in irqbalance's memory:
the record (``SavedBan``) names the process (pid and start time) and what it
banned before; once nothing is protected it gets that back, unless someone
else changed it meanwhile (then it is left, and said). An irqbalance that
restarted has forgotten ours: nothing to give back.

``IrqbalanceBan`` is that set behind the same interface as every other mask
(kinds.py): ``read`` asks irqbalance (its ``setup`` reply's hex mask),
``apply`` tells it a cpu list, ``verify`` is the one still-ours rule (a
restarted irqbalance is ``gone``), ``restore`` gives back its own set. Unlike
a mask file, irqbalance applies a new set at its next pass, so ``apply`` does
not read it back at once. An irqbalance that does not answer raises
``Unreachable`` from ``read`` (the record is kept: it is tried again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import structlog

from ...applier.irqbalance import Unreachable, banned_cpus, reset_banned_cpus, tell_banned_cpus
from ...values.config import Config
from ...values.cpulist import format_cpulist, parse_cpulist
from ...values.decisions import MaskWrite
from ...discovery.gather.hostwork import kernel_isolated_cpus
from ...discovery.parse.irqbalance import auto_banned_cpus
from ...discovery.gather.irqhost import irqbalance_pids
from ...discovery.gather.process import read_identity
from ...discovery.read.tasks import read_environ
from ...planner.isolate.isolation import IsolationPlan
from ...values.reasons import Reason
from .kinds import MaskKind
from .rules.keys import BAN, MaskKey
from .rules.records import SavedBan, hex_cpus
from .rules.verdicts import Holds, holds

__all__ = ["IrqbalanceBan", "BanOutcome", "follow_irqbalance"]

log = structlog.get_logger("ascendbind.isolation")


class IrqbalanceBan(MaskKind):
    """irqbalance's banned CPUs: read / apply / verify / restore (see the module docstring)."""

    kind, record = BAN, SavedBan
    failed = Reason.IRQBALANCE_UNREACHABLE

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.timeout = config.command_timeout_seconds

    @staticmethod
    def key(pid: int) -> MaskKey:
        return MaskKey.of(BAN, pid)

    def read(self, key: MaskKey) -> str:
        """Its banned CPUs now, the hex mask of its ``setup`` reply (Unreachable: no answer)."""
        return banned_cpus(key.pid, proc_root=self.proc, timeout=self.timeout)

    def apply(self, key: MaskKey, text: str) -> MaskWrite:
        try:
            tell_banned_cpus(key.pid, parse_cpulist(text), proc_root=self.proc, timeout=self.timeout)
        except Unreachable as exc:
            return MaskWrite(key, "failed", None, None, str(exc))
        return MaskWrite(key, "ok", None, None)  # taken at its next pass

    def alive(self, saved: SavedBan) -> bool:
        """Whether the irqbalance ``saved`` names still runs (a restarted one forgot our set)."""
        ident = read_identity(saved.pid, self.proc)
        return ident is not None and ident.comm == "irqbalance" and ident.start_time == saved.start_time

    def verify(self, key: MaskKey, saved: SavedBan) -> Holds:
        if not self.alive(saved):
            return Holds.GONE  # its banned CPUs lived in its memory and went with it
        return holds(saved, self.cpus(self.read(key)))

    def cpus(self, text: str | None) -> frozenset[int] | None:
        """What ``read`` gives is its ``setup`` reply's hex mask (what is sent, a cpu list)."""
        return None if text is None else hex_cpus(text)

    def text(self, cpus: frozenset[int], current: str) -> str:
        return format_cpulist(cpus)

    def restore(self, key: MaskKey, saved: SavedBan) -> MaskWrite:
        """Its own set back: ``NULL`` (its start-up choice) when that is what it banned before."""
        original = saved.original_cpus() or frozenset()
        try:
            auto = auto_banned_cpus(read_environ(saved.pid, self.proc), kernel_isolated_cpus(self.sys))
            sent = reset_banned_cpus(saved.pid, None if auto == original else original, proc_root=self.proc,
                                     timeout=self.timeout)
        except Unreachable as exc:
            return MaskWrite(key, "failed", None, None, str(exc))
        return MaskWrite(key, "ok", None, sent)


class BanOutcome(NamedTuple):
    ban: SavedBan | None  # the record's ban afterwards
    status: str | None  # the ``irqbalance`` line of status
    left: dict[str, str] | None = None  # a set its owner changed meanwhile, left as it is


def follow_irqbalance(ban: SavedBan | None, iso: IsolationPlan | None, config: Config,
                      persist: Callable[[SavedBan], None]) -> BanOutcome:
    """irqbalance in line with ``iso`` (None: nothing protected: its set goes back).
    ``persist(ban)`` records ``ban`` in the state file before irqbalance is told."""
    it = IrqbalanceBan(config)
    if ban is not None and not it.alive(ban):
        ban = None
    if iso is None:
        return BanOutcome(None, None) if ban is None else _give_back(it, ban)
    pids = irqbalance_pids(config.proc_root)
    if not pids:
        return BanOutcome(ban, "not running")
    if config.irqbalance == "warn":
        return BanOutcome(ban, f"{Reason.IRQBALANCE_ACTIVE.value}: irqbalance (pid {pids[0]}) runs and may move "
                               "IRQs onto the protected CPUs again (irqbalance = warn)")
    return _tell(it, ban, pids[0], iso, persist)


def _tell(it: IrqbalanceBan, ban: SavedBan | None, pid: int, iso: IsolationPlan,
          persist: Callable[[SavedBan], None]) -> BanOutcome:
    key = it.key(ban.pid if ban is not None else pid)
    try:
        if ban is None:
            ident = read_identity(key.pid, it.proc)
            ban = SavedBan(key.pid, None if ident is None else ident.start_time, it.read(key))
        text = format_cpulist((ban.original_cpus() or frozenset()) | iso.protected_cpus)
        if ban.ours[-1:] != (text,):
            ban = ban.with_ours(text)
            persist(ban)
            w = it.apply(key, text)
            if w.status != "ok":
                raise Unreachable(w.error or w.status)
    except Unreachable as exc:
        return BanOutcome(ban, f"{Reason.IRQBALANCE_UNREACHABLE.value}: {exc}")
    return BanOutcome(ban, f"told: irqbalance (pid {key.pid}) keeps IRQs off CPUs {text} from its next pass")


def _give_back(it: IrqbalanceBan, ban: SavedBan) -> BanOutcome:
    """Nothing protected: its own set back, unless someone else changed it meanwhile."""
    key = it.key(ban.pid)
    try:
        now = it.cpus(it.read(key))
    except Unreachable as exc:
        return BanOutcome(ban, f"{Reason.IRQBALANCE_UNREACHABLE.value}: banned CPUs not given back yet: {exc}")
    if holds(ban, now) is Holds.OWNER:
        log.warning("irqbalance's banned CPUs changed by someone else; left as they are", pid=ban.pid)
        return BanOutcome(None, None, {
            "what": "irqbalance banned CPUs", "reason": Reason.CHANGED_BY_OWNER.value,
            "detail": f"irqbalance (pid {ban.pid}) bans {format_cpulist(now or ())}, neither its own "
                      f"{format_cpulist(ban.original_cpus() or ())} nor what isolation told it"})
    w = it.restore(key, ban)
    if w.status != "ok":
        return BanOutcome(ban, f"{Reason.IRQBALANCE_UNREACHABLE.value}: banned CPUs not given back yet: {w.error}")
    log.info("irqbalance's banned CPUs given back", pid=ban.pid, command=w.now)
    return BanOutcome(None, None)
