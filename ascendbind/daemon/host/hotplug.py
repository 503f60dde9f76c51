"""Hot-plug: CPU and PCI uevents trigger a debounced rediscovery.

pyudev listens on the *kernel* netlink group (``source="kernel"``): CI machines
and containers run no udevd, and the kernel's own events are what we need (a CPU
going on/offline, an NPU's PCI function appearing or leaving). Events come in
bursts (one per CPU when a socket is onlined), so a rediscovery runs once the
stream has been quiet for ``debounce`` seconds; then only workers whose plan
changed are bound again.

Where netlink is unavailable (no libudev, a sandbox without NETLINK_KOBJECT_UEVENT,
a private network namespace) the daemon runs without hot-plug and says so in
``/healthz`` and the log; SIGHUP still rediscovers.

The listener blocks in select() on the monitor and a wake-up pipe: no polling.
"""

from __future__ import annotations

import os
import select
import threading
import time

import structlog

from ..runtime.threadname import name_os_thread

__all__ = ["HotplugMonitor", "Debouncer", "SUBSYSTEMS"]

log = structlog.get_logger("ascendbind.hotplug")

SUBSYSTEMS = ("cpu", "pci")


class Debouncer:
    """Call ``action`` once the pokes have stopped for ``delay`` seconds.

    One thread owns the timing: a poke moves the deadline, and the thread waits on
    a condition until the deadline has passed unmoved, then fires. A burst whose
    gaps are shorter than ``delay`` fires exactly once however late the scheduler
    runs anybody: there is no timer to cancel, so no timer that fires while it is
    being cancelled. The thread starts on the first poke and, with nothing due,
    waits without a timeout (an idle daemon is not woken).
    """

    def __init__(self, delay: float, action) -> None:
        self.delay, self.action = delay, action
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._firing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.pokes = 0
        self.fired = 0

    def poke(self) -> None:
        with self._cond:
            if self._closed:
                return
            self.pokes += 1
            self._deadline = time.monotonic() + self.delay
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="debounce", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pending(self) -> bool:
        """True while a fire is due or running (a burst not yet acted upon)."""
        with self._cond:
            return self._deadline is not None or self._firing

    def _due(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _run(self) -> None:
        name_os_thread()
        while True:
            with self._cond:
                while not self._closed and not self._due():
                    left = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
                    self._cond.wait(left)
                if self._closed:
                    return
                self._deadline = None
                self._firing = True
                self.fired += 1
            try:
                self.action()
            except Exception:
                log.exception("rediscovery after hot-plug failed")
            finally:
                with self._cond:
                    self._firing = False
                    self._cond.notify_all()

    def close(self) -> None:
        """Drop anything due and end the thread (a fire already running completes)."""
        with self._cond:
            self._closed = True
            self._deadline = None
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)


class HotplugMonitor:
    def __init__(self, on_change, *, debounce: float = 2.0) -> None:
        self.debouncer = Debouncer(debounce, on_change)
        self.status = "off"
        self._monitor = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1

    def start(self) -> str:
        """Start listening; returns a status line ("kernel netlink: cpu, pci" or "disabled: why")."""
        try:
            import pyudev

            ctx = pyudev.Context()
            mon = pyudev.Monitor.from_netlink(ctx, source="kernel")
            for sub in SUBSYSTEMS:
                mon.filter_by(sub)
            mon.start()
        except Exception as exc:  # ImportError (no libudev), OSError (no netlink), pyudev errors
            self.status = f"disabled: {type(exc).__name__}: {exc}"[:200]
            log.warning("hot-plug monitoring unavailable; rediscovery only on SIGHUP", reason=self.status)
            return self.status
        self._monitor = mon
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="hotplug", daemon=True)
        self._thread.start()
        self.status = "kernel netlink: " + ", ".join(SUBSYSTEMS)
        log.info("hot-plug monitor started", subsystems=list(SUBSYSTEMS))
        return self.status

    def _run(self) -> None:
        name_os_thread()
        mon = self._monitor
        while True:
            try:
                ready, _, _ = select.select([mon, self._wake_r], [], [])
            except (OSError, ValueError):
                return
            if self._wake_r in ready:
                return
            try:
                dev = mon.poll(timeout=0)
            except Exception as exc:
                log.warning("reading a uevent failed", error=str(exc))
                continue
            if dev is None:
                continue
            log.info("uevent", subsystem=dev.subsystem, action=dev.action, device=dev.sys_name)
            self.debouncer.poke()

    def stop(self) -> None:
        self.debouncer.close()
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(5)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
