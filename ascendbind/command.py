"""Run an external tool (npu-smi, lscpu, ps, migratepages, systemctl): argv, no shell, a timeout.

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

Retries: a spawn that fails with EAGAIN (fork hit a process or memory limit),
EBUSY or ETXTBSY (the binary is being replaced) is tried again a few times;
those clear by themselves. A timeout is never retried here: a command that
hung once is likely to hang again, and the caller decides what a timeout
costs (the daemon caches the failure and backs off).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence

from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

__all__ = ["run_command", "tool_env", "TRANSIENT_SPAWN_ERRNOS", "SPAWN_ATTEMPTS"]

TRANSIENT_SPAWN_ERRNOS = frozenset({errno.EAGAIN, errno.EBUSY, errno.ETXTBSY})
SPAWN_ATTEMPTS = 3
# after SIGKILL to the group, how long to wait for the pipes to close (only a
# descendant that left the group can hold them open longer)
_REAP_GRACE = 2.0


def tool_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every tool runs with: C locale (parsers read English
    headers and '.' decimals), the daemon's PATH, nothing else unless asked."""
    env = {"LC_ALL": "C", "LANG": "C", "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
    env.update(extra or {})
    return env


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
    process group, and OSError when it cannot start (after the transient
    retries). A non-zero exit status is returned, not raised.
    """
    proc = _spawn(argv, tool_env() if env is None else env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        # timeout, or KeyboardInterrupt / SystemExit while waiting: leave nothing behind
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
