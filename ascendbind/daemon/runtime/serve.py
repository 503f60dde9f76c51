"""``ascendbind serve``: start every part of the daemon, run until SIGTERM.

Start order: the state directory check (a ``state_dir`` another user could
change is refused with exit 2 before anything else happens), listening socket
(so clients queue rather than fail), state restore, reconcile loop, hot-plug, auto-bind, metrics listener, the API; then
READY=1. Host discovery runs in the background: a hanging npu-smi delays
nothing, requests get 503 with the reason until it succeeds.

SIGHUP reloads the config file (a bad file is logged and the old config kept)
and rediscovers the host; isolation follows the new level at once (``off``
puts back every mask it changed).

Config lint (planner/lint.py: legal settings that contradict each other or do
nothing on this host) needs the host's facts, so it is logged as warnings after
the first successful discovery, whether the start-up warm-up or a later request
made it, and once more after the discovery that follows each SIGHUP reload.

The kernel may hand SIGHUP, SIGTERM or SIGINT to any of the daemon's threads;
Python runs the handler in the main thread, but a main thread asleep on a lock
would not notice one taken elsewhere until something else woke it (a reload,
or a stop, lost). So the main loop sleeps on ``signal.set_wakeup_fd``'s pipe,
which the C-level handler writes to from whichever thread took the signal.

SIGTERM/SIGINT stop the daemon; bindings stay in place (``ascendbind release
--all`` undoes them), but every mask isolation changed on the rest of the host
is put back (a restarted daemon sets them again for the workers it keeps). Every tool still running then (a hanging npu-smi, lscpu)
has its process group killed and reaped before anything else
stops, so nothing the daemon started outlives it, under systemd or not.

The stop is bounded: its parts get ``STOP_SECONDS`` together. A thread can be
stuck where no flag reaches it (a request reading a file that a worker's own
filesystem never serves), so a part still waiting then is named in the log, the
state file is written if the daemon's lock can be had at once (it is written
after every change anyway, so the file on disk is the last complete state),
and ``serve()`` returns; the ``serve`` verb then ends the process without
waiting for such threads, and the kernel's exit interrupts their waits.

File descriptors are budgeted: each listener's connection cap is its share, and
the rest (state file, /proc reads, command pipes, udev, epoll) needs at most a
hundred or so, plus two pidfds per bound worker (its record's, and the
reconcile loop's copy). The daemon checks the soft RLIMIT_NOFILE covers the sum at start
(raising it to the hard limit if needed) and says so when it cannot.
"""

from __future__ import annotations

import contextlib
import os
import queue
import resource
import select
import signal
import threading
import time

import structlog

from ... import __version__
from ...command import allow_commands, stop_commands
from ...values.config import Config
from ...discovery.read.deadline import READERS
from ...errors import AscendbindError, ConfigError
from ...values.model import HostFacts
from ...values.reasons import Step
from ...planner import lint_config
from . import systemd
from .threadname import name_os_thread
from ..host.autobind import AutoBinder
from ..heart.daemon import Daemon
from ..isolate.taskwatch import TaskWatch
from ..host.hotplug import HotplugMonitor
from ..api.listen import open_listen_socket
from ..api.metrics import Metrics
from ..api.metricsport import METRICS_LIMITS, start_tcp_listener
from ..watch.reconcile import Reconciler
from ..host.replan import rediscover_and_replan
from ..api.server import API_LIMITS, ApiServer

__all__ = ["serve", "RESTART_KEYS", "STOP_SECONDS"]

log = structlog.get_logger("ascendbind.serve")

# descriptors besides the listeners' connections: see the module docstring (128 for the
# daemon's own files, 128 for the pidfds of 64 bound workers)
FD_OVERHEAD = 256

# SIGTERM to exit, whatever a thread is stuck on: below systemd's default TimeoutStopSec
STOP_SECONDS = 4.0

# keys a running daemon cannot change on SIGHUP
RESTART_KEYS = ("socket", "state_dir", "metrics_listen", "socket_group", "proc_root", "sys_root", "kubelet_root")


class _Service:
    def __init__(self, config: Config, reload) -> None:
        self.config = config
        self.reload_config = reload
        self.metrics = Metrics()
        READERS.thread_init = name_os_thread  # a stuck reader shows as worker-read in ps -L
        # this process is the daemon: its own threads keep to the housekeeping CPUs (isolate/)
        self.daemon = Daemon(config, metrics=self.metrics, confine_self=True)
        _stop_points(self.daemon, os.environ.get("ASCENDBIND_TEST_STOP_AT", ""))
        self.server: ApiServer | None = None
        self.tcp = None
        self.reconciler = Reconciler(self.daemon)
        self.taskwatch = TaskWatch(self.daemon.isolation, config=lambda: self.daemon.config,
                                   adopt=self.daemon.adopt_tasks, commit=self.daemon.commit)
        self.hotplug = HotplugMonitor(lambda: rediscover_and_replan(self.daemon))
        self.autobind: AutoBinder | None = None
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.owned_path: str | None = None
        self.stopping: str | None = None  # the part stop() is waiting for
        # the config whose lint is still to be logged; None once it has been
        self._lint_due: Config | None = config
        self._lint_lock = threading.Lock()
        self.daemon.hosts.on_discovered = self._lint

    def _lint(self, facts: HostFacts) -> None:
        """Log each lint sentence of the pending config once (runs on every discovery)."""
        with self._lint_lock:
            config, self._lint_due = self._lint_due, None
        if config is None:
            return  # already said for this config: a hot-plug rediscovery repeats nothing
        for sentence in lint_config(config, facts):
            log.warning("config lint", detail=sentence)

    def start(self) -> None:
        cfg = self.config
        real_state_dir = self.daemon.state.prepare()
        ensure_fd_budget(API_LIMITS.max_total + METRICS_LIMITS.max_total + FD_OVERHEAD)
        try:
            sock, how, owned = open_listen_socket(cfg.socket, cfg.socket_group)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {cfg.socket}: {exc.strerror or exc}") from None
        self.owned_path = cfg.socket if owned else None
        self.server = ApiServer(sock, self.daemon)
        restored = self.daemon.restore()
        threading.Thread(target=self._warm_up, name="discovery", daemon=True).start()
        self.reconciler.start()
        self.taskwatch.start()
        self.daemon.hotplug_status = self.hotplug.start()
        self.daemon.rediscovery_pending = self.hotplug.debouncer.pending
        self.daemon.reconcile_mode = self.reconciler.thread_events.describe
        self.daemon.thread_events_of = self.reconciler.thread_events.worker
        self.daemon.held_changed = self.reconciler.poke
        if cfg.auto_bind:
            self.autobind = AutoBinder(self.daemon)
            self.autobind.start()
        try:
            self.tcp = start_tcp_listener(self.metrics, cfg.metrics_listen)
        except (OSError, ValueError) as exc:
            log.error("metrics listener not started", listen=cfg.metrics_listen, error=str(exc))
        threading.Thread(target=self.server.serve, name="api", daemon=True).start()
        interval = systemd.watchdog_interval()
        if interval:
            threading.Thread(target=self._watchdog, args=(interval,), name="watchdog", daemon=True).start()
        log.info("ascendbind serving", version=__version__, socket=sock.getsockname() or cfg.socket, via=how,
                 state_dir=real_state_dir,
                 metrics_listen=cfg.metrics_listen or None, workers=restored["kept"],
                 reconcile_seconds=cfg.reconcile_seconds, auto_bind=cfg.auto_bind, hotplug=self.daemon.hotplug_status)
        systemd.notify("READY=1", f"STATUS=serving; {restored['kept']} workers restored", f"MAINPID={_pid()}")

    def _warm_up(self) -> None:
        try:
            facts = self.daemon.hosts.get()
        except AscendbindError:
            return  # logged by the cache; requests answer 503 until it works
        log.info("host discovered", device_type=facts.device_type.value, npus=len(facts.chips),
                 cpus=len(facts.cpus))
        self.daemon.commit()  # isolation needs the host's facts: it follows the restored workers now

    def _watchdog(self, interval: float) -> None:
        # ping only while the reconcile loop makes progress: a wedged daemon gets restarted
        while True:
            time.sleep(interval)
            if self.reconciler.healthy():
                systemd.notify("WATCHDOG=1")

    def reload(self) -> None:
        try:
            new = self.reload_config()
        except ConfigError as exc:
            log.error("SIGHUP: config not reloaded; keeping the running one", error=str(exc))
            return
        fixed = [k for k in RESTART_KEYS if getattr(new, k) != getattr(self.config, k)]
        if fixed:
            log.warning("SIGHUP: these keys need a restart to change; keeping the running values", keys=fixed)
            new = new.replace(**{k: getattr(self.config, k) for k in fixed})
        classes_changed = new.thread_classes != self.config.thread_classes
        self.config = new
        self.daemon.config = new
        self.daemon.hosts.set_config(new)
        with self._lint_lock:
            self._lint_due = new  # said again after the rediscovery below
        if new.auto_bind and self.autobind is None:
            self.autobind = AutoBinder(self.daemon)
            self.autobind.start()
        elif not new.auto_bind and self.autobind is not None:
            self.autobind.stop()
            self.autobind = None
        log.info("SIGHUP: config reloaded")
        self.daemon.commit()  # isolation follows the new level now, not at the next change
        threading.Thread(target=rediscover_and_replan, args=(self.daemon,), kwargs={"classes_changed": classes_changed},
                         name="rediscover", daemon=True).start()

    def stop(self) -> None:
        systemd.notify("STOPPING=1")
        # first: a part's stop() may wait for a thread that waits for a hung tool
        self.stopping = "tools"
        left = stop_commands()
        if left:
            log.error("tools still unreaped after SIGKILL to their process groups", groups=left)
        self.stopping = "api"
        if self.server is not None:
            self.server.stop()
        for name, part in (("reconcile loop", self.reconciler), ("host task watcher", self.taskwatch),
                           ("hot-plug monitor", self.hotplug),
                           ("auto-bind", self.autobind), ("metrics listener", self.tcp)):
            if part is not None:
                self.stopping = name
                part.stop()
        # moving pages stop before their next chunk; their marks stay in the state file
        self.stopping = "memory moves"
        self.daemon.close()
        self.stopping = "isolation"
        self.daemon.stop_isolation()
        self.stopping = "state file"
        self.daemon.commit()
        self.stopping = None
        self._unlink_socket()
        log.info("ascendbind stopped; bindings left in place", workers=len(self.daemon.reader))

    def stop_within(self, seconds: float) -> bool:
        """stop(), for at most ``seconds``: False (and logged) when a part was still waiting."""
        t = threading.Thread(target=self.stop, name="stop", daemon=True)
        t.start()
        t.join(seconds)
        if not t.is_alive():
            return True
        saved = self.daemon.commit(timeout=0.2)
        self._unlink_socket()
        log.error("stop did not finish in time; exiting anyway, bindings left in place", seconds=seconds,
                  waiting_for=self.stopping, state_saved=saved, workers=len(self.daemon.reader))
        return False

    def _unlink_socket(self) -> None:
        if self.owned_path:
            _unlink_if_socket(self.owned_path)


def ensure_fd_budget(needed: int) -> int:
    """Make the soft RLIMIT_NOFILE at least ``needed`` where the hard limit allows; returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
        if soft < needed:
            log.warning("open-file limit below the daemon's budget; raise LimitNOFILE", limit=soft, needed=needed)
    return soft


def _pid() -> int:
    return os.getpid()


def _unlink_if_socket(path: str) -> None:
    import stat

    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


def _signal_wakeup() -> int:
    """A pipe the C-level signal handler writes to, whichever thread the kernel gave the
    signal to; its read end. A signal taken by another thread only flags the main thread,
    which would not notice while it sleeps on a lock: so the main loop sleeps on this."""
    rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    return rfd


def _next_event(events: queue.SimpleQueue, wake: int) -> str:
    """The next event a signal handler queued. Between two looks the main thread waits on
    the wake-up pipe; the handler itself runs in this thread as soon as that returns."""
    while True:
        try:
            return events.get_nowait()
        except queue.Empty:
            pass
        select.select([wake], [], [], 5.0)
        with contextlib.suppress(OSError):
            os.read(wake, 512)


def serve(config: Config, *, reload=None) -> int:
    """Run until SIGTERM/SIGINT; ``reload()`` returns a fresh Config on SIGHUP."""
    allow_commands()  # a process that served before (tests) starts tools again
    svc = _Service(config, reload or (lambda: config))
    for sig, what in ((signal.SIGTERM, "stop"), (signal.SIGINT, "stop"), (signal.SIGHUP, "hup")):
        signal.signal(sig, lambda _s, _f, what=what: svc.events.put(what))
    wake = _signal_wakeup()
    try:
        svc.start()
    except OSError as exc:
        where = str(exc.filename or "")
        if where and (where == config.state_dir or where.startswith(config.state_dir.rstrip("/") + "/")):
            raise ConfigError(f"cannot use state_dir {config.state_dir}: {exc.strerror or exc}") from None
        raise ConfigError(f"could not start: {exc.strerror or exc} ({where or '-'})") from None
    while True:
        event = _next_event(svc.events, wake)
        if event == "hup":
            systemd.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
            svc.reload()
            systemd.notify("READY=1", "STATUS=serving (config reloaded)")
            continue
        break
    svc.stop_within(STOP_SECONDS)
    return 0


def _stop_points(daemon: Daemon, points: str) -> None:
    """Tests only (``ASCENDBIND_TEST_STOP_AT``, a comma list of points): the daemon stops
    itself (SIGSTOP) in every bind right after its in-flight record, before its first write
    (``record``), after the task masks, before the IRQ masks (``irq``), or after the IRQ
    masks, before the bind's record is final (``written``), so that a test kills it exactly
    there."""
    def stop(*_args) -> None:
        # sent to this thread: it stops before its next instruction; sent to the process, the
        # kernel may hand it to another thread, and this one writes on until that one stops
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    names = {p.strip() for p in points.split(",") if p.strip()}
    unknown = names - {"record", "irq", "written"}
    if unknown:
        raise ConfigError(f"ASCENDBIND_TEST_STOP_AT: unknown point(s) {', '.join(sorted(unknown))}; "
                          "known: record, irq, written")
    if "record" in names:
        daemon.before_writes = stop
    steps = {step for name, step in (("irq", Step.IRQ), ("written", Step.MEMORY)) if name in names}
    if steps:
        daemon.among_writes = lambda _pid, step: stop() if step in steps else None
