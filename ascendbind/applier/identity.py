"""Process identity: a pid plus its start time, so a recycled pid is never bound.

A pid alone names a process only until it exits; the kernel hands the number to
the next fork once the pid space wraps. The start time (field 22 of
``/proc/<pid>/stat``, clock ticks since boot) never repeats for one pid number
within a boot, so (pid, start time) is an identity. A zombie has no threads left
to bind and no memory to migrate: it counts as gone.

``read_identity`` reads ``stat`` and ``status`` through one open
``/proc/<pid>`` directory: that directory stands for the task it was opened on,
so once that task is reaped, reads through it fail instead of describing a
process that reused the number. The two files therefore describe one process.

Never a worker (``ProcessIdentity.not_a_worker``): pid 1 of our pid namespace,
kernel threads (``PF_KTHREAD``) and the binding process itself. Pinning init or
a per-CPU kernel thread to one NPU's CPUs stalls the host; pinning ourselves
starves the daemon.
"""

from __future__ import annotations

import os

from ..discovery.procfs import parse_stat, parse_status
from ..errors import NotPermitted, ParseError, ProcessGone
from ..model import ProcessIdentity

__all__ = ["start_time", "proc_state", "verify_identity", "check_may_bind", "read_identity", "require_identity", "require_worker",
           "refuse_non_worker", "recycled"]

CAP_SYS_NICE = 23
_GONE_STATES = ("Z", "X", "x")


def _read_at(dir_fd: int | None, path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return os.read(fd, 16384).decode("utf-8", "replace")
    except OSError:
        # ESRCH: the task exited between open and read
        return None
    finally:
        os.close(fd)


def _read_stat(pid: int, proc_root: str) -> tuple[str, int] | None:
    """(state letter, start time) from /proc/<pid>/stat, or None when the pid is absent."""
    text = _read_at(None, f"{proc_root}/{pid}/stat")
    if text is None:
        return None
    try:
        st = parse_stat(text, f"{proc_root}/{pid}/stat")
    except ParseError:
        return None
    return st.state, st.start_time


def read_identity(pid: int, proc_root: str = "/proc") -> ProcessIdentity | None:
    """``pid``'s identity from one read of its stat and status, or None when it is absent."""
    try:
        dir_fd = os.open(f"{proc_root}/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        stat_text, status_text = _read_at(dir_fd, "stat"), _read_at(dir_fd, "status")
    finally:
        os.close(dir_fd)
    if stat_text is None:
        return None
    try:
        st = parse_stat(stat_text, f"{proc_root}/{pid}/stat")
        status = parse_status(status_text, f"{proc_root}/{pid}/status") if status_text else None
    except ParseError:
        return None
    return ProcessIdentity(
        pid=pid,
        start_time=st.start_time,
        tgid=status.tgid if status is not None and status.tgid is not None else pid,
        ppid=st.ppid,
        state=st.state,
        is_kthread=st.is_kthread,
        uids=status.uids if status is not None else (),
        comm=st.comm,
    )


def refuse_non_worker(identity: ProcessIdentity, binder_pid: int | None = None) -> None:
    """NotPermitted (``not_a_worker``) for pid 1, a kernel thread or the binding process."""
    why = identity.not_a_worker(os.getpid() if binder_pid is None else binder_pid)
    if why is not None:
        raise NotPermitted(f"{why}: ascendbind never binds it", code="not_a_worker")


def require_identity(pid: int, proc_root: str = "/proc") -> ProcessIdentity:
    """The identity of live process ``pid``; ProcessGone when it is absent or a zombie."""
    identity = read_identity(pid, proc_root)
    if identity is None or identity.state in _GONE_STATES:
        what = "is a zombie" if identity is not None else "does not exist"
        raise ProcessGone(f"process {pid} {what}", code="pid_gone")
    return identity


def require_worker(pid: int, proc_root: str = "/proc", *, binder_pid: int | None = None) -> ProcessIdentity:
    """``require_identity``, and NotPermitted (``not_a_worker``) for a process ascendbind never binds."""
    identity = require_identity(pid, proc_root)
    refuse_non_worker(identity, binder_pid)
    return identity


def start_time(pid: int, proc_root: str = "/proc") -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None when there is no such pid."""
    st = _read_stat(pid, proc_root)
    return None if st is None else st[1]


def proc_state(pid: int, proc_root: str = "/proc") -> str | None:
    """The one-letter state of ``pid`` (R, S, D, Z, …), or None when absent."""
    st = _read_stat(pid, proc_root)
    return None if st is None else st[0]


def verify_identity(pid: int, expected_start: int | None, proc_root: str = "/proc") -> int:
    """Return the current start time of ``pid`` if it is still the process we mean.

    Raises ProcessGone with code ``pid_gone`` (absent, zombie or dead) or
    ``pid_recycled`` (alive, but started at another time than ``expected_start``).
    ``expected_start`` None checks only that the pid is alive.
    """
    st = _read_stat(pid, proc_root)
    if st is None or st[0] in _GONE_STATES:
        what = "is a zombie" if st is not None else "does not exist"
        raise ProcessGone(f"process {pid} {what}", code="pid_gone")
    if expected_start is not None and st[1] != expected_start:
        raise recycled(pid, st[1], expected_start)
    return st[1]


def recycled(pid: int, now: int, expected: int) -> ProcessGone:
    """The ``pid_recycled`` error: ``pid`` names a process started at ``now``, not ``expected``."""
    return ProcessGone(
        f"pid {pid} was recycled: it now belongs to a process started at tick {now}, not {expected}",
        code="pid_recycled",
    )


def _status_field(pid: int | str, name: str, proc_root: str) -> str | None:
    try:
        with open(f"{proc_root}/{pid}/status", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key == name:
                    return value.strip()
    except OSError:
        return None
    return None


def check_may_bind(pid: int, proc_root: str = "/proc") -> None:
    """Raise NotPermitted unless this process may set ``pid``'s affinity.

    The kernel allows sched_setaffinity on another task when the caller's
    effective uid is the target's real or effective uid, or with CAP_SYS_NICE.
    Checking first means a refused caller changes nothing, instead of failing
    thread by thread half-way through.
    """
    cap_eff = _status_field("self", "CapEff", proc_root)
    try:
        if cap_eff is not None and int(cap_eff, 16) >> CAP_SYS_NICE & 1:
            return
    except ValueError:
        pass
    uids = (_status_field(pid, "Uid", proc_root) or "").split()
    euid = os.geteuid()
    if len(uids) >= 2 and euid in (int(uids[0]), int(uids[1])):
        return
    owner = uids[0] if uids else "unknown"
    raise NotPermitted(
        f"may not bind pid {pid}: it belongs to uid {owner}, and this process (uid {euid}) "
        "lacks CAP_SYS_NICE; run as root or ask the ascendbind daemon"
    )
