"""Isolation: which CPUs the rest of the host keeps to while workers are bound. Pure.

A bound worker's *protected* CPUs are its plan's main, ACL and release CPUs
(on Ascend 950, its whole pool: every role is main there). The *housekeeping*
CPUs are where everything that is not a bound worker's thread runs: the
daemon's own threads and the tools it starts at every level, the interrupts of
other devices at ``irqs``.

How ``housekeeping_cpus = auto`` chooses, and why: it must never change a
plan, so it takes no CPU away from any pool. The whole host is planned with
the same rules and config a worker gets (every NPU, every online CPU allowed);
the housekeeping set is the CPUs no NPU's pool covers, plus every pool's IRQ
CPUs (the two CPUs a pool reserves for its NPU's SQ/CQ interrupts already host
interrupt work), less every protected CPU. Where every CPU is in some NPU's
pool (an A3 host under ``global_slice``) that leaves exactly the pools' IRQ
CPUs. A CPU that is only an unbound NPU's main or ACL CPU is neither: nothing
is moved onto it, and nothing is moved off it.

An explicit ``housekeeping_cpus`` list is taken as given, less the CPUs that
are not online and less the protected ones (each with a warning). With
protected CPUs and no housekeeping CPU left, ``irqs`` and ``host`` refuse the bind
(``no_housekeeping_cpus``, with the numbers): there is nowhere to move the
rest of the host to.

``narrowed`` is the one rule for a mask the ``irqs`` level changes: the mask
less the protected CPUs, or the housekeeping set when nothing would be left.
The driver's per-device work (its kernel threads, workqueues and mailbox IRQs,
driverwork.py) goes to its NPU's IRQ CPUs instead.

``host`` adds the other userspace tasks, the unbound workqueues' shared
mask and the soft-lockup watchdog's CPUs. ``task_target`` is the one rule for a task: its mask less the protected
CPUs, and nothing (left where it is, and reported) when that leaves no CPU:
such a task was pinned there by its owner. The workqueues' and the watchdog's
masks follow ``narrowed``, like an IRQ's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ...values.config import Config
from ...values.cpulist import format_cpulist, parse_cpulist
from ...values.frozen import frozen_map
from ...values.model import HostFacts, Mode, Plan, PlanIssue, WorkerFacts
from ..plan import make_plan

__all__ = ["IsolationPlan", "plan_isolation", "host_plan", "protected_roles", "narrowed", "task_target",
           "explain_isolation", "left_to_kernel", "NO_HOUSEKEEPING"]

NO_HOUSEKEEPING = "no_housekeeping_cpus"
_ROLES = ("main", "acl", "release")


@dataclass(frozen=True)
class IsolationPlan:
    """What isolation does on one host for one set of bound plans."""

    level: str
    source: str  # "auto" | "config"
    online: frozenset[int]
    # CPU -> the bound roles on it ("NPU 0 main"); the protected CPUs are its keys
    protected: Mapping[int, tuple[str, ...]]
    housekeeping: frozenset[int]
    # CPU -> its place in the whole-host plan: "NPU 3 irq", "NPU 3 pool" or "no pool"
    host_roles: Mapping[int, str] = field(default_factory=frozen_map)
    # NPU -> its bound plan's IRQ CPUs (where its driver work goes)
    npu_irq_cpus: Mapping[int, frozenset[int]] = field(default_factory=frozen_map)
    warnings: tuple[str, ...] = ()
    error: PlanIssue | None = None

    @property
    def protected_cpus(self) -> frozenset[int]:
        return frozenset(self.protected)

    @property
    def moves_irqs(self) -> bool:
        """Whether this level changes IRQ masks: ``irqs`` (and the levels above it) with
        something bound and somewhere to move to."""
        return self.level != "off" and bool(self.protected) and bool(self.housekeeping)

    @property
    def moves_tasks(self) -> bool:
        """Whether this level changes other tasks' affinity, the unbound workqueues'
        mask and the watchdog's: ``host`` with something bound and somewhere to move to."""
        return self.level == "host" and bool(self.protected) and bool(self.housekeeping)

    def to_json(self) -> dict:
        return {
            "level": self.level,
            "housekeeping_cpus": self.source,
            "housekeeping": format_cpulist(self.housekeeping),
            "protected": format_cpulist(self.protected),
            "cpus": [dict(zip(("cpus", "class", "role"), g)) for g in _groups(self)],
            "warnings": list(self.warnings),
            "error": None if self.error is None else self.error.to_json(),
        }


def _online(host: HostFacts) -> frozenset[int]:
    """The host's online CPUs (lscpu -e), else its NUMA nodes' CPUs."""
    online = frozenset(c.cpu for c in host.cpus if c.online)
    if online or not host.numa_nodes:
        return online
    return frozenset().union(*host.numa_nodes.values())


def host_plan(host: HostFacts, config: Config) -> Plan:
    """Every NPU of the host planned over every online CPU, with ``config``'s rules: the
    pools a worker of each NPU would get from a cpuset of the whole host."""
    cpus = _online(host)
    whole = WorkerFacts(pid=0, start_time=None, allowed_cpus=cpus, allowed_source="status",
                        mems_allowed=frozenset(host.numa_nodes), env=frozen_map({}))
    npus = host.logic_ids or tuple(sorted(host.topo_affinity))
    return make_plan(host, whole, npus, config)


def protected_roles(plan: Plan) -> dict[int, list[str]]:
    """CPU -> the roles of ``plan`` that make it protected (main, ACL, release; on
    Ascend 950, where every role is main, the whole pool)."""
    out: dict[int, list[str]] = {}
    for p in plan.npus:
        roles = (("main", p.pool),) if plan.mode is Mode.ASCEND950_CLUSTER else \
            ((r, getattr(p, r)) for r in _ROLES)
        for role, cpus in roles:
            for cpu in cpus:
                label = f"NPU {p.npu} {role}"
                if label not in out.setdefault(cpu, []):
                    out[cpu].append(label)
    return out


def plan_isolation(host: HostFacts, bound: Sequence[Plan], config: Config, *,
                   whole: Plan | None = None) -> IsolationPlan:
    """The housekeeping set and the protected CPUs for the ``bound`` workers' plans.
    ``whole``: ``host_plan(host, config)``, where the caller keeps it (it depends on the host
    and the config alone, and costs milliseconds on a host of hundreds of CPUs)."""
    online = _online(host)
    if whole is None:
        whole = host_plan(host, config)
    host_roles: dict[int, str] = {cpu: "no pool" for cpu in online}
    for cpu in whole.uvb_cpus:
        host_roles[cpu] = "UVB pool"
    for p in whole.npus:
        for cpu in p.pool:
            host_roles[cpu] = f"NPU {p.npu} pool"
        for cpu in p.irq:
            host_roles[cpu] = f"NPU {p.npu} irq"
    protected: dict[int, list[str]] = {}
    irq_cpus: dict[int, frozenset[int]] = {}
    for plan in bound:
        for cpu, labels in protected_roles(plan).items():
            protected.setdefault(cpu, []).extend(x for x in labels if x not in protected.get(cpu, ()))
        for p in plan.npus:
            irq_cpus[p.npu] = irq_cpus.get(p.npu, frozenset()) | frozenset(p.irq)
    guarded = frozenset(protected)
    warnings: list[str] = []
    if config.housekeeping_cpus == "auto":
        source = "auto"
        pooled = frozenset(c for p in whole.npus for c in p.pool)
        irq = frozenset(c for p in whole.npus for c in p.irq) | frozenset().union(*irq_cpus.values())
        housekeeping = ((online - pooled) | (irq & online)) - guarded
    else:
        source = "config"
        named = parse_cpulist(config.housekeeping_cpus)
        absent = named - online
        if absent:
            warnings.append(f"housekeeping_cpus names CPUs {format_cpulist(absent)}, which are not online here "
                            f"(online: {format_cpulist(online)}); they are left out")
        overlap = named & guarded
        if overlap:
            who = sorted({x for c in overlap for x in protected[c]})
            warnings.append(f"housekeeping_cpus {config.housekeeping_cpus} overlaps the bound workers' main, ACL "
                            f"and release CPUs {format_cpulist(overlap)} ({', '.join(who)}); those are not "
                            f"housekeeping while they are bound")
        housekeeping = (named & online) - guarded
    error = None
    if guarded and not housekeeping:
        error = PlanIssue(None, NO_HOUSEKEEPING, _no_housekeeping(source, config, online, guarded, whole))
    return IsolationPlan(
        level=config.isolation, source=source, online=online,
        protected=frozen_map({c: tuple(v) for c, v in sorted(protected.items())}),
        housekeeping=frozenset(housekeeping), host_roles=frozen_map(dict(sorted(host_roles.items()))),
        npu_irq_cpus=frozen_map(dict(sorted(irq_cpus.items()))), warnings=tuple(warnings), error=error)


def _no_housekeeping(source: str, config: Config, online: frozenset[int], guarded: frozenset[int],
                     whole: Plan) -> str:
    if source == "auto":
        pooled = frozenset(c for p in whole.npus for c in p.pool)
        irq = frozenset(c for p in whole.npus for c in p.irq)
        where = (f"housekeeping_cpus = auto would use: the pools' IRQ CPUs ({format_cpulist(irq) or 'none'}) "
                 f"and the CPUs no pool covers ({format_cpulist(online - pooled) or 'none'})")
    else:
        where = f"housekeeping_cpus = {config.housekeeping_cpus} names"
    return (f"no housekeeping CPU is left for the rest of the host: the bound workers' main, ACL and release CPUs "
            f"{format_cpulist(guarded)} ({len(guarded)} of {len(online)} online CPUs) cover every CPU that {where}; "
            f"set housekeeping_cpus to CPUs outside them, or isolation = off")


def narrowed(mask: frozenset[int], protected: frozenset[int], housekeeping: frozenset[int]) -> frozenset[int]:
    """The mask an IRQ (or the default for new IRQs) gets: ``mask`` less the protected
    CPUs, else the housekeeping CPUs, else ``mask`` unchanged (nowhere to go)."""
    kept = frozenset(mask) - protected
    return kept or frozenset(housekeeping) or frozenset(mask)


def task_target(mask: frozenset[int], protected: frozenset[int]) -> frozenset[int] | None:
    """The affinity another task gets at ``host``: ``mask`` less the protected CPUs; None
    when nothing would be left (a task pinned inside the protected CPUs by its owner is
    left there and reported: moving it elsewhere would overrule a choice it made)."""
    kept = frozenset(mask) - protected
    return kept or None


# ---------------------------------------------------------------- explanation

_WHAT = {
    "off": {
        "protected": "no thread of the daemon, no tool it runs",
        "housekeeping": "the daemon's threads and the tools it runs (npu-smi, lscpu)",
        "other": "unchanged",
    },
    "irqs": {
        "protected": "no thread of the daemon, no tool it runs; no IRQ but its NPU's pinned SQ/CQ "
                     "(each other IRQ loses these CPUs, new IRQs too, irqbalance is told to keep off)",
        "housekeeping": "the daemon's threads and the tools it runs; the IRQs that would have no CPU left",
        "other": "unchanged (an IRQ allowed here keeps it)",
    },
    "host": {
        "protected": "no thread of the daemon, no tool it runs; no IRQ but its NPU's pinned SQ/CQ; no other "
                     "userspace task (each loses these CPUs, one started later within 100 ms) but the bound "
                     "workers, their children, pid 1, kubelet's pods and the exempt; no unbound workqueue, no "
                     "soft-lockup watchdog check",
        "housekeeping": "the daemon's threads and the tools it runs; the IRQs that would have no CPU left; the "
                        "other tasks, the unbound workqueues and the watchdog keep the CPUs they had here",
        "other": "unchanged (an IRQ or a task allowed here keeps it)",
    },
}


def _class(iso: IsolationPlan, cpu: int) -> tuple[str, str]:
    if cpu in iso.protected:
        return "protected", ", ".join(iso.protected[cpu])
    role = iso.host_roles.get(cpu, "no pool")
    return ("housekeeping" if cpu in iso.housekeeping else "other"), role


def _groups(iso: IsolationPlan) -> list[tuple[str, str, str]]:
    """(cpulist, class, role) for runs of consecutive CPUs of the same class and role."""
    out: list[tuple[list[int], str, str]] = []
    for cpu in sorted(iso.online | iso.protected_cpus):
        cls, role = _class(iso, cpu)
        if out and out[-1][1:] == (cls, role) and out[-1][0][-1] == cpu - 1:
            out[-1][0].append(cpu)
        else:
            out.append(([cpu], cls, role))
    return [(format_cpulist(cpus), cls, role) for cpus, cls, role in out]


def left_to_kernel(cpus: str) -> str:
    """What ``host`` cannot move off the protected CPUs ``cpus`` (a cpu list), and the boot
    parameters that would."""
    return (f"left to the kernel: unless it isolates CPUs {cpus} from boot (isolcpus=domain,managed_irq,{cpus} "
            f"nohz_full={cpus}), its load balancing and per-CPU work (ksoftirqd, per-CPU kworkers such as the "
            f"vmstat update) still run there")


def explain_isolation(iso: IsolationPlan) -> str:
    """The ``plan --explain`` / ``status`` text: the level, the sets, and CPU by CPU what it does."""
    level = iso.level if iso.level in _WHAT else "irqs"
    lines = [f"isolation {iso.level}: housekeeping CPUs {format_cpulist(iso.housekeeping) or 'none'} "
             f"({'auto' if iso.source == 'auto' else 'housekeeping_cpus'}), protected CPUs "
             f"{format_cpulist(iso.protected) or 'none'}"]
    if not iso.protected:
        lines.append("  nothing is bound: the daemon's threads stay where they started and nothing else moves")
    else:
        groups = _groups(iso)
        lines += [f"  {cls} CPUs: {what}" for cls, what in _WHAT[level].items() if any(g[1] == cls for g in groups)]
        width = max(len(c) for c, _, _ in groups)
        lines += [f"  CPU {cpus:<{width}}  {cls:<12}  {role}" for cpus, cls, role in groups]
        if level == "host":
            lines.append(f"  {left_to_kernel(format_cpulist(iso.protected))}")
    lines += [f"  warning: {w}" for w in iso.warnings]
    if iso.error is not None:
        verdict = "a bind is refused" if iso.level != "off" else "the daemon's threads stay where they started"
        lines.append(f"  error [{iso.error.code}]: {iso.error.reason}; {verdict}")
    return "\n".join(lines)
