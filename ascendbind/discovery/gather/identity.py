"""Process identity: a pid plus its start time, so a recycled pid is never bound.

A pid alone names a process only until it exits; the kernel hands the number to
the next fork once the pid space wraps. The start time (field 22 of
``/proc/<pid>/stat``) counts clock ticks since boot (100 a second), so (pid,
start time) tells apart every two holders of one number but those forked in the
same tick: a worker that exits in the tick it was born in leaves its number to a
newcomer with its very start time. A pidfd (pin.py) has no such blind spot, so
wherever one is held it decides (``verify_identity(pin=...)``), and a process
known only from a state file is compared by its pidfs inode too
(``pin_identity``). A zombie has no threads left to bind and no memory to
migrate: it counts as gone.

The reads are process.py's (one observation of a process through one open
``/proc/<pid>`` directory, so its files describe one process); this module holds
the checks made on what was read, which the applier, the daemon and the command
line share: is the process live, is it still the one we mean, may it be bound.

Never a worker (``ProcessIdentity.not_a_worker``): pid 1 of our pid namespace,
kernel threads (``PF_KTHREAD``) and the binding process itself. Pinning init or
a per-CPU kernel thread to one NPU's CPUs stalls the host; pinning ourselves
starves the daemon.
"""

from __future__ import annotations

import os

from ..read.pin import LIVE_PROC, ProcessPin, open_pin
from .process import read_identity, stat_of, status_field
from ...errors import NotPermitted, ProcessGone
from ...values.model import ProcessIdentity

__all__ = ["start_time", "proc_state", "verify_identity", "pin_identity", "check_may_bind", "may_bind",
           "require_identity", "require_live", "require_worker", "refuse_non_worker", "recycled", "GONE_STATES"]

CAP_SYS_NICE = 23
GONE_STATES = ("Z", "X", "x")


def refuse_non_worker(identity: ProcessIdentity, binder_pid: int | None = None) -> None:
    """NotPermitted (``not_a_worker``) for pid 1, a kernel thread or the binding process."""
    why = identity.not_a_worker(os.getpid() if binder_pid is None else binder_pid)
    if why is not None:
        raise NotPermitted(f"{why}: ascendbind never binds it", code="not_a_worker")


def require_live(identity: ProcessIdentity | None, pid: int) -> ProcessIdentity:
    """``identity`` when it names a live process; ProcessGone (``pid_gone``) when it is None
    (no such process) or a zombie (no threads left to bind, no memory to migrate)."""
    if identity is None or identity.state in GONE_STATES:
        what = "is a zombie" if identity is not None else "does not exist"
        raise ProcessGone(f"process {pid} {what}", code="pid_gone")
    return identity


def require_identity(pid: int, proc_root: str = "/proc") -> ProcessIdentity:
    """The identity of live process ``pid``; ProcessGone when it is absent or a zombie."""
    return require_live(read_identity(pid, proc_root), pid)


def require_worker(pid: int, proc_root: str = "/proc", *, binder_pid: int | None = None) -> ProcessIdentity:
    """``require_identity``, and NotPermitted (``not_a_worker``) for a process ascendbind never binds."""
    identity = require_identity(pid, proc_root)
    refuse_non_worker(identity, binder_pid)
    return identity


def start_time(pid: int, proc_root: str = "/proc") -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None when there is no such pid."""
    st = stat_of(pid, proc_root)
    return None if st is None else st[1]


def proc_state(pid: int, proc_root: str = "/proc") -> str | None:
    """The one-letter state of ``pid`` (R, S, D, Z, …), or None when absent."""
    st = stat_of(pid, proc_root)
    return None if st is None else st[0]


def verify_identity(pid: int, expected_start: int | None, proc_root: str = "/proc", *,
                    pin: ProcessPin | None = None) -> int:
    """Return the current start time of ``pid`` if it is still the process we mean.

    Raises ProcessGone with code ``pid_gone`` (absent, zombie or dead) or
    ``pid_recycled`` (alive, but started at another time than ``expected_start``).
    ``expected_start`` None checks only that the pid is alive. With ``pin`` (the
    process held by its pidfd), the pidfd decides: once it says exited, the number
    names a newcomer (``pid_recycled``) whatever its start time, even one started in
    the same clock tick; read after the stat, a pidfd that has not exited proves
    that stat was this process's.
    """
    st = stat_of(pid, proc_root)
    if st is None or st[0] in GONE_STATES:
        what = "is a zombie" if st is not None else "does not exist"
        raise ProcessGone(f"process {pid} {what}", code="pid_gone")
    if expected_start is not None and st[1] != expected_start:
        raise recycled(pid, st[1], expected_start)
    if pin is not None and pin.exited():
        raise ProcessGone(f"pid {pid} was recycled: the process held by its pidfd has exited, and the "
                          f"number now names another one (started at tick {st[1]})", code="pid_recycled")
    return st[1]


def pin_identity(pid: int, expected_start: int | None, ino: int | None = None,
                 proc_root: str = "/proc") -> ProcessPin | None:
    """A pin of ``pid`` proven to be the process (``expected_start``, ``ino``) names, for a
    worker known only by those (a restarted daemon's state file): the pidfd is opened
    first, then the start time read (``verify_identity``) and, where pidfs gives the
    pidfd an inode unique to its process and ``ino`` was recorded, that inode compared:
    two processes forked in the same clock tick differ there and nowhere in their stat.
    None where no pidfd can be had (another ``proc_root``, an old kernel); then the start
    time alone was checked. ProcessGone as ``verify_identity``."""
    held = open_pin(pid) if proc_root == LIVE_PROC else None
    try:
        verify_identity(pid, expected_start, proc_root, pin=held)
        now = held.ino if held is not None and ino is not None else None
        if now is not None and now != ino:
            raise ProcessGone(f"pid {pid} was recycled: its pidfd inode is {now}, not {ino}, though it "
                              f"started in the same clock tick", code="pid_recycled")
    except BaseException:
        if held is not None:
            held.close()
        raise
    return held


def recycled(pid: int, now: int, expected: int) -> ProcessGone:
    """The ``pid_recycled`` error: ``pid`` names a process started at ``now``, not ``expected``."""
    return ProcessGone(
        f"pid {pid} was recycled: it now belongs to a process started at tick {now}, not {expected}",
        code="pid_recycled",
    )


def may_bind(target_uids: tuple[int, ...], cap_eff: str | None, euid: int) -> bool:
    """Whether a caller with effective capabilities ``cap_eff`` (hex, as /proc prints
    them) and effective uid ``euid`` may set the affinity of a task with ``target_uids``.

    The kernel allows sched_setaffinity on another task when the caller's
    effective uid is the target's real or effective uid, or with CAP_SYS_NICE.
    """
    try:
        if cap_eff is not None and int(cap_eff, 16) >> CAP_SYS_NICE & 1:
            return True
    except ValueError:
        pass
    return len(target_uids) >= 2 and euid in (target_uids[0], target_uids[1])


def check_may_bind(pid: int | ProcessIdentity, proc_root: str = "/proc") -> None:
    """Raise NotPermitted unless this process may set the affinity of ``pid`` (a pid, or
    the identity already read for it, whose uids are then used as they were read).

    Checking first means a refused caller changes nothing, instead of failing
    thread by thread half-way through.
    """
    if isinstance(pid, ProcessIdentity):
        uids, pid = pid.uids, pid.pid
    else:
        text = status_field(pid, "Uid", proc_root) or ""
        try:
            uids = tuple(int(u) for u in text.split())
        except ValueError:
            uids = ()
    euid = os.geteuid()
    if may_bind(uids, status_field("self", "CapEff", proc_root), euid):
        return
    owner = uids[0] if uids else "unknown"
    raise NotPermitted(
        f"may not bind pid {pid}: it belongs to uid {owner}, and this process (uid {euid}) "
        "lacks CAP_SYS_NICE; run as root or ask the ascendbind daemon"
    )
