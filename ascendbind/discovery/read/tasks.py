"""A live process's threads and the little the daemon reads of them between binds:
the thread count, the task list, a thread's ``comm``, the environment, the command
line and the parent, and a pidfd that says when the process has exited.

Every reader takes ``proc_root`` and answers None (or empty) for a process or
thread that is gone or unreadable: between two looks anything may exit, and
that is news for the caller, not an error. Reads are bounded and use
``os.open``/``os.read`` (no buffering, no decoding surprises); the environment and
the command line, copied out of the process's memory, are read on deadline.py's
readers, and one that does not answer in time reads as unreadable.

Kernel facts these rely on:

* ``stat()`` of ``/proc/<pid>/task`` reports ``nlink`` = threads + 2, counted by
  the kernel in O(1); ``/proc/<pid>/stat`` instead sums every thread's CPU
  times and faults, so reading it walks all the threads' task structs.
* A pidfd (``pidfd_open``) polls readable once the process has exited, and
  keeps naming that process even after its pid is handed to another: holding
  one makes "is it still there?" one ``poll`` for all workers, where reading
  each worker's start time walks its threads.
"""

from __future__ import annotations

import os
import select
from collections.abc import Iterable

from ...values.digits import is_ascii_digits
from ...errors import DiscoveryError
from .bounded import read_bounded
from .deadline import READERS
from ..parse.procfs import ENVIRON_LIMIT, cut_environ, parse_environ, real_uid

__all__ = ["thread_count", "list_tids", "task_comm", "read_environ", "read_cmdline", "parent_pid",
           "pid_namespace", "open_pidfd", "exited_pidfds", "CMDLINE_LIMIT"]

CMDLINE_LIMIT = 1 << 16


def thread_count(pid: int, proc_root: str = "/proc") -> int | None:
    """How many threads ``pid`` has (from the task directory's link count); None when gone."""
    try:
        return os.stat(f"{proc_root}/{pid}/task").st_nlink - 2
    except OSError:
        return None


def list_tids(pid: int, proc_root: str = "/proc") -> list[int] | None:
    """The thread ids of ``pid``; None when its task list cannot be read (gone)."""
    try:
        names = os.listdir(f"{proc_root}/{pid}/task")
    except OSError:
        return None
    return [int(n) for n in names if is_ascii_digits(n)]


def task_comm(pid: int, tid: int, proc_root: str = "/proc") -> str | None:
    """Thread ``tid``'s name, read under ``pid`` (None when it is not, or no longer, a thread of ``pid``)."""
    text = read_bounded(f"{proc_root}/{pid}/task/{tid}/comm", 64, single=True)
    return None if text is None else text.rstrip("\n")


def _read_memory_file(pid: int, name: str, proc_root: str, limit: int) -> bytes | None:
    """``/proc/<pid>/<name>`` (environ, cmdline), on the readers: None when unreadable or
    when it did not answer in time."""
    status = read_bounded(f"{proc_root}/{pid}/status", 4096, single=True)
    owner = None if status is None else real_uid(status)
    try:
        path = f"{proc_root}/{pid}/{name}"
        return READERS.read(name, path, lambda: read_bounded(path, limit, binary=True), worker=pid, owner=owner)
    except DiscoveryError:
        return None


def read_environ(pid: int, proc_root: str = "/proc", limit: int = ENVIRON_LIMIT) -> dict[str, str]:
    """``pid``'s environment (getenv's view: the first entry of a key), from the complete
    entries within its first ``limit`` bytes; {} when unreadable."""
    raw = _read_memory_file(pid, "environ", proc_root, limit)
    return parse_environ(cut_environ(raw.decode("utf-8", "replace"), limit)[0]) if raw else {}


def read_cmdline(pid: int, proc_root: str = "/proc", limit: int = CMDLINE_LIMIT) -> bytes:
    """``pid``'s raw command line (NUL-separated), its first ``limit`` bytes; b"" when unreadable."""
    return (_read_memory_file(pid, "cmdline", proc_root, limit) or b"")[:limit]


def pid_namespace(pid: int, proc_root: str = "/proc") -> str | None:
    """``pid``'s PID namespace (``pid:[inode]``, the link ``/proc/<pid>/ns/pid``); None when gone."""
    try:
        return os.readlink(f"{proc_root}/{pid}/ns/pid")
    except OSError:
        return None


def parent_pid(pid: int, proc_root: str = "/proc") -> int | None:
    """``pid``'s parent (field 4 of its stat, counted from the last ``)``); None when unreadable."""
    text = read_bounded(f"{proc_root}/{pid}/stat", 4096, single=True)
    if text is None:
        return None
    rest = text[text.rfind(")") + 1:].split()
    try:
        return int(rest[1])
    except (IndexError, ValueError):
        return None


def open_pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (close-on-exec), or None where the kernel or the fd budget
    has none to give. The caller checks afterwards that ``pid`` is still the process it
    means (start time): a pidfd opened after a recycle names the newcomer."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:
        return None


def exited_pidfds(fds: Iterable[int]) -> set[int]:
    """Of ``fds`` (pidfds), those whose process has exited: one poll, no waiting."""
    poller = select.poll()
    fds = list(fds)
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(0)} if fds else set()
