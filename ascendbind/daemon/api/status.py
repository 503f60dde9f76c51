"""``GET /v1/workers``: what the daemon holds, and why each worker is as it is.

``/v1/workers`` lists every held worker, and beside them what isolation does on
this host (``isolation``: the level, the housekeeping and protected CPUs, CPU
by CPU, and the masks it changed, skipped or left to their owner); ``?pid=P``
answers that one worker
(404 ``not_bound`` when the daemon does not hold it); ``&explain=1`` adds
``explanation``: the text ``ascendbind plan --explain`` prints (hints, merge,
decision, config lint) for the plan the worker is bound with. It is derived from
the facts the plan was made from, which the daemon keeps with each binding; a
binding restored from the state file has none, so its facts are read again
(the explanation says so). Explaining is read-only and runs outside the
daemon's lock: a slow discovery never stalls a bind. Only root and a caller who
may release the worker (its uid, and the worker itself or its descendant) get
an explanation: it may read the worker's files again, so the caller is checked
before anything of the worker is read (403 otherwise).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

from ...discovery.gather.identity import require_identity
from ...errors import ProcessGone, UsageError
from ...planner.explain import explain_plan
from .auth import Peer, authorize

__all__ = ["parse_workers_query", "workers_answer", "explain_held"]

_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def parse_workers_query(query: str) -> tuple[int | None, bool]:
    """``pid=P&explain=1`` -> (pid or None, explain); UsageError (400) on anything else."""
    try:
        q = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=4)
    except ValueError as exc:
        raise UsageError(f"bad query string: {str(exc)[:100]}", code="bad_request") from None
    unknown = sorted(set(q) - {"pid", "explain"})
    if unknown:
        raise UsageError(f"unknown query parameter {unknown[0][:40]!r} (pid, explain)", code="bad_request")
    pid = None
    if "pid" in q:
        text = q["pid"][-1]
        if not (text.isascii() and text.isdigit() and len(text) <= 12 and int(text) >= 1):
            raise UsageError("query parameter 'pid' must be a decimal integer >= 1", code="bad_request")
        pid = int(text)
    explain = False
    if "explain" in q:
        text = q["explain"][-1].lower()
        if text not in _TRUE + _FALSE + ("",):
            raise UsageError("query parameter 'explain' must be 1 or 0", code="bad_request")
        explain = text in _TRUE or text == ""
    if explain and pid is None:
        raise UsageError("explain needs a pid: /v1/workers?pid=P&explain=1", code="bad_request")
    return pid, explain


def workers_answer(daemon, query: str = "", peer: Peer | None = None) -> dict[str, Any]:
    """The answer to ``GET /v1/workers?query`` asked by ``peer`` (None: the daemon itself)."""
    pid, explain = parse_workers_query(query)
    daemon.contention.refresh(force=True)  # a look of its own, outside the daemon's lock
    if pid is None:
        return daemon.reader.read(lambda held: {"workers": [_record(daemon, h) for _, h in sorted(held.items())],
                                                "isolation": daemon.isolation.to_json(daemon.config)})
    h = daemon.reader.get(pid)
    if h is None:
        raise ProcessGone(f"process {pid} is not bound by this daemon", code="not_bound")
    record = daemon.reader.read(lambda _: _record(daemon, h))
    if explain:
        if peer is not None and not peer.is_root:
            _authorize_explain(daemon, peer, h)
        record["explanation"] = explain_held(daemon, h)
    return {"workers": [record]}


def _authorize_explain(daemon, peer: Peer, h) -> None:
    """NotPermitted unless ``peer`` may release the worker ``h`` holds; read: its stat and
    status, nothing more."""
    target = require_identity(h.binding.pid, daemon.config.proc_root)
    if target.start_time != h.binding.start_time:
        raise ProcessGone(f"process {h.binding.pid} is no longer the bound worker (pid reused)", code="not_bound")
    authorize(peer, target, daemon_pid=daemon.pid, proc_root=daemon.config.proc_root, binding=False)


def _record(daemon, h) -> dict[str, Any]:
    record = h.to_json(daemon.mover.job(h.binding.pid))
    record["contention"] = daemon.contention.worker_json(h.binding.pid, h.binding.start_time)
    record["thread_events"] = daemon.thread_events_of(h.binding.pid)
    return record


def explain_held(daemon, h) -> str:
    """The plan explanation of one held worker, from the facts its plan was made from."""
    b = h.binding
    if h.facts is not None:
        host, worker, config = h.facts
        return explain_plan(host, worker, b.plan, config)
    target = require_identity(b.pid, daemon.config.proc_root)
    if not daemon.still_bound(h, target.start_time):
        raise ProcessGone(f"process {b.pid} is no longer the bound worker (pid reused)", code="not_bound")
    config, host, worker = daemon.planning_facts(h, target)
    return ("note: this binding predates the daemon's start; the facts below were read now, the plan is the "
            "one bound\n" + explain_plan(host, worker, b.plan, config))
