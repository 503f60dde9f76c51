"""The daemon's cache of a host's static facts (issue 4, "Discovery cache").

Static facts (NPU map, topo affinity, lscpu, NUMA distances, PCI addresses) cost
several ``npu-smi`` runs, so they are discovered once at start and again only on
a hot-plug event, SIGHUP or an explicit refresh. A failed discovery is cached
for ``retry_after`` seconds: while ``npu-smi`` hangs, requests get a fast 503
naming the reason instead of each waiting out the command timeout again.

The process table (``npu-smi info``) changes with every worker, so it is read
fresh when a request needs it (bind without ``npu``, auto-bind).

``on_discovered(facts)``, when set, runs after every successful discovery
(under the cache's lock, so keep it short); ``serve`` uses it to log the config
lint once the host is known, whichever request or thread discovered it first.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import structlog

from ..discovery import LiveHost, discover_host
from ..errors import AscendbindError, DiscoveryError
from ..model import HostFacts, NpuProcess

__all__ = ["HostCache"]

log = structlog.get_logger("ascendbind.discovery")


def _static_part(h: HostFacts) -> HostFacts:
    """HostFacts without the fields that change while the hardware does not."""
    return dataclasses.replace(h, processes=(), warnings=())


class HostCache:
    def __init__(self, config, metrics=None, *, source=None, retry_after: float = 2.0) -> None:
        self.config = config
        self.source = source or LiveHost.from_config(config)
        self.metrics = metrics
        self.retry_after = retry_after
        self._lock = threading.Lock()  # one discovery at a time: npu-smi is not cheap
        self._facts: HostFacts | None = None
        self._error: DiscoveryError | None = None
        self._error_at = 0.0
        self.generation = 0  # bumped when the static facts change (hot-plug re-plans)
        self.on_discovered: Callable[[HostFacts], None] | None = None

    def set_config(self, config) -> None:
        self.config = config
        self.source = LiveHost.from_config(config) if isinstance(self.source, LiveHost) else self.source

    @property
    def status(self) -> str:
        if self._facts is not None:
            return "ok"
        if self._error is not None:
            return f"{self._error.code}: {self._error}"
        return "not yet discovered"

    def get(self) -> HostFacts:
        """Cached facts; discovers when none (DiscoveryError, possibly a cached one)."""
        facts = self._facts
        if facts is not None:
            return facts
        with self._lock:
            if self._facts is not None:
                return self._facts
            if self._error is not None and time.monotonic() - self._error_at < self.retry_after:
                raise self._error
            return self._discover_locked()

    def refresh(self) -> tuple[HostFacts, bool]:
        """Rediscover now; returns (facts, whether the static facts changed).

        On failure the previous facts stay in use (a transient npu-smi stall
        must not unbind anybody) and the error propagates.
        """
        with self._lock:
            before = self._facts
            facts = self._discover_locked(keep_previous=True)
            changed = before is None or _static_part(before) != _static_part(facts)
            if changed and before is not None:
                self.generation += 1
            return facts, changed

    def processes(self) -> tuple[NpuProcess, ...]:
        """A fresh ``npu-smi info`` process table (full rediscovery when discovery has no cheaper call)."""
        from .. import discovery

        cheap = getattr(discovery, "discover_processes", None)
        if cheap is not None:
            start = time.monotonic()
            try:
                facts = self._facts
                chips = facts.chips if facts is not None and facts.chips else None
                return tuple(cheap(self.source, self.config, chips=chips))
            except DiscoveryError as exc:
                self._note_error(exc)
                raise
            finally:
                if self.metrics:
                    self.metrics.discovery_duration.observe(time.monotonic() - start)
        facts, _ = self.refresh()
        return facts.processes

    def _note_error(self, exc: DiscoveryError) -> None:
        if self.metrics:
            self.metrics.discovery_error(exc.code)

    def _discover_locked(self, *, keep_previous: bool = False) -> HostFacts:
        start = time.monotonic()
        try:
            facts = discover_host(self.source, self.config)
        except DiscoveryError as exc:
            self._error, self._error_at = exc, time.monotonic()
            if not keep_previous:
                self._facts = None
            self._note_error(exc)
            log.warning("host discovery failed", code=exc.code, detail=str(exc))
            raise
        except AscendbindError:
            raise
        except Exception as exc:  # a parser bug must not take the daemon down: report it as discovery
            err = DiscoveryError(f"host discovery crashed: {type(exc).__name__}: {exc}")
            self._error, self._error_at = err, time.monotonic()
            self._note_error(err)
            log.exception("host discovery crashed")
            raise err from None
        finally:
            if self.metrics:
                self.metrics.discovery_duration.observe(time.monotonic() - start)
        self._facts, self._error = facts, None
        hook = self.on_discovered
        if hook is not None:
            try:
                hook(facts)
            except Exception:  # a listener's bug must not turn good facts into a failed discovery
                log.exception("on_discovered hook failed")
        return facts
