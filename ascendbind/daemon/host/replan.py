"""Rediscover the host and bind again only the workers whose plan changed.

Called after a hot-plug burst and on SIGHUP. A transient discovery failure
keeps every current binding (unbinding a healthy worker because npu-smi hiccuped
would be worse than a stale plan); a worker whose NPU can no longer be planned
keeps its binding too, with a warning. The new binding is handed to the daemon
(``Daemon.rebound``), which alone changes the held record.
"""

from __future__ import annotations

import dataclasses

import structlog

from ...applier import apply_plan
from ...discovery import discover_worker
from ...discovery.gather.process import thread_masks
from ...errors import AscendbindError, DiscoveryError
from ...values.model import DeviceType
from ...planner import make_plan
from ...values.reasons import Outcome, Step
from ..api.requests import resolve_policy

__all__ = ["rediscover_and_replan"]

log = structlog.get_logger("ascendbind.replan")


def rediscover_and_replan(daemon) -> dict:
    daemon.metrics.rediscoveries.inc()
    try:
        host, changed = daemon.hosts.refresh()
    except DiscoveryError as exc:
        log.warning("rediscovery failed; keeping current bindings", error=str(exc))
        return {"changed": False, "rebound": [], "error": str(exc)}
    if not changed:
        log.info("rediscovered: host unchanged")
        return {"changed": False, "rebound": []}
    rebound: list[int] = []
    with daemon.lock:
        held = sorted(daemon.held.items())
    for pid, h in held:
        if not daemon.is_alive(h):
            continue
        try:
            # the worker's facts are read outside the lock (for a 950, ps -Te runs)
            config = resolve_policy(h.ask, daemon.config)
            worker = discover_worker(daemon.hosts.source, pid, config,
                                     want_uvb=host.device_type is DeviceType.A950)
            if not daemon.still_bound(h, worker.start_time):
                continue  # recycled: the reconcile loop drops the entry; never bind the newcomer
            if worker.allowed_source == "status":
                worker = dataclasses.replace(worker, allowed_cpus=h.binding.original_cpus)
            # the same NPUs as bound, for the same reasons: the decision travels on
            plan = dataclasses.replace(make_plan(host, worker, h.binding.npus, config),
                                       targets=h.binding.plan.targets)
            if plan.errors:
                log.warning("worker no longer plannable on the changed host; binding kept",
                            pid=pid, reason=plan.errors[0].reason)
                continue
            if plan.npus == h.binding.plan.npus and plan.uvb_cpus == h.binding.plan.uvb_cpus:
                continue
            with daemon.lock:
                if daemon.held.get(pid) is not h:
                    continue  # released or bound again meanwhile
                # its pages move afterwards, on the mover, like a bind's
                binding = apply_plan(plan, worker, host, config, move_memory=False, pin=h.pin)
                daemon.rebound(h, binding, (host, worker, config), thread_masks(pid, proc_root=config.proc_root))
                memory = binding.step(Step.MEMORY)
                if memory is not None and memory.outcome is Outcome.PENDING:
                    daemon.move_memory(h, memory.data["target_node"], "replan")
            daemon.metrics.step_results(binding.steps)
            rebound.append(pid)
        except AscendbindError as exc:
            log.warning("re-plan failed; binding kept", pid=pid, error=str(exc))
    daemon.save()
    log.info("rediscovered: host changed", rebound=rebound)
    return {"changed": True, "rebound": rebound}
