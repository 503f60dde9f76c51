"""irqbalance under isolation: told which CPUs to keep IRQs off, and given its own
banned CPUs back.

While ``irqs`` or ``host`` protects CPUs, a running irqbalance is told (over
its socket) to ban them as well as those it bans already (``irqbalance = ban``
or ``stop``; ``warn`` only reports it). The set lives in irqbalance's memory:
the record names the process (pid and start time) and what it banned before;
once nothing is protected it gets that back, unless someone else changed it
meanwhile (then it is left, and said). An irqbalance that restarted has
forgotten ours: nothing to give back.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from ...applier.irqbalance import Unreachable, banned_cpus, reset_banned_cpus, tell_banned_cpus
from ...values.config import Config
from ...values.cpulist import format_cpulist, parse_cpulist
from ...discovery.gather.hostwork import kernel_isolated_cpus
from ...discovery.parse.irqbalance import auto_banned_cpus
from ...discovery.gather.irqhost import irqbalance_pids
from ...discovery.gather.process import read_identity
from ...discovery.read.tasks import read_environ
from ...planner.isolate.isolation import IsolationPlan
from ...values.reasons import Reason
from ..state.isolationrecord import SavedBan
from .masks import hex_cpus, list_cpus

__all__ = ["follow_irqbalance", "reset_irqbalance"]

log = structlog.get_logger("ascendbind.isolation")


def follow_irqbalance(keeper, iso: IsolationPlan | None, config: Config, persist: Callable[[], None]) -> None:
    proc, timeout = config.proc_root, config.command_timeout_seconds
    ban = keeper.record.irqbalance
    if ban is not None:
        ident = read_identity(ban.pid, proc)
        if ident is None or ident.comm != "irqbalance" or ident.start_time != ban.start_time:
            keeper.record = keeper.record.with_ban(None)
            ban = None  # its banned CPUs lived in its memory and went with it
    pids = irqbalance_pids(proc) if iso is not None or ban is not None else []
    if iso is None:
        keeper.irqbalance = None
        if ban is not None:
            reset_irqbalance(keeper, ban, config)
        return
    if not pids:
        keeper.irqbalance = "not running"
        return
    if config.irqbalance == "warn":
        keeper.irqbalance = (f"{Reason.IRQBALANCE_ACTIVE.value}: irqbalance (pid {pids[0]}) runs and may move IRQs "
                             "onto the protected CPUs again (irqbalance = warn)")
        return
    pid = ban.pid if ban is not None else pids[0]
    try:
        if ban is None:
            ident = read_identity(pid, proc)
            ban = SavedBan(pid, None if ident is None else ident.start_time,
                           banned_cpus(pid, proc_root=proc, timeout=timeout))
        original = hex_cpus(ban.original) or frozenset()
        text = format_cpulist(original | iso.protected_cpus)
        if ban.ours[-1:] != (text,):
            keeper.record = keeper.record.with_ban(ban.with_ours(text))
            persist()
            tell_banned_cpus(pid, parse_cpulist(text), proc_root=proc, timeout=timeout)
        keeper.irqbalance = f"told: irqbalance (pid {pid}) keeps IRQs off CPUs {text} from its next pass"
    except Unreachable as exc:
        keeper.irqbalance = f"{Reason.IRQBALANCE_UNREACHABLE.value}: {exc}"


def reset_irqbalance(keeper, ban: SavedBan, config: Config) -> None:
    proc, timeout = config.proc_root, config.command_timeout_seconds
    original = hex_cpus(ban.original) or frozenset()
    try:
        now = hex_cpus(banned_cpus(ban.pid, proc_root=proc, timeout=timeout))
        if now != original and now not in [list_cpus(t) for t in ban.ours]:
            keeper.left.append({"what": "irqbalance banned CPUs", "reason": Reason.CHANGED_BY_OWNER.value,
                              "detail": f"irqbalance (pid {ban.pid}) bans {format_cpulist(now or ())}, neither "
                                        f"its own {format_cpulist(original)} nor what isolation told it"})
            log.warning("irqbalance's banned CPUs changed by someone else; left as they are", pid=ban.pid)
        else:
            auto = auto_banned_cpus(read_environ(ban.pid, proc), kernel_isolated_cpus(config.sys_root))
            sent = reset_banned_cpus(ban.pid, None if auto == original else original, proc_root=proc,
                                     timeout=timeout)
            log.info("irqbalance's banned CPUs given back", pid=ban.pid, command=sent)
        keeper.record = keeper.record.with_ban(None)
    except Unreachable as exc:
        keeper.irqbalance = f"{Reason.IRQBALANCE_UNREACHABLE.value}: banned CPUs not given back yet: {exc}"
