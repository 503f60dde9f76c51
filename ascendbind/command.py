"""Run an external tool (npu-smi, lscpu, ps, systemctl): argv, no shell, a timeout.

Why a process group: a tool that hangs is rarely alone. ``npu-smi`` forks
helpers that talk to the driver, and a shell wrapper forks the real binary;
``subprocess.run(timeout=)`` kills only the direct child, so every timeout used
to leave its descendants running (and holding our pipes open). Here each
command starts in a session of its own (its pid is the process-group id), and
on a timeout the whole group gets SIGKILL before the leader is reaped; while
the leader is unreaped its pid cannot be reused, so the kill cannot hit a
stranger's group.

A descendant that calls ``setsid()`` itself escapes the group; reaping does not
wait for it (the pipes are closed after a short grace), so it costs us nothing
but is not killed either: only a cgroup could catch that.

Shutdown: ``stop_commands()`` (the daemon calls it first thing on SIGTERM and
SIGINT) refuses every later command and SIGKILLs the group of every command
still running, then waits until each one's caller has reaped its leader.
Without it a tool that is hanging when the daemon stops would outlive it: its
own session puts it out of reach of a signal sent to the daemon's process
group, and only systemd's ``KillMode=`` would catch it, not a shell, a
container entry point or a test harness.

Retries: a spawn that fails with EAGAIN (fork hit a process or memory limit),
EBUSY or ETXTBSY (the binary is being replaced) is tried again a few times;
those clear by themselves. A timeout is never retried here: a command that
hung once is likely to hang again, and the caller decides what a timeout
costs (the daemon caches the failure and backs off).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

__all__ = ["run_command", "tool_env", "stop_commands", "allow_commands", "CommandsStopped",
           "sigterm_kills_tools", "TRANSIENT_SPAWN_ERRNOS", "SPAWN_ATTEMPTS"]

TRANSIENT_SPAWN_ERRNOS = frozenset({errno.EAGAIN, errno.EBUSY, errno.ETXTBSY})
SPAWN_ATTEMPTS = 3
# after SIGKILL to the group, how long to wait for the pipes to close (only a
# descendant that left the group can hold them open longer)
_REAP_GRACE = 2.0


class CommandsStopped(OSError):
    """The process is stopping: a command was refused, or killed while it ran."""

    def __init__(self, argv0: str, killed: bool) -> None:
        what = "killed" if killed else "not started"
        super().__init__(errno.ESHUTDOWN, f"{what} because the daemon is stopping")
        self.filename = argv0
        self.killed = killed


class _Running:
    """The commands running now, and whether new ones may start.

    A spawn happens under the lock, so a command is either refused or
    registered before ``stop`` reads the set: none can slip in between.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.procs: set[subprocess.Popen] = set()
        self.stopping = False

    def spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
        with self.cond:
            if self.stopping:
                raise CommandsStopped(str(argv[0]), killed=False)
            proc = _spawn(argv, env)
            self.procs.add(proc)
            return proc

    def done(self, proc: subprocess.Popen) -> bool:
        """Forget a reaped command; True when ``stop`` killed it."""
        with self.cond:
            self.procs.discard(proc)
            self.cond.notify_all()
            return self.stopping

    def stop(self, timeout: float) -> list[int]:
        with self.cond:
            self.stopping = True
            groups = sorted(p.pid for p in self.procs)
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + timeout
        with self.cond:
            # each caller's communicate() sees its pipes close and reaps its leader;
            # until then the leader's pid (our group id) cannot be reused
            while self.procs and self.cond.wait(max(0.0, deadline - time.monotonic())):
                pass
            return sorted(p.pid for p in self.procs)

    def reset(self) -> None:
        with self.cond:
            self.stopping = False


_running = _Running()


def stop_commands(timeout: float = _REAP_GRACE + 3.0) -> list[int]:
    """Refuse new commands; SIGKILL the process group of every running one and wait
    up to ``timeout`` seconds until each is reaped. Returns the group ids still
    unreaped then (empty when every one was). Idempotent."""
    return _running.stop(timeout)


def allow_commands() -> None:
    """Undo ``stop_commands`` (for a process that runs a daemon more than once, as tests do)."""
    _running.reset()


def tool_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every tool runs with: C locale (parsers read English
    headers and '.' decimals), the daemon's PATH, nothing else unless asked."""
    env = {"LC_ALL": "C", "LANG": "C", "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
    env.update(extra or {})
    return env


class _Terminated(BaseException):
    """SIGTERM arrived while a one-shot command line ran (see sigterm_kills_tools)."""


def _raise_terminated(_signum, _frame) -> None:
    raise _Terminated


@contextlib.contextmanager
def sigterm_kills_tools() -> Iterator[None]:
    """For a one-shot command line (``plan``, ``apply``, ``snapshot``): SIGTERM
    unwinds the main thread, so a tool it waits for has its group killed on the
    way (``run_command``), and then this process dies of SIGTERM as it would
    have without the handler. Off the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise  # not reached: the default action ends the process
    finally:
        signal.signal(signal.SIGTERM, previous)


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_SPAWN_ERRNOS


@retry(
    retry=retry_if_exception(_transient),
    stop=stop_after_attempt(SPAWN_ATTEMPTS),
    wait=wait_exponential(multiplier=0.05, max=0.5),
    reraise=True,
)
def _spawn(argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env),
        text=True,
        errors="replace",
        start_new_session=True,
    )


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the command's group, then reap the leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=_REAP_GRACE)
    except subprocess.TimeoutExpired:
        # a descendant that left the group still holds a pipe: stop reading
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()


def run_command(
    argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``argv`` (argv[0] an executable path) and capture its text output.

    Raises ``subprocess.TimeoutExpired`` after killing the command's whole
    process group, OSError when it cannot start (after the transient
    retries), and ``CommandsStopped`` (an OSError) once ``stop_commands`` has
    been called, for a command it killed or one asked for afterwards. A
    non-zero exit status is returned, not raised.
    """
    proc = _running.spawn(argv, tool_env() if env is None else env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        # timeout, or KeyboardInterrupt / SystemExit while waiting: leave nothing behind
        _kill_group(proc)
        _running.done(proc)
        raise
    if _running.done(proc) and proc.returncode < 0:
        raise CommandsStopped(str(argv[0]), killed=True)
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
