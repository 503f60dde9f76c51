"""Reads of what a worker controls, on threads a request can walk away from.

Some of what the daemon reads about a worker is, in effect, the worker's: its
``/dev`` through ``/proc/<pid>/root`` is whatever its mount namespace mounted there,
and ``/proc/<pid>/environ`` and ``cmdline`` are copied out of the worker's own
memory, which may be a mapping of a file on such a filesystem. A FUSE filesystem
whose server never answers, an NFS server gone away or a hung device make such a
read wait for ever, in the kernel, on the daemon's thread.

Kernel behaviour this relies on:

* A FUSE request waits interruptibly, then killably, for the server's answer (and
  every request first waits, killably, for the answer to the connection's INIT):
  it ends when the server answers, when the server's ``/dev/fuse`` descriptor is
  closed (the connection is aborted: ENOTCONN), or on a fatal signal. Nothing a
  thread can do from inside Python ends it; an NFS hard mount waits killably too.
* A process exit (``exit_group``) sends SIGKILL to every thread, which ends those
  waits: a thread stuck there never holds up the daemon's exit, provided nobody
  joins it first. Python's exit joins only non-daemon threads, so the readers here
  are daemon threads, and nothing ever joins them. (A driver that waits in D state
  holds even the exit; nothing in user space helps that.)

So each such read runs on a reader thread. The caller waits at most ``deadline``
seconds, then leaves the read where it is and gets a DiscoveryError with code
``read_timeout`` naming the file; the read counts as abandoned, and as stuck until
it returns (its result is then dropped, and its thread serves again). The limits
keep one worker's trouble its own, and fail at once (the same error) rather than
start another thread:

* one read of a worker at a time: a second one waits for the first (within its own
  deadline), and once a read is stuck the worker is not read again until it returns;
* ``per_owner`` stuck reads per owner (the real uid of the process read): a user
  with many hung processes uses up its own share, not everyone's;
* ``max_stuck`` stuck reads in all, and at most ``max_busy`` more threads at work:
  the threads one daemon can lose are bounded.

An idle reader waits ``idle_seconds`` for the next read, then ends. ``READERS`` is the
process's one set, which every LiveHost uses unless it is given another; the daemon
sets its ``thread_init`` to name each reader's OS thread (``worker-read`` in ``ps -L``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ...errors import DiscoveryError

__all__ = ["Readers", "ReadStats", "READERS", "READ_DEADLINE", "READ_FILES", "MEMORY_FILES"]

T = TypeVar("T")

# a read of a few hundred KiB of /proc or a listing of /dev takes well under a millisecond;
# two seconds is room for a loaded host, and short of the API's request deadline
READ_DEADLINE = 2.0
# the kinds of read (the metrics' label values)
READ_FILES = ("environ", "cmdline", "dev", "root")
# the files of /proc/<pid> the kernel copies out of the process's memory (access_remote_vm)
MEMORY_FILES = frozenset({"environ", "cmdline"})


@dataclass(frozen=True)
class ReadStats:
    """Per kind of read: ``abandoned`` (ever left at the deadline), ``refused`` (failed at
    once, a limit reached), ``stuck`` (abandoned and not returned yet)."""

    abandoned: dict[str, int]
    refused: dict[str, int]
    stuck: dict[str, int]


class _Job(Generic[T]):
    __slots__ = ("fn", "kind", "what", "worker", "owner", "done", "result", "error", "finished", "abandoned_at")

    def __init__(self, fn: Callable[[], T], kind: str, what: str, worker: int | None, owner: int | None) -> None:
        self.fn, self.kind, self.what, self.worker, self.owner = fn, kind, what, worker, owner
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.abandoned_at: float | None = None


class _Reader:
    __slots__ = ("jobs",)

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()


class Readers:
    """A bounded set of reader threads (see the module's docstring)."""

    def __init__(self, *, deadline: float = READ_DEADLINE, max_stuck: int = 16, per_owner: int = 4,
                 max_busy: int = 16, idle_seconds: float = 60.0) -> None:
        self.deadline = deadline
        self.max_stuck, self.per_owner, self.max_busy = max_stuck, per_owner, max_busy
        self.idle_seconds = idle_seconds
        self.thread_init: Callable[[], None] | None = None  # called first on each new reader thread
        self._lock = threading.Lock()
        self._idle: list[_Reader] = []
        self._threads = 0
        self._stuck: list[_Job] = []
        self._ahead: dict[int, _Job] = {}  # the read of each worker in flight or stuck
        self._abandoned = dict.fromkeys(READ_FILES, 0)
        self._refused = dict.fromkeys(READ_FILES, 0)

    def read(self, kind: str, what: str, fn: Callable[[], T], *, worker: int | None = None,
             owner: int | None = None) -> T:
        """``fn()`` (which should answer None or a value for the ordinary failures, not
        raise) on a reader thread, waited for at most ``deadline`` seconds. ``kind`` is one
        of READ_FILES, ``what`` the file as the error names it, ``worker`` the pid read and
        ``owner`` its real uid, when known. DiscoveryError ``read_timeout`` past the
        deadline, or at once when a limit is reached."""
        if kind not in READ_FILES:
            raise ValueError(f"unknown kind of read {kind!r}")
        job = _Job(fn, kind, what, worker, owner)
        end = time.monotonic() + self.deadline
        while True:
            with self._lock:
                ahead = self._ahead.get(worker) if worker is not None else None
                if ahead is None or ahead.abandoned_at is not None or time.monotonic() >= end:
                    why = self._refusal(job, ahead)
                    reader = self._reader() if why is None else None
                    if why is None and reader is None:
                        why = f"all {self._threads} reader threads are busy"
                    if why is not None:
                        self._refused[kind] += 1
                    elif worker is not None:
                        self._ahead[worker] = job
                    break
            # one read of a worker at a time: wait (within this read's deadline) for the one ahead
            ahead.done.wait(max(0.0, end - time.monotonic()))
        if why is not None:
            raise DiscoveryError(f"{what} not read: {why}", code="read_timeout")
        reader.jobs.put(job)
        if not job.done.wait(max(0.0, end - time.monotonic())):
            with self._lock:
                if not job.finished:
                    job.abandoned_at = time.monotonic()
                    self._stuck.append(job)
                    self._abandoned[kind] += 1
            if job.abandoned_at is not None:
                raise DiscoveryError(
                    f"{what} did not answer within {self.deadline:g} s (a filesystem of the worker's that nobody "
                    "serves, or a hung device); the read was left behind", code="read_timeout")
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]

    def stats(self) -> ReadStats:
        with self._lock:
            stuck = dict.fromkeys(READ_FILES, 0)
            for job in self._stuck:
                stuck[job.kind] += 1
            return ReadStats(dict(self._abandoned), dict(self._refused), stuck)

    def threads(self) -> int:
        """Reader threads alive now (idle, at work or stuck)."""
        with self._lock:
            return self._threads

    # ------------------------------------------------------------ under the lock

    def _refusal(self, job: _Job, ahead: _Job | None) -> str | None:
        now = time.monotonic()
        if ahead is not None:
            # it ran a whole deadline before it was left behind (or while this one waited)
            since = self.deadline + (now - ahead.abandoned_at if ahead.abandoned_at is not None else 0.0)
            return f"a read of {ahead.what} has not returned for {since:.0f} s"
        if len(self._stuck) >= self.max_stuck:
            return f"{len(self._stuck)} reads of workers' files are stuck (at most {self.max_stuck})"
        if job.owner is not None:
            mine = sum(1 for other in self._stuck if other.owner == job.owner)
            if mine >= self.per_owner:
                return f"{mine} reads of uid {job.owner}'s processes are stuck (at most {self.per_owner})"
        return None

    def _reader(self) -> _Reader | None:
        if self._idle:
            return self._idle.pop()
        if self._threads >= len(self._stuck) + self.max_busy:
            return None
        reader = _Reader()
        self._threads += 1
        threading.Thread(target=self._serve, args=(reader,), name="worker-read", daemon=True).start()
        return reader

    # ------------------------------------------------------------ a reader thread

    def _serve(self, reader: _Reader) -> None:
        if self.thread_init is not None:
            self.thread_init()
        while True:
            try:
                job = reader.jobs.get(timeout=self.idle_seconds)
            except queue.Empty:
                with self._lock:
                    if reader in self._idle:
                        self._idle.remove(reader)
                        self._threads -= 1
                        return
                job = reader.jobs.get()  # handed a read as the wait ended
            try:
                job.result = job.fn()
            except BaseException as exc:  # handed to the caller, who raises it
                job.error = exc
            with self._lock:
                job.finished = True
                if job.worker is not None and self._ahead.get(job.worker) is job:
                    del self._ahead[job.worker]
                if job.abandoned_at is not None:
                    self._stuck.remove(job)
                    job.fn = job.result = None  # nobody reads an abandoned result
                self._idle.append(reader)
            job.done.set()


READERS = Readers()

