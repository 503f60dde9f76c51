"""One process's ``/proc/<pid>`` directory, read through one descriptor held open.

``ProcDir`` is what an observation reads through (process.py): names relative to the
process's directory (``stat``, ``task/12/comm``). ``LiveProcDir`` holds the directory
open, so every read describes the process it was opened on; a HostSource without
``open_process`` is adapted path by path (sources.py's ``path_proc_dir``).
"""

from __future__ import annotations

import os
import threading
from typing import Protocol

from ...values.digits import ascii_int
from .bounded import read_bounded
from .deadline import MEMORY_FILES, Readers
from ..parse.procfs import real_uid

__all__ = ["ProcDir", "LiveProcDir"]


class ProcDir(Protocol):
    """One process's ``/proc/<key>``: names are relative to it (``stat``, ``task/12/comm``).
    ``pinned``: every read is of the process the directory was opened on. ``owner``: its
    real uid once the reader knows it (from the status it read), to charge a stuck read to."""

    pinned: bool
    owner: int | None

    def read(self, name: str, limit: int | None = None) -> str | None: ...

    def listdir(self, name: str) -> list[str] | None: ...

    def close(self) -> None: ...


class LiveProcDir:
    """``/proc/<pid>`` held open: the kernel ties the directory to the task it was opened
    on, so after that task is reaped reads fail (ESRCH) rather than reach a newcomer.
    The files copied out of the process's memory (``environ``, ``cmdline``) are read on
    ``readers`` (deadline.py): that memory may be a file of a filesystem nobody serves."""

    pinned = True

    def __init__(self, fd: int, key: str = "self", readers: Readers | None = None) -> None:
        self.fd, self.key, self.readers = fd, key, readers
        self.owner: int | None = None

    def read(self, name: str, limit: int | None = None) -> str | None:
        # the process's memory, and what its own mount namespace holds (under root/), may be a
        # filesystem nobody serves: both are read on a reader with a deadline
        kind = name if name in MEMORY_FILES else ("root" if name.startswith("root/") else None)
        if kind is None or self.readers is None:
            return read_bounded(name, limit, dir_fd=self.fd)
        if self.owner is None:
            status = read_bounded("status", 4096, dir_fd=self.fd, single=True)
            self.owner = None if status is None else real_uid(status)
        try:
            # the reader's own copy of the directory: a read left behind may start after this
            # one is closed, and must not find its number reused by another open
            copy = _Once(os.dup(self.fd))
        except OSError:
            return None

        def read() -> str | None:
            dir_fd = copy.take()
            if dir_fd < 0:
                return None  # its caller has gone already
            try:
                return read_bounded(name, limit, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)

        try:
            return self.readers.read(kind, f"/proc/{self.key}/{name}", read, worker=ascii_int(self.key),
                                     owner=self.owner)
        finally:
            left = copy.take()  # refused at once, or left before the reader began: never read
            if left >= 0:
                os.close(left)

    def read_small(self, name: str, size: int) -> str | None:
        """One read of at most ``size`` bytes (a thread's comm): the per-thread hot path."""
        return read_bounded(name, size, dir_fd=self.fd, single=True)

    def task_comms(self) -> list[tuple[int, str]] | None:
        """(tid, comm) of every thread under ``task/`` (one listing, one read per thread; a
        thread that exits meanwhile is left out); None when the process is gone. One plain
        loop, relative to the open task directory: a bind reads hundreds of these, and a
        call or a full path walk per thread would show in its time."""
        try:
            task_fd = os.open("task", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return None
        out = []
        flags = os.O_RDONLY | os.O_CLOEXEC
        open_, read, close = os.open, os.read, os.close
        try:
            for name in os.listdir(task_fd):
                try:
                    fd = open_(f"{name}/comm", flags, dir_fd=task_fd)
                except OSError:
                    continue
                try:
                    raw = read(fd, 64)
                except OSError:
                    continue
                finally:
                    close(fd)
                out.append((int(name), raw.decode("utf-8", "replace").rstrip("\n")))
        except OSError:
            return None
        finally:
            close(task_fd)
        return out

    def listdir(self, name: str) -> list[str] | None:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return None
        try:
            return os.listdir(fd)
        except OSError:
            return None
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Once:
    """A descriptor that exactly one of two threads takes (and closes)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.lock = fd, threading.Lock()

    def take(self) -> int:
        with self.lock:
            fd, self.fd = self.fd, -1
        return fd
