"""The daemon's cache of a host's facts, and of its failures to get them.

Two queries feed requests:

* ``host_facts``: the static facts (NPU map, topo affinity, lscpu, NUMA
  distances, PCI addresses). They cost several ``npu-smi`` runs, so they are
  discovered once at start and again only on a hot-plug event, SIGHUP or an
  explicit refresh.
* ``process_table``: ``npu-smi info``'s process table, which changes with every
  worker, so it is read fresh when a request needs it (bind without ``npu``,
  auto-bind).

A failing query is cached too, because a hung ``npu-smi`` must cost one
timeout, not one per request: after a failure every request that needs the
query is answered at once with ``DiscoveryUnavailable`` (HTTP 503
``discovery_unavailable``, naming the query and the failure) and runs nothing.
A background retry runs the query again after a backoff that doubles with each
consecutive failure (``backoff_initial`` up to ``backoff_max``); the first
success clears the failure. So while ``npu-smi`` hangs there is at most one
``npu-smi`` of each query running, and none started by a request. Static facts
already known stay in use while a later rediscovery fails (a transient stall
must not unbind anybody), but the failure still shows in ``health()``.

Each NPU's IRQs (``npu_irqs``) are kept beside the static facts they were
found under: the kernel numbers them when the driver probes the device, so only
a hot-plug or a driver reload (a PCI uevent, hence a rediscovery) changes them,
and every successful discovery starts the cache afresh. Only what cannot change
without such an event is kept: IRQs found, or an NPU without a PCI address; a
lookup that found no MSI vectors, no named SQ IRQ or an unreadable
``/proc/interrupts`` is made again at the next bind.

``health()`` is the ``/healthz`` document's discovery part: ``degraded`` while
any query fails or before the first discovery, with each failing query named.

``on_discovered(facts)``, when set, runs after every successful discovery
(under the cache's lock, so keep it short); ``serve`` uses it to log the config
lint once the host is known, whichever request or thread discovered it first.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from ...values.decisions import NpuIrqs
from ...discovery import LiveHost, discover_host, discover_processes
from ...discovery.gather.irqhost import discover_npu_irqs
from ...discovery.read.sources import OneTimeoutPerTool
from ...errors import AscendbindError, DiscoveryError, DiscoveryUnavailable
from ...values.model import HostFacts, NpuProcess
from ...values.reasons import Reason

__all__ = ["HostCache", "QueryFailure", "backoff_delay", "HOST_FACTS", "PROCESS_TABLE"]

log = structlog.get_logger("ascendbind.discovery")

HOST_FACTS = "host_facts"
PROCESS_TABLE = "process_table"
_WHAT = {
    HOST_FACTS: "host discovery (npu-smi info/-m/-t topo/-t board, lscpu)",
    PROCESS_TABLE: "the npu-smi process table (npu-smi info)",
}


def backoff_delay(failures: int, initial: float, cap: float) -> float:
    """Seconds before the next try after ``failures`` consecutive failures: doubling from ``initial``."""
    return min(cap, initial * 2 ** max(0, min(failures - 1, 30)))


@dataclasses.dataclass
class QueryFailure:
    query: str
    error: DiscoveryError
    failures: int  # consecutive
    since: float  # wall clock of the first of them
    retry_at: float  # monotonic

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "query": self.query,
            "error": self.error.code,
            "detail": str(self.error),
            "failures": self.failures,
            "since": round(self.since, 3),
            "retry_in_seconds": round(max(0.0, self.retry_at - now), 3),
        }


def _static_part(h: HostFacts) -> HostFacts:
    """HostFacts without the fields that change while the hardware does not."""
    return dataclasses.replace(h, processes=(), warnings=())


class HostCache:
    def __init__(self, config, metrics=None, *, source=None, backoff_initial: float = 2.0,
                 backoff_max: float = 30.0) -> None:
        self.config = config
        self.source = source or LiveHost.from_config(config)
        self.metrics = metrics
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._lock = threading.Lock()  # one host discovery at a time: npu-smi is not cheap
        self._proc_lock = threading.Lock()  # one process-table query at a time, for the same reason
        self._state = threading.Lock()  # guards _failures and _timers
        self._facts: HostFacts | None = None
        self._failures: dict[str, QueryFailure] = {}
        self._timers: dict[str, threading.Timer] = {}
        self._closed = False
        self.generation = 0  # bumped when the static facts change (hot-plug re-plans)
        # NPU -> its IRQs, valid for the facts object they were found under (_irq_facts)
        self._irqs: dict[int, NpuIrqs] = {}
        self._irq_facts: HostFacts | None = None
        self.on_discovered: Callable[[HostFacts], None] | None = None

    def set_config(self, config) -> None:
        self.config = config
        self.source = LiveHost.from_config(config) if isinstance(self.source, LiveHost) else self.source

    def close(self) -> None:
        """Cancel the pending background retries (a stopped daemon, a finished test)."""
        with self._state:
            self._closed = True
            timers, self._timers = list(self._timers.values()), {}
        for t in timers:
            t.cancel()

    # ---------------------------------------------------------- health

    def failures(self) -> list[QueryFailure]:
        with self._state:
            return [dataclasses.replace(f) for _, f in sorted(self._failures.items())]

    @property
    def status(self) -> str:
        """One line: ``ok``, ``not yet discovered``, or each failing query with its error."""
        failing = self.failures()
        if failing:
            return "; ".join(f"{f.query}: {f.error.code}: {f.error}" for f in failing)
        return "ok" if self._facts is not None else "not yet discovered"

    def health(self) -> dict[str, Any]:
        """``status`` (ok|degraded), ``discovery`` (one line) and ``failing`` (one entry per failing query)."""
        now = time.monotonic()
        failing = self.failures()
        return {
            "status": "ok" if not failing and self._facts is not None else "degraded",
            "discovery": self.status,
            "failing": [f.to_json(now) for f in failing],
        }

    # ---------------------------------------------------------- queries

    def get(self) -> HostFacts:
        """Cached facts; discovers when none. DiscoveryUnavailable at once while the
        last host discovery failed and no facts are known yet."""
        facts = self._facts
        if facts is not None:
            return facts
        self._fail_fast(HOST_FACTS)
        with self._lock:
            if self._facts is not None:
                return self._facts
            self._fail_fast(HOST_FACTS)  # it failed while we waited for the lock
            return self._discover_locked()

    def known(self) -> HostFacts | None:
        """The cached facts, or None before the first discovery; never discovers."""
        return self._facts

    def refresh(self) -> tuple[HostFacts, bool]:
        """Rediscover now (hot-plug, SIGHUP); returns (facts, whether the static facts changed).

        On failure the previous facts stay in use (a transient npu-smi stall
        must not unbind anybody), the failure is cached like any other, and the
        error propagates.
        """
        with self._lock:
            return self._rediscover_locked()

    def processes(self) -> tuple[NpuProcess, ...]:
        """A fresh ``npu-smi info`` process table; DiscoveryUnavailable at once while it keeps failing."""
        self._fail_fast(PROCESS_TABLE)
        with self._proc_lock:
            self._fail_fast(PROCESS_TABLE)  # the query we waited for failed
            return self._query_processes_locked()

    def npu_irqs(self, host: HostFacts, npus) -> dict[int, NpuIrqs]:
        """NPU -> its IRQs for each of ``npus`` on ``host`` (facts from this cache): what
        an earlier bind found since the last discovery, else looked up now (see above)."""
        with self._state:
            facts = self._facts
            cached = self._irqs if facts is not None and self._irq_facts is facts else {}
            hit = {n: cached[n] for n in npus if n in cached}
        missing = [n for n in npus if n not in hit]
        if not missing:
            return hit
        found = discover_npu_irqs(self.source, host, missing)
        lasting = {n: v for n, v in found.items() if v.reason is None or v.reason is Reason.NO_PCI_ADDRESS}
        # kept only when ``host`` still has the PCI addresses of the cached facts: a request
        # that planned from facts a rediscovery has since replaced must not fill the new cache
        with self._state:
            if lasting and facts is not None and self._facts is facts and \
                    host.pci_addresses == facts.pci_addresses and host.pci_unknown == facts.pci_unknown:
                if self._irq_facts is not facts:
                    self._irqs, self._irq_facts = {}, facts
                self._irqs.update(lasting)
        return {**hit, **found}

    def forget_irqs(self) -> None:
        """Drop the cached IRQs: a write to one failed, so it may be gone (driver reload)."""
        with self._state:
            self._irqs, self._irq_facts = {}, None

    # ---------------------------------------------------------- the runs

    def _rediscover_locked(self) -> tuple[HostFacts, bool]:
        before = self._facts
        facts = self._discover_locked(keep_previous=True)
        changed = before is None or _static_part(before) != _static_part(facts)
        if changed and before is not None:
            self.generation += 1
        return facts, changed

    def _query_processes_locked(self) -> tuple[NpuProcess, ...]:
        facts = self._facts
        chips = facts.chips if facts is not None and facts.chips else None
        rows = self._timed(PROCESS_TABLE, "process table query", lambda: tuple(
            discover_processes(OneTimeoutPerTool(self.source), self.config, chips=chips)))
        self._succeeded(PROCESS_TABLE)
        return rows

    def _discover_locked(self, *, keep_previous: bool = False) -> HostFacts:
        facts = self._timed(HOST_FACTS, "host discovery", lambda: discover_host(OneTimeoutPerTool(self.source),
                                                                                  self.config),
                            forget=not keep_previous)
        with self._state:
            self._facts = facts
            self._irqs, self._irq_facts = {}, None  # a discovery is the event IRQ numbers change with
        self._succeeded(HOST_FACTS)
        hook = self.on_discovered
        if hook is not None:
            try:
                hook(facts)
            except Exception:  # a listener's bug must not turn good facts into a failed discovery
                log.exception("on_discovered hook failed")
        return facts

    def _timed(self, query: str, shown: str, run: Callable[[], Any], *, forget: bool = False) -> Any:
        """``run()``, timed on the discovery histogram. A DiscoveryError is cached as ``query``'s
        failure (``forget``: the facts held are dropped too); any other exception but our own
        is a parser's bug, which must not take the daemon down: reported as a discovery failure."""
        start = time.monotonic()
        try:
            return run()
        except DiscoveryError as exc:
            if forget:
                self._facts = None
            self._failed(query, exc)
            raise
        except AscendbindError:
            raise
        except Exception as exc:
            err = DiscoveryError(f"{shown} crashed: {type(exc).__name__}: {exc}")
            log.exception(f"{shown} crashed")
            self._failed(query, err)
            raise err from None
        finally:
            if self.metrics:
                self.metrics.discovery_duration.observe(time.monotonic() - start)

    # ---------------------------------------------------------- the failure cache

    def _fail_fast(self, query: str) -> None:
        with self._state:
            f = self._failures.get(query)
            if f is None:
                return
            left = max(0.0, f.retry_at - time.monotonic())
        raise DiscoveryUnavailable(
            f"{_WHAT[query]} is failing ({f.error.code}: {f.error}); {f.failures} failure(s) in a row, "
            f"next try in the background in {left:.1f}s"
        )

    def _failed(self, query: str, exc: DiscoveryError) -> None:
        with self._state:
            prev = self._failures.get(query)
            n = prev.failures + 1 if prev else 1
            delay = backoff_delay(n, self.backoff_initial, self.backoff_max)
            self._failures[query] = QueryFailure(query, exc, n, prev.since if prev else time.time(),
                                                 time.monotonic() + delay)
            self._schedule_locked(query, delay)
        if self.metrics:
            self.metrics.discovery_error(exc.code)
        log.warning("discovery query failed", query=query, code=exc.code, detail=str(exc), failures=n,
                    retry_in_seconds=delay)

    def _succeeded(self, query: str) -> None:
        with self._state:
            prev = self._failures.pop(query, None)
            timer = self._timers.pop(query, None)
        if timer is not None:
            timer.cancel()
        if prev is not None:
            log.info("discovery query recovered", query=query, after_failures=prev.failures)

    def _schedule_locked(self, query: str, delay: float) -> None:
        old = self._timers.pop(query, None)
        if old is not None:
            old.cancel()
        if self._closed:
            return
        t = threading.Timer(delay, self._retry, args=(query,))
        t.daemon = True
        t.name = f"retry-{query}"
        self._timers[query] = t
        t.start()

    def _retry(self, query: str) -> None:
        """The background retry of a failing query; a failure schedules the next one."""
        with self._state:
            if self._timers.get(query) is threading.current_thread():
                del self._timers[query]
        try:
            if query == PROCESS_TABLE:
                with self._proc_lock:
                    self._query_processes_locked()
            else:
                with self._lock:
                    before = self._facts
                    _, changed = self._rediscover_locked()
                if changed and before is not None:
                    log.warning("host facts changed while discovery was failing; "
                                "bound workers keep their plans until the next rediscovery (SIGHUP)")
        except DiscoveryError:
            pass  # recorded, and the next retry scheduled, by _failed
        except Exception as exc:  # never leave a failure cached with no retry pending
            log.exception("background discovery retry crashed", query=query)
            self._failed(query, DiscoveryError(f"{_WHAT[query]} retry crashed: {type(exc).__name__}: {exc}"))
