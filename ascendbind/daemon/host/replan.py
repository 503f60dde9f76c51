"""Plan bound workers again and bind again only those whose plan changed.

Called after a hot-plug burst and on SIGHUP (``rediscover_and_replan``: every
worker, on the rediscovered host), and by the reconcile loop for one worker whose
cgroup cpuset changed or whose kubelet checkpoint changed (``replan_worker``). A
transient discovery failure keeps every current binding (unbinding a healthy
worker because npu-smi hiccuped would be worse than a stale plan); a worker whose
NPU can no longer be planned keeps its binding too, with a warning. The new
binding is handed to the daemon (``Daemon.rebound``), which alone changes the
held record. A re-bind writes ahead as a bind does: the binding as it will be,
with the host's originals, is in the state file as in flight before its first
write, so a daemon killed among its writes leaves a record the next one undoes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import structlog

from ...discovery import discover_worker
from ...errors import AscendbindError, DiscoveryError
from ...values.model import DeviceType, Plan, WorkerFacts
from ...planner import make_plan
from ..api.requests import resolve_policy

__all__ = ["rediscover_and_replan", "replan_worker", "Replanned"]

log = structlog.get_logger("ascendbind.replan")


@dataclasses.dataclass(frozen=True)
class Replanned:
    """What one re-plan came to: ``outcome`` (metrics.REPLAN_OUTCOMES, or ``gone`` /
    ``skipped``), the worker's allowed CPUs it was planned from (None: not read), and
    the plan error's sentence when no plan fits."""

    outcome: str
    allowed: frozenset[int] | None = None
    error: str | None = None


def rediscover_and_replan(daemon, *, classes_changed: bool = False) -> dict:
    """``classes_changed``: a reload changed the thread classes, which every plan carries, so
    every worker is planned again even on an unchanged host."""
    daemon.metrics.rediscoveries.inc()
    try:
        host, changed = daemon.hosts.refresh()
    except DiscoveryError as exc:
        log.warning("rediscovery failed; keeping current bindings", error=str(exc))
        return {"changed": False, "rebound": [], "error": str(exc)}
    if not changed and not classes_changed:
        log.info("rediscovered: host unchanged")
        return {"changed": False, "rebound": []}
    rebound: list[int] = []
    for pid, h in sorted(daemon.reader.records().items()):
        if not daemon.is_alive(h):
            continue
        done = replan_worker(daemon, h, host, reason="host_changed" if changed else "classes_changed")
        if done.outcome == "rebound":
            rebound.append(pid)
    daemon.commit()
    log.info("rediscovered: host changed" if changed else "rediscovered: thread classes changed", rebound=rebound)
    return {"changed": changed, "rebound": rebound}


def replan_worker(daemon, h, host, *, reason: str,
                  wanted: Callable[[Plan, WorkerFacts], bool] | None = None) -> Replanned:
    """Plan ``h``'s worker again on ``host`` from its facts now (read outside the lock)
    and bind it by the new plan when the plan changed (pools, UVB CPUs, or the allowed
    CPUs it was made from: the kernel may have moved the threads). ``wanted(plan,
    worker)``: whether to go on with the new plan at all (False: ``skipped``). Counted
    in ``ascendbind_replans_total{reason,outcome}``; the caller saves the state file."""
    pid = h.binding.pid
    try:
        # the worker's facts are read outside the lock (for a 950, ps -Te runs)
        config = resolve_policy(h.ask, daemon.config)
        worker = discover_worker(daemon.hosts.source, pid, config, want_uvb=host.device_type is DeviceType.A950)
        if not daemon.still_bound(h, worker.start_time):
            return Replanned("gone")  # recycled: the reconcile loop drops the entry; never bind the newcomer
        worker = daemon.allowance(worker, h)  # planned from the allowance it was first bound with
        # the same NPUs as bound, for the same reasons: the decision travels on
        plan = dataclasses.replace(make_plan(host, worker, h.binding.npus, config), targets=h.binding.plan.targets)
        allowed = worker.allowed_cpus
        if wanted is not None and not wanted(plan, worker):
            return Replanned("skipped", allowed)
        if plan.errors:
            log.warning("worker no longer plannable; binding kept", pid=pid, why=reason,
                        reason=plan.errors[0].reason)
            daemon.metrics.replanned(reason, "failed")
            return Replanned("failed", allowed, f"{plan.errors[0].code}: {plan.errors[0].reason}")
        old = h.binding.plan
        if plan.npus == old.npus and plan.uvb_cpus == old.uvb_cpus and plan.allowed_cpus == old.allowed_cpus \
                and plan.thread_classes == old.thread_classes:  # a class's role moves threads too
            daemon.metrics.replanned(reason, "unchanged")
            return Replanned("unchanged", allowed)
        # written ahead like a bind, its pages moved afterwards on the mover (the Daemon's rebind)
        binding = daemon.rebind(h, plan, worker, host, config)
        if binding is None:
            return Replanned("gone")  # released or bound again meanwhile
        daemon.metrics.step_results(binding.steps)
        daemon.metrics.replanned(reason, "rebound")
        log.info("worker planned again", pid=pid, why=reason,
                 pools={p.npu: list(p.pool) for p in plan.npus}, allowed=sorted(allowed))
        return Replanned("rebound", allowed)
    except AscendbindError as exc:
        log.warning("re-plan failed; binding kept", pid=pid, why=reason, error=str(exc))
        daemon.metrics.replanned(reason, "failed")
        return Replanned("failed", None, str(exc))
