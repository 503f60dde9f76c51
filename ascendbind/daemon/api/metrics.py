"""Prometheus metrics of the daemon, on an explicit registry.

Every label value comes from a fixed set defined here (or by the planner's
alignment reasons), never from a pid or free text, so the series count is
bounded. Failure series are created at 0 up front: a scrape that has never seen
a failure still shows the series, so alerts on ``increase(...) > 0`` work from
the first scrape.
"""

from __future__ import annotations

import itertools
import platform
import threading
import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ... import __version__
from ...discovery.read.deadline import READ_FILES, READERS, Readers
from ...planner import ALIGNMENT_FAILURE_REASONS

__all__ = ["Metrics", "BindClock", "BIND_PHASES", "OUTCOMES", "CULPRITS",
           "DISCOVERY_ERRORS", "REPLAN_REASONS", "REPLAN_OUTCOMES", "HTTP_PATHS", "ALIGNMENT_REASONS", "MEMORY_CHECK_RESULTS", "MOVE_OUTCOMES",
           "RECONCILE_MODES", "LISTING_REASONS"]

# `_created` series double every counter for no operator value
prometheus_client.disable_created_metrics()

OUTCOMES = ("aligned", "unaligned", "failed", "rejected")
STEPS = ("affinity", "irq", "memory", "uvb")
STEP_OUTCOMES = ("applied", "skipped", "failed")
# who moved a bound thread's or IRQ's mask: the verdicts of the blame rule (blame.py), decided on evidence
# (``cpuset``: the kernel, narrowing the worker to its changed cpuset)
CULPRITS = ("self", "env", "irqbalance", "external", "cpuset")
# why a bound worker was planned again (lifecycle.REPLAN_REASONS), and what came of it: bound by
# the new plan, the same plan kept, or no plan fits (the binding kept)
REPLAN_REASONS = ("host_changed", "cpuset_changed", "checkpoint_changed", "classes_changed")
REPLAN_OUTCOMES = ("rebound", "unchanged", "failed")
DISCOVERY_ERRORS = ("tool_missing", "command_failed", "command_timeout", "parse_error", "other")
DROP_REASONS = ("exited", "recycled", "released", "replaced", "evicted", "other_boot", "npu_mismatch", "interrupted")
# npu-smi's verdict on a bind that named its NPU (watch/npucheck.py)
NPU_CHECK_VERDICTS = ("confirmed", "unlisted", "unverified", "contradicted")
# what became of an affinity write that reached another process's thread (applier/confirm.py)
RECYCLED_WRITE_RESULTS = ("undone", "failed")
ISOLATION_TASK_STATES = ("recorded", "left_to_owner", "pinned_inside", "record_full")
HTTP_PATHS = ("/v1/bind", "/v1/release", "/v1/workers", "/v1/plan", "/healthz", "/metrics", "other")
# what one numa_maps read came to (daemon/watch/locality.py)
MEMORY_CHECK_RESULTS = ("measured", "no_pages", "unreadable", "malformed", "too_large")
# how a background memory move ended (daemon/watch/memmove.py)
MOVE_OUTCOMES = ("applied", "skipped", "failed", "cancelled")
HTTP_CODES = ("200", "400", "403", "404", "405", "408", "409", "411", "413", "422", "503", "505")
LISTENERS = ("api", "metrics")
# how the reconcile loop learns of new, renamed and exited threads (daemon/watch/threadevents.py):
# from the kernel's process events, or by listing and re-reading names; and why not events
RECONCILE_MODES = ("events", "listing")
LISTING_REASONS = ("off", "unsupported", "permission", "namespace", "no_ack", "overflow", "error")

# where a bind's time goes, in order: the caller's credentials (SO_PEERCRED, at accept), the
# worker's identity (pin, stat, status, authorization), the rest of its observation and its facts
# (cgroup, cpuset, environ, threads), the plan (targets, claim, planner), the writes (the four
# steps), the record (held table, state file), the answer (JSON, sent)
BIND_PHASES = ("peer", "identity", "worker", "plan", "apply", "record", "answer")

# the planner's fixed alignment-failure set, plus "other" for anything unforeseen
ALIGNMENT_REASONS = (*ALIGNMENT_FAILURE_REASONS, "other")


class BindClock:
    """One bind's time, phase by phase: ``mark(phase)`` charges the time since the last mark
    (or since the clock started) to ``phase``. A phase may be marked more than once; the
    daemon adds the whole to ``ascendbind_bind_phase_seconds_total`` once the bind ends."""

    __slots__ = ("_last", "spent")

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.spent: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.spent[phase] = self.spent.get(phase, 0.0) + now - self._last
        self._last = now


class WorkerReads:
    """The reads of what workers control (discovery/read/deadline.py), as they stand at each scrape:
    abandoned at the deadline, refused at once (a limit reached), stuck now; by file. The
    registry learns the names from one collect (it describes by collecting)."""

    ABANDONED = ("ascendbind_worker_reads_abandoned", "Reads of a worker's /dev, environ or cmdline left behind at "
                 "their deadline (a filesystem nobody serves, a hung device)")
    REFUSED = ("ascendbind_worker_reads_refused", "Reads of a worker's files failed at once: an earlier read of the "
               "worker, too many of its owner's, or too many in all are stuck")
    STUCK = ("ascendbind_worker_reads_stuck", "Reads left behind that have not returned yet (each holds a thread)")

    def __init__(self, readers: Readers) -> None:
        self.readers = readers

    def collect(self):
        stats = self.readers.stats()
        for family, values in ((CounterMetricFamily(*self.ABANDONED, labels=["file"]), stats.abandoned),
                               (CounterMetricFamily(*self.REFUSED, labels=["file"]), stats.refused),
                               (GaugeMetricFamily(*self.STUCK, labels=["file"]), stats.stuck)):
            for name in READ_FILES:
                family.add_metric([name], values[name])
            yield family


def _at_zero(family, *values: tuple) -> None:
    """Creates ``family``'s series for every combination of label ``values`` (one tuple per
    label, in order), at 0: a failure never seen still shows, so alerts on increase() work."""
    for labels in itertools.product(*values):
        family.labels(*labels)


class Metrics:
    """All series of one daemon. Methods take domain values and map them to labels.
    ``readers``: the worker reads whose counts it exports (the process's own by default)."""

    def __init__(self, readers: Readers = READERS) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        r.register(WorkerReads(readers))
        # the families by subject, registered in this order (the order of /metrics)
        self._bind_series(r)
        self._discovery_series(r)
        self._reconcile_series(r)
        self._isolation_series(r)
        self._thread_event_series(r)
        self._worker_series(r)
        self._http_series(r)
        self._memory_series(r)
        self.build_info = Info("ascendbind_build", "Version of the running daemon", registry=r)
        self.build_info.info({"version": __version__, "python": platform.python_version()})

    def _bind_series(self, r: CollectorRegistry) -> None:
        """A bind's outcome, alignment, steps, duration and phases; the workers held."""
        self.bind_requests = Counter(
            "ascendbind_bind_requests", "Bind requests by outcome", ["outcome"], registry=r
        )
        self.alignment_reasons = ALIGNMENT_REASONS
        self.alignment_failures = Counter(
            "ascendbind_alignment_failures", "Plans that could not be NUMA-aligned, by reason", ["reason"], registry=r
        )
        self.steps = Counter("ascendbind_steps", "Applier steps by outcome", ["step", "outcome"], registry=r)
        self.bound_workers = Gauge("ascendbind_bound_workers", "Workers the daemon currently holds bound", registry=r)
        self.bind_duration = Histogram(
            "ascendbind_bind_duration_seconds",
            "Time to plan and bind one worker",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.bind_phase = Counter(
            "ascendbind_bind_phase_seconds",
            "Seconds spent in each phase of the binds answered 200 (peer: credentials at accept; identity: pin, "
            "stat, status, authorization; worker: the rest of the observation and its facts; plan; apply: the "
            "four steps; record: held table and state file; answer: JSON and send)",
            ["phase"], registry=r,
        )
        _at_zero(self.bind_requests, OUTCOMES)
        self._phase_children = {p: self.bind_phase.labels(p) for p in BIND_PHASES}
        _at_zero(self.alignment_failures, self.alignment_reasons)
        _at_zero(self.steps, STEPS, STEP_OUTCOMES)

    def _discovery_series(self, r: CollectorRegistry) -> None:
        """The host's discovery, its hot-plug rediscoveries and the re-plans they cause."""
        self.discovery_duration = Histogram(
            "ascendbind_discovery_duration_seconds",
            "Time to discover the host's static facts (npu-smi, lscpu, sysfs)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.discovery_errors = Counter(
            "ascendbind_discovery_errors", "Failed host discoveries, by error code", ["code"], registry=r
        )
        self.rediscoveries = Counter(
            "ascendbind_rediscoveries", "Host rediscoveries triggered by hot-plug events or SIGHUP", registry=r
        )
        self.replans = Counter(
            "ascendbind_replans", "Bound workers planned again, by why (host_changed, cpuset_changed, "
            "checkpoint_changed, classes_changed) and outcome (rebound, unchanged, failed)", ["reason", "outcome"], registry=r,
        )
        _at_zero(self.discovery_errors, DISCOVERY_ERRORS)
        _at_zero(self.replans, REPLAN_REASONS, REPLAN_OUTCOMES)

    def _reconcile_series(self, r: CollectorRegistry) -> None:
        """The reconcile loop: drift and what it set back, its passes, their cost and its mode."""
        self.drift = Counter(
            "ascendbind_drift", "Bound thread or IRQ masks found changed by someone else, by culprit (on evidence)",
            ["culprit"], registry=r,
        )
        self.reasserts = Counter(
            "ascendbind_reasserts", "Masks the reconcile loop set back after drift", registry=r
        )
        self.late_threads = Counter(
            "ascendbind_late_threads_pinned", "Threads created after binding and pinned by role", registry=r
        )
        self.reconcile_runs = Counter("ascendbind_reconcile_runs", "Reconcile passes", registry=r)
        self.reconcile_quiet_runs = Counter(
            "ascendbind_reconcile_quiet_runs",
            "Reconcile passes that ended after one poll and their share of the mask sweep: no thread event "
            "queued, no worker exited, no mask read had moved",
            registry=r,
        )
        self.reconcile_woken_runs = Counter(
            "ascendbind_reconcile_woken_runs",
            "Looks between passes at the workers process events named (a thread born, renamed or exited), "
            "woken by the events themselves", registry=r,
        )
        self.reconcile_duration = Histogram(
            "ascendbind_reconcile_duration_seconds",
            "Wall time of one reconcile pass over all bound workers (includes time preempted)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.reconcile_cpu = Histogram(
            "ascendbind_reconcile_cpu_seconds",
            "CPU time of one reconcile pass (its thread's own, so a busy host does not inflate it)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.reconcile_mode = Gauge(
            "ascendbind_reconcile_mode",
            "1 for the way the reconcile loop learns of thread changes now: events (the kernel's process "
            "events) or listing (task lists and a staggered name sweep), with the reason events are off",
            ["mode", "reason"], registry=r,
        )
        _at_zero(self.drift, CULPRITS)
        self.reconcile_mode.labels("events", "")
        _at_zero(self.reconcile_mode, ("listing",), LISTING_REASONS)

    def _isolation_series(self, r: CollectorRegistry) -> None:
        self.isolation_tasks = Gauge(
            "ascendbind_isolation_tasks",
            "Threads the host isolation level holds moved (recorded), leaves to their owner, leaves pinned inside "
            "the protected CPUs, or could not move because its record is full",
            ["state"], registry=r,
        )
        for state in ISOLATION_TASK_STATES:
            self.isolation_tasks.labels(state=state).set(0)

    def _thread_event_series(self, r: CollectorRegistry) -> None:
        """The kernel's process events about bound workers' threads."""
        self.thread_events = Counter(
            "ascendbind_thread_events", "Process events about bound workers' threads read by the reconcile loop",
            registry=r,
        )
        self.thread_event_losses = Counter(
            "ascendbind_thread_event_losses",
            "Reconcile passes that found process events lost (queue overflow), each followed by a full re-read",
            registry=r,
        )
        self.thread_event_overflows = Counter(
            "ascendbind_thread_event_overflows",
            "Times a bound worker sent more process events than its budget (thread_event_budget a second) and "
            "was followed by listing instead, counted again each time a probe after its cooldown found it flooding",
            registry=r,
        )
        self.thread_event_listing = Gauge(
            "ascendbind_thread_event_listing_workers",
            "Bound workers over their process-event budget now: their events are dropped in the kernel and their "
            "threads found by listing once a pass",
            registry=r,
        )

    def _worker_series(self, r: CollectorRegistry) -> None:
        """Workers dropped, NPU checks after a bind, writes that reached a recycled thread."""
        self.dropped = Counter(
            "ascendbind_workers_dropped", "Workers no longer held, by reason", ["reason"], registry=r
        )
        self.npu_checks = Counter(
            "ascendbind_npu_checks", "Binds that named their NPU, checked against npu-smi's process table after "
            "the answer, by verdict", ["verdict"], registry=r,
        )
        self.recycled = Counter(
            "ascendbind_recycled_writes",
            "Affinity writes found, right after writing, on a thread of another process than the worker's "
            "(its pid or a thread id recycled since it was observed): undone (mask set back as read before "
            "the write) or failed (could not be)", ["result"], registry=r,
        )
        _at_zero(self.dropped, DROP_REASONS)
        _at_zero(self.npu_checks, NPU_CHECK_VERDICTS)
        _at_zero(self.recycled, RECYCLED_WRITE_RESULTS)

    def _http_series(self, r: CollectorRegistry) -> None:
        self.http = Counter(
            "ascendbind_http_requests", "Socket API requests by path and status", ["path", "code"], registry=r
        )
        self.refused = Counter(
            "ascendbind_connections_refused", "Connections answered 503 busy at accept (a cap was reached)",
            ["listener"], registry=r,
        )
        self.internal_errors = Counter(
            "ascendbind_http_internal_errors", "API requests that failed on an unexpected exception", registry=r
        )
        _at_zero(self.refused, LISTENERS)

    def _memory_series(self, r: CollectorRegistry) -> None:
        """Bound workers' memory: its locality, its checks and reruns, and the background moves."""
        self.memory_local_ratio = Gauge(
            "ascendbind_memory_local_ratio",
            "Share (0-1, of bytes) of the bound worker's resident memory on its pool's NUMA nodes, by NPU",
            ["npu"], registry=r,
        )
        self._memory_npus: set[int] = set()
        self._memory_lock = threading.Lock()
        self.memory_checks = Counter(
            "ascendbind_memory_checks", "Reads of a bound worker's numa_maps, by result", ["result"], registry=r
        )
        self.memory_reruns = Counter(
            "ascendbind_memory_reruns", "Memory steps run again because locality fell below the threshold",
            ["outcome"], registry=r,
        )
        self.memory_moves = Counter(
            "ascendbind_memory_moves", "Background moves of bound workers' private pages that ended, by outcome",
            ["outcome"], registry=r,
        )
        self.memory_moved_bytes = Counter(
            "ascendbind_memory_moved_bytes", "Bytes of private memory moved to the pools' NUMA nodes", registry=r
        )
        self.memory_move_duration = Histogram(
            "ascendbind_memory_move_duration_seconds", "Time one move of a worker's private pages took",
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800), registry=r,
        )
        self.memory_moves_queued = Gauge(
            "ascendbind_memory_moves_queued", "Memory moves queued (pending) or running (moving)", ["state"],
            registry=r,
        )
        _at_zero(self.memory_checks, MEMORY_CHECK_RESULTS)
        _at_zero(self.memory_reruns, STEP_OUTCOMES)
        _at_zero(self.memory_moves, MOVE_OUTCOMES)
        _at_zero(self.memory_moves_queued, ("pending", "moving"))

    def attach(self, collector) -> None:
        """Export ``collector``'s series (the daemon's contention.Contention), in place of any
        attached before: one daemon's series per registry."""
        old = getattr(self, "_attached", None)
        if old is not None:
            self.registry.unregister(old)
        self.registry.register(collector)
        self._attached = collector

    # ------------------------------------------------------------ recorders

    def bind_outcome(self, outcome: str) -> None:
        self.bind_requests.labels(outcome if outcome in OUTCOMES else "failed").inc()

    def bind_phases(self, spent) -> None:
        """Add one bind's phase times (BindClock.spent; phases outside BIND_PHASES are dropped)."""
        children = self._phase_children
        for phase, seconds in spent.items():
            child = children.get(phase)
            if child is not None:
                child.inc(seconds)

    def alignment_failure(self, reason: str | None) -> None:
        self.alignment_failures.labels(reason if reason in self.alignment_reasons else "other").inc()

    def step_results(self, steps) -> None:
        for s in steps:
            step, outcome = s.step.value, s.outcome.value
            if step in STEPS and outcome in STEP_OUTCOMES:
                self.steps.labels(step, outcome).inc()

    def discovery_error(self, code: str) -> None:
        self.discovery_errors.labels(code if code in DISCOVERY_ERRORS else "other").inc()

    def drifted(self, culprit: str) -> None:
        self.drift.labels(culprit if culprit in CULPRITS else "external").inc()

    def replanned(self, reason: str, outcome: str) -> None:
        if reason in REPLAN_REASONS and outcome in REPLAN_OUTCOMES:
            self.replans.labels(reason, outcome).inc()

    def dropped_worker(self, reason: str) -> None:
        if reason in DROP_REASONS:
            self.dropped.labels(reason).inc()

    def npu_check(self, verdict: str) -> None:
        if verdict in NPU_CHECK_VERDICTS:
            self.npu_checks.labels(verdict).inc()

    def recycled_writes(self, step) -> None:
        """Count the writes of an affinity step (a StepResult, or None) that its check after
        writing found on another process's thread, by what became of them."""
        confirmed = step.data.get("confirmed") if step is not None else None
        for res in RECYCLED_WRITE_RESULTS:
            n = confirmed.get(res, 0) if confirmed else 0
            if n:
                self.recycled.labels(res).inc(n)

    def memory_local(self, ratios) -> None:
        """Export exactly ``ratios`` (NPU -> 0..1): an NPU no longer listed loses its series."""
        with self._memory_lock:
            for npu in self._memory_npus - set(ratios):
                self.memory_local_ratio.remove(str(npu))
            for npu, ratio in ratios.items():
                self.memory_local_ratio.labels(str(int(npu))).set(min(1.0, max(0.0, float(ratio))))
            self._memory_npus = {int(n) for n in ratios}

    def memory_check(self, result: str) -> None:
        if result in MEMORY_CHECK_RESULTS:
            self.memory_checks.labels(result).inc()

    def memory_move(self, outcome: str, moved_bytes: int, seconds: float | None) -> None:
        self.memory_moves.labels(outcome if outcome in MOVE_OUTCOMES else "failed").inc()
        if moved_bytes > 0:
            self.memory_moved_bytes.inc(moved_bytes)
        if seconds is not None:
            self.memory_move_duration.observe(seconds)

    def memory_queue(self, counts) -> None:
        for state in ("pending", "moving"):
            self.memory_moves_queued.labels(state).set(counts.get(state, 0))

    def memory_rerun(self, outcome: str) -> None:
        if outcome in STEP_OUTCOMES:
            self.memory_reruns.labels(outcome).inc()

    def set_reconcile_mode(self, mode: str, reason: str = "") -> None:
        """Exactly one series at 1: ("events", "") or ("listing", a reason from LISTING_REASONS)."""
        want = ("events", "") if mode == "events" else ("listing", reason if reason in LISTING_REASONS else "error")
        self.reconcile_mode.labels("events", "").set(want == ("events", ""))
        for r in LISTING_REASONS:
            self.reconcile_mode.labels("listing", r).set(want == ("listing", r))

    def http_request(self, path: str, code: int) -> None:
        p = path if path in HTTP_PATHS else "other"
        c = str(code) if str(code) in HTTP_CODES else "other"
        self.http.labels(p, c).inc()

    def connection_refused(self, listener: str) -> None:
        self.refused.labels(listener if listener in LISTENERS else "api").inc()

    def http_internal_error(self) -> None:
        self.internal_errors.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
