"""The memory step: move a bound worker's *private* pages to its pool's NUMA node.

What moves: the worker's anonymous pages that it alone maps — heap, thread
stacks, anonymous mappings (``malloc`` arenas, a framework's caching
allocator), private huge pages, and the copies it made of a privately mapped
file's pages by writing them. Pages it allocates after the bind follow the
first-touch policy of the CPUs it now runs on, so one move after the bind and
the occasional rerun keep it local.

What never moves: anything another process may map — ``MAP_SHARED`` mappings,
``/dev/shm``, memfd and System V segments, hugetlbfs files, the page cache of
libraries and model files — and anonymous pages still shared with a parent or
child after ``fork``. ``migratepages``/``migrate_pages(2)`` run as root
(CAP_SYS_NICE) move those too: two workers on two nodes mapping one segment then
take it from each other at every rerun, and a move of a worker's view of a
200 GiB shared host table is a move of every rank's. Shared memory is measured
(``numa_maps``), never moved.

How: the private mappings with anonymous pages off the node come from ``maps``
and ``numa_maps`` (``maps`` alone for a worker of many mappings: discovery/gather/pages.py);
pagemap names their pages present, anonymous and exclusive; ``move_pages(2)``
moves those (asking first where they are, unless numa_maps saw a mapping wholly
off the node) with ``MPOL_MF_MOVE``, never ``_ALL``, so the kernel itself refuses
a page that became shared meanwhile (``EACCES``). The walk (pagewalk.py) reads
pagemap a chunk of address space a read and hands the kernel ``CHUNK_BYTES`` of
pages of many mappings a call, within caps on one move's work (``move_too_large``
past them: the next rerun goes on). Pages reported busy (``EBUSY``: moving with
their transparent huge page, or pinned, e.g. for the NPU's DMA) are asked about
again at the end; those still busy stay, as do pages refused as shared: neither
fails the step. A full target node (``ENOMEM``) or another per-page error does,
with what did move in its data.

Between chunks the move checks that the worker is still the process it was
started for (pid and start time), stops when told to (``MoveCancel``: released or
exited) and keeps under its rate, which counts every kind of work in bytes
(pagewalk.py's cost model); each chunk's progress, with the move's CPU time,
goes to ``on_progress``. ``move_pages(2)`` releases the interpreter lock while the
kernel copies: the daemon's other threads run meanwhile.
"""

from __future__ import annotations

import errno
import platform
import threading
import time
from array import array
from collections.abc import Callable

from ..values.config import Config
from ..discovery.gather.identity import verify_identity
from ..discovery.gather.pages import BASE_PAGE, MoveRanges, open_pagemap, read_move_ranges
from ..discovery.gather.process import exiting
from ..errors import DiscoveryError, ParseError, ProcessGone
from ..values.frozen import frozen_map
from ..values.model import HostFacts, Plan, StepResult
from ..values.reasons import Outcome, Reason, Step
from .movepages import UNREPORTED, MovePages
from .pagewalk import MAX_MAPPINGS, MAX_PAGES, Chosen, Cost, MoveProgress, Walk, choose, choose_spans

__all__ = ["CHUNK_BYTES", "MoveCancel", "PageMove", "memory_target", "pending_memory", "migrate_memory"]

CHUNK_BYTES = 64 << 20
# per-page statuses that leave a page where it is without failing the step
_SHARED = (errno.EACCES,)  # mapped by another process meanwhile
_GONE = (errno.ENOENT, errno.EFAULT)  # unmapped or freed meanwhile, or the zero page
_BUSY = (errno.EBUSY, errno.EAGAIN)


class _NodeFull(Exception):
    """The target node ran out of memory during a chunk: the move ends there."""


class MoveCancel:
    """Tells a running move to stop (``set(why)``); its ``wait`` is the rate limiter's sleep."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.why = ""

    def set(self, why: str) -> None:
        if not self._event.is_set():
            self.why = why
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(max(0.0, seconds))


def memory_target(plan: Plan, host: HostFacts) -> int | StepResult:
    """The node the worker's pages go to (that of the first NPU's ``pool[0]``), or the
    step's skip result when there is nowhere else for them to be."""
    nodes = sorted(host.numa_nodes)
    if not nodes or not plan.npus or not plan.npus[0].pool:
        return _result(Outcome.SKIPPED, Reason.NO_NUMA_INFO, "no NUMA node list from lscpu/sysfs")
    if len(nodes) == 1:
        return _result(Outcome.SKIPPED, Reason.SINGLE_NUMA_NODE, f"one NUMA node ({nodes[0]}): nothing to move")
    anchor = plan.npus[0].pool[0]
    target = host.node_of_cpu(anchor)
    if target is None:
        return _result(Outcome.SKIPPED, Reason.NO_NUMA_INFO, f"CPU {anchor} (pool[0]) is on no known NUMA node")
    return target


def pending_memory(node: int) -> StepResult:
    """The memory step of a bind that moves its pages in the background."""
    return _result(Outcome.PENDING, None, f"private pages move to NUMA node {node} in the background",
                   {"target_node": node})


class PageMove:
    """One move of ``pid``'s private pages to ``node`` (``run`` once; see the module docstring).

    ``rate``: bytes per second at most, every kind of work counted (pagewalk.py's
    ``Cost``; 0: as fast as the kernel goes). ``max_mappings``, ``max_pages``: the
    most one move walks (pagewalk.py's ``choose``)."""

    def __init__(self, source, pid: int, start_time: int | None, node: int, *, proc_root: str = "/proc",
                 rate: float = 0.0, cancel: MoveCancel | None = None,
                 on_progress: Callable[[MoveProgress], None] | None = None, syscall: MovePages | None = None,
                 chunk_bytes: int = CHUNK_BYTES, max_mappings: int = MAX_MAPPINGS,
                 max_pages: int = MAX_PAGES) -> None:
        self.source, self.pid, self.start_time, self.node = source, int(pid), start_time, int(node)
        self.proc_root = proc_root
        self.rate = max(0.0, float(rate))
        self.cancel = cancel or MoveCancel()
        self.on_progress = on_progress
        self.syscall = syscall or MovePages()
        self.chunk = max(BASE_PAGE, chunk_bytes - chunk_bytes % BASE_PAGE)
        self.max_mappings, self.max_pages = max_mappings, max_pages
        self.moved = self.pages_moved = self.to_move = self.calls = self.lines = 0
        self.coarse = False  # read from maps alone: what is off the node is found as the walk goes
        self.left: dict[str, int] = {}
        self.chosen = Chosen(())
        self._walk: Walk | None = None
        self._t0 = self._c0 = self._cpu = 0.0

    def cost(self) -> Cost:
        w = self._walk
        return Cost(self.moved, self.lines, w.mappings if w else 0, w.entries if w else 0,
                    self.calls + (w.reads if w else 0))

    def progress(self) -> MoveProgress:
        """Where the move stands (its CPU time as of the last chunk, when asked from another thread)."""
        return MoveProgress(self.node, self.moved, self.to_move, self.pages_moved, frozen_map(self.left),
                            time.monotonic() - self._t0 if self._t0 else 0.0, self.cost(), self._cpu)

    def _tick(self) -> None:
        """Note the moving thread's CPU time (only that thread's clock knows it)."""
        self._cpu = time.thread_time() - self._c0

    def run(self) -> StepResult:
        self._t0, self._c0 = time.monotonic(), time.thread_time()
        if not self.syscall.supported:
            return self._done(Outcome.SKIPPED, Reason.MOVE_UNSUPPORTED,
                              f"move_pages(2) is not known on {platform.machine()}; pages stay where they are")
        found = self._read()
        if isinstance(found, StepResult):
            return found
        caps = {"max_mappings": self.max_mappings, "max_pages": self.max_pages}
        if found.spans is not None:
            self.chosen, self.coarse = choose_spans(found.spans, **caps), True
            if self.chosen.capped:  # past a cap, only numa_maps says what the last move left off the node
                found, self.coarse = self._read(coarse_over=None), False
                if isinstance(found, StepResult):
                    return found
        if found.spans is None:
            if not found.ranges:
                return self._done(Outcome.APPLIED, None,
                                  f"{_mib(sum(found.residency.private_kib.values()) << 10)} of private memory, "
                                  f"all on NUMA node {self.node} already")
            self.chosen, self.to_move = choose(found.ranges, **caps), found.remote_bytes
        pagemap = open_pagemap(self.source, self.pid)
        if pagemap is None:
            return self._gone_or(Outcome.FAILED, Reason.MEMORY_UNREADABLE,
                                 f"the pagemap of process {self.pid} cannot be opened; pages stay where they are")
        retry: dict[int, list[int]] = {}
        try:
            with pagemap:
                self._walk = Walk(pagemap, self.chosen.ranges, self.chunk)
                checked = -self.chunk
                for batch in self._walk:
                    # between pagemap reads with nothing to move, a check every chunk's worth of work
                    if batch is None and self.cost().budget - checked < self.chunk:
                        continue
                    stop = self._between_chunks()
                    if stop is not None:
                        return stop
                    checked = self.cost().budget
                    if batch is not None:
                        busy = self._move_chunk(batch.direct, batch.ask, batch.page)
                        if busy:
                            retry.setdefault(batch.page, []).extend(busy)
                if retry and not self.cancel.wait(0.05):
                    for size, addrs in sorted(retry.items()):
                        step = max(1, self.chunk // size)
                        for i in range(0, len(addrs), step):
                            self._move_chunk([], addrs[i:i + step], size, last=True)
        except _NodeFull:
            pass
        except OSError as exc:
            return self._syscall_failed(exc)
        return self._verdict()

    def _read(self, **how) -> MoveRanges | StepResult:
        """What the move walks (discovery/gather/pages.py), or the step's result when it cannot be read."""
        try:
            verify_identity(self.pid, self.start_time, self.proc_root)
            found = read_move_ranges(self.source, self.pid, self.node, start_time=self.start_time, **how)
        except ProcessGone as exc:
            return self._done(Outcome.SKIPPED, Reason(exc.code), f"{exc}: nothing moved")
        except (DiscoveryError, ParseError) as exc:
            return self._gone_or(Outcome.FAILED, Reason.MEMORY_UNREADABLE, f"{exc}; pages stay where they are")
        self.lines += found.mappings
        return found

    # ------------------------------------------------------------ one chunk

    def _move_chunk(self, direct: list[int], ask: list[int], page: int, *, last: bool = False) -> list[int]:
        """Move the pages of ``direct`` and those of ``ask`` that are not on the node yet;
        returns those that stayed without a reason (busy: asked about again at the end,
        unless ``last``).

        ``direct``: numa_maps saw their mappings' pages all off the node, so they are not
        asked about first (one that came to the node since counts as moved). The move's
        statuses are the kernel's own when it tried every page and none failed to
        migrate (it returned 0). Otherwise, and for pages reported busy (those of a
        transparent huge page move with its first one and say EBUSY), where they are is
        asked again: after a failed page the kernel leaves statuses unwritten."""
        node = self.node
        todo = direct
        if ask:
            self.calls += 1
            where = self.syscall.query(self.pid, ask)
            # the usual answer, every page off the node, is told by two scans in C
            if node in where or min(where) < 0:
                ask = [a for a, s in zip(ask, where) if 0 <= s != node]
            todo = direct + ask if direct else ask
        if self.coarse and not last:
            self.to_move += len(todo) * page
        if not todo:
            return []
        full = False
        self.calls += 1
        try:
            _not_moved, status = self.syscall.move(self.pid, todo, node)
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            status, full = array("i", [UNREPORTED]) * len(todo), True
        moved = status.count(node)
        busy: list[int] = []
        if moved < len(todo):
            later, busy = self._recheck(todo, status, full)
            moved += later
        self.pages_moved += moved
        self.moved += moved * page
        if last:
            self.left["busy"] = self.left.get("busy", 0) + len(busy)
            busy = []
        if self.on_progress is not None:
            self._tick()
            self.on_progress(self.progress())
        if full:
            raise _NodeFull
        return busy

    def _recheck(self, todo: list[int], status, full: bool) -> tuple[int, list[int]]:
        """After a move that left pages of ``todo`` off the node: counts those the kernel gave a
        reason for, and asks again where the others are (busy, unwritten, or after a failed
        page not tried). Returns (how many of those are on the node now, those still busy)."""
        node = self.node
        unsure = []
        for a, s in zip(todo, status):
            if s == node:
                continue
            if s < 0 and -s not in _BUSY:
                self._count_left(-s)
            else:
                unsure.append(a)
        if not unsure:
            return 0, []
        self.calls += 1
        again = self.syscall.query(self.pid, unsure)
        busy = []
        for a, s in zip(unsure, again):
            if s != node:
                if full:
                    self._count_left(errno.ENOMEM)
                else:
                    busy.append(a)
        return again.count(node), busy

    def _count_left(self, err: int) -> None:
        why = ("shared" if err in _SHARED else "gone" if err in _GONE else
               "target_full" if err == errno.ENOMEM else "failed")
        self.left[why] = self.left.get(why, 0) + 1

    def _between_chunks(self) -> StepResult | None:
        """The checks and the rate limit before each chunk: a result when the move stops."""
        if self.cancel.is_set():
            return self._done(Outcome.SKIPPED, Reason.MOVE_CANCELLED,
                              f"move cancelled ({self.cancel.why}) after {_mib(self.moved)}")
        try:
            verify_identity(self.pid, self.start_time, self.proc_root)
        except ProcessGone as exc:
            return self._done(Outcome.SKIPPED, Reason(exc.code), f"{exc} after {_mib(self.moved)} moved")
        if self.rate:
            ahead = self.cost().budget / self.rate - (time.monotonic() - self._t0)
            if ahead > 0 and self.cancel.wait(ahead):
                return self._between_chunks()
        return None

    # ------------------------------------------------------------ results

    def _syscall_failed(self, exc: OSError) -> StepResult:
        gone = self._gone()
        if gone is not None or exc.errno == errno.ESRCH:
            return gone or self._done(Outcome.SKIPPED, Reason.PID_GONE, f"process {self.pid} exited")
        if exc.errno == errno.ENOSYS:
            return self._done(Outcome.SKIPPED, Reason.MOVE_UNSUPPORTED,
                              "this kernel has no move_pages(2) (built without NUMA or page migration)")
        if exc.errno == errno.EPERM:
            return self._done(Outcome.FAILED, Reason.NOT_PERMITTED,
                              f"move_pages(2) on process {self.pid} not permitted (CAP_SYS_NICE, or a "
                              f"seccomp filter); {_mib(self.moved)} moved")
        return self._done(Outcome.FAILED, Reason.MOVE_FAILED,
                          f"move_pages(2) failed: {exc.strerror or exc}; {_mib(self.moved)} moved")

    def _gone(self) -> StepResult | None:
        """The skip result when the worker has exited, is exiting (its address space going
        away makes move_pages fail with EINVAL or per-page errors) or its pid was reused;
        else None."""
        try:
            verify_identity(self.pid, self.start_time, self.proc_root)
        except ProcessGone as exc:
            return self._done(Outcome.SKIPPED, Reason(exc.code), f"{exc}: {_mib(self.moved)} moved")
        if exiting(self.pid, self.proc_root):
            return self._done(Outcome.SKIPPED, Reason.PID_GONE,
                              f"process {self.pid} is exiting: {_mib(self.moved)} moved")
        return None

    def _gone_or(self, outcome: Outcome, reason: Reason, detail: str) -> StepResult:
        """The worker having exited explains a read or a call failing: say that instead."""
        return self._gone() or self._done(outcome, reason, detail)

    def _verdict(self) -> StepResult:
        # a worker that exits mid-move fails its last pages, or (its pagemap reading short or
        # empty once its address space is gone) leaves the walk nothing more to move: either
        # way that is an exit, not a failure nor a move done
        gone = self._gone()
        if gone is not None:
            return gone
        full, failed = self.left.get("target_full", 0), self.left.get("failed", 0)
        stayed = ", ".join(f"{n} {why}" for why, n in sorted(self.left.items()) if n)
        summary = f"{_mib(self.moved)} of private memory moved to NUMA node {self.node}"
        if stayed:
            summary += f" (pages left where they were: {stayed})"
        if full:
            return self._done(Outcome.FAILED, Reason.TARGET_NODE_FULL,
                              f"NUMA node {self.node} ran out of free memory: {summary}")
        if failed:
            return self._done(Outcome.FAILED, Reason.MOVE_FAILED, f"pages could not be moved: {summary}")
        c = self.chosen
        if c.capped:
            return self._done(Outcome.FAILED, Reason.MOVE_TOO_LARGE,
                              f"{summary}; {c.left_mappings} more mappings and {c.cut} cut short, "
                              f"{_mib(c.left_bytes)} off the node, were left: one move walks at most "
                              f"{self.max_mappings} mappings and {self.max_pages} pages (the next rerun goes on)")
        return self._done(Outcome.APPLIED, None, summary)

    def _done(self, outcome: Outcome, reason: Reason | None, detail: str) -> StepResult:
        self._tick()
        data = self.progress().to_json()
        if self.rate:
            data["rate_bytes_per_second"] = self.rate
        return _result(outcome, reason, detail, data)


def migrate_memory(plan: Plan, pid: int, host: HostFacts, config: Config, *, source=None,
                   start_time: int | None = None) -> StepResult:
    """The memory step now, to the end (``ascendbind apply``: no daemon, nobody waits on a lock)."""
    target = memory_target(plan, host)
    if isinstance(target, StepResult):
        return target
    if source is None:
        from ..discovery import LiveHost

        source = LiveHost.from_config(config)
    return PageMove(source, pid, start_time, target, proc_root=config.proc_root,
                    rate=config.memory_move_gib_per_second * (1 << 30)).run()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _result(outcome: Outcome, reason: Reason | None, detail: str, data: dict | None = None) -> StepResult:
    return StepResult(Step.MEMORY, outcome, reason, detail, frozen_map(data))
