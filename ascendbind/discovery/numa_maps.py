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

from ..errors import ParseError
from ..frozen import frozen_map

__all__ = ["NumaResidency", "NumaRegion", "parse_numa_maps", "numa_regions", "residency_of", "local_ratio"]

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


@dataclass(frozen=True)
class NumaRegion:
    """One mapping's line: where it starts, its page size, how many of its pages are
    anonymous (``anon``) and how many are present on each node (``nodes``)."""

    start: int
    page_kib: int
    anon: int
    nodes: Mapping[int, int]

    def private_pages(self) -> dict[int, int]:
        """Node -> anonymous pages, split in proportion where the mapping also holds file pages."""
        return _private_split(self.nodes, self.anon)


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


def _lines(text: str) -> Iterator[str]:
    """The lines of ``text`` one at a time: numa_maps of a big process runs to
    megabytes, and a list of all its lines would hold it twice over."""
    start, end = 0, len(text)
    while start < end:
        stop = text.find("\n", start)
        if stop < 0:
            stop = end
        yield text[start:stop]
        start = stop + 1


def _rows(text: str, source: str) -> Iterator[tuple[str, dict[int, int], int, int]]:
    """(address, node -> pages, page size in KiB, anonymous pages) of every line that
    has pages present; ParseError for a malformed line (see ``parse_numa_maps``)."""
    # Mappings print alike but for their address (a worker's thread stacks: hundreds
    # of "default anon=3 dirty=3 active=0 N0=3 kernelpagesize_kB=4"), so the fields of
    # each distinct rest of a line are read once. Bounded, so a file of all-distinct
    # lines costs no more memory than the text itself.
    seen: dict[str, tuple[dict[int, int], int | None, int]] = {}
    for lineno, line in enumerate(_lines(text), start=1):
        parts = line.split(None, 1)
        if not parts:
            continue
        if not _HEX.match(parts[0]):
            raise ParseError(source, "row does not start with a hex address", line=lineno, text=line)
        if len(parts) < 2:
            raise ParseError(source, "row has no memory policy", line=lineno, text=line)
        rest = parts[1]
        found = seen.get(rest)
        if found is None:
            found = _line_fields([parts[0], *rest.split()], source, lineno, line)
            if len(seen) < _SEEN_MAX:
                seen[rest] = found
        nodes, page_kib, anon = found
        if not nodes:
            continue
        if page_kib is None:
            raise ParseError(source, "node counts without kernelpagesize_kB", line=lineno, text=line)
        yield parts[0], nodes, page_kib, anon


def parse_numa_maps(text: str, source: str = "numa_maps") -> NumaResidency:
    """Sum the ``N<node>=`` counts of every mapping (see the module docstring), and
    split them into private (anonymous) and shared memory.

    ParseError (naming ``source`` and the line) for a line that does not start
    with a hex address and a policy, a malformed ``N``/page-size field, or node
    counts without a page size (the kernel prints one whenever it prints counts).
    """
    return _residency((nodes, page_kib, anon) for _addr, nodes, page_kib, anon in _rows(text, source))


def residency_of(regions: Iterable[NumaRegion]) -> NumaResidency:
    """What ``parse_numa_maps`` reads from the text ``regions`` were read from."""
    return _residency((r.nodes, r.page_kib, r.anon) for r in regions)


def _residency(rows: Iterable[tuple[Mapping[int, int], int, int]]) -> NumaResidency:
    """The sums over (node -> pages, page size in KiB, anonymous pages) of each mapping."""
    kib: dict[int, int] = {}
    pages: dict[int, int] = {}
    private: dict[int, int] = {}
    for nodes, page_kib, anon in rows:
        for node, count in nodes.items():
            pages[node] = pages.get(node, 0) + count
            kib[node] = kib.get(node, 0) + count * page_kib
        for node, count in _private_split(nodes, anon).items():
            private[node] = private.get(node, 0) + count * page_kib
    shared = {n: v - private.get(n, 0) for n, v in kib.items()}
    return NumaResidency(_sorted(kib), _sorted(pages), _sorted(private),
                         _sorted({n: v for n, v in shared.items() if v}))


def numa_regions(text: str, source: str = "numa_maps") -> tuple[NumaRegion, ...]:
    """Every mapping with pages present, in the file's order (ParseError as ``parse_numa_maps``)."""
    return tuple(NumaRegion(int(addr, 16), page_kib, anon, frozen_map(nodes))
                 for addr, nodes, page_kib, anon in _rows(text, source))


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
