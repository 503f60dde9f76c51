"""Memory moves in the background: a bind answers once its CPU affinity, IRQs and
UVB threads are set, and its worker's private pages move afterwards, here.

A bind (or a locality rerun, or the start of a daemon that stopped before a move
finished) ``submit``\\ s a job: the worker, the node its pages go to, why. Jobs
queue per target node and run ``memory_moves_per_node`` at a time per node (one by
default: moves to one node share that node's memory bandwidth, and the worker
already on it should keep most of it), each on a thread of its own, at most
``memory_move_gib_per_second`` (applier/memory.py's ``PageMove`` paces itself).
Nothing here takes the daemon's lock while pages move: the daemon is told when a
job ends (``Daemon.memory_moved``) and records the outcome on the held worker
then. Lock order: the daemon's lock, then this queue's; the mover never calls
into the daemon while it holds its own.

A job is cancelled when its worker is released, replaced, bound again elsewhere
or gone (the daemon calls ``cancel``), and on its own once the worker's pidfd
(the held record's pin) says it exited, whatever its pid names by then: a
newcomer forked in the clock tick the worker was born in passes the start-time
check the move makes before each chunk, but never this one. The move stops
before its next chunk (64 MiB), and its result says how far it got. ``close`` cancels every job for a
daemon that is stopping: those keep their ``memory_move`` mark in the state
file, and the next daemon submits them again (a move walks only pages still off
the node, so nothing is moved twice).

``job(pid)`` is what ``status`` shows while a job is queued or running: its
state (``pending`` / ``moving``), its target node and its progress.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import structlog

from ...applier.memory import MoveCancel, PageMove
from ...applier.pagewalk import MoveProgress
from ...values.model import StepResult
from ...values.reasons import Outcome, Reason, Step
from ..runtime.threadname import name_os_thread

__all__ = ["MemoryMover", "MoveJob", "STOPPING"]

log = structlog.get_logger("ascendbind.memory")

# the cancel reason of a daemon that stops: the job's mark stays, the next daemon resumes it
STOPPING = "the daemon is stopping"


EXITED = "has exited"


class _Gone(Exception):
    """The worker exited before its move started."""


class UntilExit(MoveCancel):
    """A move's cancel flag that also sets itself once ``pin`` (the worker's pidfd, or None)
    says the worker has exited: the move checks it before every chunk."""

    def __init__(self, pid: int, pin) -> None:
        super().__init__()
        self.pid, self.pin = pid, pin

    def is_set(self) -> bool:
        if not super().is_set() and self.pin is not None and self.pin.exited():
            self.set(f"process {self.pid} {EXITED}")
        return super().is_set()


@dataclass
class MoveJob:
    """One worker's move: queued (``pending``) until a slot on its node is free, then ``moving``."""

    pid: int
    start_time: int | None
    node: int
    why: str  # bind, rerun, replan or restart
    held: object  # the Held record the move is for: a job outlives no binding
    ratio_before: float | None = None
    state: str = "pending"
    queued_at: float = field(default_factory=time.time)
    started_at: float | None = None
    cancel: MoveCancel = field(default_factory=MoveCancel)
    progress: MoveProgress | None = None
    result: StepResult | None = None
    finished: threading.Event = field(default_factory=threading.Event)  # set once the daemon recorded it

    def to_json(self) -> dict:
        out = {"state": self.state, "why": self.why, "target_node": self.node, "queued_at": round(self.queued_at, 3),
               "started_at": None if self.started_at is None else round(self.started_at, 3)}
        if self.progress is not None:
            out.update(self.progress.to_json())
        return out


class MemoryMover:
    """The daemon's move queue (``daemon.config``, ``daemon.hosts.source`` and the
    daemon's ``memory_moved`` callback)."""

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self._cond = threading.Condition()
        self._queues: dict[int, deque[MoveJob]] = {}
        self._running: dict[int, int] = {}  # node -> jobs moving now
        self._jobs: dict[int, MoveJob] = {}  # pid -> its job, queued or moving
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def submit(self, held, node: int, why: str, *, ratio_before: float | None = None) -> MoveJob | None:
        """Queue a move of ``held``'s worker to ``node``; a job it already has for another
        binding or node is cancelled first. None once the mover is closed."""
        b = held.binding
        job = MoveJob(b.pid, b.start_time, int(node), why, held, ratio_before,
                      cancel=UntilExit(b.pid, getattr(held, "pin", None)))
        with self._cond:
            if self._closed:
                return None
            old = self._jobs.get(b.pid)
            if old is not None and old.held is held and old.node == job.node:
                return old  # the same move, already on its way
            if old is not None:
                old.cancel.set("bound again")
                self._unqueue(old)
            self._jobs[b.pid] = job
            self._queues.setdefault(job.node, deque()).append(job)
            self._dispatch(job.node)
        return job

    def cancel(self, pid: int, why: str) -> None:
        """Stop ``pid``'s job (released, replaced, gone): a queued one is dropped now, a
        moving one stops before its next chunk."""
        with self._cond:
            job = self._jobs.get(pid)
            if job is None:
                return
            job.cancel.set(why)
            queued = self._unqueue(job)
            if queued:
                self._jobs.pop(pid, None)
            self.daemon.metrics.memory_queue(self._counts())
        if queued:
            self.daemon.memory_moved(job, None)
            job.finished.set()

    def job(self, pid: int) -> MoveJob | None:
        with self._cond:
            return self._jobs.get(pid)

    def jobs(self) -> list[MoveJob]:
        with self._cond:
            return list(self._jobs.values())

    def counts(self) -> dict[str, int]:
        with self._cond:
            return self._counts()

    def _counts(self) -> dict[str, int]:
        moving = sum(self._running.values())
        return {"pending": sum(len(q) for q in self._queues.values()), "moving": moving}

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every job (their marks stay for the next daemon) and wait for the moving ones."""
        with self._cond:
            self._closed = True
            for job in self._jobs.values():
                job.cancel.set(STOPPING)
            for q in self._queues.values():
                q.clear()
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------ the queue

    def _unqueue(self, job: MoveJob) -> bool:
        """Take a pending ``job`` off its queue (under the condition); False if it is moving."""
        q = self._queues.get(job.node)
        if q is not None and job in q:
            q.remove(job)
            return True
        return False

    def _dispatch(self, node: int) -> None:
        """Start the queued jobs of ``node`` that fit under the per-node limit (under the condition)."""
        q = self._queues.get(node)
        limit = max(1, int(self.daemon.config.memory_moves_per_node))
        while q and self._running.get(node, 0) < limit and not self._closed:
            job = q.popleft()
            self._running[node] = self._running.get(node, 0) + 1
            job.state = "moving"
            job.started_at = time.time()
            t = threading.Thread(target=self._run, args=(job,), name=f"memory-move-{node}", daemon=True)
            self._threads.add(t)
            t.start()
        self.daemon.metrics.memory_queue(self._counts())

    def _run(self, job: MoveJob) -> None:
        name_os_thread()
        result: StepResult | None = None
        t0 = time.monotonic()
        try:
            cfg = self.daemon.config
            if job.cancel.is_set() and job.cancel.why.endswith(EXITED):
                raise _Gone
            move = PageMove(self.daemon.hosts.source, job.pid, job.start_time, job.node, proc_root=cfg.proc_root,
                            rate=cfg.memory_move_gib_per_second * (1 << 30), cancel=job.cancel,
                            on_progress=lambda p: setattr(job, "progress", p))
            result = job.result = move.run()
            job.progress = move.progress()
        except _Gone:
            result = job.result = StepResult(Step.MEMORY, Outcome.SKIPPED, Reason.PID_GONE,
                                             f"{job.cancel.why}: nothing moved")
        except Exception:  # a bug in one move must not take the mover down
            log.exception("memory move crashed", pid=job.pid)
        try:
            # recorded while the job is still listed, so status never shows it neither moving nor done
            self.daemon.memory_moved(job, result, seconds=time.monotonic() - t0)
        finally:
            with self._cond:
                self._running[job.node] -= 1
                if self._jobs.get(job.pid) is job:
                    self._jobs.pop(job.pid)
                self._threads.discard(threading.current_thread())
                self._dispatch(job.node)
            job.finished.set()
