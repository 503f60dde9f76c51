"""What a request reads of its worker and of the host, before the table is touched.

A bind or a plan observes its target once (discovery's ``ProcessView``), then
reads the worker's facts from that observation and the host's from the cache
(with npu-smi's process table only when the request does not name its NPU),
and weighs the evidence into the target NPUs. Nothing here holds the daemon's
lock: it is all read before it.
"""

from __future__ import annotations

import dataclasses

from ...discovery.gather.identity import recycled
from ...discovery.gather.process import ProcessView, observe_process
from ...discovery.gather.worker import discover_worker, without_process_table
from ...errors import DiscoveryError, PlanImpossible
from ...planner import resolve_targets
from ...values.config import Config
from ...values.model import DeviceType, ProcessIdentity
from ...values.targeting import TargetRequest
from ..api.requests import PlanAsk, recycled_is_a_conflict, resolve_policy

__all__ = ["view_of", "facts_of", "targets_of"]


def view_of(source, target: ProcessIdentity | ProcessView, *, pin: bool = False) -> ProcessView:
    """``target`` itself, or a new observation of the process the identity names (with
    ``pin``, holding it: the caller closes ``view.pin``)."""
    if isinstance(target, ProcessView):
        return target

    def same(seen: ProcessIdentity) -> None:
        if seen.start_time != target.start_time:
            raise recycled(target.pid, seen.start_time, target.start_time)

    with recycled_is_a_conflict():
        return observe_process(source, target.pid, pin=pin, vet=same)


def facts_of(hosts, config: Config, view: ProcessView, request: TargetRequest, policy: PlanAsk | str | None):
    """(config, host, worker, the process table's failure or None). A request that names its
    NPU costs no npu-smi run: its process table is not read (the worker's evidence says so)."""
    config = resolve_policy(policy, config)
    host = hosts.get()
    unread = "not read: the request names its NPU" if request.names_npus else None
    failure = None
    if unread is None:
        try:
            host = dataclasses.replace(host, processes=hosts.processes())
        except DiscoveryError as exc:
            failure, unread = exc, f"unavailable: {exc}"
    with recycled_is_a_conflict():
        worker = discover_worker(hosts.source, view.pid, config,
                                 want_uvb=host.device_type is DeviceType.A950, view=view)
    if unread is not None:
        worker = without_process_table(worker, unread)
    return config, host, worker, failure


def targets_of(host, worker, request: TargetRequest, failure: DiscoveryError | None):
    """The rule's decision; without any evidence and with the process table failing, the
    table's failure (503: ask again) rather than "no target"."""
    try:
        return resolve_targets(host, worker, request)
    except PlanImpossible as exc:
        if failure is not None and exc.code == "no_target_npu":
            raise failure from None
        raise
