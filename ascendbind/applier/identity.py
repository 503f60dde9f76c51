"""Process identity: a pid plus its start time, so a recycled pid is never bound.

A pid alone names a process only until it exits; the kernel hands the number to
the next fork once the pid space wraps. The start time (field 22 of
``/proc/<pid>/stat``, clock ticks since boot) never repeats for one pid number
within a boot, so (pid, start time) is an identity. A zombie has no threads left
to bind and no memory to migrate: it counts as gone.
"""

from __future__ import annotations

import os

from ..errors import NotPermitted, ProcessGone

__all__ = ["start_time", "proc_state", "verify_identity", "check_may_bind"]

CAP_SYS_NICE = 23


def _read_stat(pid: int, proc_root: str) -> tuple[str, int] | None:
    """(state letter, start time) from /proc/<pid>/stat, or None when the pid is absent."""
    try:
        fd = os.open(f"{proc_root}/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096)
    except OSError:
        # ESRCH: the task exited between open and read
        return None
    finally:
        os.close(fd)
    text = raw.decode("utf-8", "replace")
    # comm (field 2) may hold spaces and ')' itself: split at the LAST ')'
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 20:
        return None
    try:
        # fields[0] is field 3 (state); field 22 (starttime) is fields[19]
        return fields[0], int(fields[19])
    except ValueError:
        return None


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
    if st is None or st[0] in ("Z", "X", "x"):
        what = "is a zombie" if st is not None else "does not exist"
        raise ProcessGone(f"process {pid} {what}", code="pid_gone")
    if expected_start is not None and st[1] != expected_start:
        raise ProcessGone(
            f"pid {pid} was recycled: it now belongs to a process started at tick {st[1]}, "
            f"not {expected_start}",
            code="pid_recycled",
        )
    return st[1]


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
