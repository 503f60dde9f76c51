"""A process held while it is acted on: its pidfd, and for one request its open ``/proc/<pid>``.

A pid names a process only until that process is reaped; the next fork may get
the number, and its threads the numbers of the old one's threads. A request
that observes a worker and writes its threads' masks a few milliseconds later
must know, after writing, that every write reached that worker.

Kernel facts this module is built on:

* ``pidfd_open(pid)`` names the process that holds ``pid`` at that moment for
  as long as the descriptor is open, and polls readable (``POLLIN``) once that
  whole process has exited (every thread: a zombie, or reaped), even after the
  number went to another process.
* An open ``/proc/<pid>`` directory stands for its process too: once that
  process is reaped, every read through it fails (ESRCH).
* So a pidfd opened while that directory is open, then a read through the
  directory that succeeds, name one process: it held the number the whole time.
  ``observe_process(pin=True)`` opens the pidfd exactly there, before the
  ``stat`` that the request authorizes; the pidfd is then the process that was
  authorized, with no start time compared. A pidfd opened from a number alone
  (a restarted daemon's state file) is proven by what is read after it.
* The start time in ``/proc/<pid>/stat`` counts clock ticks (``USER_HZ``, 100
  a second): a newcomer forked in the tick its predecessor was born in has the
  same one and passes any start-time check. A pidfd has no such blind spot.
* With pidfs (Linux 6.9), a pidfd's inode number is unique to its process for
  the whole boot and never reused; before it, every pidfd shares one anonymous
  inode. Where it is unique (``ino``) it is what a state file keeps beside the
  start time, and a restarted daemon compares it.
* ``sched_setaffinity`` takes a thread id, never a descriptor: a write by tid
  is checked afterwards (``tids``: is it still a task of this process?).

Pins exist only on the live host with ``/proc`` at its usual place (a pidfd
of a pid read under another ``proc_root`` would name an unrelated process).
A pin is closed by whoever opened it (``close``, or ``with``); ``keep`` hands
a copy of its pidfd to a record that outlives the request.
"""

from __future__ import annotations

import functools
import os
import select
import threading
import warnings

from ...eventfd import EFD_CLOEXEC, eventfd
from .procdir import ProcDir
from .tasks import list_tids, open_pidfd, task_comm

__all__ = ["ProcessPin", "open_pin", "pin_observed", "pidfs_unique"]

LIVE_PROC = "/proc"


@functools.cache
def pidfs_unique() -> bool:
    """Whether pidfds carry an inode number unique to their process (pidfs): on older
    kernels a pidfd's (device, inode) is the one anonymous inode an eventfd has too."""
    fd = open_pidfd(os.getpid())
    if fd is None:
        return False
    try:
        ev = eventfd(0, EFD_CLOEXEC)
    except OSError:
        os.close(fd)
        return False
    try:
        a, b = os.fstat(fd), os.fstat(ev)
        return (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino)
    finally:
        os.close(fd)
        os.close(ev)


class ProcessPin:
    """One process by its pidfd (``fd``), and while a request runs its ``/proc/<pid>``
    directory. Thread-safe: a pin closed by one thread reads as exited to the others,
    never as another descriptor that reused the number."""

    def __init__(self, pid: int, fd: int, proc_dir: ProcDir | None = None) -> None:
        self.pid = pid
        self._fd = fd
        self._dir = proc_dir
        self._lock = threading.Lock()
        # every tid the last ``new_tasks`` listed, seen or not: a listing made after a bind's
        # writes confirms them without listing again (``tids``)
        self.listed: frozenset[int] = frozenset()

    def __repr__(self) -> str:
        return f"ProcessPin(pid={self.pid}, fd={self._fd}, dir={self._dir is not None})"

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def fileno(self) -> int:
        """The pidfd itself (-1 once closed), for a ``poll`` over many; it stays this pin's."""
        return self._fd

    def exited(self) -> bool:
        """Whether the process has exited (a zombie counts), or this pin is closed."""
        with self._lock:
            if self._fd < 0:
                return True
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            return bool(poller.poll(0))

    @property
    def ino(self) -> int | None:
        """The pidfd's inode number where it is unique to the process (pidfs), else None."""
        if not pidfs_unique():
            return None
        with self._lock:
            return None if self._fd < 0 else os.fstat(self._fd).st_ino

    def tids(self, listed: frozenset[int] | None = None) -> frozenset[int] | None:
        """The thread ids the process has now, or None once it has exited. Listed through
        the pinned directory when the pin has one, else by path, and then the pidfd says
        the number was still this process's after the listing. ``listed``: a listing made
        by ``new_tasks`` since the moment that matters, used instead of listing again."""
        if listed is not None:
            tids = listed
        elif self._dir is None:
            tids = list_tids(self.pid)
        else:
            names = self._dir.listdir("task")
            tids = None if names is None else [int(n) for n in names if n.isdigit()]
        if tids is None or self.exited():
            return None
        return frozenset(tids)

    def listing(self, listed: frozenset[int] | None = None) -> tuple[frozenset[int] | None, bool]:
        """(the thread ids that are this process's, whether it has exited): through the
        pinned directory, its tasks even once it has exited (a zombie's leader is still
        its own) until it is reaped (None); by path, None once it has exited (the number
        may name another process by then). ``listed``: as for ``tids``."""
        if self._dir is None:
            tids = self.tids(listed)
            return tids, tids is None
        if listed is None:
            names = self._dir.listdir("task")
            listed = None if names is None else frozenset(int(n) for n in names if n.isdigit())
        return listed, self.exited()

    def new_tasks(self, seen: set[str]) -> list[tuple[str, str | None]] | None:
        """(tid, comm) of the threads not in ``seen`` (discovery's ``new_tasks``), read
        through the pinned directory; None once the process is gone. Without a directory:
        by path, and None when the pidfd says the number may name another process now."""
        if self._dir is None:
            tids = list_tids(self.pid)
            if tids is None:
                return None
            found = [(str(t), task_comm(self.pid, t)) for t in tids if str(t) not in seen]
            self.listed = frozenset(tids)
            return None if self.exited() else found
        names = self._dir.listdir("task")
        if names is None:
            return None
        self.listed = frozenset(int(n) for n in names if n.isdigit())
        read = getattr(self._dir, "read_small", None) or self._dir.read
        out: list[tuple[str, str | None]] = []
        for name in names:
            if name not in seen:
                comm = read(f"task/{name}/comm", 64)
                out.append((name, None if comm is None else comm.rstrip("\n")))
        return out

    def dup_fd(self) -> int | None:
        """A descriptor of its own for the same process (the caller closes it); None once closed."""
        with self._lock:
            return None if self._fd < 0 else os.dup(self._fd)

    def keep(self) -> ProcessPin | None:
        """A pin of the same process without the directory, for a record that outlives the
        request (its own pidfd); None once this one is closed."""
        fd = self.dup_fd()
        return None if fd is None else ProcessPin(self.pid, fd)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
            d, self._dir = self._dir, None
        if fd >= 0:
            os.close(fd)
        if d is not None:
            d.close()

    def __enter__(self) -> ProcessPin:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # a pin is closed by its owner; one left to the collector is a leak in the making
        if getattr(self, "_fd", -1) >= 0:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2)
            self.close()


def open_pin(pid: int, proc_dir: ProcDir | None = None) -> ProcessPin | None:
    """A pin of whatever holds ``pid`` now (None where the kernel or the descriptor
    budget gives no pidfd). The caller proves it names the process it means: by a read
    through ``proc_dir`` opened before it, or by the identity read after it."""
    fd = open_pidfd(pid)
    return None if fd is None else ProcessPin(pid, fd, proc_dir)


def pin_observed(source, proc_dir: ProcDir, pid: int | None) -> ProcessPin | None:
    """The pin an observation takes, right after opening ``proc_dir`` and before reading
    anything through it: only of a real pid of the live host (see the module docstring)."""
    if pid is None or not proc_dir.pinned or getattr(source, "proc_root", None) != LIVE_PROC:
        return None
    return open_pin(pid, proc_dir)
