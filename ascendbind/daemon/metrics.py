"""Prometheus metrics of the daemon, on an explicit registry.

Every label value comes from a fixed set defined here (or by the planner's
alignment reasons), never from a pid or free text, so the series count is
bounded. Failure series are created at 0 up front: a scrape that has never seen
a failure still shows the series, so alerts on ``increase(...) > 0`` work from
the first scrape.
"""

from __future__ import annotations

import platform
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from .. import __version__
from ..planner import ALIGNMENT_FAILURE_REASONS

__all__ = ["Metrics", "MetricsListener", "start_tcp_listener", "parse_listen", "OUTCOMES", "CULPRITS",
           "DISCOVERY_ERRORS", "HTTP_PATHS", "ALIGNMENT_REASONS"]

# `_created` series double every counter for no operator value
prometheus_client.disable_created_metrics()

OUTCOMES = ("aligned", "unaligned", "failed", "rejected")
STEPS = ("affinity", "irq", "memory", "uvb")
STEP_OUTCOMES = ("applied", "skipped", "failed")
# who moved a bound thread's mask: fixed guess set (daemon/reconcile.py)
CULPRITS = ("irqbalance", "env", "self", "unknown")
DISCOVERY_ERRORS = ("tool_missing", "command_failed", "command_timeout", "parse_error", "other")
DROP_REASONS = ("exited", "recycled", "released", "replaced", "evicted", "other_boot")
HTTP_PATHS = ("/v1/bind", "/v1/release", "/v1/workers", "/v1/plan", "/healthz", "/metrics", "other")
HTTP_CODES = ("200", "400", "403", "404", "405", "409", "413", "422", "500", "503")

# the planner's fixed alignment-failure set, plus "other" for anything unforeseen
ALIGNMENT_REASONS = (*ALIGNMENT_FAILURE_REASONS, "other")


class Metrics:
    """All series of one daemon. Methods take domain values and map them to labels."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
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
        self.drift = Counter(
            "ascendbind_drift", "Bound thread or IRQ masks found changed by someone else, by culprit guess",
            ["culprit"], registry=r,
        )
        self.reasserts = Counter(
            "ascendbind_reasserts", "Masks the reconcile loop set back after drift", registry=r
        )
        self.late_threads = Counter(
            "ascendbind_late_threads_pinned", "Threads created after binding and pinned by role", registry=r
        )
        self.reconcile_runs = Counter("ascendbind_reconcile_runs", "Reconcile passes", registry=r)
        self.reconcile_duration = Histogram(
            "ascendbind_reconcile_duration_seconds",
            "Time of one reconcile pass over all bound workers",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.dropped = Counter(
            "ascendbind_workers_dropped", "Workers no longer held, by reason", ["reason"], registry=r
        )
        self.http = Counter(
            "ascendbind_http_requests", "Socket API requests by path and status", ["path", "code"], registry=r
        )
        self.build_info = Info("ascendbind_build", "Version of the running daemon", registry=r)
        self.build_info.info({"version": __version__, "python": platform.python_version()})

        for o in OUTCOMES:
            self.bind_requests.labels(o)
        for reason in self.alignment_reasons:
            self.alignment_failures.labels(reason)
        for s in STEPS:
            for o in STEP_OUTCOMES:
                self.steps.labels(s, o)
        for c in CULPRITS:
            self.drift.labels(c)
        for c in DISCOVERY_ERRORS:
            self.discovery_errors.labels(c)
        for d in DROP_REASONS:
            self.dropped.labels(d)

    # ------------------------------------------------------------ recorders

    def bind_outcome(self, outcome: str) -> None:
        self.bind_requests.labels(outcome if outcome in OUTCOMES else "failed").inc()

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
        self.drift.labels(culprit if culprit in CULPRITS else "unknown").inc()

    def dropped_worker(self, reason: str) -> None:
        if reason in DROP_REASONS:
            self.dropped.labels(reason).inc()

    def http_request(self, path: str, code: int) -> None:
        p = path if path in HTTP_PATHS else "other"
        c = str(code) if str(code) in HTTP_CODES else "500"
        self.http.labels(p, c).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_listen(value: str) -> tuple[str, int] | None:
    """``host:port`` (``[::1]:9464`` for IPv6) -> (host, port); empty -> None (disabled)."""
    if not value:
        return None
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


class _MetricsHandler(BaseHTTPRequestHandler):
    server_version = "ascendbind-metrics"
    sys_version = ""

    def do_GET(self) -> None:
        if urlsplit(self.path).path not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = self.server.metrics.render()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args) -> None:
        pass


class MetricsListener(ThreadingHTTPServer):
    """/metrics over TCP for Prometheus. Its accept loop blocks in select() with no
    timeout (prometheus_client's own server wakes twice a second); ``stop()``
    wakes it by connecting."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, addr: tuple[str, int], metrics: Metrics) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        super().__init__(addr, _MetricsHandler)
        self.metrics = metrics
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": None},
                                        name="metrics-tcp", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        stopper = threading.Thread(target=self.shutdown, daemon=True)
        stopper.start()
        try:
            with socket.create_connection(self.server_address[:2], timeout=1):
                pass
        except OSError:
            pass
        stopper.join(5)
        self.server_close()


def start_tcp_listener(metrics: Metrics, listen: str) -> MetricsListener | None:
    """Serve /metrics on ``listen`` (host:port); None when ``listen`` is empty (disabled)."""
    addr = parse_listen(listen)
    if addr is None:
        return None
    return MetricsListener(addr, metrics)
