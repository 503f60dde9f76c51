"""``/proc/<pid>/numa_maps`` -> where a process's resident memory lives. Pure.

One line per mapping (VMA), as the kernel's ``show_numa_map`` prints it::

    <start addr> <policy> [file=<path>|heap|stack] [huge] [anon=N] [dirty=N]
        [mapped=N] [mapmax=N] [swapcache=N] [active=N] [writeback=N]
        [N<node>=<pages> ...] kernelpagesize_kB=<size>

What counts as resident: ``N<node>=<pages>`` is the number of the mapping's
pages the kernel found *present* (mapped by a page-table entry) on that node
while walking the page tables. Swapped-out and never-touched pages are not
counted; a page shared with other processes (library text, a model file's page
cache, a ``/dev/shm`` segment) is counted in every process that maps it. A
mapping with nothing present prints no ``N`` field and no page size.

Private and shared: ``anon=<pages>`` counts the mapping's anonymous pages: the
heap, stacks, anonymous mappings, private huge pages and the copies a process
made of pages of a privately mapped file when it wrote them. That is the
worker's own memory, the only memory the memory step moves (applier/memory.py).
Everything else is shared: the page cache of files (libraries, model files),
``MAP_SHARED`` mappings, ``/dev/shm``, memfd and System V segments, shared huge
pages; it is measured (``shared_kib``) and never moved, since another process
may use it from another node. Where a mapping holds both kinds (a private file
mapping, partly written), its per-node counts are split between them in the
proportion of ``anon`` to the whole: the kernel prints no per-node split.

Units: the counts are in the mapping's own page size, ``kernelpagesize_kB``:
one per 2 MiB (or 1 GiB) huge page in a hugetlb mapping, one per base page
elsewhere (a transparent huge page is already counted as 512 base pages). A
ratio over raw counts would weigh a 2 MiB huge page like a 4 KiB page, so a
worker whose 100 GiB of hugetlb memory is all remote could still look local
through its small pages. Every count is therefore multiplied by its page size:
``kib`` is the resident memory per node in KiB, and ratios are ratios of bytes.
``pages`` keeps the counts as printed (what ``status --memory`` shows).

``file=`` paths are printed unescaped (only a newline is escaped), so a path
may contain spaces and even ``N0=5``-like words. The fields the kernel adds
always follow the path, so they are read from the end of the line backwards,
stopping at the first word that is not one of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from ...errors import ParseError
from ...values.frozen import frozen_map

__all__ = ["NumaResidency", "NumaScan", "OffNode", "parse_numa_maps", "scan_numa_maps", "text_lines", "local_ratio"]

# the kernel's own counters besides N<node>; anything else ends the trailing run of fields
_COUNTERS = frozenset(("kernelpagesize_kB", "anon", "dirty", "mapped", "mapmax", "swapcache", "active", "writeback"))
_SEEN_MAX = 4096
_HEX = re.compile(r"^[0-9a-fA-F]+$")


@dataclass(frozen=True)
class NumaResidency:
    """Resident memory of one process per NUMA node: ``kib`` (KiB, page-size
    weighted) and ``pages`` (the kernel's counts, each in its mapping's page size);
    ``kib`` split into ``private_kib`` (anonymous pages: what the memory step moves)
    and ``shared_kib`` (the rest: never moved)."""

    kib: Mapping[int, int]
    pages: Mapping[int, int]
    private_kib: Mapping[int, int] = field(default_factory=frozen_map)
    shared_kib: Mapping[int, int] = field(default_factory=frozen_map)

    @property
    def total_kib(self) -> int:
        return sum(self.kib.values())


class OffNode(NamedTuple):
    """A mapping with anonymous pages off the node a move goes to: its page size, and its
    anonymous bytes, all of them and those off the node."""

    page_size: int
    private_bytes: int
    remote_bytes: int


@dataclass(frozen=True)
class NumaScan:
    """One pass over a numa_maps text: the residency (``parse_numa_maps``), the mappings
    with anonymous pages off one node by start address as the file prints it (``maps``
    prints it alike), and how many lines (mappings) the file has."""

    residency: NumaResidency
    off_node: Mapping[str, OffNode]
    lines: int


def _private_split(nodes: Mapping[int, int], anon: int) -> dict[int, int]:
    total = sum(nodes.values())
    if anon <= 0 or total <= 0:
        return {}
    if anon >= total:
        return dict(nodes)
    return {n: c * anon // total for n, c in nodes.items()}


def _line_fields(fields: list[str], source: str, lineno: int,
                 line: str) -> tuple[dict[int, int], int | None, int]:
    """(node -> pages, page size in KiB or None, anonymous pages) from the trailing
    kernel fields of one line.

    A word is a field when it is ``<counter>=<digits>`` or ``N<digits>=<digits>``
    (ASCII digits, as the kernel prints them); a word in field position that
    starts like one (``N…=``, ``kernelpagesize_kB=``) but is not is malformed. String
    methods rather than a regular expression per word: a big worker prints thousands
    of lines, and the locality check reads every bound worker's."""
    nodes: dict[int, int] = {}
    page_kib: int | None = None
    anon = 0
    for word in reversed(fields[2:]):
        key, eq, value = word.partition("=")
        digits = key[1:]
        is_node = key[:1] == "N" and digits.isascii() and digits.isdecimal()
        if not (eq and value.isascii() and value.isdecimal() and (is_node or key in _COUNTERS)):
            if eq and (key == "kernelpagesize_kB" or (key[:1] == "N" and (not digits or is_node))):
                raise ParseError(source, f"bad field {word!r}", line=lineno, text=line)
            break
        count = int(value)
        if is_node:
            node = int(digits)
            if node in nodes:
                raise ParseError(source, f"node N{node} printed twice", line=lineno, text=line)
            nodes[node] = count
        elif key == "kernelpagesize_kB":
            if page_kib is not None or count == 0:
                raise ParseError(source, f"bad field {word!r}", line=lineno, text=line)
            page_kib = count
        elif key == "anon":
            anon = count
    return nodes, page_kib, anon


def text_lines(text: str) -> Iterator[str]:
    """The lines of ``text`` one at a time: numa_maps of a big process runs to
    megabytes, and a list of all its lines would hold it twice over."""
    start, end = 0, len(text)
    while start < end:
        stop = text.find("\n", start)
        if stop < 0:
            stop = end
        yield text[start:stop]
        start = stop + 1


class _Kind:
    """What one distinct rest of a line (all but the address) says, and how many lines say it."""

    __slots__ = ("nodes", "page_kib", "anon", "off", "count")

    def __init__(self, nodes: dict[int, int], page_kib: int | None, anon: int, node: int | None) -> None:
        self.nodes, self.page_kib, self.anon, self.count = nodes, page_kib, anon, 0
        self.off = None
        if node is not None and nodes and page_kib:
            private = _private_split(nodes, anon)
            remote = sum(c for n, c in private.items() if n != node)
            if remote:
                page = page_kib * 1024
                self.off = OffNode(page, sum(private.values()) * page, remote * page)


def scan_numa_maps(text: str, source: str = "numa_maps", *, node: int | None = None) -> NumaScan:
    """The residency of the whole file and, with ``node``, the mappings holding anonymous
    pages off it; ParseError as ``parse_numa_maps``.

    Mappings print alike but for their address (a worker's thread stacks: hundreds of
    "default anon=3 dirty=3 active=0 N0=3 kernelpagesize_kB=4"; an allocator's
    one-page mappings: tens of thousands), so each distinct rest of a line is read and
    added up once, and every further line saying it costs a dictionary look-up. The
    distinct rests kept are bounded, so a file of all-distinct lines costs no more
    memory than the text itself."""
    kinds: dict[str, _Kind] = {}
    loose: list[_Kind] = []  # lines past the bound, each its own
    off: dict[str, OffNode] = {}
    lines = 0
    for lineno, line in enumerate(text_lines(text), start=1):
        parts = line.split(None, 1)
        if not parts:
            continue
        lines += 1
        if not _HEX.match(parts[0]):
            raise ParseError(source, "row does not start with a hex address", line=lineno, text=line)
        if len(parts) < 2:
            raise ParseError(source, "row has no memory policy", line=lineno, text=line)
        rest = parts[1]
        kind = kinds.get(rest)
        if kind is None:
            kind = _Kind(*_line_fields([parts[0], *rest.split()], source, lineno, line), node)
            if kind.nodes and kind.page_kib is None:
                raise ParseError(source, "node counts without kernelpagesize_kB", line=lineno, text=line)
            if len(kinds) < _SEEN_MAX:
                kinds[rest] = kind
            else:
                loose.append(kind)
        kind.count += 1
        if kind.off is not None:
            off[parts[0]] = kind.off
    rows = ((k.nodes, k.page_kib, k.anon, k.count) for k in (*kinds.values(), *loose) if k.nodes)
    return NumaScan(_residency(rows), frozen_map(off), lines)


def parse_numa_maps(text: str, source: str = "numa_maps") -> NumaResidency:
    """Sum the ``N<node>=`` counts of every mapping (see the module docstring), and
    split them into private (anonymous) and shared memory.

    ParseError (naming ``source`` and the line) for a line that does not start
    with a hex address and a policy, a malformed ``N``/page-size field, or node
    counts without a page size (the kernel prints one whenever it prints counts).
    """
    return scan_numa_maps(text, source).residency


def _residency(rows: Iterable[tuple[Mapping[int, int], int, int, int]]) -> NumaResidency:
    """The sums over (node -> pages, page size in KiB, anonymous pages, mappings alike) of each kind of line."""
    kib: dict[int, int] = {}
    pages: dict[int, int] = {}
    private: dict[int, int] = {}
    for nodes, page_kib, anon, times in rows:
        for node, count in nodes.items():
            pages[node] = pages.get(node, 0) + count * times
            kib[node] = kib.get(node, 0) + count * page_kib * times
        for node, count in _private_split(nodes, anon).items():
            private[node] = private.get(node, 0) + count * page_kib * times
    shared = {n: v - private.get(n, 0) for n, v in kib.items()}
    return NumaResidency(_sorted(kib), _sorted(pages), _sorted(private),
                         _sorted({n: v for n, v in shared.items() if v}))


def _sorted(d: dict[int, int]) -> Mapping[int, int]:
    return frozen_map(dict(sorted(d.items())))


def local_ratio(kib_by_node: Mapping[int, int], nodes: Iterable[int]) -> float | None:
    """Share (0-1) of the resident memory that lies on ``nodes``; None when
    nothing is resident (no locality to speak of: neither 1 nor 0 is true)."""
    total = sum(kib_by_node.values())
    if total <= 0:
        return None
    wanted = set(nodes)
    return sum(v for n, v in kib_by_node.items() if n in wanted) / total
