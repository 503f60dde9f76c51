"""Auto-bind (``auto_bind = true``, off by default).

A multi-process server (``vllm serve`` with tensor parallelism) starts one
worker per NPU without asking anybody; ``ascendbind run --npu`` suits single-NPU
workers only. With auto-bind the daemon reads the ``npu-smi info`` process table
every ``auto_bind_seconds`` and binds each process it lists, that it does not
hold yet, to the NPU(s) listed for it.

A process that could not be bound (gone, not plannable, NPU held, or never a
worker: pid 1, a kernel thread, the daemon itself) is remembered by (pid, start
time) and not retried, so a permanent problem costs one log line, not one per
tick. Each listed pid's identity is read once and carried into the bind, like
an API request's.
"""

from __future__ import annotations

import threading

import structlog

from ...discovery.gather.identity import start_time
from ...discovery.gather.process import read_identity
from ...errors import AscendbindError, DiscoveryError
from ..runtime.threadname import name_os_thread
from ..api.requests import outcome_of_error

__all__ = ["AutoBinder"]

log = structlog.get_logger("ascendbind.autobind")


class AutoBinder:
    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed: set[tuple[int, int | None]] = set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="auto-bind", daemon=True)
        self._thread.start()
        log.info("auto-bind on", every_seconds=self.daemon.config.auto_bind_seconds)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        name_os_thread()
        # first look right away: workers started before the daemon should not wait a period
        while True:
            try:
                self.tick()
            except Exception:
                log.exception("auto-bind tick crashed")
            if self._stop.wait(max(1.0, float(self.daemon.config.auto_bind_seconds))):
                return

    def tick(self) -> list[int]:
        d = self.daemon
        try:
            rows = d.hosts.processes()
        except DiscoveryError as exc:
            log.warning("auto-bind: npu-smi process table unavailable", error=str(exc))
            return []
        wanted: dict[int, set[int]] = {}
        listed = frozenset((row.npu, row.pid) for row in rows)
        for row in rows:
            wanted.setdefault(row.pid, set()).add(row.npu)
        bound: list[int] = []
        for pid, npus in sorted(wanted.items()):
            if d.holds(pid):
                continue
            target = read_identity(pid, d.config.proc_root)
            if target is None:
                continue
            key = (pid, target.start_time)
            if key in self._failed:
                continue
            try:
                # the table it was read from proves the binding (daemon/watch/proof.py)
                result = d.bind_process(target, tuple(sorted(npus)), None, listed=listed)
            except AscendbindError as exc:
                self._failed.add(key)
                d.metrics.bind_outcome(outcome_of_error(exc))
                log.warning("auto-bind failed", pid=pid, npus=sorted(npus), error=exc.code, detail=str(exc))
                continue
            d.metrics.bind_outcome(result["outcome"])
            bound.append(pid)
            log.info("auto-bound", pid=pid, npus=sorted(npus), outcome=result["outcome"])
        # forget failures of processes that are gone, so the set stays bounded
        self._failed = {k for k in self._failed if start_time(k[0], d.config.proc_root) == k[1]}
        return bound
