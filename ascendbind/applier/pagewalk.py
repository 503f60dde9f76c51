"""The work of one memory move: which mappings it walks, in how many system calls, what
that work counts for against the move's rate limit, and where a move stands
(``MoveProgress``: what ``status`` shows of it).

A worker's private memory may lie in one mapping or in tens of thousands (an
allocator that maps small objects apart, or a worker's owner, any local user, who
would have root's daemon spend its CPU). What a move costs then goes by mapping
and by system call, not by byte, so the walk keeps both few:

* ``pagemap`` is read through one descriptor, in ``pread``\\ s of at most one
  chunk of address space (64 MiB of 4 KiB pages: 16384 entries, 128 KiB);
  mappings at most ``GAP_PAGES`` apart share a read (reading the gap's entries
  costs 8 bytes a page, a read of its own a system call).
* The movable pages of many mappings go to ``move_pages(2)`` together, a chunk
  of pages of one size at a time (``Batch``). Each call costs the kernel more
  than its pages: before it moves any it drains every CPU's per-CPU page lists
  and waits for an RCU grace period (``lru_cache_disable``), so ten thousand
  one-page calls make ten thousand rounds of interrupts to every CPU.
* A worker read from ``maps`` alone (many mappings: discovery/gather/pages.py) has its
  neighbours come out of the scan of ``maps`` as runs (those listed one after
  another in one 1 MiB block, with their count: memmap.py's
  ``writable_anonymous``), and runs and mappings close together walked as one
  range (``choose_spans``): a few hundred bounds converted for ten thousand
  one-page mappings side by side, no step per mapping after the scan.
* One move walks at most ``MAX_MAPPINGS`` mappings and ``MAX_PAGES`` pagemap
  entries (``choose``). A worker past either has its mappings with the most
  bytes off the node walked first (numa_maps read then, even past the many
  mappings: only it says which mappings a rerun has left); the move then ends
  ``move_too_large`` with what it left, and the next rerun, which walks only
  what is still off the node, goes on from there. The kernel's default
  ``vm.max_map_count`` (65530) keeps every worker of a default host under the
  first cap; the second is 1 TiB of 4 KiB pages.

The cost model (``Cost``): the rate limit, ``memory_move_gib_per_second``, is in
bytes, and every kind of work a move does counts as a number of bytes of it:

=====================================================  ==================
work                                                   counts as
=====================================================  ==================
a page moved                                           its size
a mapping of the worker (a line of maps or numa_maps)  ``LINE`` (4 KiB)
a mapping walked                                       ``MAPPING`` (64 KiB)
a pagemap entry read (a page considered)               ``ENTRY`` (128 bytes)
a system call (a pagemap read, a ``move_pages(2)``)    ``CALL`` (256 KiB)
=====================================================  ==================

Each is set above what that work costs the daemon's CPU against a page moved.
On the two-node guest (bench/memory_mappings.py) a worker of ten thousand
one-page mappings costs 1.3 to 2.5 times the CPU of the same pages in one
mapping (the host's count of the guest: 1.9 times): what a one-page mapping
adds is its line of maps, formatted by the kernel and scanned, and the kernel's
dearer move of a page among many mappings; natively a
pagemap entry costs about a fortieth of a 4 KiB page moved, a move_pages(2) call
its drain of every CPU. A worker of one-page mappings is therefore paced as if
each of its pages were some 72 KiB, and at any limit takes no more of the
daemon's CPU a second than a worker of the same bytes in one mapping; a worker
of big mappings pays about 4 % more than its bytes (a 64 MiB chunk: 2 MiB of
entries, two or three calls).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, compress, islice, repeat
from operator import gt, itemgetter, neg, sub
from typing import NamedTuple

from ..discovery.parse.memmap import PM_EXCLUSIVE, PM_FILE, PM_PRESENT, MoveRange
from ..discovery.gather.pages import BASE_PAGE, PageMap
from ..values.frozen import frozen_map

__all__ = ["Batch", "Chosen", "Cost", "MoveProgress", "Walk", "choose", "choose_spans", "GAP_PAGES", "MAX_MAPPINGS", "MAX_PAGES"]

GAP_PAGES = 256  # mappings this close share a pagemap read (2 KiB of entries read between them)
MAX_MAPPINGS = 65536
MAX_PAGES = 1 << 28  # pagemap entries: 1 TiB of 4 KiB pages
# present, not a file page, exclusive: bits 63, 61 and 56, all in an entry's top byte
_TOP = 7 if sys.byteorder == "little" else 0
_TOP_MASK, _TOP_MOVABLE = (PM_PRESENT | PM_FILE | PM_EXCLUSIVE) >> 56, (PM_PRESENT | PM_EXCLUSIVE) >> 56
_FLAGS = bytes(int(b & _TOP_MASK == _TOP_MOVABLE) for b in range(256))


@dataclass(frozen=True)
class Cost:
    """Bytes of the rate limit each kind of work counts for (see the module docstring)."""

    LINE = 4 << 10
    MAPPING = 64 << 10
    ENTRY = 128
    CALL = 256 << 10

    moved: int = 0  # bytes
    lines: int = 0
    mappings: int = 0
    entries: int = 0
    calls: int = 0

    @property
    def budget(self) -> int:
        return (self.moved + self.lines * self.LINE + self.mappings * self.MAPPING + self.entries * self.ENTRY
                + self.calls * self.CALL)


@dataclass(frozen=True)
class Chosen:
    """The mappings one move walks, and what it leaves of the worker's memory off the node."""

    ranges: tuple[MoveRange, ...]
    left_mappings: int = 0  # mappings with bytes off the node not walked at all
    left_bytes: int = 0  # numa_maps' bytes off the node in those, and in the parts of mappings cut short
    cut: int = 0  # mappings walked only in part

    @property
    def capped(self) -> bool:
        return bool(self.left_mappings or self.cut)


def _pick(weights: list[int], sizes: list[int], max_mappings: int, max_pages: int,
          counts: Sequence[int] | None = None) -> tuple[list[int], int | None]:
    """The indices one move takes, in index order: the greatest weight first (of equal
    weight, the smallest size), up to ``max_mappings`` mappings (``counts``: how many each
    index stands for; one each when None) and ``max_pages`` of size; and the index of the
    last one taken when only part of it fits (None when all do). Sorted by tuples built in
    C: a worker past the caps has some 100000 mappings."""
    order = sorted(zip(map(neg, weights), sizes, range(len(sizes))))
    keep: list[int] = []
    room, part, used = max_pages, None, 0
    for _w, size, i in order:
        used += 1 if counts is None else counts[i]
        if used > max_mappings or room <= 0:
            break
        keep.append(i)
        if size > room:
            part = i
            break
        room -= size
    keep.sort()
    return keep, part


def choose(ranges: Sequence[MoveRange], *, max_mappings: int = MAX_MAPPINGS, max_pages: int = MAX_PAGES,
           base_page: int = BASE_PAGE) -> Chosen:
    """``ranges`` if one move may walk them all; else those with the most bytes off the node
    first, up to ``max_mappings`` mappings and ``max_pages`` pagemap entries (the last one
    taken cut short to the pages left, in whole pages of its size), in address order."""
    sizes = [(r.end - r.start) // base_page for r in ranges]
    if len(ranges) <= max_mappings and sum(sizes) <= max_pages:
        return Chosen(tuple(ranges))
    remote = [r.remote_bytes for r in ranges]
    keep, part = _pick(remote, sizes, max_mappings, max_pages)
    out = [ranges[i] for i in keep]
    left_b = sum(remote) - sum(remote[i] for i in keep)
    cut = 0
    if part is not None:
        at = keep.index(part)
        r = ranges[part]
        room = max_pages - sum(sizes[i] for i in keep if i != part)
        end = r.start + room * base_page
        end -= (end - r.start) % r.page_size
        left_b += r.remote_bytes * (r.end - end) // (r.end - r.start)
        if end > r.start:
            out[at], cut = r._replace(end=end), 1
        else:
            del out[at]
    return Chosen(tuple(out), len(ranges) - len(out), left_b, cut)


def choose_spans(spans: Sequence[tuple[int, int, int]], *, max_mappings: int = MAX_MAPPINGS,
                 max_pages: int = MAX_PAGES, base_page: int = BASE_PAGE) -> Chosen:
    """What one move walks of a worker read from ``maps`` alone (``spans``: its writable
    anonymous mappings, (start, end, mappings) in address order, a run of neighbours
    as one: discovery/parse/memmap.py's ``writable_anonymous``; where their pages are is not
    known): the biggest first past the caps, and neighbours at most ``GAP_PAGES`` apart
    walked as one range (``mappings`` says how many each spans). Whatever lies between
    two neighbours is read with them; only pages pagemap calls present, anonymous and
    exclusive are ever moved, so that is the worker's own memory or nothing."""
    left_n = left_b = cut = 0
    los, his, counts = (list(map(itemgetter(k), spans)) for k in range(3))
    if sum(counts) > max_mappings or (sum(his) - sum(los)) // base_page > max_pages:
        sizes = [(hi - lo) // base_page for lo, hi, _n in spans]
        keep, part = _pick(sizes, sizes, max_mappings, max_pages, counts)
        left_n = sum(counts) - sum(counts[i] for i in keep)
        left_b = (sum(sizes) - sum(sizes[i] for i in keep)) * base_page
        chosen = [spans[i] for i in keep]
        if part is not None:
            lo, hi, n = spans[part]
            room = max_pages - sum(sizes[i] for i in keep if i != part)
            left_b += hi - lo - room * base_page
            chosen[keep.index(part)] = (lo, lo + room * base_page, n)
            cut = 1
        los, his, counts = (list(map(itemgetter(k), chosen)) for k in range(3))
    # a range starts at the first span and at each more than the gap past the one before:
    # the gaps are compared in C, and the loop below runs once a range, not once a span
    n = len(los)
    apart = map(gt, map(sub, islice(los, 1, None), his), repeat(GAP_PAGES * base_page))
    firsts = [0, *compress(range(1, n), apart), n] if n else []
    upto = [0, *accumulate(counts)]
    out = [MoveRange(los[a], his[b - 1], base_page, his[b - 1] - los[a], his[b - 1] - los[a], True,
                     upto[b] - upto[a]) for a, b in zip(firsts, firsts[1:])]
    return Chosen(tuple(out), left_n, left_b, cut)


@dataclass(frozen=True)
class MoveProgress:
    """Where one move stands: bytes moved of the (numa_maps) estimate, and why pages stayed."""

    node: int
    bytes_moved: int = 0
    bytes_to_move: int = 0
    pages_moved: int = 0
    pages_left: Mapping[str, int] = field(default_factory=frozen_map)  # shared, busy, target_full, failed
    seconds: float = 0.0
    cost: Cost = Cost()  # the work done, as the rate limit counts it
    cpu_seconds: float = 0.0  # of the thread that moves

    def to_json(self) -> dict:
        c = self.cost
        return {"target_node": self.node, "bytes_moved": self.bytes_moved, "bytes_to_move": self.bytes_to_move,
                "pages_moved": self.pages_moved, "pages_left": dict(self.pages_left),
                "seconds": round(self.seconds, 3), "cpu_seconds": round(self.cpu_seconds, 3),
                "mappings_walked": c.mappings, "pages_considered": c.entries, "syscalls": c.calls,
                "cost_bytes": c.budget}


class Batch(NamedTuple):
    """Pages of one size for one ``move_pages(2)``: those to move straight away (numa_maps
    saw their mapping wholly off the node) and those to ask where they are first."""

    page: int
    direct: list[int]
    ask: list[int]


class Walk:
    """The movable pages of ``ranges`` (sorted by address), read from ``pagemap``.

    Iterating yields a ``Batch`` whenever one holds a chunk (``chunk_bytes``) of pages of
    one size, the rest at the end, and None after each pagemap read: a point where
    the caller may check on the worker and keep to its rate without a batch to move.
    ``mappings``, ``entries`` and ``reads`` count the work done so far."""

    def __init__(self, pagemap: PageMap, ranges: Sequence[MoveRange], chunk_bytes: int,
                 base_page: int = BASE_PAGE) -> None:
        self.pagemap, self.ranges, self.base = pagemap, ranges, base_page
        self.chunk = max(base_page, chunk_bytes)
        self.mappings = self.entries = self.reads = 0

    def _pieces(self) -> Iterator[tuple[int, int, MoveRange]]:
        """(first entry, entries, range) of each part of a range that fits one read: a
        chunk of address space, in whole pages of the range's size."""
        base, per = self.base, self.chunk // self.base
        for r in self.ranges:
            stride = max(1, r.page_size // base)
            step = max(stride, per - per % stride)
            first, last = r.start // base, r.end // base
            for lo in range(first, last, step):
                yield lo, min(last, lo + step) - lo, r

    def _windows(self) -> Iterator[tuple[int, int, list[tuple[int, int, MoveRange]]]]:
        """(first entry, entries, pieces) of each pagemap read: pieces close enough
        together share one, up to a chunk of address space."""
        per = self.chunk // self.base
        start = end = 0
        members: list[tuple[int, int, MoveRange]] = []
        for lo, n, r in self._pieces():
            if members and lo - end <= GAP_PAGES and lo + n - start <= per:
                members.append((lo, n, r))
                end = lo + n
                continue
            if members:
                yield start, end - start, members
            start, end, members = lo, lo + n, [(lo, n, r)]
        if members:
            yield start, end - start, members

    def __iter__(self) -> Iterator[Batch | None]:
        base = self.base
        pending: dict[int, Batch] = {}
        last: MoveRange | None = None
        for start, count, members in self._windows():
            raw = self.pagemap.read(start * base, count)
            self.reads += 1
            self.entries += count
            have = len(raw) // 8  # fewer once the process is gone: those pages are none of ours
            for lo, n, r in members:
                if r is not last:
                    self.mappings += r.mappings
                    last = r
                page = r.page_size
                i, stop = lo - start, min(lo - start + n, have)
                if i >= stop:
                    continue
                if n == 1:  # a one-page mapping: no list to build
                    addrs = [lo * base] if _FLAGS[raw[8 * i + _TOP]] else []
                else:
                    # the flags of an entry are its top byte: that byte of every stride-th entry,
                    # mapped to 1 (movable) or 0, picks the addresses, each step done in C
                    flags = raw[8 * i + _TOP:8 * stop:8 * max(1, page // base)].translate(_FLAGS)
                    addrs = list(compress(range(lo * base, lo * base + len(flags) * page, page), flags))
                if not addrs:
                    continue
                batch = pending.get(page)
                limit = max(1, self.chunk // page)
                if batch is not None and len(batch.direct) + len(batch.ask) + len(addrs) > limit:
                    yield pending.pop(page)
                    batch = None
                if batch is None:
                    batch = pending[page] = Batch(page, [], [])
                (batch.ask if r.ask else batch.direct).extend(addrs)
                if len(batch.direct) + len(batch.ask) >= limit:
                    yield pending.pop(page)
            yield None
        yield from pending.values()
